"""Overwriting a checkpoint on a (nearly) full disk: nothing of the checkpoint being replaced is
removed for a save that has failed or cannot fit (dcp_datastates.storage.room).

Each test failed before the fix: an early-placed save that ran out of space (or past the file
size limit) beside the old checkpoint removed it under the claim and then failed, leaving no
checkpoint at all.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    HANG_S,
    assert_state_equal,
    captured_logs,
    gated_planner,
    mounted_tmpfs,
    zeros_like_state,
)
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from dcp_datastates import DataStatesWriter, _core, verify_checkpoint
from dcp_datastates.storage import room

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BIG = 1 << 20  # floats: a 4 MiB tensor


def state(seed: int, n: int = BIG) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g), "b": torch.randn(300, generator=g), "n": seed}


def digest(directory: str) -> dict[str, str]:
    return {
        n: hashlib.sha256(open(os.path.join(directory, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(directory))
    }


def assert_intact(path: str, before: dict[str, str], sd: dict[str, Any]) -> None:
    """The old checkpoint is exactly as it was: same files, bit for bit; stock dcp.load reads it;
    verify passes."""
    assert digest(path) == before
    out = zeros_like_state(sd)
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(out, sd)
    rep = verify_checkpoint(path)
    assert rep.ok, rep.summary()


@pytest.fixture
def small_fs(tmp_path: Any) -> Iterator[str]:
    """A 1 MiB file system (tmpfs): a real disk that fills up."""
    with mounted_tmpfs(tmp_path / "small-fs", "1m") as mnt:
        yield mnt


def test_full_disk_overwrite_that_fits_once_the_old_one_is_gone_completes(
    writer_factory: Any, small_fs: str
) -> None:
    # Old and new (640 kB each) do not fit side by side on 1 MiB; the new one alone does. The
    # early placement cannot reserve its room, so the save replaces the old checkpoint as
    # early_flush=False does (it used to run out of space after removing it: no checkpoint).
    path = os.path.join(small_fs, "ckpt")
    w: DataStatesWriter = writer_factory(host_cache_size="8MiB", early_flush=True)
    dcp.save(state(1, n=160_000), storage_writer=w, checkpoint_id=path)
    new = state(2, n=160_000)
    dcp.async_save(new, storage_writer=w, checkpoint_id=path).result(timeout=HANG_S)
    out = zeros_like_state(new)
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(out, new)
    assert verify_checkpoint(path).ok


@pytest.mark.parametrize("early_flush", [True, False], ids=["early", "late"])
def test_full_disk_overwrite_that_cannot_fit_keeps_the_old_checkpoint(
    writer_factory: Any, small_fs: str, early_flush: bool
) -> None:
    path = os.path.join(small_fs, "ckpt")
    w: DataStatesWriter = writer_factory(host_cache_size="8MiB", early_flush=early_flush)
    old = state(1, n=25_000)
    dcp.save(old, storage_writer=w, checkpoint_id=path)
    before = digest(path)
    with pytest.raises(BaseException) as ei:  # 1.2 MB: more than the whole file system
        dcp.async_save(state(2, n=300_000), storage_writer=w, checkpoint_id=path).result(
            timeout=HANG_S
        )
    msg = str(ei.value)
    assert "not enough space" in msg and path in msg, msg
    assert_intact(path, before, old)
    dcp.async_save(state(3, n=25_000), storage_writer=w, checkpoint_id=path).result(
        timeout=HANG_S
    )
    assert_intact(path, digest(path), state(3, n=25_000))



@pytest.mark.parametrize("early_flush", [True, False], ids=["early", "late"])
def test_overwrite_past_the_file_size_limit_keeps_the_old_checkpoint(
    tmp_path: Any, early_flush: bool
) -> None:
    # A real limit, not a mock: RLIMIT_FSIZE (SIGXFSZ ignored: writes past it fail with EFBIG).
    path = str(tmp_path / "ckpt")
    child = textwrap.dedent(
        f"""
        import os, resource, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch.distributed.checkpoint as dcp
        import test_disk_full_overwrite as t
        from dcp_datastates import DataStatesWriter
        path = {path!r}
        w = DataStatesWriter(path, host_cache_size="64MiB", chunk_size="1MiB", prefault=False,
                             early_flush={early_flush!r})
        dcp.async_save(t.state(1), storage_writer=w, checkpoint_id=path).result(timeout=60)
        before = t.digest(path)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # smaller than one file
        try:
            dcp.async_save(t.state(2), storage_writer=w, checkpoint_id=path).result(timeout=60)
        except BaseException as e:
            msg = str(e)
            assert "File too large" in msg or "file size limit" in msg, msg
            assert path in msg, msg
        else:
            raise AssertionError("a save past the file size limit succeeded")
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        t.assert_intact(path, before, t.state(1))
        # The writer goes on: the same path, once the limit is lifted.
        dcp.async_save(t.state(3), storage_writer=w, checkpoint_id=path).result(timeout=60)
        w.close()
        print("OK", flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])
    out = zeros_like_state(state(3))
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(out, state(3))


