"""Multi-level flush (``persist_to``): the fast tier first, then the persistent tier.

The fast tier is a tmpfs directory (``/dev/shm``); the persistent tier a local directory or a
bucket on moto's S3 server (tests/s3_server.py). Every checkpoint is read back with the stock
``dcp.load`` from each tier, bit for bit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import HANG_S, assert_state_equal, in_thread, zeros_like_state
from s3_server import (  # noqa: F401 - fixtures
    S3Bucket,
    Tarpit,
    s3_bucket_fixture,
    s3_server_fixture,
    tarpit_fixture,
)
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from dcp_datastates import DataStatesWriter, PersistError, resume_path
from dcp_datastates.lifecycle import remote
from dcp_datastates.lifecycle.checkpoints import (
    INCOMPLETE_MARKER,
    METADATA_FILE,
    RetentionPolicy,
    latest_complete,
    list_checkpoints,
    prune,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# The copies in a thread of the test process (persist_agent=False): these tests drive the
# promotion itself (monkeypatched copies, timeouts, supersedes); the persistence agent, which runs
# the same Promoter in a process of its own, is tested in tests/test_persist_agent.py.
OPTS: dict[str, Any] = {"host_cache_size": "8MiB", "persist_agent": False}


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
    with DataStatesWriter(fast, **OPTS, persist_to=str(slow)) as w:
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
    (fast / "step-2" / METADATA_FILE).unlink()  # the fast copy is partial: the slow one is used
    assert resume_path(fast, slow) == str(slow / "step-2")
    shutil.rmtree(fast / "step-2")  # the fast copy of the newest is lost
    assert resume_path(fast, slow) == str(slow / "step-2")
    shutil.rmtree(fast)  # a node replacement wipes the fast tier
    assert resume_path(fast, slow) == str(slow / "step-2")
    assert resume_path(fast, tmp_path / "none") is None


def test_s3_slow_tier_metadata_last_and_stock_load(fast: Path, s3: S3Bucket) -> None:
    sd = state(7)
    url = s3.url("run")
    from dcp_datastates.lifecycle import tiers

    calls: list[str] = []
    orig_copy = tiers._Slow.copy_file

    def copy_file(self: Any, src: str, rel: str, atomic: bool = False) -> int:
        calls.append(os.path.basename(rel))
        return orig_copy(self, src, rel, atomic)

    mp = pytest.MonkeyPatch()
    mp.setattr(tiers._Slow, "copy_file", copy_file)
    try:
        with DataStatesWriter(
            fast, **OPTS, persist_to=url,
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
    logging.getLogger("dcp_datastates.lifecycle.tiers").addHandler(log)
    sd = state(3)
    url = s3.url("run")
    with DataStatesWriter(
        fast, **OPTS, persist_to=url, persist_storage_options=s3.storage_options
    ) as w:
        s3.server.stop()  # the object store goes down
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / "step-1"))
        fut.result(HANG_S)  # the fast save itself succeeds
        with pytest.raises(PersistError, match="step-1"):
            w.wait_persisted(timeout=HANG_S)
        logging.getLogger("dcp_datastates.lifecycle.tiers").removeHandler(log)
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
    from dcp_datastates.lifecycle import tiers

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
    with DataStatesWriter(fast, **OPTS, persist_to=str(slow)) as w:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / "step-9")).result(HANG_S)
        with pytest.raises(PersistError, match="No space left"):
            w.wait_persisted(timeout=HANG_S)
    infos = list_checkpoints(slow)
    assert [(i.name, i.state.name) for i in infos] == [("step-9", "PARTIAL")]
    assert latest_complete(slow) is None and resume_path(fast, slow) == str(fast / "step-9")


def test_bad_configurations_are_clear_errors(fast: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="incremental"):
        DataStatesWriter(fast, **OPTS, persist_to=str(tmp_path), incremental=True)
    with pytest.raises(ValueError, match="local directory"):
        DataStatesWriter("s3://b/x", **OPTS, persist_to=str(tmp_path))
    with pytest.raises(ValueError, match="own path"):
        DataStatesWriter(fast, **OPTS, persist_to=str(fast))
    with pytest.raises(ValueError, match="persist_timeout"):
        DataStatesWriter(fast, **OPTS, persist_to=str(tmp_path), persist_timeout=0)
    with pytest.raises(ValueError, match="need persist_to"):
        DataStatesWriter(fast, host_cache_size="8MiB", fast_retention=2)
    with pytest.raises(ValueError, match="persist_retention must keep at least 1"):
        DataStatesWriter(
            fast, **OPTS, persist_to=str(tmp_path), persist_retention=0
        )
    with pytest.raises(TypeError, match="fast_retention must be None, an int"):
        DataStatesWriter(fast, **OPTS, persist_to=str(tmp_path), fast_retention="2")
    with DataStatesWriter(fast, **OPTS, persist_to=str(tmp_path / "s")) as w:
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
        w = DataStatesWriter({str(fast)!r}, host_cache_size="8MiB", persist_to={str(slow)!r},
                             persist_agent=False)
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
    with DataStatesWriter(fast_rank, **OPTS, persist_to=slow_root) as w:
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

    from dcp_datastates.lifecycle import tiers

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


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) if root.exists() \
        else []


def test_retention_per_tier(fast: Path, tmp_path: Path) -> None:
    slow = tmp_path / "slow"
    states = [state(10 + i) for i in range(4)]
    with DataStatesWriter(
        fast, **OPTS, persist_to=str(slow), fast_retention=1,
        persist_retention=RetentionPolicy(keep_last=2),
    ) as w:
        for i, sd in enumerate(states):
            dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / f"step-{i}")).result(
                HANG_S
            )
        assert w.wait_persisted(timeout=HANG_S)
        stats = w.save_stats()
        recs = w.persist_stats()
    # Each save's stats say where its copy stands; the records say what retention deleted.
    assert [s["persist_state"] for s in stats] == ["done"] * 4
    assert all(s["persist_error"] is None and s["persist_s"] >= 0 for s in stats)
    pruned = [p for r in recs for p in r["pruned"]]
    assert str(slow / "step-0") in pruned and str(fast / "step-2") in pruned
    assert _steps(fast) == ["step-3"] and _steps(slow) == ["step-2", "step-3"]
    assert latest_complete(fast) == fast / "step-3" and latest_complete(slow) == slow / "step-3"
    for root, kept in ((fast, [3]), (slow, [2, 3])):
        for i in kept:
            assert_state_equal(states[i], load_local(root / f"step-{i}", states[i]))


def test_fast_retention_keeps_a_checkpoint_whose_copy_failed(
    fast: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_datastates.lifecycle import tiers

    slow = tmp_path / "slow"
    orig = tiers._Slow.copy_file
    fail = {"step-1"}

    def copy_file(self: Any, src: str, rel: str, atomic: bool = False) -> int:
        if rel.split("/")[0] in fail:
            raise PermissionError(13, "Permission denied", self.url(rel))
        return orig(self, src, rel, atomic)

    monkeypatch.setattr(tiers._Slow, "copy_file", copy_file)
    states = {i: state(20 + i) for i in range(4)}
    with DataStatesWriter(
        fast, **OPTS, persist_to=str(slow), fast_retention=1
    ) as w:
        for i in (0, 1, 2, 3):
            dcp.async_save(states[i], storage_writer=w,
                           checkpoint_id=str(fast / f"step-{i}")).result(HANG_S)
        with pytest.raises(PersistError, match="Permission denied"):
            w.wait_persisted(timeout=HANG_S)
        assert w.unpersisted() == [str(fast / "step-1")]
        assert [s["persist_state"] for s in w.save_stats()] == ["done", "failed", "done", "done"]
        # The only complete copy of step-1 is the fast one: retention keeps it.
        assert _steps(fast) == ["step-1", "step-3"]
        assert_state_equal(states[1], load_local(fast / "step-1", states[1]))
        assert [i.name for i in list_checkpoints(slow) if i.complete] == [
            "step-0", "step-2", "step-3"
        ]
        # Saved again and promoted this time: no longer held back, and retention may go on.
        fail.clear()
        dcp.async_save(states[1], storage_writer=w,
                       checkpoint_id=str(fast / "step-1")).result(HANG_S)
        assert w.wait_persisted(timeout=HANG_S)
        assert w.unpersisted() == []
    assert (slow / "step-1" / METADATA_FILE).exists()
    assert _steps(fast) == ["step-1", "step-3"]  # step-1 is `latest` now; nothing else is older


def test_fast_retention_of_a_rank_with_a_node_local_tier(fast: Path, tmp_path: Path) -> None:
    # Rank 1 of node-local fast tiers holds its own files and no .metadata. It deletes its copy
    # only once the checkpoint is complete on the persistent tier, or gone from there while a
    # newer one is complete (the persistent tier's retention dropped it); never a copy whose
    # persistent counterpart is partial (a promotion that failed on rank 0).
    from dcp_datastates.format.commit import manifest_name
    from dcp_datastates.lifecycle import tiers

    slow = tmp_path / "slow"
    for step in range(5):
        d = fast / f"step-{step}"
        d.mkdir()
        (d / "__1_0.distcp").write_bytes(bytes([step]) * 1000)
        (d / manifest_name(1)).write_text("{}")
        (d / INCOMPLETE_MARKER).write_bytes(b"")
    (slow / "step-0").mkdir(parents=True)
    (slow / "step-0" / INCOMPLETE_MARKER).write_bytes(b"")  # rank 0's copy failed
    (slow / "step-2").mkdir()
    (slow / "step-2" / METADATA_FILE).write_bytes(b"x")  # complete; step-1 was dropped there
    # (every rank is given the same options: persist_retention explains step-1's absence)
    p = tiers.Promoter(
        str(fast), str(slow), fast_retention=1, persist_retention=1, timeout_s=HANG_S
    )
    try:
        p.submit(str(fast / "step-3"), rank=1, world_size=2, coordinator=False)
        assert p.wait(timeout=HANG_S)
        assert p.records()[-1]["pruned"] == [str(fast / "step-1"), str(fast / "step-2")]
        # step-3 is only copied (not committed yet), step-4 never promoted: both stay.
        assert _steps(fast) == ["step-0", "step-3", "step-4"]
        assert (slow / "step-3" / "__1_0.distcp").read_bytes() == bytes([3]) * 1000
    finally:
        p.close(timeout=HANG_S)


def test_two_writers_promoting_into_one_persistent_name(
    fast: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two writers of one process with different fast tiers and the same persistent root both
    # save "step-1": the second copy would mix its files with the first's under one .metadata.
    import threading

    from dcp_datastates.lifecycle import tiers

    slow = tmp_path / "slow"
    fa, fb = fast / "a", fast / "b"
    fa.mkdir()
    fb.mkdir()
    orig = tiers._Slow.copy_file
    entered, release = threading.Event(), threading.Event()

    def copy_file(self: Any, src: str, rel: str, atomic: bool = False) -> int:
        if src.startswith(str(fa)):  # writer A's copy stalls (a slow tier) in its first file
            entered.set()
            assert release.wait(HANG_S)
        return orig(self, src, rel, atomic)

    monkeypatch.setattr(tiers._Slow, "copy_file", copy_file)
    sa, sb = state(31), state(32)
    with DataStatesWriter(fa, **OPTS, persist_to=str(slow)) as wa, \
            DataStatesWriter(fb, **OPTS, persist_to=str(slow)) as wb:
        dcp.async_save(sa, storage_writer=wa, checkpoint_id=str(fa / "step-1")).result(HANG_S)
        assert entered.wait(HANG_S)
        try:
            dcp.async_save(sb, storage_writer=wb, checkpoint_id=str(fb / "step-1")).result(
                HANG_S
            )
            with pytest.raises(PersistError, match="another writer of this process"):
                wb.wait_persisted(timeout=HANG_S)
        finally:
            release.set()
        assert wa.wait_persisted(timeout=HANG_S)
    assert_state_equal(sa, load_local(slow / "step-1", sa))


def test_persistent_retention_on_s3(fast: Path, s3: S3Bucket) -> None:
    url = s3.url("run")
    states = [state(40 + i) for i in range(3)]
    with DataStatesWriter(
        fast, **OPTS, persist_to=url, persist_storage_options=s3.storage_options,
        persist_retention=1,
    ) as w:
        for i, sd in enumerate(states):
            dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / f"step-{i}")).result(
                HANG_S
            )
        assert w.wait_persisted(timeout=HANG_S)
    infos = remote.list_checkpoints(url, storage_options=s3.storage_options)
    assert [(i.name, i.complete) for i in infos] == [("step-2", True)]
    assert _steps(fast) == ["step-0", "step-1", "step-2"]  # no fast_retention: all kept
    out = zeros_like_state(states[2])
    dcp.load(out, storage_reader=FsspecReader(url + "/step-2", **s3.storage_options))
    assert_state_equal(states[2], out)


def test_fast_retention_keeps_a_checkpoint_never_persisted(fast: Path, tmp_path: Path) -> None:
    # step-1 was saved without persist_to (or its copy never ran: a crash before it): its only
    # copy is the fast one. Without persist_retention nothing was ever dropped from the
    # persistent tier, so its absence there says nothing: fast_retention keeps it.
    slow = tmp_path / "slow"
    s1 = state(50)
    with DataStatesWriter(fast, host_cache_size="8MiB") as w:
        dcp.async_save(s1, storage_writer=w, checkpoint_id=str(fast / "step-1")).result(HANG_S)
    with DataStatesWriter(
        fast, **OPTS, persist_to=str(slow), fast_retention=1
    ) as w:
        for i in (2, 3):
            dcp.async_save(state(50 + i), storage_writer=w,
                           checkpoint_id=str(fast / f"step-{i}")).result(HANG_S)
        assert w.wait_persisted(timeout=HANG_S)
    assert _steps(slow) == ["step-2", "step-3"]
    assert _steps(fast) == ["step-1", "step-3"]  # step-2 is persisted, step-1 is not
    assert_state_equal(s1, load_local(fast / "step-1", s1))
    # With persist_retention, a step that policy drops anyway may go from the fast tier too.
    with DataStatesWriter(
        fast, **OPTS, persist_to=str(slow), fast_retention=1,
        persist_retention=2,
    ) as w:
        dcp.async_save(state(54), storage_writer=w,
                       checkpoint_id=str(fast / "step-4")).result(HANG_S)
        assert w.wait_persisted(timeout=HANG_S)
    assert _steps(slow) == ["step-3", "step-4"] and _steps(fast) == ["step-4"]


def test_fast_retention_skips_a_checkpoint_being_saved_again(fast: Path, tmp_path: Path) -> None:
    # A save of an older name in this process (claimed, committed, not yet queued for its
    # promotion) is not deleted on the strength of the promotion of its previous contents.
    from dcp_datastates.format.commit import claim_path, release_path
    from dcp_datastates.lifecycle import tiers

    slow = tmp_path / "slow"
    for step in (1, 2, 3):
        d = fast / f"step-{step}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(bytes([step]) * 100)
        (d / "__datastates_manifest_0.json").write_text("{}")
        (d / METADATA_FILE).write_bytes(b"x")
    first = tiers.Promoter(str(fast), str(slow), timeout_s=HANG_S)  # no fast_retention
    try:
        for step in (1, 2):
            first.submit(str(fast / f"step-{step}"), rank=0, world_size=1, coordinator=True)
        assert first.wait(timeout=HANG_S)
    finally:
        first.close(timeout=HANG_S)
    p = tiers.Promoter(str(fast), str(slow), fast_retention=1, timeout_s=HANG_S)
    try:
        key = os.path.realpath(fast / "step-1")
        claim_path(key)  # step-1 is being saved again (its new contents are not persisted)
        try:
            p.submit(str(fast / "step-3"), rank=0, world_size=1, coordinator=True)
            assert p.wait(timeout=HANG_S)
        finally:
            release_path(key)
        assert p.records()[-1]["pruned"] == [str(fast / "step-2")]
        assert _steps(fast) == ["step-1", "step-3"]
    finally:
        p.close(timeout=HANG_S)


def test_persist_timeout_bounds_each_copy_wait_persisted_and_close(
    fast: Path, tarpit: Tarpit
) -> None:
    # The persistent tier stops answering: every copy ends within persist_timeout, reported as
    # failed; wait_persisted() and close() return within it too.
    url = "s3://ckpt/run"
    timeout = 3.0
    w = DataStatesWriter(
        fast, **OPTS, persist_to=url, persist_timeout=timeout,
        persist_storage_options=tarpit.storage_options(connect_s=1, read_s=1),
    )
    try:
        sd = state(41)
        dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / "step-1")).result(HANG_S)
        t0 = time.monotonic()
        with pytest.raises(PersistError) as ei:
            in_thread(lambda: w.wait_persisted(), what="wait_persisted()")
        assert time.monotonic() - t0 < timeout + 5, time.monotonic() - t0
        msg = str(ei.value)
        assert f"{url}/step-1" in msg and "persist_timeout (3 s)" in msg, msg
        assert [s["persist_state"] for s in w.save_stats()] == ["failed"]
        assert_state_equal(sd, load_local(fast / "step-1", sd))  # the fast copy is intact
        for step in (2, 3):  # two more copies queued; close() does not wait for each in turn
            dcp.async_save(state(step), storage_writer=w,
                           checkpoint_id=str(fast / f"step-{step}")).result(HANG_S)
        t0 = time.monotonic()
    finally:
        in_thread(w.close, what="close()")
    assert time.monotonic() - t0 < timeout + 5, time.monotonic() - t0
    errors = [r["error"] for r in w.persist_stats()]
    assert len(errors) == 3 and all(e and "persist_timeout" in e for e in errors), errors


def test_a_copy_past_persist_timeout_aborts_its_upload(
    fast: Path, s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An S3 server that takes a part and never answers: the copy stops at persist_timeout, its
    # multipart upload is aborted (no stored parts), the persistent copy stays partial.
    import s3fs

    from dcp_datastates.lifecycle import tiers

    monkeypatch.setattr(tiers, "_S3_PART_BYTES", 5 * 1024**2, raising=False)
    orig = s3fs.S3FileSystem._call_s3

    async def call(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "upload_part" and kwargs.get("PartNumber") == 2:
            await asyncio.sleep(3600)
        return await orig(fs, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)
    url = s3.url("run")
    sd = {"w": torch.randn(3 * 1024**2), "step": 1}  # 12 MiB: three parts
    with DataStatesWriter(
        fast, **OPTS, persist_to=url, persist_timeout=3.0,
        persist_storage_options=s3.storage_options,
    ) as w:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / "step-1")).result(HANG_S)
        t0 = time.monotonic()
        with pytest.raises(PersistError, match="step-1/__0_0.distcp"):
            in_thread(lambda: w.wait_persisted(), what="wait_persisted()")
        assert time.monotonic() - t0 < 3.0 + 5, time.monotonic() - t0
    assert s3.pending_uploads() == []
    keys = s3.keys("run")
    assert "run/step-1/.metadata" not in keys and "run/step-1/__0_0.distcp" not in keys, keys
    assert remote.latest_complete(url, storage_options=s3.storage_options) is None


def test_saving_again_while_its_copy_runs_supersedes_the_copy(
    fast: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same checkpoint id saved again and again while its copy to the persistent tier runs:
    # every save succeeds (the writer's own copy is not "another process"), the old copy stops,
    # and both tiers end with the last save's contents.
    from dcp_datastates.lifecycle import tiers

    slow = tmp_path / "slow"
    orig = tiers._Slow.copy_file
    copying = threading.Event()

    def slow_copy(self: Any, src: str, rel: str, atomic: bool = False) -> int:
        copying.set()
        time.sleep(0.3)  # a slow persistent tier
        return orig(self, src, rel, atomic)

    monkeypatch.setattr(tiers._Slow, "copy_file", slow_copy)
    ckpt = fast / "step-1"
    states = [state(50 + i) for i in range(4)]
    with DataStatesWriter(fast, **OPTS, persist_to=str(slow)) as w:
        for sd in states:
            copying.clear()
            dcp.async_save(sd, storage_writer=w, checkpoint_id=str(ckpt)).result(HANG_S)
            assert copying.wait(HANG_S)  # its copy runs when the next save begins
        assert w.wait_persisted(timeout=HANG_S)  # superseded copies are not failures
        stats = w.save_stats()
        recs = w.persist_stats()
    assert [s["error"] for s in stats] == [None] * 4
    assert [s["persist_state"] for s in stats][-1] == "done"
    assert "superseded" in [s["persist_state"] for s in stats[:-1]], stats
    assert all(r["error"] is None for r in recs)
    for root in (fast, slow):
        assert_state_equal(states[-1], load_local(root / "step-1", states[-1]))
    assert latest_complete(slow) == slow / "step-1"
    assert not (slow / "step-1" / INCOMPLETE_MARKER).exists()


def test_a_superseded_s3_copy_aborts_its_upload(
    fast: Path, s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    from dcp_datastates.lifecycle import tiers

    monkeypatch.setattr(tiers, "_S3_PART_BYTES", 5 * 1024**2, raising=False)
    orig = s3fs.S3FileSystem._call_s3
    parts = threading.Event()

    async def call(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        # A slow object store (a data file's parts): the next save begins mid-copy.
        if method in ("upload_part", "put_object") and kwargs.get("Key", "").endswith(".distcp"):
            parts.set()
            await asyncio.sleep(0.5)
        return await orig(fs, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)
    url = s3.url("run")
    states = [{"w": torch.randn(3 * 1024**2, generator=torch.Generator().manual_seed(i))}
              for i in range(3)]
    with DataStatesWriter(
        fast, **OPTS, persist_to=url, persist_storage_options=s3.storage_options,
    ) as w:
        for sd in states:
            parts.clear()
            dcp.async_save(sd, storage_writer=w, checkpoint_id=str(fast / "step-1")).result(HANG_S)
            assert parts.wait(HANG_S)
        assert w.wait_persisted(timeout=HANG_S)
        persist = [s["persist_state"] for s in w.save_stats()]
    assert persist[-1] == "done" and "superseded" in persist[:-1], persist
    assert s3.pending_uploads() == []  # the stopped uploads were aborted
    out = zeros_like_state(states[-1])
    dcp.load(out, storage_reader=FsspecReader(url + "/step-1", **s3.storage_options))
    assert_state_equal(states[-1], out)
    assert_state_equal(states[-1], load_local(fast / "step-1", states[-1]))
