"""The stand-in CUDA runtime (tests/cuda_sim/simcudart.cpp) for tests on CPU: its build, a ctypes
front (:class:`Sim`), pytest fixtures (``simcudart``, ``simcudart13``, ``simcudart_nobatch``,
``sim``) and engine helpers. Used by tests/test_cuda_sim.py (the save path) and
tests/test_device_read.py (the restore path into device memory)."""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dcp_datastates import _core

SRC = Path(__file__).parent / "cuda_sim" / "simcudart.cpp"
TIMEOUT_S = 30.0  # every wait is bounded: a regression fails instead of hanging CI

# cudaError_t values the tests inject
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
ILLEGAL_ADDRESS = 700
NOT_SUPPORTED = 801
# cudaRuntimeGetVersion values: the first with CUDA 12's cudaMemcpyBatchAsync, then CUDA 13's
CUDA12_BATCH, CUDA13_BATCH = 12080, 13000


class Sim:
    """ctypes front of the stand-in runtime; remembers the streams and events the test owns."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        lib = ctypes.CDLL(self.path)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in {
            "cudaStreamCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
            "cudaStreamDestroy": [vp],
            "cudaEventCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
            "cudaEventDestroy": [vp],
            "cudaEventRecord": [vp, vp],
            "simcuda_enqueue_host_write": [vp, vp, vp, sz, ctypes.c_int],
            "simcuda_enqueue_gate": [vp, ctypes.c_int],
            "simcuda_open_gate": [ctypes.c_int],
            "simcuda_fail": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int],
            "simcuda_fail_exec": [ctypes.c_int, ctypes.c_int],
            "simcuda_set_latency": [ctypes.c_char_p, ctypes.c_int],
            "simcuda_set_copy_us": [ctypes.c_int],
            "simcuda_count": [ctypes.c_char_p],
            "simcuda_quiesce": [ctypes.c_int],
            "simcuda_set_runtime_version": [ctypes.c_int],
            "simcuda_set_fail_index": [ctypes.c_longlong],
        }.items():
            getattr(lib, name).argtypes = args
        lib.simcuda_count.restype = ctypes.c_ulonglong
        self.lib = lib
        self.streams: list[int] = []
        self.events: list[int] = []
        self.engines: list[Any] = []  # closed by reset(), so a failed test leaks nothing
        # Live objects before the test (non-zero only after an earlier test leaked some).
        self.base = {k: self.count(k) for k in ("streams", "events", "registrations")}
        self._gates = 0

    # -- the test plays the training ("compute") stream
    def stream(self) -> int:
        h = ctypes.c_void_p()
        assert self.lib.cudaStreamCreateWithFlags(ctypes.byref(h), 1) == 0
        assert h.value is not None
        self.streams.append(h.value)
        return h.value

    def event(self) -> int:
        h = ctypes.c_void_p()
        assert self.lib.cudaEventCreateWithFlags(ctypes.byref(h), 2) == 0
        assert h.value is not None
        self.events.append(h.value)
        return h.value

    def record(self, event: int, stream: int) -> None:
        assert self.lib.cudaEventRecord(event, stream) == 0

    def host_write(self, stream: int, dst: np.ndarray, src: np.ndarray, delay_s: float = 0) -> None:
        """A kernel on `stream` that writes `src` into `dst` after `delay_s`."""
        assert dst.nbytes == src.nbytes
        rc = self.lib.simcuda_enqueue_host_write(stream, dst.ctypes.data, src.ctypes.data,
                                                 dst.nbytes, int(delay_s * 1e6))
        assert rc == 0

    def gate(self, stream: int) -> int:
        """A kernel on `stream` that runs until open_gate(); returns the gate."""
        self._gates += 1
        assert self.lib.simcuda_enqueue_gate(stream, self._gates) == 0
        return self._gates

    def open_gate(self, gate: int) -> None:
        self.lib.simcuda_open_gate(gate)

    # -- knobs and counters
    def fail(self, name: str, nth: int = 1, error: int = INVALID_VALUE, times: int = 1) -> None:
        self.lib.simcuda_fail(name.encode(), nth, error, times)

    def fail_exec(self, nth: int, error: int) -> None:
        self.lib.simcuda_fail_exec(nth, error)

    def runtime_version(self, version: int) -> None:
        """What cudaRuntimeGetVersion reports to engines enabled from now on (12080: CUDA 12's
        cudaMemcpyBatchAsync, 13000: CUDA 13's; the default, 12040, has none)."""
        self.lib.simcuda_set_runtime_version(version)

    def fail_index(self, index: int) -> None:
        """The failIdx an injected cudaMemcpyBatchAsync failure reports (-1: none)."""
        self.lib.simcuda_set_fail_index(index)

    def latency(self, name: str, seconds: float) -> None:
        self.lib.simcuda_set_latency(name.encode(), int(seconds * 1e6))

    def copy_time(self, seconds: float) -> None:
        self.lib.simcuda_set_copy_us(int(seconds * 1e6))

    def count(self, name: str) -> int:
        return int(self.lib.simcuda_count(name.encode()))

    def engine_streams(self) -> int:
        return self.count("streams") - self.base["streams"] - len(self.streams)

    def engine_events(self) -> int:
        return self.count("events") - self.base["events"] - len(self.events)

    def registrations(self) -> int:
        return self.count("registrations") - self.base["registrations"]

    def last_error_peek(self) -> int:
        return int(self.lib.simcuda_last_error_peek())

    def quiesce(self, timeout_s: float = TIMEOUT_S) -> bool:
        return bool(self.lib.simcuda_quiesce(int(timeout_s * 1000)))

    def wait_count(self, name: str, at_least: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while self.count(name) < at_least:
            assert time.monotonic() < deadline, f"{name} never reached {at_least}"
            time.sleep(0.005)

    def reset(self) -> None:
        self.lib.simcuda_reset()  # opens every gate: nothing the test queued stays blocked
        for eng in self.engines:
            close_within(eng)
        self.engines.clear()
        for e in self.events:
            self.lib.cudaEventDestroy(e)
        for s in self.streams:
            self.lib.cudaStreamDestroy(s)
        self.events.clear()
        self.streams.clear()
        assert self.quiesce()
        self.lib.simcuda_reset()


def build_simcudart(out: Path, *defines: str) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in CUDA runtime")
    cmd = [cxx, "-std=c++17", "-shared", "-fPIC", "-O2", "-pthread", "-Wl,-z,nodelete",
           *[f"-D{d}" for d in defines], str(SRC), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def simcudart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_simcudart(tmp_path_factory.mktemp("simcudart") / "libsimcudart.so")


@pytest.fixture(scope="session")
def simcudart13(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in with CUDA 13's cudaMemcpyBatchAsync prototype (no failIdx)."""
    out = tmp_path_factory.mktemp("simcudart13") / "libsimcudart13.so"
    return build_simcudart(out, "SIMCUDART_CUDA13")


@pytest.fixture(scope="session")
def simcudart_nobatch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in without cudaMemcpyBatchAsync: a runtime older than CUDA 12.8."""
    out = tmp_path_factory.mktemp("simcudart_nobatch") / "libsimcudart_nobatch.so"
    return build_simcudart(out, "SIMCUDART_NO_BATCH")


@pytest.fixture
def sim(simcudart: Path) -> Iterator[Sim]:
    s = new_sim(simcudart)
    yield s
    s.reset()


def new_sim(path: Path) -> Sim:
    """A reset Sim of the stand-in at ``path``. Garbage of earlier tests is collected first: an
    engine or staging freed only by the collector would otherwise release its streams or
    registrations during this test, below the counts taken as its base."""
    gc.collect()
    s = Sim(path)
    s.reset()
    return s


def sim_of_version(request: pytest.FixtureRequest, version: int) -> Sim:
    """A fresh stand-in reporting `version`: the CUDA 13 build for 13000 and later (its batch
    call has CUDA 13's prototype), else the default one. Reset again after the test."""
    lib = "simcudart13" if version >= CUDA13_BATCH else "simcudart"
    s = new_sim(request.getfixturevalue(lib))
    request.addfinalizer(s.reset)
    s.runtime_version(version)
    return s


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def make_engine(sim: Sim, cache: int = 1 << 20, chunk: int = 64 << 10, copy_threads: int = 2,
                flush_threads: int = 2, batch_copies: bool = True) -> Any:
    eng = _core.Engine(cache_bytes=cache, chunk_bytes=chunk, copy_threads=copy_threads,
                       flush_threads=flush_threads, prefault=False, flush_nice=0)
    sim.engines.append(eng)
    eng.enable_cuda(sim.path, batch_copies=batch_copies)
    return eng


def close_within(eng: Any, timeout_s: float = TIMEOUT_S) -> None:
    t = threading.Thread(target=eng.close, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "Engine.close() hung"


def assert_released(sim: Sim) -> None:
    """After close(): every stream, event and registration of the engine is gone, and no copy
    was left to land in memory that was freed."""
    assert sim.quiesce()
    assert sim.engine_streams() == 0
    assert sim.engine_events() == 0
    assert sim.registrations() == 0
    assert sim.count("violations") == 0
    assert sim.count("inflight_copies") == 0
