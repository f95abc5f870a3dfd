"""Restore into device memory on CPU, through the stand-in CUDA runtime (tests/simcuda.py).

The native DeviceReader (csrc/engine/device_reader.hpp) reads checkpoint bytes into page-locked
staging slots and copies them to device addresses on its own streams; "device memory" is numpy
memory here, and the stand-in copies when a copy's turn comes on its stream, reading the slot
*then*: a slot refilled before its copies ran would land wrong bytes. Then the reader's device
path (dcp_datastates.restore.device) end to end, CPU targets standing in for CUDA ones.
What only a GPU can show (the link's speed) is measured by scripts/gpu_check.sh.
"""

# ruff: noqa: F811
from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import captured_logs

# The fixtures sim, simcudart and simcudart13 are imported from simcuda: test parameters of
# those names use them (hence F811 off for this file).
from simcuda import (  # noqa: F401
    CUDA12_BATCH,
    ILLEGAL_ADDRESS,
    INVALID_VALUE,
    NOT_SUPPORTED,
    OUT_OF_MEMORY,
    Sim,
    pattern,
    sim,
    sim_of_version,
    simcudart,
    simcudart13,
)

from dcp_datastates import DataStatesReader, _core
from dcp_datastates.restore import device as device_mod
from dcp_datastates.restore import reader as reader_mod


class Layout:
    """A file of payloads back to back and the device buffer they are read into.

    ``sizes`` are the payloads; the device places them back to back too, except where ``gaps``
    says (a gap in the device breaks a run of adjacent copies). Each span is (file offset,
    bytes, device offset, crc, name).
    """

    def __init__(self, path: Path, sizes: list[int], seed: int, gaps: int = 0) -> None:
        self.path = path
        self.data = [pattern(n, seed + i) for i, n in enumerate(sizes)]
        path.write_bytes(b"".join(d.tobytes() for d in self.data))
        self.spans: list[tuple[int, int, int, int, str]] = []
        f_off = d_off = 0
        for i, d in enumerate(self.data):
            crc = _core.crc32c(d.tobytes())
            self.spans.append((f_off, d.nbytes, d_off, crc, f"model.layers.{i}.weight"))
            f_off += d.nbytes
            d_off += d.nbytes + (64 if gaps and i % gaps == gaps - 1 else 0)
        self.device = np.zeros(d_off + 64, dtype=np.uint8)  # "device memory"

    def read(self, staging: Any, threads: int = 2, block: int = 8 << 20,
             spans: list[int] | None = None, crc: bool = True) -> dict[str, int]:
        chosen = [self.spans[i] for i in (spans if spans is not None else range(len(self.spans)))]
        base = self.device.ctypes.data
        return _core.read_spans(
            [str(self.path)], [0] * len(chosen), [s[0] for s in chosen], [s[1] for s in chosen],
            [base + s[2] for s in chosen], [s[3] if crc else -1 for s in chosen],
            [s[4] for s in chosen], list(range(len(chosen))), threads, True, block, staging)

    def assert_landed(self, spans: list[int] | None = None) -> None:
        for i in spans if spans is not None else range(len(self.spans)):
            f_off, n, d_off, _, name = self.spans[i]
            got = self.device[d_off:d_off + n]
            assert np.array_equal(got, self.data[i]), f"{name} differs"


def small_and_large(seed: int) -> list[int]:
    """300 small payloads of odd sizes, a 3 MiB one among them, and a 5 MiB + 3 one last."""
    rng = np.random.default_rng(seed)
    sizes = [int(x) for x in rng.integers(1, 8 << 10, 300)]
    sizes[150] = 3 << 20
    return [*sizes, (5 << 20) + 3]


def assert_clean(sim: Sim, staging: Any = None) -> None:
    """No copy in flight, no stream or event of the reader left, no error left for torch."""
    assert sim.quiesce()
    assert sim.count("inflight_copies") == 0
    assert sim.engine_streams() == 0 and sim.engine_events() == 0
    assert sim.count("violations") == 0
    assert sim.last_error_peek() == 0


