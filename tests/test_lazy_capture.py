"""Lazy capture: async_save returns before copies finish; optimizer.step waits; snapshots exact."""

from __future__ import annotations

import copy
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, captured_logs, zeros_like_state
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_datastates import DataStatesWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.bn = torch.nn.BatchNorm1d(64)
        self.fc2 = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def make_training(seed: int = 0) -> tuple[Net, torch.optim.Optimizer, torch.Generator]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.Generator().manual_seed(seed)


def train_step(model: Net, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    x = torch.randn(16, 32, generator=gen)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def state_of(model: Net, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def test_async_save_returns_while_copies_are_held(tmp_path: Any, writer_factory: Any) -> None:
    w: DataStatesWriter = writer_factory(capture="lazy")
    sd = {"t": torch.randn(100_000)}
    ref = copy.deepcopy(sd)
    w.engine.pause_copies(True)
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    assert not fut.done()  # nothing could be copied, yet the call returned
    assert w.wait_captured(timeout=0.2) is False
    w.engine.pause_copies(False)
    assert w.wait_captured(timeout=30)
    fut.result(timeout=30)
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert_state_equal(ref, out)


@pytest.mark.parametrize("explicit", [False, True], ids=["plain-call", "protect"])
def test_step_hook_blocks_until_copies_land(
    tmp_path: Any, writer_factory: Any, explicit: bool
) -> None:
    """Deterministic barrier test: the copy threads are held; optimizer.step must wait.

    plain-call: nothing but async_save; the automatic step barrier does it.
    """
    model, opt, gen = make_training()
    train_step(model, opt, gen)
    w: DataStatesWriter = writer_factory(capture="owned")
    if explicit:
        w.protect(opt)
    ref = copy.deepcopy(state_of(model, opt, 1))
    w.engine.pause_copies(True)
    fut = dcp.async_save(
        state_of(model, opt, 1), storage_writer=w, checkpoint_id=str(tmp_path / "c")
    )
    x = torch.randn(16, 32, generator=gen)
    model(x).pow(2).mean().backward()  # forward/backward overlap the (held) copies
    stepped = threading.Event()
    t = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    t.start()
    assert not stepped.wait(0.3), "optimizer.step() ran while copies were pending"
    w.engine.pause_copies(False)
    assert stepped.wait(30), "optimizer.step() did not resume after the copies landed"
    t.join()
    fut.result(timeout=30)
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert_state_equal(ref, out)  # the pre-step state, although step() ran meanwhile
    stats = w.save_stats()[-1]
    assert stats["captured_before_barrier"] is False
    assert stats["blocked_s"] >= 0.25


def test_in_place_modification_before_capture_fails_the_save(
    tmp_path: Any, writer_factory: Any
) -> None:
    w: DataStatesWriter = writer_factory(capture="lazy")
    sd = {"weights": torch.zeros(50_000)}
    path = str(tmp_path / "c")
    w.engine.pause_copies(True)
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=path)
    sd["weights"].add_(1.0)  # modified before its lazy copy: must never be written torn
    w.engine.pause_copies(False)
    with pytest.raises(BaseException, match="weights.*modified in place"):
        fut.result(timeout=30)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    w.wait_captured()  # already read from the future: not raised again at the barrier
    # The writer stays usable.
    dcp.async_save(sd, storage_writer=w, checkpoint_id=path).result(timeout=30)
    out = {"weights": torch.zeros(50_000)}
    dcp.load(out, checkpoint_id=path)
    assert bool((out["weights"] == 1).all())


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({}, id="snapshot-into-cache"),
        pytest.param({"host_cache_size": "64KiB", "chunk_size": "16KiB"}, id="clone-fallback"),
    ],
)
def test_auto_capture_without_protect_is_exact(
    tmp_path: Any, writer_factory: Any, knobs: dict
) -> None:
    # capture="auto", nothing protected: every tensor is snapshotted at the call, into the
    # cache when it has room, else into a clone.
    w: DataStatesWriter = writer_factory(**knobs)
    sd = {"t": torch.zeros(100_000), "n": 1}
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    sd["t"].fill_(5)
    fut.result(timeout=30)
    out = {"t": torch.ones(100_000), "n": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert bool((out["t"] == 0).all()) and out["n"] == 1


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({}, id="cache-fits"),
        pytest.param({"host_cache_size": "96KiB", "chunk_size": "16KiB"}, id="cache-smaller"),
    ],
)
def test_save_every_iteration_matches_reference(
    tmp_path: Any, writer_factory: Any, knobs: dict
) -> None:
    """Saves every step while training on; each checkpoint equals its step's snapshot.

    Random delays in the copy and flush threads shake out races between capture and the step.
    """
    model, opt, gen = make_training(1)
    train_step(model, opt, gen)
    w: DataStatesWriter = writer_factory(**knobs)
    w.protect(opt)
    w.engine.set_delays(2000, 3000, seed=7)
    refs: dict[int, dict[str, Any]] = {}
    futs = []
    for step in range(1, 9):
        refs[step] = copy.deepcopy(state_of(model, opt, step))
        futs.append(
            dcp.async_save(
                state_of(model, opt, step),
                storage_writer=w,
                checkpoint_id=str(tmp_path / f"step-{step}"),
            )
        )
        train_step(model, opt, gen)  # BatchNorm stats change in forward, params in step
    for f in futs:
        f.result(timeout=60)
    for step, ref in refs.items():
        out = zeros_like_state(ref)
        dcp.load(out, checkpoint_id=str(tmp_path / f"step-{step}"))
        assert_state_equal(ref, out)
    st = w.save_stats()
    assert len(st) == 8 and all(s["error"] is None for s in st)
    assert all(s["done_s"] <= s["committed_s"] for s in st)
    c = w.engine_counters()
    assert c["jobs"] == 0 and c["cache_used_bytes"] == 0 and c["open_files"] == 0


