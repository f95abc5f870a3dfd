"""The engine's CUDA path on CPU, through a stand-in CUDA runtime (tests/cuda_sim/simcudart.cpp).

The engine dlopen()s whatever runtime `enable_cuda(path)` names; here that is a small library,
compiled by this module, with CUDA's stream and event semantics on host memory (a stream is a queue
served by its own thread, events complete when the work before them is done, copies run when their
turn comes) plus knobs: injected failures, latencies, gates that hold a "compute" stream, and
counters of live streams, events and registrations. "Device memory" is numpy memory with
device=0 or 1. What this proves and what only a GPU can is written in docs/architecture.md
("CUDA path"); tests/test_gpu.py checks the same properties on a real device.
"""

# ruff: noqa: F811
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import captured_logs

# The fixtures sim, simcudart, simcudart13 and simcudart_nobatch are imported from simcuda: test
# parameters of those names use them (hence F811 off for this file).
from simcuda import (  # noqa: F401
    CUDA12_BATCH,
    CUDA13_BATCH,
    ILLEGAL_ADDRESS,
    INVALID_VALUE,
    NOT_SUPPORTED,
    OUT_OF_MEMORY,
    TIMEOUT_S,
    Sim,
    assert_released,
    close_within,
    make_engine,
    pattern,
    sim,
    sim_of_version,
    simcudart,
    simcudart13,
    simcudart_nobatch,
)

from dcp_datastates import _core

Entry = tuple[str, np.ndarray, int, int]  # name, source, device, ready_event


def save(eng: Any, path: Path, entries: list[Entry], label: str = "job") -> tuple[int, list[int]]:
    """One job writing `entries` back to back into `path`; returns (job, payload offsets)."""
    job = eng.create_job(label)
    ids = [eng.add_entry(job, n, a.ctypes.data, a.nbytes, d, ev) for n, a, d, ev in entries]
    eng.start_copies(job)
    offsets = list(np.cumsum([0] + [a.nbytes for _n, a, _d, _ev in entries[:-1]]))
    try:
        f = eng.open_file(job, str(path))
        for i, off in enumerate(offsets):
            eng.place(job, ids[i], f, int(off), b"", b"")
        eng.seal(job)
    except _core.EngineError:
        pass  # the job failed already: the test's waits raise its error
    return job, [int(o) for o in offsets]


def assert_file(path: Path, offsets: list[int], expected: list[np.ndarray]) -> None:
    raw = path.read_bytes()
    for off, a in zip(offsets, expected, strict=True):
        assert raw[off : off + a.nbytes] == a.tobytes()


# ------------------------------------------------------------------------------------------------


