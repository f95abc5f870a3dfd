"""Measurement helpers: summary statistics, process memory, page-cache eviction.

Memory is read from ``/proc/self/status`` (Linux): ``VmRSS`` is the current resident set,
``VmHWM`` its high-water mark, which can be reset by writing ``5`` to ``/proc/self/clear_refs``
so that the peak of one save (including its background threads) can be isolated. Where that is
unavailable a sampling thread (psutil, 5 ms) stands in.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

GB = 1e9


def summarize(values: Iterable[float | None]) -> dict[str, Any] | None:
    """Median, min, max and count of the non-None values; None when there are none."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Current resident set size of this process."""
    kib = _read_status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return int(psutil.Process().memory_info().rss)


def vmhwm_bytes() -> int | None:
    """The process's resident high-water mark (``VmHWM``), None where /proc lacks it."""
    kib = _read_status_kib("VmHWM")
    return None if kib is None else kib * 1024


class PeakRSS:
    """Peak resident set size over a window: ``reset()`` ... ``peak()``.

    Uses the kernel's VmHWM where it can be reset, else a 5 ms sampling thread.
    """

    def __init__(self) -> None:
        self._hwm_ok = self._try_reset_hwm()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.method = "VmHWM" if self._hwm_ok else "psutil sampling (5 ms)"

    @staticmethod
    def _try_reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return _read_status_kib("VmHWM") is not None

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, rss_bytes())

    def reset(self) -> None:
        if self._hwm_ok:
            self._try_reset_hwm()
            return
        self.close()
        self._peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def peak(self) -> int:
        if self._hwm_ok:
            kib = _read_status_kib("VmHWM")
            return (kib or 0) * 1024
        return max(self._peak, rss_bytes())

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def release_memory() -> None:
    """Collect garbage and return freed heap memory to the OS (glibc ``malloc_trim``).

    Called between contenders, outside every timed window. glibc keeps freed blocks below its
    (dynamic, up to 32 MiB) mmap threshold in per-thread arenas; without trimming, the staging
    copies one method freed would still count in the next method's RSS, and at checkpoint sizes
    near the machine's memory they add up to an out-of-memory kill.
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


def files_under(path: str) -> list[str]:
    """All regular files below ``path`` (or ``[path]`` if it is a file)."""
    if os.path.isfile(path):
        return [path]
    out: list[str] = []
    for root, _dirs, files in os.walk(path):
        out.extend(os.path.join(root, f) for f in files)
    return out


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(path))


def fsync_tree(path: str) -> None:
    """fsync every file below ``path`` and the directories holding them."""
    dirs = set()
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(os.path.dirname(p))
    for d in dirs:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict_page_cache(path: str) -> bool:
    """Drop the (clean) cached pages of the files below ``path`` so a load reads the disk.

    Returns False where ``posix_fadvise`` is unavailable. Files must have been fsynced:
    dirty pages are not dropped.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def now() -> float:
    """The single clock of the harness (same clock as DataStatesWriter telemetry)."""
    return time.perf_counter()


def gbps(nbytes: float, seconds: float | None) -> float | None:
    if seconds is None or seconds <= 0:
        return None
    return nbytes / seconds / GB


def median_or_none(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def cpu_busy_seconds() -> float | None:
    """Machine-wide busy CPU time (all cores, all processes) from /proc/stat, in seconds."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    vals = [int(v) for v in fields]
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time of this process and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
