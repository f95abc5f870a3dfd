"""Multi-level flush (``persist_to``): the fast tier first, then the persistent tier.

The fast tier is a tmpfs directory (``/dev/shm``); the persistent tier a local directory or a
bucket on moto's S3 server (tests/s3_server.py). Every checkpoint is read back with the stock
``dcp.load`` from each tier, bit for bit.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import HANG_S, assert_state_equal, zeros_like_state
from s3_server import S3Bucket, s3_bucket_fixture, s3_server_fixture  # noqa: F401 - fixtures
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from dcp_datastates import DataStatesWriter, PersistError, remote, resume_path
from dcp_datastates.checkpoints import (
    INCOMPLETE_MARKER,
    METADATA_FILE,
    RetentionPolicy,
    latest_complete,
    list_checkpoints,
    prune,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def fast() -> Iterator[Path]:
    """A fresh directory on tmpfs (the fast tier), removed afterwards."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    d = base / f"dcpds-tiers-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300_000, generator=g),  # above the O_DIRECT threshold: its own path
        "b": torch.randint(0, 255, (5000,), dtype=torch.uint8, generator=g),
        "h": torch.randn(1000, generator=g).to(torch.bfloat16),
        "step": seed,
    }


def load_local(path: str | Path, like: dict[str, Any]) -> dict[str, Any]:
    out = zeros_like_state(like)
    dcp.load(out, checkpoint_id=str(path))
    return out


def test_local_slow_tier_commit_latest_and_resume(fast: Path, tmp_path: Path) -> None:
    slow = tmp_path / "slow"
    states = [state(s) for s in range(3)]
    with DataStatesWriter(fast, host_cache_size="8MiB", persist_to=str(slow)) as w:
        for i, sd in enumerate(states):
            dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / f"step-{i}")).result(
                HANG_S
            )
        assert w.wait_persisted(timeout=HANG_S)
        recs = w.persist_stats()
    assert [r["error"] for r in recs] == [None] * 3
    assert all(r["bytes"] > 0 and r["persist_s"] >= 0 for r in recs)
    for i, sd in enumerate(states):
        for root in (fast, slow):
            d = root / f"step-{i}"
            assert (d / METADATA_FILE).exists() and not (d / INCOMPLETE_MARKER).exists() or (
                root == fast  # the fast copy may keep the (unlocked) marker of the promotion
            )
            assert_state_equal(sd, load_local(d, sd))
        fast_names = {p.name for p in (fast / f"step-{i}").iterdir()} - {INCOMPLETE_MARKER}
        assert fast_names == {p.name for p in (slow / f"step-{i}").iterdir()}
    # `latest` per tier, and the resume rule: the fast tier when it has the newest checkpoint.
    assert latest_complete(fast) == fast / "step-2" and latest_complete(slow) == slow / "step-2"
    assert resume_path(fast, slow) == str(fast / "step-2")
    shutil.rmtree(fast / "step-2")  # the fast copy of the newest is lost: the slow one is used
    assert resume_path(fast, slow) == str(slow / "step-2")
    shutil.rmtree(fast)  # a node replacement wipes the fast tier
    assert resume_path(fast, slow) == str(slow / "step-2")
    assert resume_path(fast, tmp_path / "none") is None