def test_copy_is_ordered_after_the_event_recorded_at_the_save_call(
    sim: Sim, tmp_path: Path
) -> None:
    n = 1 << 20
    dev = np.zeros(n, np.uint8)  # the "device tensor"
    produced, later = pattern(n, 1), pattern(n, 2)
    compute = sim.stream()
    gate = sim.gate(compute)  # the forward/backward still running at the save call
    sim.host_write(compute, dev, produced, delay_s=0.02)  # the kernel that produces the tensor
    ready = sim.event()
    sim.record(ready, compute)  # the save call
    eng = make_engine(sim, cache=4 << 20, chunk=64 << 10, copy_threads=3)

    # Control: without the event the copy does not wait and sees the stale bytes.
    ctl, ctl_off = save(eng, tmp_path / "ctl.bin", [("w", dev, 0, 0)], "control")
    assert eng.wait_done(ctl, TIMEOUT_S)
    assert_file(tmp_path / "ctl.bin", ctl_off, [np.zeros(n, np.uint8)])

    job = eng.create_job("ordered")
    e = eng.add_entry(job, "w", dev.ctypes.data, n, 0, ready)
    eng.start_copies(job)
    assert not eng.wait_captured(job, 0.2)  # every chunk waits for the compute stream
    assert not eng.is_captured(job)
    sim.open_gate(gate)
    assert eng.wait_captured(job, TIMEOUT_S)
    # The optimizer step runs after the barrier: its write must not reach the checkpoint.
    sim.host_write(compute, dev, later)
    assert sim.quiesce()
    assert np.array_equal(dev, later)
    f = eng.open_file(job, str(tmp_path / "c.bin"))
    eng.place(job, e, f, 0, b"", b"")
    eng.seal(job)
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "c.bin", [0], [produced])
    assert sim.count("pageable_copies") == 0  # the pinned cache took every copy
    eng.forget(ctl)
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_jobs_in_flight_on_two_devices_through_a_small_cache(
    sim: Sim, tmp_path: Path, copy_threads: int
) -> None:
    """Several jobs, each with its own producing stream, entries larger than the cache (chunked,
    with backpressure) on two devices, several copy threads: every byte lands where placed."""
    sim.latency("cudaMemcpyAsync", 0.0005)
    eng = make_engine(sim, cache=256 << 10, chunk=32 << 10, copy_threads=copy_threads)
    jobs = []
    for j in range(3):
        compute = sim.stream()
        ready = sim.event()
        dev0, dev1 = np.zeros(600_000, np.uint8), np.zeros(300_001, np.uint8)
        want0, want1 = pattern(dev0.nbytes, 10 + j), pattern(dev1.nbytes, 20 + j)
        sim.host_write(compute, dev0, want0, delay_s=0.01)
        sim.host_write(compute, dev1, want1)
        sim.record(ready, compute)
        path = tmp_path / f"j{j}.bin"
        job, offs = save(eng, path, [("a", dev0, 0, ready), ("b", dev1, 1, ready)], f"j{j}")
        jobs.append((job, path, offs, [want0, want1], (dev0, dev1)))
    for job, path, offs, want, _keep in jobs:
        assert eng.wait_done(job, TIMEOUT_S)
        assert_file(path, offs, want)
        assert eng.stats(job)["bytes_written"] == sum(a.nbytes for a in want)
        eng.forget(job)
    # One stream and one event per copy thread and device, reused across jobs.
    assert 2 <= sim.engine_streams() <= 2 * copy_threads
    assert sim.engine_events() == sim.engine_streams()
    assert eng.counters()["cache_used_bytes"] == 0
    close_within(eng)
    assert_released(sim)


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_copies_of_a_job_are_waited_for_in_batches(
    sim: Sim, tmp_path: Path, copy_threads: int
) -> None:
    """A copy thread issues the chunks of a job queued one behind the other on its stream and
    waits once per batch (one event), not once per chunk, and makes its stream wait for the
    save call's event once per batch: 100 small tensors and one of 16 chunks through a cache of
    4 chunks. Batches end where free cache space ends; every chunk still waits for the event
    recorded at the save call; every byte lands where placed."""
    eng = make_engine(sim, cache=256 << 10, chunk=64 << 10, copy_threads=copy_threads)
    compute = sim.stream()
    gate = sim.gate(compute)
    devs = [np.zeros(4096, np.uint8) for _ in range(100)] + [np.zeros(1 << 20, np.uint8)]
    wants = [pattern(d.nbytes, 100 + i) for i, d in enumerate(devs)]
    for d, w in zip(devs, wants, strict=True):
        sim.host_write(compute, d, w)
    ready = sim.event()
    sim.record(ready, compute)
    records0 = sim.count("calls:cudaEventRecord")
    stream_waits0 = sim.count("calls:cudaStreamWaitEvent")
    job, offs = save(eng, tmp_path / "b.bin", [(f"t{i}", d, 0, ready) for i, d in enumerate(devs)])
    assert not eng.wait_captured(job, 0.2)  # held by the compute stream, batched or not
    sim.open_gate(gate)
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "b.bin", offs, wants)
    chunks = 100 + 16
    waits = sim.count("calls:cudaEventRecord") - records0
    # 400 KiB of small tensors never fit at once. With two threads on a loaded machine they
    # may take alternate chunks (a batch ends where the other thread's cache ticket comes
    # first): 53 waits for 116 chunks were seen with four test processes on two cores.
    assert 2 <= waits <= chunks // (4 if copy_threads == 1 else 2), waits
    # one wait for the save call's event per batch at most, not one per chunk
    stream_waits = sim.count("calls:cudaStreamWaitEvent") - stream_waits0
    assert 1 <= stream_waits <= waits, (stream_waits, waits)
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


