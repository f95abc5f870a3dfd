"""A busy machine: lazy copies would starve under SCHED_IDLE, so the call copies instead, and a
step barrier raises the copy threads to normal priority while it waits.

The policy reads the machine's CPU counters (dcp_datastates.runtime.cpuload); here a meter reporting
a chosen load stands in for them (conftest's ``quiet_machine`` pins every other test to a quiet
one), and the meter itself is checked against a real busy process.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, zeros_like_state

from dcp_datastates import DataStatesWriter
from dcp_datastates.runtime.cpuload import CpuLoad, CpuMeter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BUSY = CpuLoad(window_s=1.0, idle_cores=0.0, others_cores=1.0, own_cores=1.0)
QUIET = CpuLoad(window_s=1.0, idle_cores=1.2, others_cores=0.0, own_cores=0.8)
MANY_CORES = CpuLoad(window_s=1.0, idle_cores=40.0, others_cores=8.0, own_cores=2.0)


class FixedMeter(CpuMeter):
    """Reports the load it is given."""

    def __init__(self, load: CpuLoad | None) -> None:
        self.load = load

    def sample(self) -> CpuLoad | None:
        return self.load


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 256)).sum().backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.mark.parametrize(
    ("load", "boost", "lazy"),
    [
        (BUSY, False, False),
        (BUSY, True, True),
        (QUIET, False, True),
        (MANY_CORES, False, True),
        (None, False, True),
    ],
)
def test_busy_machine_copies_at_the_call_and_keeps_the_snapshot(
    tmp_path: Any, writer_factory: Any, load: CpuLoad | None, boost: bool, lazy: bool
) -> None:
    """Busy (others took a core, none idle) where no barrier may raise the copy threads: the
    optimizer's state is copied at the call, nothing is left to the copy threads, and the
    checkpoint holds the state of the call although the step changes it at once. Busy but
    boostable, quiet, idle cores left (a large node), or no counters: lazy."""
    model, opt = _model_and_opt()
    w: DataStatesWriter = writer_factory(host_cache_size="16MiB")
    w._stager._meter = FixedMeter(load)
    w.engine.can_boost = lambda: boost  # type: ignore[method-assign]
    ref = copy.deepcopy(_state(model, opt))
    fut = dcp.async_save(_state(model, opt), storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    _step(model, opt)  # changes every parameter and moment right after the call
    fut.result(timeout=30)
    st = w.save_stats()[-1]
    if lazy:
        assert st["lazy_bytes"] > 0 and st["busy_bytes"] == 0
    else:
        assert st["lazy_bytes"] == 0 and st["busy_bytes"] > 0
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert_state_equal(out, ref)


def test_busy_capture_left_to_the_copies_when_the_cache_is_full(
    tmp_path: Any, writer_factory: Any
) -> None:
    """Busy, but the cache is held by an earlier save whose flush is slowed: the call does not
    wait behind that flush; what does not fit now stays lazy, and both saves are exact."""
    model, opt = _model_and_opt()
    nbytes = sum(p.numel() * 4 for p in model.parameters())  # one copy of the parameters
    cache = f"{int(nbytes * 3.5)}B"
    w: DataStatesWriter = writer_factory(host_cache_size=cache, chunk_size="64KiB")
    w._stager._meter = FixedMeter(BUSY)
    w.engine.can_boost = lambda: False  # type: ignore[method-assign]
    w.engine.set_delays(0, 100_000, seed=1)  # slow flushes: the first save holds its space
    ref1 = copy.deepcopy(_state(model, opt))
    f1 = dcp.async_save(_state(model, opt), storage_writer=w, checkpoint_id=str(tmp_path / "a"))
    _step(model, opt)
    ref2 = copy.deepcopy(_state(model, opt))
    f2 = dcp.async_save(_state(model, opt), storage_writer=w, checkpoint_id=str(tmp_path / "b"))
    _step(model, opt)
    f1.result(timeout=60)
    f2.result(timeout=60)
    w.engine.set_delays(0, 0)
    assert w.save_stats()[-1]["lazy_bytes"] > 0  # the second did not fit at its call
    for ref, name in ((ref1, "a"), (ref2, "b")):
        out = zeros_like_state(ref)
        dcp.load(out, checkpoint_id=str(tmp_path / name))
        assert_state_equal(out, ref)


def test_adapt_to_load_off_keeps_the_policy(tmp_path: Any, writer_factory: Any) -> None:
    """``adapt_to_load=False``: no meter; the policy alone decides (optimizer state lazy)."""
    model, opt = _model_and_opt()
    w: DataStatesWriter = writer_factory(adapt_to_load=False)
    assert w._stager._meter is None
    fut = dcp.async_save(_state(model, opt), storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    _step(model, opt)
    fut.result(timeout=30)
    assert w.save_stats()[-1]["lazy_bytes"] > 0


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_meter_sees_another_process_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real counters: a process spinning beside this one counts as others' load; within
    ``MIN_WINDOW_S`` the previous sample is repeated."""
    monkeypatch.undo()  # conftest's quiet_machine pinned CpuMeter.sample: the real one here
    meter = CpuMeter()
    sample = CpuMeter.sample
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_spin, args=(3.0,))
    p.start()
    try:
        time.sleep(1.0)  # the child is started and spinning
        sample(meter)  # window starts
        time.sleep(0.8)
        load = sample(meter)
        again = sample(meter)  # within MIN_WINDOW_S: the same sample
    finally:
        p.join(30)
    if load is None:
        pytest.skip("no /proc/stat here")
    assert again == load
    assert load.others_cores >= 0.5, load
    assert load.own_cores < 0.5, load  # this process slept


_EARLIER: set[str] = set()  # copy threads of writers made before the test's own


def _copy_policies() -> list[int]:
    """Scheduling policy (proc(5) field 41) of this process's dcpds-copy threads, but those of
    writers that earlier tests left to the collector (``_EARLIER``)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        if name.startswith("dcpds-copy") and tid not in _EARLIER:
            out.append(int(stat[stat.rfind(")") + 2 :].split()[38]))
    return out


def test_barrier_boosts_idle_copy_threads_and_lowers_them_again(
    tmp_path: Any, writer_factory: Any
) -> None:
    """The step barrier raises the SCHED_IDLE copy threads to normal priority while it waits
    (where the OS allows it) and puts them back afterwards; the snapshot stays exact."""
    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc")
    _EARLIER.clear()
    _EARLIER.update(os.listdir("/proc/self/task"))
    model, opt = _model_and_opt()
    w: DataStatesWriter = writer_factory(host_cache_size="16MiB", chunk_size="64KiB")
    SCHED_IDLE = 5
    deadline = time.monotonic() + 10.0  # the copy threads start, name and lower themselves
    while not (_copy_policies() and set(_copy_policies()) == {SCHED_IDLE}):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert _copy_policies() and set(_copy_policies()) == {SCHED_IDLE}
    before = w.engine.counters()
    if os.geteuid() == 0:  # root may leave SCHED_IDLE
        assert before["boost_available"]
    ref = copy.deepcopy(_state(model, opt))
    w.engine.set_delays(20_000, 0, seed=2)  # slow copies: unfinished when the step comes
    fut = dcp.async_save(_state(model, opt), storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    _step(model, opt)  # the barrier helps, boosted
    w.engine.set_delays(0, 0)
    fut.result(timeout=30)
    after = w.engine.counters()
    assert after["boosts"] > before["boosts"]
    if after["boost_refused"] == before["boost_refused"]:
        assert set(_copy_policies()) == {SCHED_IDLE}  # lowered again
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert_state_equal(out, ref)
