"""The commit lock across processes, cleanup/prune next to live saves, overwrites, symlinks.

Each test failed before the fix it guards (issue 9 items 6, 7, 8, 11, 12, 13, 14): a second
process's save to the same path succeeded and mixed bytes; cleanup from another process deleted
a save in flight; a 1-rank overwrite of a 2-rank checkpoint left rank 1's files (verify failed);
concurrent prunes raised FileNotFoundError; ENOSPC on a manifest did not name it; planted
symlinks were followed; file:// roots and missing roots were mishandled.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks

import dcp_datastates
from dcp_datastates import verify_checkpoint
from dcp_datastates.cli import main as cli_main
from dcp_datastates.errors import CheckpointSaveError
from dcp_datastates.format.commit import CheckpointDir
from dcp_datastates.lifecycle import checkpoints as ck

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CHILD_TIMEOUT_S = 90


@pytest.fixture
def holder() -> Iterator[Any]:
    """Starts lock_child.py on a path; the process is killed at the end in any case."""
    procs: list[subprocess.Popen[str]] = []

    def start(path: Path) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "lock_child.py"), str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(p.stdout.readline()))  # type: ignore[union-attr]
        t.start()
        t.join(CHILD_TIMEOUT_S)
        assert line and line[0].strip() == "ready", (line, p.poll())
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=CHILD_TIMEOUT_S)
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def _kill(p: subprocess.Popen[str]) -> None:
    os.kill(p.pid, signal.SIGKILL)  # as a crash would: no cleanup runs in the child
    p.wait(timeout=CHILD_TIMEOUT_S)


def _sd(v: float) -> dict[str, Any]:
    return {"w": torch.full((64, 64), v), "step": int(v)}


def test_save_from_another_process_is_refused_and_a_dead_lock_recovered(
    tmp_path: Path, writer_factory: Any, holder: Any
) -> None:
    path = tmp_path / "ckpt"
    child = holder(path)
    w = writer_factory()
    with pytest.raises(BaseException, match=rf"CheckpointBusyError.*pid {child.pid}") as ei:
        dcp.save(_sd(1.0), storage_writer=w, checkpoint_id=str(path))
    assert "another save" in str(ei.value)
    assert not (path / ".metadata").exists()
    _kill(child)  # its lock dies with it: no manual recovery
    dcp.save(_sd(2.0), storage_writer=w, checkpoint_id=str(path))
    rep = verify_checkpoint(str(path))
    assert rep.fully_verified, rep.summary()
    out = {"w": torch.zeros(64, 64), "step": 0}
    dcp_datastates.load(out, str(path))
    assert torch.equal(out["w"], torch.full((64, 64), 2.0)) and out["step"] == 2


def test_in_process_second_save_is_refused(tmp_path: Path, writer_factory: Any) -> None:
    from dcp_datastates.format.commit import claim_and_prepare, release_path

    d = CheckpointDir(str(tmp_path / "c"))
    key = claim_and_prepare(d, durable=False)
    try:
        with pytest.raises(dcp_datastates.CheckpointBusyError, match="in this process"):
            claim_and_prepare(CheckpointDir(str(tmp_path / "c")), durable=False)
    finally:
        release_path(key)
    release_path(claim_and_prepare(d, durable=False))  # free again


def _cleanup_cli(*args: str) -> int:
    try:
        return cli_main(["cleanup", *args])
    except SystemExit as e:
        return int(e.code or 0)


def test_cleanup_never_removes_a_live_save(tmp_path: Path, holder: Any) -> None:
    root = tmp_path / "root"
    live = root / "step-1"
    child = holder(live)
    for name in ("step-2", "step-3", "step-4"):  # partial, their writers are gone
        (root / name).mkdir()
        (root / name / ".datastates.incomplete").write_text("{}")
        (root / name / "__0_0.distcp").write_bytes(b"x")
    old = 1_000_000_000.0
    for name in ("step-2", "step-3"):
        for p in (root / name, *(root / name).iterdir()):
            os.utime(p, (old, old))
    # step-4 is fresh: --min-age keeps it; step-3 is excluded
    assert _cleanup_cli(str(root), "--min-age", "3600", "--exclude", "step-3") == 0
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-3", "step-4"]
    assert (live / ".datastates.incomplete").exists()
    assert ck.cleanup_incomplete(root) == [root / "step-3", root / "step-4"]
    assert live.exists()  # in flight in another process, not listed in exclude: still kept
    _kill(child)
    assert ck.cleanup_incomplete(f"file://{root}") == [live]
    assert list(root.iterdir()) == []


def test_cleanup_and_latest_reject_bad_roots(tmp_path: Path, capsys: Any) -> None:
    assert _cleanup_cli(str(tmp_path / "missing")) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert _cleanup_cli(str(tmp_path / "file")) == 2
    assert _cleanup_cli(str(tmp_path), "--min-age", "-1") == 2
    with pytest.raises(ValueError, match="file:// URLs"):
        ck.latest_complete("s3://bucket/ckpts")


def test_latest_complete_accepts_file_urls(tmp_path: Path, writer_factory: Any) -> None:
    root = tmp_path / "root"
    dcp.save(_sd(3.0), storage_writer=writer_factory(), checkpoint_id=f"file://{root}/step-3")
    assert ck.latest_complete(f"file://{root}") == root / "step-3"
    assert [i.name for i in ck.list_checkpoints(f"file://{root}")] == ["step-3"]


def _race(fns: list[Any]) -> list[BaseException]:
    """Runs ``fns`` in threads released together; returns what they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(fns))

    def run(fn: Any) -> None:
        try:
            barrier.wait(timeout=30)
            fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "prune/cleanup hung"
    return errors


