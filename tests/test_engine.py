"""The native engine through its binding: checksums, GIL release, lifetimes, shutdown."""

from __future__ import annotations

import errno
import os
import threading
import time
import zlib
from typing import Any

import numpy as np
import pytest
import torch

from dcp_datastates import _core
from dcp_datastates.format.layout import FileLayout, build_template


def test_crc32c_known_vectors() -> None:
    assert _core.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert _core.crc32c(b"") == 0
    data = np.random.default_rng(0).integers(0, 255, 1_000_003, dtype=np.uint8).tobytes()
    whole = _core.crc32c(data)
    assert _core.crc32c(data[500_000:], _core.crc32c(data[:500_000])) == whole  # incremental
    assert whole != zlib.crc32(data)  # it is Castagnoli, not the zip polynomial


def _crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    """A slow reference CRC-32C, independent of the native code paths."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_interleaved_path_matches_the_reference() -> None:
    # Buffers of 12 KiB and more take three interleaved chains that are combined afterwards;
    # check sizes around that threshold and around the 8-byte lane rounding, from a nonzero
    # starting CRC, against a bitwise reference.
    rng = np.random.default_rng(1)
    for n in (12_287, 12_288, 12_289, 12_295, 40_001, 65_536):
        data = rng.integers(0, 255, n, dtype=np.uint8).tobytes()
        assert _core.crc32c(data, 0x1234ABCD) == _crc32c_bitwise(data, 0x1234ABCD), n
    big = rng.integers(0, 255, (1 << 20) + 7, dtype=np.uint8).tobytes()
    pieces = 0
    for i in range(0, len(big), 4000):  # 4000-byte pieces take the single-chain path
        pieces = _core.crc32c(big[i : i + 4000], pieces)
    assert _core.crc32c(big) == pieces


def test_blocking_waits_release_the_gil(tmp_path: Any) -> None:
    eng = _core.Engine(cache_bytes=1 << 20, prefault=False)
    src = torch.ones(10_000)
    job = eng.create_job("gil")
    eng.add_entry(job, "t", src.data_ptr(), src.numel() * 4)
    eng.pause_copies(True)
    eng.start_copies(job)
    waiter = threading.Thread(target=eng.wait_captured, args=(job,))
    waiter.start()
    n = 0
    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end:
        n += 1  # Python work while the waiter blocks in native code
    assert waiter.is_alive()
    assert n > 10_000, "the waiting thread held the GIL"
    eng.pause_copies(False)
    waiter.join(10)
    assert not waiter.is_alive()
    eng.forget(job)
    eng.close()


def test_close_with_unfinished_jobs_does_not_hang() -> None:
    eng = _core.Engine(cache_bytes=64 * 1024, chunk_bytes=16 * 1024, prefault=False)
    src = torch.ones(100_000)  # 400 kB through a 64 KiB cache, never placed: copies block
    job = eng.create_job("stuck")
    eng.add_entry(job, "t", src.data_ptr(), src.numel() * 4)
    eng.start_copies(job)
    time.sleep(0.1)
    t0 = time.perf_counter()
    eng.close()
    assert time.perf_counter() - t0 < 10
    with pytest.raises(_core.EngineError, match="closed"):
        eng.create_job("after")


def test_job_errors_are_latched_and_raised(tmp_path: Any) -> None:
    eng = _core.Engine(cache_bytes=1 << 20, prefault=False)
    src = torch.arange(1000, dtype=torch.float32)
    job = eng.create_job("bad")
    e = eng.add_entry(job, "weights", src.data_ptr(), 4000)
    eng.start_copies(job)
    eng.wait_captured(job)
    f = eng.open_file(job, str(tmp_path / "data.bin"))
    eng.abort(job, "stopped by the test")
    with pytest.raises(_core.EngineError, match="stopped by the test"):
        eng.place(job, e, f, 0, b"", b"")
    with pytest.raises(_core.EngineError, match="stopped by the test"):
        eng.wait_done(job)
    assert eng.counters()["cache_used_bytes"] == 0
    with pytest.raises(_core.EngineError, match="unknown save job"):
        eng.wait_done(job + 100)
    eng.forget(job)
    with pytest.raises(_core.EngineError, match="cannot create"):
        j2 = eng.create_job("nodir")
        eng.open_file(j2, str(tmp_path / "missing-dir" / "x"))
    eng.close()


def test_engine_writes_exact_bytes_with_header_and_trailer(tmp_path: Any) -> None:
    eng = _core.Engine(cache_bytes=64 * 1024, chunk_bytes=8192, copy_threads=2, flush_threads=3,
                       prefault=False)
    payload = np.random.default_rng(1).integers(0, 255, 100_000, dtype=np.uint8)
    job = eng.create_job("bytes")
    e = eng.add_entry(job, "p", payload.ctypes.data, payload.nbytes)
    eng.start_copies(job)
    f = eng.open_file(job, str(tmp_path / "out.bin"))
    eng.place(job, e, f, 10, b"HEADERXXXX", b"TRAILER")
    eng.write_bytes(job, f, 0, b"0123456789"[:0])  # an empty raw write is harmless
    eng.seal(job)
    eng.wait_done(job)
    recs = eng.chunk_records(job)
    assert sum(r[5] for r in recs) == payload.nbytes and len(recs) == 13
    raw = (tmp_path / "out.bin").read_bytes()
    assert raw[:10] == b"HEADERXXXX" and raw[-7:] == b"TRAILER"
    assert raw[10:-7] == payload.tobytes()
    for _e, _c, _f, off, _eo, n, crc in recs:
        assert _core.crc32c(raw[off : off + n]) == crc
    eng.forget(job)
    eng.close()


def test_seal_refuses_a_placed_entry_whose_copy_never_started(tmp_path: Any) -> None:
    # A placement path that forgot start_copies used to be sealed silently: the entry was
    # skipped, its bytes never written, and the save looked complete.
    eng = _core.Engine(cache_bytes=64 * 1024, chunk_bytes=8192, copy_threads=1, flush_threads=1,
                       prefault=False)
    payload = np.arange(1000, dtype=np.uint8)
    job = eng.create_job("unstarted")
    e = eng.add_entry(job, "weights.0", payload.ctypes.data, payload.nbytes, -1, 0, True)
    f = eng.open_file(job, str(tmp_path / "out.bin"))
    eng.place(job, e, f, 0, b"", b"")
    with pytest.raises(_core.EngineError, match="'weights.0'.*never started"):
        eng.seal(job)
    eng.abort(job, "test")
    eng.forget(job)
    eng.close()


def test_two_engines_in_one_process_are_independent() -> None:
    a = _core.Engine(cache_bytes=1 << 20, prefault=False)
    b = _core.Engine(cache_bytes=1 << 20, prefault=False)
    ja = a.create_job("a")
    a.abort(ja, "only a")
    jb = b.create_job("b")
    b.start_copies(jb)
    assert b.wait_captured(jb)
    a.close()
    assert b.wait_captured(jb)
    b.forget(jb)
    b.close()


def test_archive_template_matches_torch_save() -> None:
    import io

    for dtype, shape in [(torch.float32, (3, 4)), (torch.bfloat16, ()), (torch.bool, (0, 2))]:
        t = torch.ones(shape, dtype=dtype)
        tmpl = build_template(dtype, shape)
        blob = tmpl.prefix + t.numpy().tobytes() if dtype != torch.bfloat16 else None
        if blob is None:
            blob = tmpl.prefix + t.view(torch.int16).numpy().tobytes()
        back = torch.load(io.BytesIO(blob + tmpl.suffix), weights_only=True)
        assert torch.equal(back, t)



def test_archive_template_is_byte_identical_to_a_real_tensors_archive() -> None:
    """The template's prototype maps no payload memory (layout._prototype); torch.save of a
    real tensor of the same dtype and shape (under skip_data, as the template: no payload CRC)
    gives the same bytes around the payload, for the dtypes torch pickles by both of its
    formats (TypedStorage and UntypedStorage + dtype)."""
    import io

    from torch.serialization import skip_data

    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64,
              torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.bool, torch.complex64]
    for dtype in dtypes:
        for shape in [(), (0,), (3, 5), (2, 0, 3), (7, 1, 3)]:
            real = torch.zeros(shape, dtype=dtype)
            buf = io.BytesIO()
            with skip_data():
                torch.save(real, buf)  # the payload's gap reads back as zeros
            tmpl = build_template(dtype, shape)
            assert tmpl.payload_bytes == real.nbytes
            payload = bytes(real.nbytes)
            assert tmpl.prefix + payload + tmpl.suffix == buf.getvalue(), (dtype, shape)

def _small_items_job(
    eng: Any, tmp_path: Any, name: str, n: int, seed: int, direct: bool = True
) -> tuple[int, list[str], list[bytearray], list[np.ndarray]]:
    """Places ``n`` small items (every 7th flushed from its source when ``direct``) into two
    files the way FileLayout does (headers, trailers, back to back), with the copies held until
    everything is placed, so that the flush thread finds a backlog. Every 37th item leaves a gap
    before it that another writer fills (as the writer does for a spilled tensor) before the
    flush starts: no combined write may touch it. Returns the job, the files' paths, the bytes
    each file must hold and the sources (which must outlive the job)."""
    rng = np.random.default_rng(seed)
    job = eng.create_job(name)
    paths = [str(tmp_path / f"{name}{k}.bin") for k in range(2)]
    files = [eng.open_file(job, p) for p in paths]
    expected = [bytearray(), bytearray()]
    keep: list[np.ndarray] = []
    placements = []
    foreign: list[tuple[int, int, bytes]] = []
    for i in range(n):
        payload = rng.integers(0, 255, int(rng.integers(1, 30_000)), dtype=np.uint8)
        keep.append(payload)
        e = eng.add_entry(job, f"item{i}", payload.ctypes.data, payload.nbytes,
                          direct=direct and i % 7 == 3)
        k = 0 if i % 5 else 1
        head = bytes(rng.integers(0, 255, int(rng.integers(0, 50)), dtype=np.uint8))
        tail = bytes(rng.integers(0, 255, int(rng.integers(0, 30)), dtype=np.uint8))
        buf = expected[k]
        if i % 37 == 36:
            other = bytes([0xAB]) * int(rng.integers(1, 64))
            foreign.append((k, len(buf), other))
            buf.extend(other)
        start = len(buf)
        buf.extend(head + payload.tobytes() + tail)
        placements.append((e, files[k], start + len(head), head, tail))
    eng.pause_copies(True)
    eng.start_copies(job)
    for e, f, off, head, tail in placements:
        eng.place(job, e, f, off, head, tail)
    for k, off, other in foreign:  # the files exist now; the held copies keep the flush away
        fd = os.open(paths[k], os.O_WRONLY)
        try:
            os.pwrite(fd, other, off)
        finally:
            os.close(fd)
    eng.pause_copies(False)
    eng.seal(job)
    return job, paths, expected, keep


@pytest.mark.parametrize("o_direct", [True, False])
def test_small_items_are_written_together_exactly(tmp_path: Any, o_direct: bool) -> None:
    # A backlog of small items in one file is written by one pwritev per run (write combining):
    # the bytes must be exactly what one write per item gives, gaps zero, every checksum right.
    eng = _core.Engine(cache_bytes=16 << 20, copy_threads=1, flush_threads=1, o_direct=o_direct,
                       prefault=False)
    eng.set_delays(0, 3000, 7)  # the first flush waits: the rest of the items queue up behind it
    n = 400
    job, paths, expected, _keep = _small_items_job(eng, tmp_path, "small", n, seed=3)
    eng.wait_done(job)
    for k, path in enumerate(paths):
        with open(path, "rb") as fh:
            assert fh.read() == bytes(expected[k]), f"file {k}"
    stats = eng.stats(job)
    assert stats["bytes_written"] == stats["bytes_total"]
    assert stats["flush_writes"] <= n // 4, stats["flush_writes"]  # not one write per item
    recs = eng.chunk_records(job)
    assert len(recs) == n
    for _e, _c, f, off, _eo, length, crc in recs:
        data = bytes(expected[f])[off : off + length]
        assert _core.crc32c(data) == crc
    assert eng.counters()["cache_used_bytes"] == 0
    eng.forget(job)
    eng.close()


def test_a_failed_combined_write_fails_the_job_and_frees_the_cache(tmp_path: Any) -> None:
    eng = _core.Engine(cache_bytes=16 << 20, copy_threads=1, flush_threads=1, prefault=False)
    # The first flush sleeps 18.7 ms (the first draw of seed 6) before it takes its run: every
    # held copy has landed by then, so the first write, which fails, is a combined one.
    eng.set_delays(0, 20_000, 6)
    _core.set_write_fault("combfail", errno.EIO)
    try:
        job, _paths, _expected, _keep = _small_items_job(
            eng, tmp_path, "combfail", 200, seed=5, direct=False
        )
        combined = r"flush of 'item\d+' \(and \d+ more items written with it\) failed"
        with pytest.raises(_core.EngineError, match=combined):
            eng.wait_done(job)
        assert eng.counters()["cache_used_bytes"] == 0
        assert eng.stats(job)["failed"]
        eng.forget(job)
    finally:
        _core.set_write_fault("", 0)
        eng.close()


def test_file_layout_alignment() -> None:
    lay = FileLayout(2, payload_align=4096)
    tmpl = build_template(torch.float32, (5000,))
    for _ in range(5):
        f, start, payload = lay.place_tensor(tmpl)
        assert payload % 4096 == 0 and payload - start == len(tmpl.prefix)
    assert abs(lay.sizes[0] - lay.sizes[1]) <= tmpl.total_bytes + 4096
    # Payloads under a page gain nothing from O_DIRECT: no padding, back to back (the engine
    # writes runs of them together).
    small = build_template(torch.float32, (100,))
    f, start, payload = lay.place_tensor(small)
    assert payload - start == len(small.prefix)
    end = lay.sizes[f]
    lay.sizes[1 - f] = end + 10**6  # the next item goes to the same file
    f2, start2, _ = lay.place_tensor(small)
    assert f2 == f and start2 == end


def test_file_layout_pads_only_payloads_the_engine_writes_direct() -> None:
    from dcp_datastates import _core

    lay = FileLayout(1, payload_align=_core.DIRECT_ALIGN, direct_min=_core.DIRECT_MIN_BYTES)
    below = build_template(torch.float32, (_core.DIRECT_MIN_BYTES // 4 - 16,))
    above = build_template(torch.float32, (_core.DIRECT_MIN_BYTES // 4,))
    lay.sizes[0] = 100  # an unaligned end
    _, start, payload = lay.place_tensor(below)
    assert start == 100  # written buffered: no padding
    _, start, payload = lay.place_tensor(above)
    assert payload % _core.DIRECT_ALIGN == 0


def _thread_policies() -> dict[int, int]:
    """Scheduling policy (field 41 of /proc/self/task/<tid>/stat) of each thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = int(fields[38])  # fields after "(comm) ": state is field 3 -> index 0
    return out


@pytest.mark.parametrize("flush_idle", [False, True])
def test_thread_priorities(flush_idle: bool) -> None:
    # Copy threads run under SCHED_IDLE (5) with idle_priority; flush threads only with
    # flush_idle (they mostly wait for the disk and must keep it busy while training runs).
    sched_idle = 5
    before = {t for t, p in _thread_policies().items() if p == sched_idle}
    eng = _core.Engine(
        cache_bytes=1 << 20,
        prefault=False,
        copy_threads=2,
        flush_threads=3,
        idle_priority=True,
        flush_idle=flush_idle,
    )
    try:
        deadline = time.monotonic() + 10
        expected = 5 if flush_idle else 2
        while True:
            idle = {t for t, p in _thread_policies().items() if p == sched_idle} - before
            if len(idle) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.01)  # the threads set their own policy when they start
        assert len(idle) == expected
    finally:
        eng.close()