def test_s3_slow_tier_metadata_last_and_stock_load(fast: Path, s3: S3Bucket) -> None:
    sd = state(7)
    url = s3.url("run")
    from dcp_datastates import tiers

    calls: list[str] = []
    orig_copy = tiers._Slow.copy_file

    def copy_file(self: Any, src: str, rel: str, atomic: bool = False) -> int:
        calls.append(os.path.basename(rel))
        return orig_copy(self, src, rel, atomic)

    mp = pytest.MonkeyPatch()
    mp.setattr(tiers._Slow, "copy_file", copy_file)
    try:
        with DataStatesWriter(
            fast, host_cache_size="8MiB", persist_to=url,
            persist_storage_options=s3.storage_options,
        ) as w:
            dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / "step-5")).result(HANG_S)
            assert w.wait_persisted(timeout=HANG_S)
    finally:
        mp.undo()
    assert calls[-1] == METADATA_FILE and calls.count(METADATA_FILE) == 1
    assert calls[-2].startswith("__datastates_manifest_")
    keys = s3.keys("run/step-5")
    assert "run/step-5/.metadata" in keys and f"run/step-5/{INCOMPLETE_MARKER}" not in keys
    out = zeros_like_state(sd)
    dcp.load(out, storage_reader=FsspecReader(url + "/step-5", **s3.storage_options))
    assert_state_equal(sd, out)
    assert remote.latest_complete(url, storage_options=s3.storage_options) == url + "/step-5"
    shutil.rmtree(fast / "step-5")
    assert resume_path(fast, url, storage_options=s3.storage_options) == url + "/step-5"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_slow_tier_failure_is_reported_and_the_fast_checkpoint_survives(
    fast: Path, s3: S3Bucket
) -> None:
    log = _Records()
    logging.getLogger("dcp_datastates.tiers").addHandler(log)
    sd = state(3)
    url = s3.url("run")
    with DataStatesWriter(
        fast, host_cache_size="8MiB", persist_to=url, persist_storage_options=s3.storage_options
    ) as w:
        s3.server.stop()  # the object store goes down
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / "step-1"))
        fut.result(HANG_S)  # the fast save itself succeeds
        with pytest.raises(PersistError, match="step-1"):
            w.wait_persisted(timeout=HANG_S)
        logging.getLogger("dcp_datastates.tiers").removeHandler(log)
        assert any("step-1" in m for m in log.messages)
        assert w.unpersisted() == [str(fast / "step-1")]
        assert w.wait_persisted(timeout=HANG_S)  # reported once
        # The fast checkpoint is complete and loads; retention that honours unpersisted keeps it.
        assert_state_equal(sd, load_local(fast / "step-1", sd))
        s3.server.start()
        sd2 = state(4)
        dcp.async_save(sd2, storage_writer=w, checkpoint_id=str(fast / "step-2")).result(HANG_S)
        assert w.wait_persisted(timeout=HANG_S)  # a later save is promoted normally
        removed = prune(fast, RetentionPolicy(keep_last=1), exclude=w.unpersisted())
        assert removed == []  # step-1 is not persisted, step-2 is the last
    assert (fast / "step-1" / METADATA_FILE).exists()
    names = {i.name for i in remote.list_checkpoints(url, storage_options=s3.storage_options)
             if i.complete}
    assert names == {"step-2"}
    assert resume_path(fast, url, storage_options=s3.storage_options) == str(fast / "step-2")


def test_a_partial_slow_copy_never_looks_complete(
    fast: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_datastates import tiers

    slow = tmp_path / "slow"
    orig = tiers._Slow.copy_file
    copied: list[str] = []

    def failing_copy(self: Any, src: str, rel: str, atomic: bool = False) -> int:
        if copied:  # the second file: the disk of the persistent tier fills up
            raise OSError(28, "No space left on device")
        copied.append(rel)
        return orig(self, src, rel, atomic)

    monkeypatch.setattr(tiers._Slow, "copy_file", failing_copy)
    sd = state(1)
    with DataStatesWriter(fast, host_cache_size="8MiB", persist_to=str(slow)) as w:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / "step-9")).result(HANG_S)
        with pytest.raises(PersistError, match="No space left"):
            w.wait_persisted(timeout=HANG_S)
    infos = list_checkpoints(slow)
    assert [(i.name, i.state.name) for i in infos] == [("step-9", "PARTIAL")]
    assert latest_complete(slow) is None and resume_path(fast, slow) == str(fast / "step-9")


def test_bad_configurations_are_clear_errors(fast: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="incremental"):
        DataStatesWriter(fast, host_cache_size="8MiB", persist_to=str(tmp_path), incremental=True)
    with pytest.raises(ValueError, match="local directory"):
        DataStatesWriter("s3://b/x", host_cache_size="8MiB", persist_to=str(tmp_path))
    with pytest.raises(ValueError, match="own path"):
        DataStatesWriter(fast, host_cache_size="8MiB", persist_to=str(fast))
    with pytest.raises(ValueError, match="persist_timeout"):
        DataStatesWriter(fast, host_cache_size="8MiB", persist_to=str(tmp_path), persist_timeout=0)
    with DataStatesWriter(fast, host_cache_size="8MiB", persist_to=str(tmp_path / "s")) as w:
        with pytest.raises(BaseException, match="not inside the writer.s path"):
            dcp.save(state(0), storage_writer=w, checkpoint_id=str(tmp_path / "elsewhere"))
        assert not (tmp_path / "elsewhere" / METADATA_FILE).exists()