def test_concurrent_prune_and_cleanup_tolerate_vanishing_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    policy = ck.RetentionPolicy(keep_last=1)
    for rnd in range(4):
        for step in range(40):
            d = root / f"step-{rnd * 100 + step}"
            d.mkdir(parents=True)
            for i in range(8):
                (d / f"__0_{i}.distcp").write_bytes(b"x")
            (d / (".metadata" if step % 4 else ".datastates.incomplete")).write_bytes(b"m")
        errors = _race(
            [
                lambda: ck.prune(root, policy),
                lambda: ck.prune(root, policy),
                lambda: ck.cleanup_incomplete(root),
                lambda: ck.cleanup_incomplete(root),
            ]
        )
        assert not errors, errors
        assert [i.name for i in ck.list_checkpoints(root)] == [f"step-{rnd * 100 + 39}"]


def _two_rank_save(rank: int, world: int, path: str) -> None:
    from dcp_datastates import DataStatesWriter

    sd = {f"r{rank}": torch.full((100,), float(rank)), "shared": torch.ones(10)}
    w = DataStatesWriter(path, host_cache_size="1MiB", chunk_size="16KiB", prefault=False)
    dcp.save(sd, storage_writer=w, checkpoint_id=path, process_group=dist.group.WORLD)
    w.close()


def test_overwriting_two_ranks_with_one_leaves_no_stale_files(
    tmp_path: Path, writer_factory: Any
) -> None:
    path = tmp_path / "ckpt"
    run_ranks(_two_rank_save, str(path), tmp_path=tmp_path / "work", timeout_s=120)
    assert (path / "__datastates_manifest_1.json").exists()
    assert verify_checkpoint(str(path)).fully_verified
    dcp.save(_sd(5.0), storage_writer=writer_factory(), checkpoint_id=str(path))
    assert not any(p.name.startswith("__1_") for p in path.iterdir())
    assert not (path / "__datastates_manifest_1.json").exists()
    rep = verify_checkpoint(str(path))
    assert rep.fully_verified and rep.ranks == 1, rep.summary()
    out = {"w": torch.zeros(64, 64), "step": 0}
    dcp_datastates.load(out, str(path))  # verify=True: accepted
    assert out["step"] == 5


def test_stale_manifest_of_another_save_is_ignored(tmp_path: Path, writer_factory: Any) -> None:
    """A leftover manifest (e.g. from a writer that does not clean up) is noted, not damage."""
    path = tmp_path / "ckpt"
    dcp.save(_sd(1.0), storage_writer=writer_factory(), checkpoint_id=str(path))
    m0 = (path / "__datastates_manifest_0.json").read_text()
    stale = m0.replace('"rank":0', '"rank":3').replace('"__0_', '"__3_')
    stale = stale.replace('"save_id":"', '"save_id":"old')
    (path / "__datastates_manifest_3.json").write_text(stale)
    rep = verify_checkpoint(str(path))
    assert rep.fully_verified, rep.summary()
    assert any("stale manifest" in n for n in rep.notes)