def test_wait_captured_waits_for_exactly_its_own_copies(sim: Sim, tmp_path: Path) -> None:
    eng = make_engine(sim, cache=1 << 20, chunk=64 << 10, copy_threads=2)
    compute = sim.stream()
    gate = sim.gate(compute)
    ready = sim.event()
    sim.record(ready, compute)
    a1, a2, b = pattern(100_000, 1), pattern(50_000, 2), pattern(200_000, 3)
    ja = eng.create_job("a")
    eng.add_entry(ja, "a1", a1.ctypes.data, a1.nbytes, 0, 0)
    eng.add_entry(ja, "a2", a2.ctypes.data, a2.nbytes, 0, ready)  # one chunk, held by the gate
    eng.start_copies(ja)
    jb = eng.create_job("b")  # queued after a, independent of the compute stream
    eng.add_entry(jb, "b", b.ctypes.data, b.nbytes, 0, 0)
    eng.add_entry(jb, "b_host", b.ctypes.data, b.nbytes, -1, 0)
    eng.start_copies(jb)
    assert eng.wait_captured(jb, TIMEOUT_S)  # does not wait for a's held copy
    assert not eng.wait_captured(ja, 0.2)  # a1 landed, a2 has not
    assert not eng.is_captured(ja)
    sim.open_gate(gate)
    assert eng.wait_captured(ja, TIMEOUT_S)
    for j in (ja, jb):
        eng.seal(j)
        assert eng.wait_done(j, TIMEOUT_S)
        eng.forget(j)
    close_within(eng)
    assert_released(sim)


def test_cache_is_pinned_once_and_unpinned_at_close(sim: Sim) -> None:
    registers = sim.count("calls:cudaHostRegister")
    eng = make_engine(sim)
    eng.enable_cuda(sim.path)  # idempotent
    assert eng.cuda_enabled and eng.cache_pinned and eng.pin_error == ""
    assert sim.registrations() == 1
    assert sim.count("calls:cudaHostRegister") == registers + 1
    close_within(eng)
    assert_released(sim)