def test_cache_much_smaller_than_one_checkpoint_does_not_deadlock(
    tmp_path: Any, writer_factory: Any
) -> None:
    w: DataStatesWriter = writer_factory(
        host_cache_size="64KiB", chunk_size="16KiB", capture="lazy"
    )
    sd = {f"t{i}": torch.full((20_000,), float(i)) for i in range(20)}  # 1.6 MB through 64 KiB
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    assert w.wait_captured(timeout=60)
    fut.result(timeout=60)
    out = zeros_like_state(sd)
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert_state_equal(sd, out)


class FailingPlanner(DefaultSavePlanner):
    def create_local_plan(self) -> Any:
        raise RuntimeError("planner exploded")


def test_save_failing_before_write_releases_its_staged_job(
    tmp_path: Any, writer_factory: Any
) -> None:
    """A save whose planning fails must not leave the barrier waiting forever."""
    w: DataStatesWriter = writer_factory(
        host_cache_size="64KiB", chunk_size="16KiB", capture="lazy"
    )
    sd = {"t": torch.randn(100_000)}  # larger than the cache: capture needs the flushes
    fut = dcp.async_save(
        sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"), planner=FailingPlanner()
    )
    with pytest.raises(BaseException, match="planner exploded"):
        fut.result(timeout=30)
    deadline = time.time() + 30
    while w.engine_counters()["jobs"] and time.time() < deadline:
        time.sleep(0.01)
    assert w.wait_captured(timeout=30)  # read from the future already: not raised again
    assert w.wait(timeout=30)
    assert w.engine_counters()["cache_used_bytes"] == 0
    assert not os.path.exists(str(tmp_path / "c" / ".metadata"))


def test_concurrent_saves_to_one_path_are_refused(tmp_path: Any, writer_factory: Any) -> None:
    """Two writers saving to one directory at once: the second is refused, the first lands."""
    w1: DataStatesWriter = writer_factory(capture="lazy")
    w2: DataStatesWriter = writer_factory(capture="lazy")
    path = str(tmp_path / "same")
    w1.engine.pause_copies(True)
    f1 = dcp.async_save({"a": torch.ones(10_000)}, storage_writer=w1, checkpoint_id=path)
    time.sleep(0.2)  # let the first save claim the path
    f2 = dcp.async_save({"a": torch.zeros(10_000)}, storage_writer=w2, checkpoint_id=path)
    with pytest.raises(BaseException, match="another save to .* is still in progress"):
        f2.result(timeout=30)
    w1.engine.pause_copies(False)
    f1.result(timeout=30)
    out = {"a": torch.zeros(10_000)}
    dcp.load(out, checkpoint_id=path)
    assert bool((out["a"] == 1).all())


