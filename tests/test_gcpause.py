"""The collector pause around per-item bookkeeping (dcp_datastates.runtime.gcpause): it nests, it
never re-enables a collector the program disabled, and a failing save leaves it as it was."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter
from dcp_datastates.runtime import gcpause
from dcp_datastates.runtime.gcpause import ProtocolPause, gc_paused


def _no_pause_in_progress() -> None:
    """Waits for pauses that end shortly after a save (ProtocolPause.end_soon) of a test."""
    deadline = time.monotonic() + 5
    while gcpause._depth and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gcpause._depth == 0, "a collector pause was left in progress"


@pytest.fixture(autouse=True)
def _restore_gc() -> Any:
    _no_pause_in_progress()
    was = gc.isenabled()
    yield
    _no_pause_in_progress()
    if was:
        gc.enable()
    else:
        gc.disable()


def test_nested_pauses_reenable_once_at_the_end() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_program_disabled_stays_disabled() -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_from_threads_end_enabled() -> None:
    gc.enable()
    barrier = threading.Barrier(4)

    def body() -> None:
        with gc_paused():
            barrier.wait(timeout=30)  # all four pauses overlap
        for _ in range(200):
            with gc_paused():
                pass

    threads = [threading.Thread(target=body) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_another_threads_pause_collects() -> None:
    # A DataLoader worker forked while a save thread is inside a pause: the child has no
    # thread that would end that pause, so it must start with the collector enabled.
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def paused_thread() -> None:
        with gc_paused():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=paused_thread)
    t.start()
    assert inside.wait(30)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanups
        ok = gc.isenabled()
        with gc_paused():
            ok = ok and not gc.isenabled()
        ok = ok and gc.isenabled()
        os.write(wfd, b"1" if ok else b"0")
        os._exit(0)
    os.close(wfd)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert not gc.isenabled()  # the parent's pause goes on
    release.set()
    t.join(30)
    assert gc.isenabled()
    assert got == b"1", "the forked child's collector stayed disabled"


def test_an_exception_inside_reenables() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def _enabled_within(seconds: float) -> bool:
    """A save's pause ends shortly after its last protocol call (ProtocolPause.end_soon)."""
    deadline = time.monotonic() + seconds
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    return gc.isenabled()


def test_saves_leave_the_collector_as_they_found_it(tmp_path: Any) -> None:
    sd = {"m": {f"t{i}": torch.randn(4) for i in range(100)}}
    with DataStatesWriter(str(tmp_path), host_cache_size="16MiB") as w:
        gc.enable()
        dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "a")).result(60)
        dcp.save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "b"))
        assert _enabled_within(5)
        gc.disable()
        dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c")).result(60)
        dcp.save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "d"))
        assert not gc.isenabled()
        gc.enable()
        # A value that cannot be staged fails the call inside the paused walk.
        bad = {"m": {"t": torch.randn(4), "lock": threading.Lock()}}
        with pytest.raises(Exception, match="lock"):
            dcp.async_save(bad, storage_writer=w, checkpoint_id=str(tmp_path / "e"))
        assert gc.isenabled()


def test_a_protocol_pause_ends_once_by_call_or_by_its_timer() -> None:
    gc.enable()
    p = ProtocolPause(max_s=60)
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the protocol pause goes on
    p.end()
    p.end()  # idempotent: a second end does not end another pause
    assert gc.isenabled()
    q, r = ProtocolPause(max_s=0.2), ProtocolPause(max_s=60)
    time.sleep(0.5)
    assert q.ended and not r.ended and not gc.isenabled()
    r.end_soon(0.1)
    assert not gc.isenabled()
    assert _enabled_within(5) and r.ended


def test_a_protocol_pause_keeps_a_disabled_collector_disabled() -> None:
    gc.disable()
    ProtocolPause(max_s=60).end()
    assert not gc.isenabled()


def test_dcp_failing_between_writer_calls_does_not_leave_the_collector_off(
    tmp_path: Any, monkeypatch: Any
) -> None:
    # A planner that raises after set_up_storage_writer: DCP never calls the writer again, so
    # the pause ends by the next save in this thread or, without one, by its timer.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Failing(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            raise RuntimeError("planner failed")

    monkeypatch.setattr(gcpause, "PROTOCOL_PAUSE_MAX_S", 0.5)
    sd = {"m": {f"t{i}": torch.randn(4) for i in range(10)}}
    gc.enable()
    with DataStatesWriter(str(tmp_path), host_cache_size="16MiB") as w:
        with pytest.raises(BaseException, match="planner failed"):
            dcp.save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "a"), planner=Failing())
        assert not gc.isenabled()  # the failed save's pause is still on ...
        dcp.save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "b"))
        assert _enabled_within(5)  # ... and the next save ended it
        with pytest.raises(BaseException, match="planner failed"):
            dcp.save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"), planner=Failing())
        time.sleep(1.0)  # no next save: the timer ends it
        assert gc.isenabled()


def test_the_stage_pause_is_handed_to_the_save_and_never_spans_a_wait_for_an_earlier_one(
    tmp_path: Any,
) -> None:
    # stage() pauses the collector in the caller; the save thread takes that pause over for
    # DCP's planning (one pause, not two), and ends it before waiting for an earlier save.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    release = threading.Event()
    planning = threading.Event()

    class Blocking(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            planning.set()
            assert release.wait(30)
            return super().create_local_plan()

    def depth_becomes(n: int) -> bool:
        deadline = time.monotonic() + 10
        while gcpause._depth != n and time.monotonic() < deadline:
            time.sleep(0.005)
        return gcpause._depth == n

    sd = {"m": {f"t{i}": torch.randn(4) for i in range(50)}}
    gc.enable()
    with DataStatesWriter(str(tmp_path), host_cache_size="16MiB") as w:
        try:
            fa = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "a"),
                                planner=Blocking())
            assert planning.wait(30)
            assert depth_becomes(1) and not gc.isenabled()  # the stage pause, handed over
            fb = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "b"))
            # b's save thread waits for a's protocol: its own pause ended before it waited.
            assert depth_becomes(1)
            assert not fb.done()
        finally:
            release.set()
        fa.result(60)
        fb.result(60)
    assert _enabled_within(5)


def _collector_during_broadcast(rank: int, world: int, root: str) -> tuple[list[bool], bool]:
    """One async_save under a process group whose broadcast of the result is slow (0.3 s, more
    than the timer a dcp.save's pause ends by): the collector stays paused through it and runs
    again once the future completed."""
    from torch.distributed.checkpoint import utils as dcp_utils

    seen: list[bool] = []
    original = dcp_utils._DistWrapper.broadcast_object

    def slow_broadcast(self: Any, obj: Any) -> Any:
        seen.append(gc.isenabled())
        time.sleep(0.3)
        seen.append(gc.isenabled())
        return original(self, obj)

    dcp_utils._DistWrapper.broadcast_object = slow_broadcast  # type: ignore[method-assign]
    gc.enable()
    sd = {"m": {f"t{i}": torch.randn(4) for i in range(50)}}
    with DataStatesWriter(root, host_cache_size="16MiB") as w:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/a").result(60)
        return seen, _enabled_within(5)


def test_the_pause_lasts_through_dcps_broadcast_of_the_result(tmp_path: Any) -> None:
    from dist_utils import run_ranks

    [(seen, after)] = run_ranks(_collector_during_broadcast, str(tmp_path / "c"),
                                tmp_path=tmp_path, world_size=1)
    assert seen == [False, False]  # paused from before the broadcast to its end
    assert after  # and enabled again once the save's future completed