def test_pinning_failure_falls_back_to_pageable_copies(sim: Sim, tmp_path: Path) -> None:
    """Documented choice: a cache that cannot be page-locked is used pageable (correct, slower);
    the reason is kept, and the caller's thread is left without a CUDA error for torch to trip
    on."""
    sim.fail("cudaHostRegister", error=OUT_OF_MEMORY, times=-1)
    eng = _core.Engine(cache_bytes=256 << 10, chunk_bytes=32 << 10, prefault=False)
    sim.engines.append(eng)
    eng.enable_cuda(sim.path)
    assert eng.cuda_enabled and not eng.cache_pinned
    assert "cudaHostRegister" in eng.pin_error and "out of memory" in eng.pin_error
    assert sim.last_error_peek() == 0  # cleared on this (the "training") thread
    assert sim.registrations() == 0
    compute = sim.stream()
    ready = sim.event()
    dev, want = np.zeros(500_000, np.uint8), pattern(500_000, 4)
    sim.host_write(compute, dev, want, delay_s=0.01)
    sim.record(ready, compute)
    job, offs = save(eng, tmp_path / "c.bin", [("w", dev, 0, ready)])
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "c.bin", offs, [want])
    assert sim.count("pageable_copies") == sim.count("copies") > 0
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_writer_warns_and_works_when_the_cache_cannot_be_pinned(
    sim: Sim, tmp_path: Path, writer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_datastates import engine as engine_mod

    monkeypatch.setattr(engine_mod, "loaded_cuda_runtime", lambda: sim.path)
    sim.fail("cudaHostRegister", error=OUT_OF_MEMORY, times=-1)
    with captured_logs("dcp_datastates.engine") as records:
        w = writer_factory(host_cache_size="1MiB", chunk_size="64KiB", pin_memory=True)
    assert any("could not be pinned" in r.getMessage() and "out of memory" in r.getMessage()
               for r in records)
    sd = {"w": torch.arange(100_000, dtype=torch.float32), "step": 3}
    dcp.save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    out = {"w": torch.zeros(100_000), "step": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3
    w.close()
    assert_released(sim)


def test_missing_runtime_is_a_clear_error(tmp_path: Path) -> None:
    eng = _core.Engine(cache_bytes=1 << 20, prefault=False)
    with pytest.raises(_core.EngineError, match="cannot load the CUDA runtime .*nope.so"):
        eng.enable_cuda(str(tmp_path / "nope.so"))
    assert not eng.cuda_enabled
    eng.close()


_FAILING_CALLS = [
    ("cudaMemcpyAsync", 3),
    ("cudaEventRecord", 3),
    ("cudaEventSynchronize", 3),
    ("cudaStreamWaitEvent", 1),  # once per run of copies of a job: only one here
    ("cudaStreamCreateWithFlags", 1),
    ("cudaEventCreateWithFlags", 1),
    ("cudaSetDevice", 1),
]


@pytest.mark.parametrize(
    ("version", "entry_point", "nth"),
    [(12040, e, n) for e, n in _FAILING_CALLS]
    # the same with batched copies: their copy call is cudaMemcpyBatchAsync
    + [(12080, e, n) for e, n in _FAILING_CALLS if e != "cudaMemcpyAsync"]
    + [(12080, "cudaMemcpyBatchAsync", 2)],
)
def test_failing_call_fails_the_job_and_the_engine_goes_on(
    request: pytest.FixtureRequest, tmp_path: Path, version: int, entry_point: str, nth: int
) -> None:
    sim = sim_of_version(request, version)
    name = "model.layers.3.weight"
    compute = sim.stream()
    ready = sim.event()
    # One copy thread: no other copy of the job delays its completion past the failed one's. A
    # cache of 3 chunks: the 8 chunks go in batches of 3, 3 and 2 (one event record and wait per
    # batch), so the third call of each entry point comes with copies in flight (the stream
    # waits for the save call's event once: its first call fails).
    eng = make_engine(sim, cache=192 << 10, chunk=64 << 10, copy_threads=1)
    dev, want = np.zeros(512 << 10, np.uint8), pattern(512 << 10, 5)
    sim.host_write(compute, dev, want, delay_s=0.01)
    sim.record(ready, compute)
    sim.copy_time(0.05)  # copies are still in flight when the failing call returns
    # (INVALID_VALUE would be a refusal of the batch call, which falls back instead of failing)
    sim.fail(entry_point, nth, OUT_OF_MEMORY if "Batch" in entry_point else INVALID_VALUE)
    job, _ = save(eng, tmp_path / "bad.bin", [(name, dev, 0, ready)])
    with pytest.raises(_core.EngineError, match=rf"'{name}'.*{entry_point}"):
        eng.wait_captured(job, TIMEOUT_S)
    with pytest.raises(_core.EngineError, match=rf"'{name}'.*{entry_point}"):
        eng.wait_done(job, TIMEOUT_S)
    # Nothing of the failed job is still landing in cache space that is free again.
    assert sim.count("inflight_copies") == 0
    st = eng.stats(job)
    assert st["failed"] and name in st["error"]
    assert eng.counters()["cache_used_bytes"] == 0
    eng.forget(job)

    sim.copy_time(0)
    again = pattern(dev.nbytes, 6)
    sim.host_write(compute, dev, again)
    sim.record(ready, compute)
    job, offs = save(eng, tmp_path / "good.bin", [(name, dev, 0, ready)])
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "good.bin", offs, [again])
    eng.forget(job)
    close_within(eng)
    assert_released(sim)
    assert sim.count("bad_handles") == 0


def test_device_fault_fails_cuda_jobs_and_host_jobs_go_on(sim: Sim, tmp_path: Path) -> None:
    """A fault during a copy is sticky on a real device: the job fails naming the tensor (the
    half-copied chunk is never written as complete), later CUDA jobs fail fast instead of
    hanging, host jobs still work, and close() releases everything."""
    eng = make_engine(sim, cache=1 << 20, chunk=64 << 10, copy_threads=2)
    dev = pattern(512 << 10, 7)
    sim.fail_exec(3, ILLEGAL_ADDRESS)
    job, _ = save(eng, tmp_path / "a.bin", [("faulty", dev, 0, 0)])
    with pytest.raises(_core.EngineError, match="'faulty'.*illegal memory access"):
        eng.wait_done(job, TIMEOUT_S)
    assert sum(r[5] for r in eng.chunk_records(job)) < dev.nbytes  # never complete
    eng.forget(job)
    job, _ = save(eng, tmp_path / "b.bin", [("next", dev, 1, 0)])
    with pytest.raises(_core.EngineError, match="'next'.*illegal memory access"):
        eng.wait_done(job, TIMEOUT_S)
    eng.forget(job)
    host = pattern(300_000, 8)
    job, offs = save(eng, tmp_path / "c.bin", [("host", host, -1, 0)])
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "c.bin", offs, [host])
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