def _no_room_beside(monkeypatch: Any) -> list[int]:
    """The file system looks nearly full (room.free_bytes) and refuses every reservation with
    ENOSPC: what an early placement meets beside a checkpoint on a nearly full disk. Returns
    the list of sizes asked for."""
    asked: list[int] = []

    def allocate(fd: int, nbytes: int) -> None:
        asked.append(nbytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(room, "free_bytes", lambda path: 4096)
    monkeypatch.setattr(room, "allocate", allocate)
    return asked


def test_no_room_beside_the_old_checkpoint_replaces_it_as_a_late_save_would(
    tmp_path: Any, writer_factory: Any, monkeypatch: Any
) -> None:
    # The new data fits once the old checkpoint is gone (same shapes): the save places
    # everything after the removal, as early_flush=False does, and completes.
    path = str(tmp_path / "ckpt")
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    dcp.save(state(1), storage_writer=w, checkpoint_id=path)
    asked = _no_room_beside(monkeypatch)
    dcp.async_save(state(2), storage_writer=w, checkpoint_id=path).result(timeout=HANG_S)
    assert asked  # the early placement tried to reserve room, and fell back
    assert w.save_stats()[-1]["early_tensors"] == 0
    out = zeros_like_state(state(2))
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(out, state(2))
    assert verify_checkpoint(path).ok


@pytest.mark.parametrize("early_flush", [True, False], ids=["early", "late"])
def test_no_room_even_without_the_old_checkpoint_removes_nothing(
    tmp_path: Any, writer_factory: Any, monkeypatch: Any, early_flush: bool
) -> None:
    path = str(tmp_path / "ckpt")
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=early_flush)
    old = state(1, n=1000)  # a small checkpoint: removing it cannot make room for 4 MiB
    dcp.save(old, storage_writer=w, checkpoint_id=path)
    before = digest(path)
    _no_room_beside(monkeypatch)
    with pytest.raises(BaseException) as ei:
        dcp.async_save(state(2), storage_writer=w, checkpoint_id=path).result(timeout=HANG_S)
    msg = str(ei.value)
    assert "not enough space" in msg and path in msg, msg
    assert_intact(path, before, old)
    monkeypatch.undo()
    dcp.async_save(state(3), storage_writer=w, checkpoint_id=path).result(timeout=HANG_S)
    out = zeros_like_state(state(3))
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(out, state(3))


def _old_checkpoint(
    tmp_path: Any, writer_factory: Any
) -> tuple[str, DataStatesWriter, dict[str, str]]:
    """A writer with early placement, the checkpoint it will overwrite, and that one's digest."""
    path = str(tmp_path / "ckpt")
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    dcp.save(state(1), storage_writer=w, checkpoint_id=path)
    return path, w, digest(path)