@pytest.mark.parametrize("version", [12040, CUDA12_BATCH, 13000])
@pytest.mark.parametrize("threads", [1, 3])
def test_small_and_large_payloads_land_exactly_in_few_calls(
    request: pytest.FixtureRequest, tmp_path: Path, version: int, threads: int
) -> None:
    """Each copy takes 200 us on its stream and reads its slot only then: every payload lands
    bit for bit (a slot refilled early would not), its CRC checked; runs adjacent in the file
    are read in one pread, runs adjacent in the device go in one copy, and a slot's copies go in
    one batch call where the runtime has it."""
    sim = sim_of_version(request, version)
    sim.copy_time(200e-6)
    lay = Layout(tmp_path / "data", small_and_large(1), seed=10, gaps=7)
    staging = _core.DeviceStaging(sim.path, 0, 2 * threads, 256 << 10)
    assert staging.pinned and staging.slots == 2 * threads
    st = lay.read(staging, threads=threads, block=64 << 10)
    lay.assert_landed()
    total = sum(s[1] for s in lay.spans)
    assert st["bytes"] == st["verified_bytes"] == total
    assert st["threads"] == threads
    groups = -(-total // (256 << 10))
    assert st["preads"] <= groups + total // (1 << 20) + 2 * threads  # not one per payload
    runs = 300 // 7 + 3  # device runs broken by gaps, and the slot boundaries
    if version >= CUDA12_BATCH:
        assert st["batch_calls"] > 0 and st["batch_copies"] + st["copy_calls"] < 2 * (runs + groups)
        assert st["copy_calls"] <= groups  # only slots holding a single run are copied alone
    else:
        assert st["batch_calls"] == 0 and st["copy_calls"] < 2 * (runs + groups)
    del staging
    assert_clean(sim)
    assert sim.registrations() == 0


def test_aligned_runs_are_read_with_o_direct_where_the_file_system_takes_it(
    sim: Sim, tmp_path: Path
) -> None:
    """Payloads starting at 4 KiB boundaries of the file (large ones do) go through O_DIRECT
    (the last pread of a run reads up to the next boundary, into slot space no earlier piece
    holds), the unaligned one through the page cache; bit for bit either way; o_direct off:
    none. Skipped where the file system refuses O_DIRECT (tmpfs before Linux 6.6)."""
    lay = Layout(tmp_path / "data", [1 << 20, (3 << 20) + 4096, 5000, 777], seed=13)
    staging = _core.DeviceStaging(sim.path, 0, 4, 1 << 20)
    chosen = [0, 1, 3]  # the last starts at an odd offset, apart from the others
    st = lay.read(staging, spans=chosen)
    lay.assert_landed(chosen)
    if st["direct_bytes"] == 0:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert st["direct_bytes"] == (4 << 20) + 4096  # the two aligned payloads
    assert st["verified_bytes"] == st["bytes"] == (4 << 20) + 4096 + 777
    lay.device[:] = 0
    base = lay.device.ctypes.data
    st = _core.read_spans([str(lay.path)], [0] * 4, [s[0] for s in lay.spans],
                          [s[1] for s in lay.spans], [base + s[2] for s in lay.spans],
                          [s[3] for s in lay.spans], [s[4] for s in lay.spans], [0, 1, 2, 3],
                          2, False, 8 << 20, staging)
    lay.assert_landed()
    assert st["direct_bytes"] == 0
    del staging
    assert_clean(sim)


def test_a_slot_is_refilled_only_once_its_copies_ran(sim: Sim, tmp_path: Path) -> None:
    """One thread, two slots, copies 20 ms each: the third slot fill must wait for the first
    slot's copies (bit-exact data proves the order)."""
    sim.copy_time(0.02)
    lay = Layout(tmp_path / "data", [100 << 10] * 6, seed=3)
    staging = _core.DeviceStaging(sim.path, 0, 2, 128 << 10)
    lay.read(staging, threads=1)
    lay.assert_landed()
    assert sim.count("calls:cudaEventSynchronize") >= 4  # waits for slots, then at the end
    del staging
    assert_clean(sim)


def test_checksum_mismatch_names_the_tensor_and_leaves_nothing_in_flight(
    sim: Sim, tmp_path: Path
) -> None:
    lay = Layout(tmp_path / "data", small_and_large(2), seed=20)
    raw = bytearray(lay.path.read_bytes())
    f_off = lay.spans[42][0]
    raw[f_off + 1] ^= 0xFF
    lay.path.write_bytes(bytes(raw))
    staging = _core.DeviceStaging(sim.path, 0, 4, 256 << 10)
    with pytest.raises(_core.EngineError,
                       match=r"checksum mismatch in 'model\.layers\.42\.weight' .*data"):
        lay.read(staging)
    lay.assert_landed(list(range(42)))  # the rest was read: the failure is found at the end
    st = lay.read(staging, crc=False)  # the staging stays usable
    assert st["verified_bytes"] == 0
    del staging
    assert_clean(sim)


def test_truncated_file_names_the_tensor(sim: Sim, tmp_path: Path) -> None:
    lay = Layout(tmp_path / "data", [3000] * 20, seed=5)
    lay.path.write_bytes(lay.path.read_bytes()[: 3000 * 12 + 100])
    staging = _core.DeviceStaging(sim.path, 0, 4, 64 << 10)
    with pytest.raises(_core.EngineError,
                       match=r"'model\.layers\.12\.weight': .*data ends at byte 36100, inside its "
                             r"data \(bytes \[36000, 39000\)\): the file is truncated"):
        lay.read(staging)
    with pytest.raises(_core.EngineError, match=r"'model\.layers\.0\.weight': cannot open .*nope"):
        _core.read_spans([str(tmp_path / "nope")], [0], [0], [10], [lay.device.ctypes.data],
                         [-1], ["model.layers.0.weight"], [0], 2, True, 1 << 20, staging)
    del staging
    assert_clean(sim)


@pytest.mark.parametrize("nth", [1, 4])
def test_failing_copy_call_names_its_tensor_and_the_next_read_works(
    sim: Sim, tmp_path: Path, nth: int
) -> None:
    """One cudaMemcpyAsync (no batch call: runtime 12.4) refused: the read fails naming the
    tensor whose copy it was; no copy stays in flight, the thread's last error is cleared, and
    the next read through the same staging lands everything."""
    lay = Layout(tmp_path / "data", [40 << 10] * 10, seed=7, gaps=1)  # a copy per payload
    staging = _core.DeviceStaging(sim.path, 0, 2, 512 << 10)
    sim.fail("cudaMemcpyAsync", nth=nth, error=INVALID_VALUE)
    with pytest.raises(_core.EngineError,
                       match=rf"'model\.layers\.{nth - 1}\.weight': copy to device 0 failed: "
                             r"cudaMemcpyAsync \(host to device\) failed: .*\(cudaError 1\)"):
        lay.read(staging, threads=1)
    assert_clean(sim)
    lay.device[:] = 0
    lay.read(staging, threads=1)
    lay.assert_landed()
    del staging
    assert_clean(sim)


def test_batch_call_failure_names_the_copy_the_runtime_points_at(
    sim: Sim, tmp_path: Path
) -> None:
    sim.runtime_version(CUDA12_BATCH)
    lay = Layout(tmp_path / "data", [4 << 10] * 16, seed=8, gaps=1)
    staging = _core.DeviceStaging(sim.path, 0, 2, 1 << 20)
    sim.fail_index(5)
    sim.fail("cudaMemcpyBatchAsync", error=ILLEGAL_ADDRESS)
    with pytest.raises(_core.EngineError,
                       match=r"'model\.layers\.5\.weight': copy to device 0 failed: "
                             r"cudaMemcpyBatchAsync \(host to device\) failed"):
        lay.read(staging, threads=1)
    assert_clean(sim)
    st = lay.read(staging, threads=1)  # batching stays on: that was no refusal
    assert st["batch_calls"] == 1 and staging.batch_error == ""
    lay.assert_landed()
    del staging
    assert_clean(sim)


def test_batch_call_refused_falls_back_to_one_by_one(sim: Sim, tmp_path: Path) -> None:
    sim.runtime_version(CUDA12_BATCH)
    lay = Layout(tmp_path / "data", [4 << 10] * 16, seed=9, gaps=1)
    staging = _core.DeviceStaging(sim.path, 0, 2, 1 << 20)
    sim.fail("cudaMemcpyBatchAsync", error=NOT_SUPPORTED)
    st = lay.read(staging, threads=1)
    lay.assert_landed()
    assert st["batch_calls"] == 0 and st["copy_calls"] == 16
    assert "refused" in staging.batch_error
    del staging
    assert_clean(sim)


def test_device_fault_during_a_copy_fails_the_read_naming_a_tensor(
    sim: Sim, tmp_path: Path
) -> None:
    """A copy faults on the device (sticky, as a real fault, and reported by whichever call
    comes next): the read fails naming a tensor of the read and the device's error, whether a
    copy call or the wait for a slot (then with how many other pieces the slot held) sees it
    first; no copy is left in flight."""
    lay = Layout(tmp_path / "data", [8 << 10] * 64, seed=11)
    staging = _core.DeviceStaging(sim.path, 0, 2, 64 << 10)
    for copy_s, seen_by in ((0.0, r"(cudaMemcpyAsync \(host to device\)|cudaEventSynchronize)"),
                            (0.3, r"cudaEventSynchronize failed: .*\(the same staging slot held 7 "
                                   r"more pieces\)")):
        sim.copy_time(copy_s)
        sim.fail_exec(2, ILLEGAL_ADDRESS)
        with pytest.raises(_core.EngineError,
                           match=r"'model\.layers\.\d+\.weight': copy to device 0 failed: "
                                 rf"{seen_by}") as info:
            lay.read(staging, threads=1)
        assert "illegal memory access" in str(info.value)
        assert sim.quiesce() and sim.count("inflight_copies") == 0
        sim.reset()  # the fault is sticky until then, as on a device
    del staging
    assert_clean(sim)


def test_staging_that_cannot_be_pinned_copies_pageable(sim: Sim, tmp_path: Path) -> None:
    sim.runtime_version(CUDA12_BATCH)
    sim.fail("cudaHostRegister", error=OUT_OF_MEMORY, times=-1)
    staging = _core.DeviceStaging(sim.path, 0, 4, 256 << 10)
    assert not staging.pinned and "out of memory" in staging.pin_error
    lay = Layout(tmp_path / "data", small_and_large(3), seed=30)
    st = lay.read(staging)
    lay.assert_landed()
    assert st["batch_calls"] == 0 and sim.count("pageable_copies") > 0
    del staging
    assert_clean(sim)
    assert sim.registrations() == 0


def test_two_threads_sharing_a_staging_take_turns(sim: Sim, tmp_path: Path) -> None:
    sim.copy_time(100e-6)
    lays = [Layout(tmp_path / f"d{i}", small_and_large(4 + i), seed=40 + 10 * i) for i in (0, 1)]
    staging = _core.DeviceStaging(sim.path, 0, 4, 256 << 10)
    errors: list[BaseException] = []

    def read(lay: Layout, staging: Any) -> None:
        try:
            lay.read(staging)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(lay, staging)) for lay in lays]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    for lay in lays:
        lay.assert_landed()
    del staging
    assert_clean(sim)