def test_close_with_copies_in_flight(sim: Sim) -> None:
    """close() waits for the copies already issued (they write into the cache it frees), drops
    those not issued, and leaves no stream, event or registration behind."""
    # a cache of 4 chunks: at most 4 of the 16 chunks can be issued (in batches) before close
    eng = make_engine(sim, cache=256 << 10, chunk=64 << 10, copy_threads=2)
    compute = sim.stream()
    gate = sim.gate(compute)
    ready = sim.event()
    sim.record(ready, compute)
    dev = pattern(1 << 20, 9)  # 16 chunks
    syncs = sim.count("calls:cudaEventSynchronize")
    copies0 = sim.count("calls:cudaMemcpyAsync")
    job = eng.create_job("in flight")
    eng.add_entry(job, "w", dev.ctypes.data, dev.nbytes, 0, ready)
    eng.start_copies(job)
    sim.wait_count("calls:cudaEventSynchronize", syncs + 1)  # a batch was issued and waits
    closer = threading.Thread(target=eng.close, daemon=True)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # the issued copies still target the cache
    assert sim.registrations() == 1
    sim.open_gate(gate)
    closer.join(TIMEOUT_S)
    assert not closer.is_alive(), "Engine.close() hung"
    issued = sim.count("calls:cudaMemcpyAsync") - copies0
    assert 1 <= issued <= 4
    assert sim.count("copies") == issued  # the chunks not yet issued were dropped
    assert_released(sim)


def test_failed_job_counts_as_captured_only_after_its_copies_in_flight(sim: Sim) -> None:
    """After wait_captured returns, even with an error, the caller frees the sources and the
    ready events: the engine must be done with them by then."""
    eng = make_engine(sim, copy_threads=1)
    compute = sim.stream()
    gate = sim.gate(compute)
    ready = sim.event()
    sim.record(ready, compute)
    dev = pattern(4096, 10)
    syncs = sim.count("calls:cudaEventSynchronize")
    job = eng.create_job("aborted")
    eng.add_entry(job, "w", dev.ctypes.data, dev.nbytes, 0, ready)
    eng.start_copies(job)
    sim.wait_count("calls:cudaEventSynchronize", syncs + 1)  # issued, waiting for compute
    eng.abort(job, "stopped by the test")
    assert not eng.is_captured(job)
    assert not eng.wait_captured(job, 0.2)
    sim.open_gate(gate)
    with pytest.raises(_core.EngineError, match="stopped by the test"):
        eng.wait_captured(job, TIMEOUT_S)
    assert sim.count("inflight_copies") == 0
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


# ------------------------------------------------------------------------------------------------
# Batched copies: cudaMemcpyBatchAsync where the runtime has it (CUDA 12.8+), else one by one.

def small_tensors(sim: Sim, count: int, seed: int) -> tuple[int, int, list[np.ndarray],
                                                             list[np.ndarray], int]:
    """`count` small "device tensors" (1 to 8 KiB, odd sizes) that a gated compute stream writes
    before the save call's event: (stream, gate, tensors, their bytes at the call, event)."""
    compute = sim.stream()
    gate = sim.gate(compute)  # the forward still running at the save call
    rng = np.random.default_rng(seed)
    devs = [np.zeros(int(n), np.uint8) for n in rng.integers(1024, 8192, count)]
    wants = [pattern(d.nbytes, seed * 1000 + i) for i, d in enumerate(devs)]
    for d, w in zip(devs, wants, strict=True):
        sim.host_write(compute, d, w)
    ready = sim.event()
    sim.record(ready, compute)
    return compute, gate, devs, wants, ready