def test_planted_symlinks_are_never_followed(tmp_path: Path, writer_factory: Any) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    victims = {}
    for name in (
        ".datastates.incomplete",
        ".metadata.tmp",
        "__datastates_manifest_0.json.tmp",
        "__0_0.distcp",
        "__0_1.distcp",
    ):
        v = tmp_path / f"victim{len(victims)}"
        v.write_bytes(b"precious")
        (path / name).symlink_to(v)
        victims[name] = v
    dcp.save(_sd(4.0), storage_writer=writer_factory(), checkpoint_id=str(path))
    for name, v in victims.items():
        assert v.read_bytes() == b"precious", name
    assert verify_checkpoint(str(path)).fully_verified


def test_engine_refuses_a_symlinked_data_file(tmp_path: Path, writer_factory: Any) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "__0_0.distcp"
    link.symlink_to(victim)
    w = writer_factory()
    job = w.engine.create_job("symlink")
    try:
        with pytest.raises(CheckpointSaveError, match="__0_0.distcp"):
            w.engine.open_file(job, str(link))
    finally:
        w.engine.abort(job, "test")
        w.engine.forget(job)
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("name", ["__datastates_manifest_0.json", ".metadata"])
def test_enospc_on_manifest_or_metadata_names_the_file(
    tmp_path: Path, writer_factory: Any, monkeypatch: Any, name: str
) -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(f"/{name}.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "ckpt"
    with pytest.raises(BaseException) as ei:
        dcp.save(_sd(1.0), storage_writer=writer_factory(), checkpoint_id=str(path))
    assert "No space left on device" in str(ei.value)
    assert str(path / name) in str(ei.value), str(ei.value)
    assert not (path / f"{name}.tmp").exists()


def _open_fds_to(path: str) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)") == path:
                found.append(fd)
        except OSError:
            continue
    return found


@pytest.mark.parametrize("existing", [False, True], ids=["new-directory", "overwrite"])
def test_disk_full_writing_the_lock_marker_locks_nothing(
    tmp_path: Path, writer_factory: Any, monkeypatch: Any, existing: bool
) -> None:
    """ENOSPC while writing the marker's owner record: the error names the marker, nothing stays
    locked or open, a marker this save created is gone, an old checkpoint is untouched, and the
    next save to the path in this process succeeds once space is back."""
    path = tmp_path / "ckpt"
    marker = path / ck.INCOMPLETE_MARKER
    w = writer_factory()
    if existing:
        dcp.save(_sd(1.0), storage_writer=w, checkpoint_id=str(path))
    before = sorted(os.listdir(path)) if existing else None
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(marker):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(BaseException) as ei:
        dcp.async_save(_sd(2.0), storage_writer=w, checkpoint_id=str(path)).result(timeout=60)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert "No space left on device" in str(ei.value) and str(marker) in str(ei.value), ei.value
    assert not _open_fds_to(str(marker))  # the marker's descriptor is closed
    assert not marker.exists()  # created by the failed save: removed again
    if existing:
        assert sorted(os.listdir(path)) == before
        out = _sd(0.0)
        dcp.load(out, checkpoint_id=str(path))
        assert torch.equal(out["w"], _sd(1.0)["w"])
        assert verify_checkpoint(str(path)).ok
    # Nothing holds the lock: another process's view (flock on a new descriptor) is free...
    fd = dcp_datastates.format.commit.lock_marker(str(path), create=True, purpose="a test")
    assert fd is not None
    dcp_datastates.format.commit.unlock_marker(fd)
    # ...and the same writer saves to the path again.
    dcp.async_save(_sd(3.0), storage_writer=w, checkpoint_id=str(path)).result(timeout=60)
    out = _sd(0.0)
    dcp.load(out, checkpoint_id=str(path))
    assert torch.equal(out["w"], _sd(3.0)["w"]) and out["step"] == 3