def _saving_child(fast: Path, slow: Path, name: str) -> str:
    """The start of a child script: a writer persisting to ``slow``, one save committed."""
    return textwrap.dedent(
        f"""
        import os, warnings; warnings.simplefilter("ignore")
        import torch, torch.distributed.checkpoint as dcp
        from dcp_datastates import DataStatesWriter
        w = DataStatesWriter({str(fast)!r}, host_cache_size="8MiB", persist_to={str(slow)!r})
        sd = {{"x": torch.arange(400_000, dtype=torch.float32)}}
        dcp.async_save(sd, storage_writer=w, checkpoint_id={str(fast / name)!r}).result(60)
        """
    )


def test_close_waits_for_promotions_and_fork_child_cannot_promote(
    fast: Path, tmp_path: Path
) -> None:
    slow = tmp_path / "slow"
    code = _saving_child(fast, slow, "step-1") + textwrap.dedent(
        f"""
        pid = os.fork()
        if pid == 0:
            try:
                w._promoter.submit({str(fast / "step-1")!r}, 0, 1, True)
                os._exit(3)
            except RuntimeError as e:
                os._exit(0 if "forked child" in str(e) else 4)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        w.close()  # no wait_persisted(): close() must not lose the promotion
        print("CLOSED")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "CLOSED" in r.stdout, r.stderr[-3000:]
    assert (slow / "step-1" / METADATA_FILE).exists()
    like = {"x": torch.zeros(400_000)}
    assert torch.equal(load_local(slow / "step-1", like)["x"], torch.arange(400_000.0))


def _two_rank_body(rank: int, world_size: int, fast_root: str, slow_root: str) -> list[str]:
    """Each rank has its own fast tier (node-local), one shared persistent tier."""
    import torch.distributed as dist

    fast_rank = os.path.join(fast_root, f"node{rank}")
    os.makedirs(fast_rank, exist_ok=True)
    pg = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(100 + rank)
    sd = {f"r{rank}": torch.randn(200_000, generator=g), "shared": torch.arange(10.0)}
    with DataStatesWriter(fast_rank, host_cache_size="8MiB", persist_to=slow_root) as w:
        for step in (1, 2):
            dcp.async_save(sd, storage_writer=w, process_group=pg,
                           checkpoint_id=os.path.join(fast_rank, f"step-{step}")).result(HANG_S)
        assert w.wait_persisted(timeout=HANG_S)
        errors = [r["error"] for r in w.persist_stats()]
    assert errors == [None, None], errors
    dist.barrier(pg)
    return sorted(os.listdir(os.path.join(slow_root, "step-2")))


def test_two_ranks_with_node_local_fast_tiers(fast: Path, tmp_path: Path) -> None:
    from dist_utils import run_ranks

    slow = tmp_path / "slow"
    names = run_ranks(_two_rank_body, str(fast), str(slow), tmp_path=tmp_path, timeout_s=120)
    assert names[0] == names[1]
    assert {"__0_0.distcp", "__1_0.distcp", "__datastates_manifest_0.json",
            "__datastates_manifest_1.json", METADATA_FILE} <= set(names[0])
    assert INCOMPLETE_MARKER not in names[0]
    # The persistent tier holds the whole checkpoint; one process loads it with the stock reader.
    like = {"r0": torch.zeros(200_000), "r1": torch.zeros(200_000), "shared": torch.zeros(10)}
    out = load_local(slow / "step-2", like)
    for r in (0, 1):
        g = torch.Generator().manual_seed(100 + r)
        assert torch.equal(out[f"r{r}"], torch.randn(200_000, generator=g))
    assert latest_complete(slow) == slow / "step-2"


def test_ranks_writing_the_same_marker_at_once_do_not_collide(tmp_path: Path) -> None:
    # Every rank writes the persistent copy's marker; with one shared temporary name, one rank's
    # rename found the file gone (a flaky FileNotFoundError in the 2-rank test).
    import threading

    from dcp_datastates import tiers

    slow = tiers._Slow(str(tmp_path), None, durable=False)
    slow.makedirs("step-1")
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(200):
                slow.put_bytes(f"step-1/{INCOMPLETE_MARKER}", b"")
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not errors, errors[:3]
    assert os.listdir(tmp_path / "step-1") == [INCOMPLETE_MARKER]


def test_a_dropped_writer_neither_hangs_the_exit_nor_loses_the_copy(
    fast: Path, tmp_path: Path
) -> None:
    slow = tmp_path / "slow"
    # no close(), no wait: the interpreter exits with the copy in flight
    code = _saving_child(fast, slow, "step-3") + 'print("SAVED")\n'
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SAVED" in r.stdout, r.stderr[-3000:]
    assert (slow / "step-3" / METADATA_FILE).exists()
    assert latest_complete(slow) == slow / "step-3"