def test_device_that_cannot_be_selected_is_a_clear_error(sim: Sim, tmp_path: Path) -> None:
    lay = Layout(tmp_path / "data", [1000] * 4, seed=12)
    staging = _core.DeviceStaging(sim.path, 7, 2, 64 << 10)  # the stand-in has devices 0, 1
    with pytest.raises(_core.EngineError, match="cannot set up a copy stream on device 7"):
        lay.read(staging)
    del staging
    assert_clean(sim)


# -- the reader's device path, CPU tensors standing in for CUDA ones ---------------------------


@pytest.fixture
def device_path(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> Sim:
    """The reader treats every CPU target as memory of device 0 of the stand-in runtime."""
    settled: list[int] = []
    monkeypatch.setattr(reader_mod, "device_of", lambda t: 0)
    monkeypatch.setattr(device_mod, "loaded_cuda_runtime", lambda: sim.path)
    monkeypatch.setattr(device_mod, "settle_device", settled.append)
    sim.settled = settled  # type: ignore[attr-defined]
    return sim


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {f"norm.{i}": torch.randn(37 + i, generator=g) for i in range(200)}
    sd["w"] = torch.randn(700, 1000, generator=g)
    sd["bf"] = torch.randn(4097, generator=g).to(torch.bfloat16)
    sd["step"] = 12
    return sd


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_reader_reads_whole_targets_through_the_device_path(
    device_path: Sim, tmp_path: Path, writer_factory: Any
) -> None:
    """A load whose targets are whole chunks: every tensor byte goes through the staging and
    the stand-in's copies (few calls for 202 tensors), the device is settled once first, the
    values are exact, the targets count as modified; a second load reuses the staging; nothing
    is left once the reader is dropped."""
    device_path.runtime_version(CUDA12_BATCH)
    sd = _state(0)
    dcp.save(sd, storage_writer=writer_factory(), checkpoint_id=str(tmp_path / "c"))
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
    versions = {k: v._version for k, v in out.items() if isinstance(v, torch.Tensor)}
    reader = DataStatesReader(tmp_path / "c")
    dcp.load(out, storage_reader=reader)
    for k, v in sd.items():
        assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, k
    assert all(out[k]._version > n for k, n in versions.items())
    tensor_bytes = sum(v.numel() * v.element_size() for v in sd.values()
                       if isinstance(v, torch.Tensor))
    lr = reader.last_read
    assert lr["device_bytes"] == lr["native_bytes"] == lr["verified_bytes"] == tensor_bytes
    assert 0 < lr["device_batch_calls"] + lr["device_copy_calls"] < 40
    assert device_path.settled == [0]  # type: ignore[attr-defined]
    assert_clean(device_path)
    # the reader keeps its staging for its next load (registered once), and settles again
    registers = device_path.count("calls:cudaHostRegister")
    assert device_path.registrations() == 1
    for t in out.values():
        if isinstance(t, torch.Tensor):
            t.zero_()
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], sd["w"]) and reader.last_read["device_bytes"] == tensor_bytes
    assert device_path.settled == [0, 0]  # type: ignore[attr-defined]
    assert device_path.count("calls:cudaHostRegister") == registers
    del reader
    gc.collect()
    assert_clean(device_path)
    assert device_path.registrations() == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_reader_mixes_device_and_host_targets_in_one_load(
    device_path: Sim, tmp_path: Path, writer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the targets "on the device", half on the host, interleaved in the same read
    batches (small batches: many of them): each batch reads its host chunks natively and its
    device chunks through the staging; every value exact; the device bytes are exactly the
    device targets'."""
    on_device: set[int] = set()
    monkeypatch.setattr(reader_mod, "device_of",
                        lambda t: 0 if t.data_ptr() in on_device else None)
    monkeypatch.setattr(reader_mod, "FIRST_BATCH_BYTES", 64 << 10)
    monkeypatch.setattr(reader_mod, "BATCH_BYTES", 256 << 10)
    sd = _state(4)
    dcp.save(sd, storage_writer=writer_factory(), checkpoint_id=str(tmp_path / "c"))
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
    tensors = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
    on_device.update(out[k].data_ptr() for k in tensors[::2])
    reader = DataStatesReader(tmp_path / "c")
    dcp.load(out, storage_reader=reader)
    for k, v in sd.items():
        assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, k
    want = sum(out[k].numel() * out[k].element_size() for k in tensors[::2])
    assert reader.last_read["device_bytes"] == want
    assert reader.last_read["native_bytes"] == sum(
        out[k].numel() * out[k].element_size() for k in tensors)
    del reader
    gc.collect()
    assert_clean(device_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_reader_device_path_off_and_resharded_items_take_temporaries(
    device_path: Sim, tmp_path: Path, writer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``device_reads=False`` and ``DCPDS_NO_DEVICE_READ=1`` keep the path off; items that are
    not whole chunks (a differently shaped target: a resharded load) never take it."""
    sd = _state(1)
    dcp.save(sd, storage_writer=writer_factory(), checkpoint_id=str(tmp_path / "c"))
    for reader, env in ((DataStatesReader(tmp_path / "c", device_reads=False), "0"),
                        (DataStatesReader(tmp_path / "c"), "1")):
        monkeypatch.setenv("DCPDS_NO_DEVICE_READ", env)
        out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
               for k, v in sd.items()}
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], sd["w"]) and reader.last_read["device_bytes"] == 0
    monkeypatch.setenv("DCPDS_NO_DEVICE_READ", "0")
    out = {"w": torch.zeros(700, 1000, dtype=torch.float64)}  # converted: not a whole chunk
    reader = DataStatesReader(tmp_path / "c")
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], sd["w"].double()) and reader.last_read["device_bytes"] == 0
    assert_clean(device_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_reader_falls_back_when_no_runtime_is_loaded(
    device_path: Sim, tmp_path: Path, writer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_mod, "loaded_cuda_runtime", lambda: "")
    sd = _state(2)
    dcp.save(sd, storage_writer=writer_factory(), checkpoint_id=str(tmp_path / "c"))
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
    reader = DataStatesReader(tmp_path / "c")
    with captured_logs("dcp_datastates.restore.device") as records:
        dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], sd["w"]) and reader.last_read["device_bytes"] == 0
    assert sum("no CUDA runtime is loaded" in r.getMessage() for r in records) == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_reader_device_path_names_a_damaged_tensor(
    device_path: Sim, tmp_path: Path, writer_factory: Any
) -> None:
    sd = _state(3)
    dcp.save(sd, storage_writer=writer_factory(), checkpoint_id=str(tmp_path / "c"))
    data = [p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp"]
    assert data
    biggest = max(data, key=lambda p: p.stat().st_size)
    raw = bytearray(biggest.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    biggest.write_bytes(bytes(raw))
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
    with pytest.raises(BaseException) as info:  # DCP wraps reader errors in CheckpointException
        dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c"))
    text = str(info.value)
    assert "checksum mismatch in 'w'" in text and "IntegrityError" in text, text
    assert_clean(device_path)