def batch_calls(eng: Any) -> tuple[int, int, int]:
    c = eng.counters()
    return c["cuda_batch_calls"], c["cuda_batch_copies"], c["cuda_copy_calls"]


@pytest.mark.parametrize("version", [CUDA12_BATCH, CUDA13_BATCH])
@pytest.mark.parametrize("copy_threads", [1, 3])
def test_small_tensors_are_copied_in_batch_calls(
    request: pytest.FixtureRequest, tmp_path: Path, version: int, copy_threads: int
) -> None:
    """300 small tensors of one save: a few cudaMemcpyBatchAsync calls (each of up to 256
    copies) instead of 300 cudaMemcpyAsync; every copy still waits for the save call's event;
    bit-exact; no error left in any thread's last-error slot. Both prototypes (CUDA 12's with
    failIdx, CUDA 13's without) are called as the runtime's version says."""
    sim = sim_of_version(request, version)
    eng = make_engine(sim, cache=4 << 20, chunk=64 << 10, copy_threads=copy_threads)
    assert eng.counters()["cuda_batch"] and eng.cuda_batch_error == ""
    _compute, gate, devs, wants, ready = small_tensors(sim, 300, 3)
    copies0 = sim.count("calls:cudaMemcpyAsync")
    batches0 = sim.count("calls:cudaMemcpyBatchAsync")
    job, offs = save(eng, tmp_path / "b.bin", [(f"t{i}", d, 0, ready) for i, d in enumerate(devs)])
    assert not eng.wait_captured(job, 0.2)  # batched or not, held by the compute stream
    assert sim.count("copies") == 0
    sim.open_gate(gate)
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "b.bin", offs, wants)
    calls, batched, singles = batch_calls(eng)
    assert calls == sim.count("calls:cudaMemcpyBatchAsync") - batches0
    assert singles == sim.count("calls:cudaMemcpyAsync") - copies0
    assert batched == sim.count("batch_copies") and batched + singles == 300
    if copy_threads == 1:  # one thread takes every chunk: batches of up to 256, never one alone
        assert calls == 2 and singles == 0, (calls, singles)
    else:  # threads racing for the queue may each take a chunk alone now and then
        assert calls >= 1 and batched >= 2 * calls, (calls, singles)
    assert sim.count("batch_largest") <= 256
    assert sim.count("stale_errors") == 0
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


def test_copies_staged_for_one_event_are_issued_before_waiting_for_the_next(
    sim: Sim, tmp_path: Path
) -> None:
    """A job whose tensors have different ready events (one captured later, outside the save
    call's walk): copies staged behind the first event are issued before the stream waits for
    the second, so they never wait for work queued after their own event."""
    sim.runtime_version(CUDA12_BATCH)
    eng = make_engine(sim, cache=1 << 20, chunk=64 << 10, copy_threads=1)
    first, second = sim.stream(), sim.stream()
    a = [pattern(4096, 40 + i) for i in range(4)]
    ev1 = sim.event()
    sim.record(ev1, first)
    gate = sim.gate(second)  # the later tensor's producer is still running
    b, b_want = np.zeros(4096, np.uint8), pattern(4096, 50)
    sim.host_write(second, b, b_want)
    ev2 = sim.event()
    sim.record(ev2, second)
    entries = [(f"a{i}", x, 0, ev1) for i, x in enumerate(a)] + [("b", b, 0, ev2)]
    batches0 = sim.count("calls:cudaMemcpyBatchAsync")
    job, offs = save(eng, tmp_path / "e.bin", entries)
    sim.wait_count("copies", len(a))  # the first event's copies ran while the gate is closed
    assert not eng.is_captured(job)
    sim.open_gate(gate)
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "e.bin", offs, [*a, b_want])
    assert sim.count("calls:cudaMemcpyBatchAsync") - batches0 == 1  # a0..a3; b alone
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