def test_an_early_flush_failing_before_the_claim_removes_nothing(
    tmp_path: Any, writer_factory: Any
) -> None:
    # The early flush runs out of space (injected) while DCP plans: the claim must not remove
    # the old checkpoint for a save that has failed already.
    path, w, before = _old_checkpoint(tmp_path, writer_factory)
    planner = gated_planner()
    _core.set_write_fault("ckpt/__0_", errno.ENOSPC)
    try:
        fut = dcp.async_save(state(2), storage_writer=w, checkpoint_id=path, planner=planner)
        try:
            assert planner.entered.wait(HANG_S)
            deadline = time.monotonic() + HANG_S
            while not any(w.engine.stats(j.engine_job)["failed"] for j in list(w._table._jobs)):
                assert time.monotonic() < deadline, "the injected fault never failed the flush"
                time.sleep(0.01)
        finally:
            planner.go.set()
        with pytest.raises(BaseException) as ei:
            fut.result(timeout=HANG_S)
    finally:
        _core.set_write_fault("", 0)
    msg = str(ei.value)
    assert "No space left on device" in msg and "ckpt/__0_" in msg, msg
    assert_intact(path, before, state(1))
    dcp.async_save(state(3), storage_writer=w, checkpoint_id=path).result(timeout=HANG_S)
    out = zeros_like_state(state(3))
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(out, state(3))


class FailAfterTheClaim(DefaultSavePlanner):
    """Fails the save's job (as a flush error would) once the path is claimed: DCP calls
    ``finish_plan`` after the coordinator's ``prepare_global_plan``."""

    def __init__(self, w: DataStatesWriter) -> None:
        super().__init__()
        self.w = w

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        from dcp_datastates.errors import CheckpointSaveError

        job = max((j for j in self.w._table._jobs if not j.finished), key=lambda j: j.seq)
        self.w._table.fail_job(job, CheckpointSaveError("injected failure after the claim"))
        return super().finish_plan(new_plan)


def test_one_rank_keeps_the_old_checkpoint_until_its_data_is_durable(
    tmp_path: Any, writer_factory: Any
) -> None:
    # With its tensors placed early, a single-rank save removes the checkpoint it replaces only
    # once its own data is durable: a failure after the claim leaves the old one whole, marker
    # included (none).
    path, w, before = _old_checkpoint(tmp_path, writer_factory)
    with pytest.raises(BaseException, match="injected failure after the claim"):
        dcp.async_save(state(2), storage_writer=w, checkpoint_id=path,
                       planner=FailAfterTheClaim(w)).result(timeout=HANG_S)
    assert_intact(path, before, state(1))
    with captured_logs("dcp_datastates.save.writer") as records:
        dcp.async_save(state(3), storage_writer=w, checkpoint_id=path).result(timeout=HANG_S)
    assert not any("copied into place" in r.getMessage() for r in records)  # linked
    assert w.save_stats()[-1]["early_tensors"] == 2
    assert_intact(path, digest(path), state(3))
    assert ".datastates.incomplete" not in os.listdir(path)


class DieAfterTheClaim(DefaultSavePlanner):
    """Kills the process once the path is claimed (``finish_plan`` follows the claim)."""

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        print("claimed", flush=True)
        os._exit(9)


def test_one_rank_killed_after_the_claim_leaves_the_old_checkpoint(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    child = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch.distributed.checkpoint as dcp
        import test_disk_full_overwrite as t
        from dcp_datastates import DataStatesWriter
        w = DataStatesWriter({path!r}, host_cache_size="64MiB", chunk_size="1MiB",
                             prefault=False, early_flush=True)
        dcp.save(t.state(1), storage_writer=w, checkpoint_id={path!r})
        print("saved", flush=True)
        dcp.async_save(t.state(2), storage_writer=w, checkpoint_id={path!r},
                       planner=t.DieAfterTheClaim()).result(timeout=60)
        """
    )
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 9 and "claimed" in r.stdout, (r.stdout, r.stderr[-3000:])
    # The old checkpoint, whole; the dead save's marker beside it (its lock died with it).
    assert ".metadata" in os.listdir(path)
    out = zeros_like_state(state(1))
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(out, state(1))
    rep = verify_checkpoint(path)
    assert rep.ok, rep.summary()
