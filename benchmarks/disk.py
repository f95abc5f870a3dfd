"""Raw sequential-write bandwidth of the checkpoint disk, measured in the same run.

``dd if=/dev/zero of=<dir>/dd.bin bs=64M count=N oflag=direct``: durable writes that bypass
the page cache, the ceiling a checkpoint flush can hope for. Where O_DIRECT is refused (tmpfs,
some overlay filesystems) it falls back to ``conv=fdatasync`` (through the page cache, then
flushed), and where ``dd`` is missing to a Python write loop plus ``fsync``. The method used is
recorded next to the number.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Any

BLOCK = 64 * 1024 * 1024


@dataclass(frozen=True)
class DiskResult:
    nbytes: int
    seconds: float
    method: str
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gbps"] = self.gbps
        return d


def _dd(target: str, count: int, flag: str) -> float | None:
    cmd = ["dd", "if=/dev/zero", f"of={target}", f"bs={BLOCK}", f"count={count}", flag]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        return None
    return elapsed


def _python_write(target: str, count: int) -> float:
    buf = bytes(BLOCK)
    t0 = time.perf_counter()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(count):
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def measure_write_bandwidth(directory: str, nbytes: int) -> DiskResult:
    """Write ``nbytes`` (rounded up to 64 MiB blocks) into ``directory`` and time it."""
    os.makedirs(directory, exist_ok=True)
    count = max(1, -(-nbytes // BLOCK))
    target = os.path.join(directory, "dd_probe.bin")
    try:
        if shutil.which("dd") is not None:
            elapsed = _dd(target, count, "oflag=direct")
            if elapsed is not None:
                return DiskResult(count * BLOCK, elapsed, "dd bs=64M oflag=direct")
            elapsed = _dd(target, count, "conv=fdatasync")
            if elapsed is not None:
                return DiskResult(
                    count * BLOCK,
                    elapsed,
                    "dd bs=64M conv=fdatasync",
                    "O_DIRECT refused by this filesystem",
                )
        elapsed = _python_write(target, count)
        return DiskResult(count * BLOCK, elapsed, "python write+fsync", "dd unavailable")
    finally:
        if os.path.exists(target):
            os.remove(target)


def measure_write_tax(
    directory: str, nbytes: int, threads: int, seconds: float = 2.0
) -> dict[str, Any]:
    """Compute a training loop loses while ``nbytes`` are written in the background.

    Runs a ``threads``-thread float32 matmul loop alone for ``seconds``, then again while
    ``dd bs=64M oflag=direct`` writes ``nbytes`` into ``directory`` (no CPU copy in the guest).
    ``lost_s`` = (1 - rate during the write / rate alone) x the write's duration: the compute
    time a job keeping every core busy gives up to that write. On a virtual machine the host's
    I/O emulation is charged to the guest's vCPUs as steal time, so even a DMA write taxes
    training; no method that writes while training runs can cost less than this per
    checkpoint. ``{"lost_s": nan}`` where ``dd`` or O_DIRECT is unavailable.
    """
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)

    def rate_while(busy: Any) -> tuple[float, float]:
        n, t0 = 0, time.perf_counter()
        while busy(t0):
            a @ b
            n += 1
        dt = time.perf_counter() - t0
        return n / dt, dt

    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, "dd_tax.bin")
    count = max(1, -(-nbytes // BLOCK))
    try:
        if shutil.which("dd") is None:
            return {"lost_s": float("nan"), "note": "dd unavailable"}
        alone, _ = rate_while(lambda t0: time.perf_counter() - t0 < seconds)
        cmd = ["dd", "if=/dev/zero", f"of={target}", f"bs={BLOCK}", f"count={count}",
               "oflag=direct", "status=none"]
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        during, dt = rate_while(lambda t0: proc.poll() is None)
        if proc.returncode != 0:
            return {"lost_s": float("nan"), "note": "O_DIRECT refused"}
        after, _ = rate_while(lambda t0: time.perf_counter() - t0 < seconds)
        base = (alone + after) / 2
        return {
            "bytes": count * BLOCK,
            "write_s": dt,
            "rate_alone": base,
            "rate_during": during,
            "lost_s": max(0.0, (1.0 - during / base) * dt),
        }
    finally:
        torch.set_num_threads(prev)
        if os.path.exists(target):
            os.remove(target)
