"""Early placement (dcp_datastates.save.early): a staged save's tensors flush while DCP plans, into
unnamed files that get their names only under the path claim."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import HANG_S, assert_state_equal, captured_logs, gated_planner, zeros_like_state
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from dcp_datastates import DataStatesWriter
from dcp_datastates.engine import Engine

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BIG = 1 << 20  # floats: 4 MiB, written with O_DIRECT


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(BIG, generator=g),
        "model": {"b": torch.randn(300, generator=g), "c": torch.randn(7, 5, generator=g)},
        "n": seed,
    }



def _unnamed_bytes(directory: str) -> int:
    """Bytes in this process's open unnamed files (O_TMPFILE) under ``directory``."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(directory.rstrip("/") + "/") and target.endswith("(deleted)"):
                total += os.stat(f"/proc/self/fd/{fd}").st_size
        except OSError:
            continue
    return total


def _wait_for(cond: Any, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _digest(directory: str) -> dict[str, str]:
    return {
        n: hashlib.sha256(open(os.path.join(directory, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(directory))
    }


def _load(path: str, like: dict[str, Any]) -> dict[str, Any]:
    out = zeros_like_state(like)
    dcp.load(out, checkpoint_id=path)
    return out


def test_tensors_flush_during_planning_and_stay_invisible_until_the_claim(
    tmp_path: Any, writer_factory: Any
) -> None:
    path = str(tmp_path / "ckpt")
    old, new = _state(1), _state(2)
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    dcp.save(old, storage_writer=w, checkpoint_id=path)
    before = _digest(path)

    planner = gated_planner()
    fut = dcp.async_save(new, storage_writer=w, checkpoint_id=path, planner=planner)
    try:
        assert planner.entered.wait(HANG_S)
        # The new save's bytes reach its files while DCP is still planning...
        _wait_for(lambda: _unnamed_bytes(path) >= BIG * 4, "the early flush")
        # ...and nobody can see them: the old checkpoint is untouched and loads exactly.
        assert _digest(path) == before
        assert_state_equal(_load(path, old), old)
    finally:
        planner.go.set()
    fut.result(timeout=HANG_S)
    assert_state_equal(_load(path, new), new)
    assert w.save_stats()[-1]["early_tensors"] == 3
    assert _unnamed_bytes(path) == 0  # every descriptor of the unnamed files is closed


def test_a_refused_save_leaves_the_old_checkpoint_and_no_files(
    tmp_path: Any, writer_factory: Any
) -> None:
    path = str(tmp_path / "ckpt")
    old = _state(1)
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", overwrite=False, early_flush=True)
    dcp.save(old, storage_writer=w, checkpoint_id=path)
    before = _digest(path)
    fut = dcp.async_save(_state(2), storage_writer=w, checkpoint_id=path)
    with pytest.raises(BaseException, match="already exists"):
        fut.result(timeout=HANG_S)
    assert _digest(path) == before
    assert_state_equal(_load(path, old), old)
    w.wait(timeout=HANG_S)
    _wait_for(lambda: _unnamed_bytes(path) == 0, "the refused save's files to be closed")


def test_a_save_failing_in_planning_leaves_no_data_files(
    tmp_path: Any, writer_factory: Any
) -> None:
    class FailingPlanner(DefaultSavePlanner):
        def create_local_plan(self) -> SavePlan:
            _wait_for(lambda: _unnamed_bytes(str(tmp_path)) >= BIG * 4, "the early flush")
            raise RuntimeError("planner broke")

    path = str(tmp_path / "new")
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    fut = dcp.async_save(_state(3), storage_writer=w, checkpoint_id=path, planner=FailingPlanner())
    with pytest.raises(BaseException, match="planner broke"):
        fut.result(timeout=HANG_S)
    w.wait(timeout=HANG_S)
    left = os.listdir(path) if os.path.isdir(path) else []
    assert not [n for n in left if n.endswith(".distcp") or n == ".metadata"], left
    _wait_for(lambda: _unnamed_bytes(str(tmp_path)) == 0, "the failed save's files to be closed")
    # The path is usable afterwards.
    dcp.async_save(_state(4), storage_writer=w, checkpoint_id=path).result(timeout=HANG_S)
    assert_state_equal(_load(path, _state(4)), _state(4))


@pytest.mark.parametrize("linked_first", [0, 1])
def test_files_that_cannot_be_linked_are_copied_into_place(
    tmp_path: Any, writer_factory: Any, monkeypatch: Any, linked_first: int
) -> None:
    # One rank names its files once their data is durable, with os.link through /proc/self/fd
    # (several ranks name them under the claim, with Engine.link_file).
    real = os.link
    calls = []

    def refuse(src: str, dst: str, **kw: Any) -> None:
        if src.startswith("/proc/self/fd/"):
            calls.append(dst)
            if len(calls) > linked_first:  # the first files are named, the next one is not
                raise OSError(errno.EXDEV, "injected EXDEV")
        real(src, dst, **kw)

    monkeypatch.setattr(os, "link", refuse)
    path = str(tmp_path / "ckpt")
    state = _state(5)
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    with captured_logs("dcp_datastates.save.writer") as records:
        dcp.async_save(state, storage_writer=w, checkpoint_id=path).result(timeout=HANG_S)
    assert len(calls) == linked_first + 1
    assert any("copied into place" in r.getMessage() for r in records)
    assert_state_equal(_load(path, state), state)
    assert w.save_stats()[-1]["early_tensors"] == 3
    assert _unnamed_bytes(str(tmp_path)) == 0


def test_a_plan_that_drops_or_replaces_staged_tensors_is_still_exact(
    tmp_path: Any, writer_factory: Any
) -> None:
    class Replacing(DefaultSavePlanner):
        """Saves 'a' doubled (a new tensor object) and drops 'model.b' from the plan."""

        def set_up_planner(
            self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
        ) -> None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            self.state_dict["a"] = self.state_dict["a"] * 2

        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = [i for i in plan.items if i.index.fqn != "model.b"]
            self.plan = SavePlan(items, planner_data=plan.planner_data)
            return self.plan

    path = str(tmp_path / "ckpt")
    state = _state(6)
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    dcp.async_save(state, storage_writer=w, checkpoint_id=path, planner=Replacing()).result(
        timeout=HANG_S
    )
    out = _load(path, {"a": state["a"], "model": {"c": state["model"]["c"]}, "n": 0})
    assert torch.equal(out["a"], state["a"] * 2)
    assert torch.equal(out["model"]["c"], state["model"]["c"])
    assert out["n"] == 6


def test_early_flush_off_and_dcp_save_place_in_write_data(
    tmp_path: Any, writer_factory: Any
) -> None:
    state = _state(7)
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=False)
    dcp.async_save(state, storage_writer=w, checkpoint_id=str(tmp_path / "a")).result(
        timeout=HANG_S
    )
    assert w.save_stats()[-1]["early_tensors"] == 0
    w2: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    dcp.save(state, storage_writer=w2, checkpoint_id=str(tmp_path / "b"))
    assert w2.save_stats()[-1]["early_tensors"] == 0
    for p in ("a", "b"):
        assert_state_equal(_load(str(tmp_path / p), state), state)


def test_a_process_killed_before_the_claim_leaves_only_the_old_checkpoint(
    tmp_path: Any, writer_factory: Any
) -> None:
    path = str(tmp_path / "ckpt")
    old = _state(1)
    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    dcp.save(old, storage_writer=w, checkpoint_id=path)
    before = _digest(path)
    child = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch.distributed.checkpoint as dcp
        import test_early_flush as t
        from dcp_datastates import DataStatesWriter
        w = DataStatesWriter({path!r}, host_cache_size="64MiB", chunk_size="1MiB",
                             early_flush=True)
        planner = t.gated_planner()
        dcp.async_save(t._state(2), storage_writer=w, checkpoint_id={path!r}, planner=planner)
        assert planner.entered.wait(30)
        t._wait_for(lambda: t._unnamed_bytes({path!r}) >= t.BIG * 4, "the early flush")
        print("flushed", flush=True)
        os._exit(9)  # dies while the new save's data sits in its unnamed files
        """
    )
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 9 and "flushed" in r.stdout, r.stderr[-3000:]
    assert _digest(path) == before
    assert_state_equal(_load(path, old), old)


def test_a_save_failed_while_it_is_placed_early_reports_the_cause(
    tmp_path: Any, writer_factory: Any, monkeypatch: Any
) -> None:
    # A barrier may fail the job (a tensor changed outside step()) while its save thread places
    # it: the save must report that cause, not what placing a forgotten job then hits.
    from dcp_datastates.errors import CaptureError

    w: DataStatesWriter = writer_factory(host_cache_size="64MiB", early_flush=True)
    real = Engine.place
    failed: list[int] = []

    def place(self: Engine, job: int, *a: Any) -> None:
        if not failed:
            failed.append(job)
            (j,) = [j for j in w._table._jobs if j.engine_job == job]
            w._table.fail_job(j, CaptureError("'a' was modified in place (injected)"))
        return real(self, job, *a)

    monkeypatch.setattr(Engine, "place", place)
    fut = dcp.async_save(_state(8), storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(BaseException, match="modified in place"):
        fut.result(timeout=HANG_S)
    assert failed
    monkeypatch.undo()
    dcp.async_save(_state(9), storage_writer=w, checkpoint_id=str(tmp_path / "c")).result(
        timeout=HANG_S
    )
    assert_state_equal(_load(str(tmp_path / "c"), _state(9)), _state(9))


def test_placed_as_dcp_starts_the_save_before_it_sets_the_writer_up(
    tmp_path: Any, monkeypatch: Any
) -> None:
    # The save thread binds its job when DCP first iterates the staged dict, right after
    # reset(checkpoint_id): the tensors are placed (and flush) from there, not only once DCP has
    # converted every top-level value and set its planner up.
    seen: list[bool] = []
    original = DataStatesWriter.set_up_storage_writer

    def recording(self: DataStatesWriter, *args: Any, **kwargs: Any) -> None:
        job = self._table.job_of_thread(threading.get_ident())
        seen.append(job is not None and job.early is not None)
        original(self, *args, **kwargs)

    monkeypatch.setattr(DataStatesWriter, "set_up_storage_writer", recording)
    sd = _state(3)
    with DataStatesWriter(str(tmp_path), host_cache_size="64MiB") as w:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "a")).result(HANG_S)
        dcp.save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "b"))  # nothing staged
    assert seen == [True, False]
    for name in ("a", "b"):
        out = zeros_like_state(sd)
        dcp.load(out, checkpoint_id=str(tmp_path / name))
        assert_state_equal(sd, out)