def test_consecutive_saves_on_one_writer_are_queued(tmp_path: Any, writer_factory: Any) -> None:
    """A save issued while the previous one is still in flight waits its turn; both land."""
    w: DataStatesWriter = writer_factory(capture="lazy")
    t = torch.ones(10_000)
    w.engine.pause_copies(True)
    f1 = dcp.async_save({"a": t}, storage_writer=w, checkpoint_id=str(tmp_path / "one"))
    f2 = dcp.async_save({"a": t}, storage_writer=w, checkpoint_id=str(tmp_path / "two"))
    time.sleep(0.2)
    assert not f1.done() and not f2.done()
    w.engine.pause_copies(False)
    f1.result(timeout=30)
    f2.result(timeout=30)
    w.wait_captured()
    t.add_(1)
    for name in ("one", "two"):
        out = {"a": torch.zeros(10_000)}
        dcp.load(out, checkpoint_id=str(tmp_path / name))
        assert bool((out["a"] == 1).all())


class _Slow(Mapping):  # type: ignore[type-arg]
    """A mapping that is not a dict: the walk takes its general path for every leaf."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._d = data

    def __getitem__(self, k: str) -> Any:
        return self._d[k]

    def __iter__(self) -> Any:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def _decisions(w: DataStatesWriter, state: dict[str, Any]) -> tuple[Any, ...]:
    """How stage() captured each leaf of ``state`` (then the staged save is dropped)."""
    staged = w.stage(state)
    job = staged._job
    rows = sorted(
        (c.name, c.lazy, c.owner is not None, c.at_call, c.nbytes, str(c.dtype), c.shape,
         c.storage_ptr, c.storage_nbytes, c.version, c.direct)
        for c in job.tensors
    )
    out = (tuple(rows), job.lazy_bytes, frozenset(o is not None for o in job.lazy_owners))
    del staged, job  # never saved: its job is released
    return out


@pytest.mark.parametrize("capture", ["auto", "owned", "eager"])
def test_inline_leaves_are_staged_as_the_general_walk_stages_them(
    tmp_path: Any, writer_factory: Any, capture: str
) -> None:
    """The walk stages the common leaves of plain dicts (and a module's OrderedDict) inline;
    each decision (lazy or taken at the call, owner, version, storage) must be the one the
    general per-leaf path makes for the same tensors."""
    model, opt, gen = make_training()
    train_step(model, opt, gen)  # the optimizer has stepped: its tensors are owned
    p = next(model.parameters())
    leaves = {
        "owned": opt.state[p]["exp_avg"],
        "owned_view": opt.state[p]["exp_avg"].t() if p.dim() == 2 else p.detach()[:1],
        "owned_empty": torch.empty(0),
        "param": p,  # an nn.Parameter: a subclass, not inlined
        "free": torch.arange(10.0),
        "free_view": torch.arange(12.0).view(3, 4).t(),
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "int": 5,
    }
    w: DataStatesWriter = writer_factory(capture=capture)
    for wrap in (dict, OrderedDict):
        fast = _decisions(w, {"m": wrap(model.state_dict()), "o": wrap(opt.state_dict()["state"]),
                              "x": wrap(leaves)})
        slow = _decisions(w, {"m": _Slow(dict(model.state_dict())),
                              "o": _Slow(dict(opt.state_dict()["state"])), "x": _Slow(leaves)})
        assert fast == slow, wrap
    rows, lazy_bytes, _ = fast
    lazy = {r[0] for r in rows if r[1]}
    if capture == "eager":
        assert not lazy and lazy_bytes == 0
    else:  # optimizer-owned leaves only, and all of them
        assert "x.owned" in lazy and "x.free" not in lazy and "m.fc1.weight" in lazy
        assert lazy_bytes > 0
    assert w.wait(timeout=30)
    assert w.engine_counters()["cache_used_bytes"] == 0


def test_device_snapshot_falls_back_to_host_memory_when_the_device_is_full(
    writer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device tensor no optimizer owns is cloned on its device at the call; with no device
    memory left for the clone, it is copied to host memory instead (warned once), never an
    error that stops training. (tests/test_gpu.py runs this against a full GPU.)"""
    from dcp_datastates.save import capture

    def no_memory(t: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(capture, "_clone_on_device", no_memory)
    w: DataStatesWriter = writer_factory()
    stager = w._stager
    src = torch.randn(6, 5).t()  # a view: the snapshot must be compact
    with captured_logs("dcp_datastates.save.capture") as records:
        a = stager._device_snapshot(src, "model.w")
        b = stager._device_snapshot(src, "model.v")
    assert a.is_contiguous() and a.device.type == "cpu" and torch.equal(a, src)
    assert a.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    assert torch.equal(b, src)
    warned = [r for r in records if "no device memory left" in r.getMessage()]
    assert len(warned) == 1 and "'model.w'" in warned[0].getMessage()


def test_owned_tensor_under_two_keys_and_in_two_saves_in_flight(
    tmp_path: Any, writer_factory: Any
) -> None:
    """An optimizer-owned tensor keys itself in its save (no alias): under two keys of one save
    it still gets two records, and two saves in flight staging the same tensor objects each
    hold their own; after the next step both checkpoints hold the values of their call."""
    model, opt, gen = make_training()
    train_step(model, opt, gen)
    p = next(model.parameters())
    m = opt.state[p]["exp_avg"]
    w: DataStatesWriter = writer_factory()
    state = {"a": m, "b": m, "nested": {"again": m}, "model": model.state_dict()}
    ref = copy.deepcopy(state)
    staged = w.stage(state)
    job = staged._job
    caps = {c.name: c for c in job.tensors}
    assert caps["a"].lazy and caps["b"].lazy and caps["nested.again"].lazy
    assert caps["a"].staged is m  # the tensor itself...
    assert caps["b"].staged is not m and caps["nested.again"].staged is not m  # ...once
    assert len({id(c.staged) for c in job.tensors}) == len(job.tensors)
    del staged, job, caps
    futs = [dcp.async_save(state, storage_writer=w, checkpoint_id=str(tmp_path / f"c{k}"))
            for k in range(2)]
    train_step(model, opt, gen)  # waits for both saves' copies, then changes m in place
    for f in futs:
        f.result(timeout=60)
    assert not torch.equal(m, ref["a"])
    for k in range(2):
        out = zeros_like_state(ref)
        dcp.load(out, checkpoint_id=str(tmp_path / f"c{k}"))
        assert_state_equal(out, ref)


def test_owned_tensor_reshaped_in_place_before_planning_fails_naming_it(
    tmp_path: Any, writer_factory: Any
) -> None:
    """Misuse: an optimizer-owned tensor (which keys itself in its save) resized in place after
    the call, before its copy and before DCP plans. The save fails with an error naming the
    key; no checkpoint is committed, and the writer keeps working."""
    p = torch.nn.Parameter(torch.randn(1000))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(1000)
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    w: DataStatesWriter = writer_factory()
    w.engine.pause_copies(True)
    fut = dcp.async_save({"m": buf}, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    buf.resize_(10)
    w.engine.pause_copies(False)
    # Either DCP planned the new shape (the planned-shape check) or it planned before the resize
    # (the storage and version checks at the capture): both name the tensor.
    with pytest.raises(BaseException, match=r"'m' planned with shape|tensor 'm' .*changed"):
        fut.result(timeout=30)
    assert not os.path.exists(tmp_path / "c" / ".metadata")
    fine = {"x": torch.arange(5.0)}
    dcp.async_save(fine, storage_writer=w, checkpoint_id=str(tmp_path / "d")).result(timeout=30)
    out = {"x": torch.zeros(5)}
    dcp.load(out, checkpoint_id=str(tmp_path / "d"))
    assert torch.equal(out["x"], fine["x"])
