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