def test_runtime_without_the_batch_call_copies_one_by_one(
    simcudart_nobatch: Path, tmp_path: Path
) -> None:
    """A runtime that reports 12.8 but has no cudaMemcpyBatchAsync symbol: the engine loads, says
    why it does not batch, and issues one cudaMemcpyAsync per copy."""
    nb = Sim(simcudart_nobatch)
    nb.reset()
    try:
        nb.runtime_version(CUDA12_BATCH)
        eng = make_engine(nb, cache=4 << 20, copy_threads=2)
        assert not eng.counters()["cuda_batch"]
        assert "no cudaMemcpyBatchAsync" in eng.cuda_batch_error
        _compute, gate, devs, wants, ready = small_tensors(nb, 120, 4)
        copies0 = nb.count("calls:cudaMemcpyAsync")
        job, offs = save(eng, tmp_path / "n.bin",
                         [(f"t{i}", d, 0, ready) for i, d in enumerate(devs)])
        nb.open_gate(gate)
        assert eng.wait_done(job, TIMEOUT_S)
        assert_file(tmp_path / "n.bin", offs, wants)
        assert batch_calls(eng) == (0, 0, 120)
        assert nb.count("calls:cudaMemcpyAsync") - copies0 == 120
        eng.forget(job)
        close_within(eng)
        assert_released(nb)
    finally:
        nb.reset()


@pytest.mark.parametrize(("version", "batch_copies", "reason"), [
    (12040, True, "older than 12.8"),  # the symbol is there, the prototype may not be
    (0, True, "older than 12.8"),  # cudaRuntimeGetVersion failed or said nothing
    (CUDA13_BATCH, False, "turned off"),  # DCPDS_NO_CUDA_BATCH=1
])
def test_batch_call_is_used_only_where_the_runtime_version_says_so(
    request: pytest.FixtureRequest, tmp_path: Path, version: int, batch_copies: bool, reason: str
) -> None:
    sim = sim_of_version(request, version)
    eng = make_engine(sim, cache=4 << 20, batch_copies=batch_copies)
    assert reason in eng.cuda_batch_error and not eng.counters()["cuda_batch"]
    _compute, gate, devs, wants, ready = small_tensors(sim, 40, 5)
    batches0 = sim.count("calls:cudaMemcpyBatchAsync")
    job, offs = save(eng, tmp_path / "v.bin", [(f"t{i}", d, 0, ready) for i, d in enumerate(devs)])
    sim.open_gate(gate)
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "v.bin", offs, wants)
    assert sim.count("calls:cudaMemcpyBatchAsync") == batches0
    assert batch_calls(eng) == (0, 0, 40)
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


@pytest.mark.parametrize("error", [NOT_SUPPORTED, INVALID_VALUE])
def test_batch_call_refused_by_the_runtime_falls_back_to_one_by_one(
    sim: Sim, tmp_path: Path, error: int
) -> None:
    """A runtime that has the entry point but refuses the call as a whole (a driver older than
    the runtime, or attributes it does not accept): the refused batch's copies are issued one by
    one, batching is off from then on, the save is correct and no error is left behind."""
    sim.runtime_version(CUDA12_BATCH)
    sim.fail("cudaMemcpyBatchAsync", error=error, times=-1)
    eng = make_engine(sim, cache=4 << 20, copy_threads=2)
    assert eng.counters()["cuda_batch"]
    _compute, gate, devs, wants, ready = small_tensors(sim, 100, 6)
    job, offs = save(eng, tmp_path / "r.bin", [(f"t{i}", d, 0, ready) for i, d in enumerate(devs)])
    sim.open_gate(gate)
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "r.bin", offs, wants)
    calls, batched, singles = batch_calls(eng)
    assert 1 <= calls <= 2 and batched == 0 and singles == 100  # one refusal per copy thread
    assert sim.count("batch_copies") == 0
    assert not eng.counters()["cuda_batch"] and "refused" in eng.cuda_batch_error
    assert sim.count("stale_errors") == 0
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


