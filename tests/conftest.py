"""Shared fixtures: small writers, state dicts, and a comparison helper."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

if TYPE_CHECKING:
    from dcp_datastates import DataStatesWriter


HANG_S = 30.0  # seconds: any blocking call in a test that takes longer than this is a hang


@contextlib.contextmanager
def mounted_tmpfs(where: Any, size: str) -> Iterator[str]:
    """A tmpfs of ``size`` (mount's syntax: "512k", "1m") mounted at the new directory ``where``:
    a real file system that fills up. Skips the test where mounting is not allowed (no root)."""
    os.makedirs(where)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def gated_planner() -> Any:
    """A DCP ``DefaultSavePlanner`` that holds the save in its local planning (after the writer's
    set-up and early placement) until ``go`` is set; ``entered`` is set when it got there."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class GatedPlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__()
            self.entered = threading.Event()
            self.go = threading.Event()

        def create_local_plan(self) -> Any:
            self.entered.set()
            assert self.go.wait(HANG_S), "the test never released the planner"
            return super().create_local_plan()

    return GatedPlanner()


@contextlib.contextmanager
def captured_logs(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records logger ``name`` emits inside the block (pytest's logging plugin is off)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger(name)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def in_thread(fn: Callable[[], Any], timeout: float = HANG_S, what: str = "the call") -> Any:
    """Runs a blocking call (``dcp.save``) in a daemon thread; fails the test if it hangs.

    Returns ``fn()``'s value or re-raises what it raised (any ``BaseException``: DCP's
    ``CheckpointException`` is not an ``Exception``). A hung call is left running in its
    daemon thread, so it cannot keep the test process alive.
    """
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{what} hung for {timeout}s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def assert_state_equal(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact comparison of nested state (tensors compared as raw bytes, NaNs included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        ac = a.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        bc = b.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        if ac.is_complex():
            ac, bc = torch.view_as_real(ac), torch.view_as_real(bc)
        assert torch.equal(ac.view(torch.uint8), bc.view(torch.uint8)), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def zeros_like_state(sd: Any) -> Any:
    """A destination for dcp.load with the same structure, tensors zeroed."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd.detach().contiguous())
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_state(v) for v in sd]
    return sd


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every writer in this process sees a quiet machine (``CpuMeter.sample`` measures nothing).

    With ``adapt_to_load`` (the default) a save's lazy state is copied at the call when other
    processes kept the cores busy (dcp_datastates.runtime.cpuload); on a test machine that depends
    on whatever else runs, so tests that check lazy capture would depend on it too. The adaptation
    itself is tested with a meter that reports a chosen load (tests/test_load_adapt.py).
    """
    from dcp_datastates.runtime import cpuload

    monkeypatch.setattr(cpuload.CpuMeter, "sample", lambda self: None)


@pytest.fixture
def writer_factory(tmp_path: Any) -> Iterator[Any]:
    from dcp_datastates import DataStatesWriter

    made: list[DataStatesWriter] = []

    def make(**kw: Any) -> DataStatesWriter:
        kw.setdefault("host_cache_size", "8MiB")
        kw.setdefault("chunk_size", "1MiB")
        kw.setdefault("prefault", False)
        w = DataStatesWriter(str(tmp_path / "default"), **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@contextlib.contextmanager
def results_gather_lost() -> Iterator[dict[str, int]]:
    """Inside, DCP's gather of the write results fails ("the gather of the write results was
    lost"): DCP stops after ``write_data`` returned, without calling ``finish()``. Yields the
    count of gathers failed so."""
    from torch.distributed.checkpoint import utils as dcp_utils

    real = dcp_utils._DistWrapper.gather_object
    calls = {"n": 0}

    def gather_object(self: Any, obj: Any) -> Any:
        if isinstance(obj, list) and obj and type(obj[0]).__name__ == "WriteResult":
            calls["n"] += 1
            raise RuntimeError("the gather of the write results was lost")
        return real(self, obj)

    dcp_utils._DistWrapper.gather_object = gather_object  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        dcp_utils._DistWrapper.gather_object = real  # type: ignore[method-assign]