@pytest.mark.parametrize(("version", "fail_index", "named"), [
    (CUDA12_BATCH, 5, "t5"),  # CUDA 12 names the failing copy through failIdx
    (CUDA12_BATCH, -1, "t0"),  # an error of the whole batch: the batch's first copy is named
    (CUDA13_BATCH, 5, "t0"),  # CUDA 13 has no failIdx
])
def test_failed_batch_call_fails_the_job_naming_a_tensor_and_the_engine_goes_on(
    request: pytest.FixtureRequest, tmp_path: Path, version: int, fail_index: int, named: str
) -> None:
    """An injected failure of the first batch call fails the save with an error naming the
    tensor, leaves no copy in flight and no cache space held, clears the copy thread's last
    error, and the next save of the same tensors succeeds, batched, bit for bit."""
    sim = sim_of_version(request, version)
    eng = make_engine(sim, cache=4 << 20, copy_threads=1)
    _compute, gate, devs, wants, ready = small_tensors(sim, 64, 7)
    sim.fail("cudaMemcpyBatchAsync", error=OUT_OF_MEMORY)
    sim.fail_index(fail_index)
    entries = [(f"t{i}", d, 0, ready) for i, d in enumerate(devs)]
    job, _ = save(eng, tmp_path / "bad.bin", entries)
    sim.open_gate(gate)
    pat = rf"'{named}'.*cudaMemcpyBatchAsync.*out of memory"
    with pytest.raises(_core.EngineError, match=pat):
        eng.wait_captured(job, TIMEOUT_S)
    with pytest.raises(_core.EngineError, match=pat):
        eng.wait_done(job, TIMEOUT_S)
    assert eng.stats(job)["failed"]
    assert sim.count("inflight_copies") == 0
    assert eng.counters()["cache_used_bytes"] == 0
    assert sim.count("stale_errors") == 0
    eng.forget(job)

    assert eng.counters()["cuda_batch"]  # a failure is not a refusal: batching stays on
    job, offs = save(eng, tmp_path / "good.bin", entries)
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "good.bin", offs, wants)
    assert batch_calls(eng)[1] >= 2
    eng.forget(job)
    close_within(eng)
    assert_released(sim)
    assert sim.count("bad_handles") == 0


def test_device_fault_during_a_batch_fails_the_job_and_host_jobs_go_on(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A copy of a batch that faults on the device (sticky): the job fails naming a tensor of the
    batch, later device jobs fail fast, host jobs still work."""
    sim = sim_of_version(request, CUDA13_BATCH)
    eng = make_engine(sim, cache=4 << 20, copy_threads=1)
    devs = [pattern(4096, 60 + i) for i in range(32)]
    sim.fail_exec(7, ILLEGAL_ADDRESS)
    job, _ = save(eng, tmp_path / "a.bin", [(f"t{i}", d, 0, 0) for i, d in enumerate(devs)])
    with pytest.raises(_core.EngineError, match=r"'t\d+'.*illegal memory access"):
        eng.wait_done(job, TIMEOUT_S)
    eng.forget(job)
    job, _ = save(eng, tmp_path / "b.bin", [(f"u{i}", d, 0, 0) for i, d in enumerate(devs)])
    with pytest.raises(_core.EngineError, match=r"'u\d+'.*illegal memory access"):
        eng.wait_done(job, TIMEOUT_S)
    eng.forget(job)
    host = pattern(300_000, 8)
    job, offs = save(eng, tmp_path / "c.bin", [("host", host, -1, 0)])
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "c.bin", offs, [host])
    eng.forget(job)
    close_within(eng)
    assert_released(sim)


def test_batches_into_a_cache_that_could_not_be_pinned(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A pageable cache (pinning refused): batch calls still carry the copies (each returns once
    its copies are done, as into pageable memory), bit for bit."""
    sim = sim_of_version(request, CUDA12_BATCH)
    sim.fail("cudaHostRegister", error=OUT_OF_MEMORY, times=-1)
    eng = make_engine(sim, cache=4 << 20, copy_threads=1)
    assert not eng.cache_pinned and eng.counters()["cuda_batch"]
    _compute, gate, devs, wants, ready = small_tensors(sim, 50, 9)
    job, offs = save(eng, tmp_path / "p.bin", [(f"t{i}", d, 0, ready) for i, d in enumerate(devs)])
    sim.open_gate(gate)
    assert eng.wait_done(job, TIMEOUT_S)
    assert_file(tmp_path / "p.bin", offs, wants)
    assert batch_calls(eng) == (1, 50, 0)
    assert sim.count("pageable_copies") == sim.count("copies") == 50
    eng.forget(job)
    close_within(eng)
    assert_released(sim)
