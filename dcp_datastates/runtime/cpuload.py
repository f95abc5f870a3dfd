"""How busy the machine was lately: the CPU time nobody used, and the CPU time other processes took.

The lazy copies run in native threads under ``SCHED_IDLE``: they get only CPU time no other thread
of the machine wants. On a machine whose cores other processes keep busy (data-loader workers, a
neighbour job), that is nothing, and the copies would land at the optimizer step, where training
waits for them. The capture policy (:mod:`dcp_datastates.save.capture`) therefore asks, at each save
call, how the machine spent the interval since the previous call: when other processes took CPU
and less than one core was left idle, lazy copies would starve, so that save copies its state at
the call instead (native threads at normal priority, the training thread among them). It asks
only where the OS refuses to raise the copy threads to normal priority while a step waits
(``Engine.can_boost``): with that boost, copies a step waits for run at normal priority anyway.

Linux only (``/proc/stat``, ``/proc/self/stat``); elsewhere :meth:`CpuMeter.sample` returns None
and the policy stays as configured. Thread-safety: one meter per writer, sampled by the thread
that stages saves (the training thread).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# Below this window the counters (10 ms ticks) say little: the previous sample is kept.
MIN_WINDOW_S = 0.1
# The machine counts as busy for background copies when other processes used at least this many
# cores on average and less than IDLE_CORES_MIN cores were idle.
OTHERS_CORES_MIN = 0.5
IDLE_CORES_MIN = 1.0

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuLoad:
    """Average use of the machine's cores over one window.

    Attributes:
        window_s: the window's wall time.
        idle_cores: cores nobody used (idle + iowait), on average.
        others_cores: cores used by processes other than this one (steal excluded).
        own_cores: cores this process used.
    """

    window_s: float
    idle_cores: float
    others_cores: float
    own_cores: float

    @property
    def starves_idle_threads(self) -> bool:
        """Whether ``SCHED_IDLE`` threads would get little CPU: others busy, no core idle."""
        return self.others_cores >= OTHERS_CORES_MIN and self.idle_cores < IDLE_CORES_MIN


def _machine_ticks() -> tuple[int, int] | None:
    """(idle ticks, busy ticks without steal) of all cores since boot; None without /proc."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:]]
    v += [0] * (8 - len(v))
    user, nice, system, idle, iowait, irq, softirq = v[:7]
    return idle + iowait, user + nice + system + irq + softirq


def _own_ticks() -> int | None:
    """User + system ticks of this process (all its threads) since it started."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class CpuMeter:
    """Samples the machine's CPU counters; each sample covers the time since the previous one."""

    def __init__(self) -> None:
        self._last = self._read()
        self._load: CpuLoad | None = None

    @staticmethod
    def _read() -> tuple[float, int, int, int] | None:
        m, own = _machine_ticks(), _own_ticks()
        if m is None or own is None:
            return None
        return time.monotonic(), m[0], m[1], own

    def sample(self) -> CpuLoad | None:
        """The load since the previous sample (or since the meter was made).

        Within ``MIN_WINDOW_S`` of the previous sample, that sample's load again (None if there
        was none). None where the counters cannot be read.
        """
        now = self._read()
        if now is None or self._last is None:
            self._last = now
            return None
        dt = now[0] - self._last[0]
        if dt < MIN_WINDOW_S:
            return self._load
        idle = (now[1] - self._last[1]) / _TICK / dt
        busy = (now[2] - self._last[2]) / _TICK / dt
        own = (now[3] - self._last[3]) / _TICK / dt
        self._last = now
        self._load = CpuLoad(
            window_s=dt, idle_cores=idle, others_cores=max(0.0, busy - own), own_cores=own
        )
        return self._load


__all__ = ["CpuLoad", "CpuMeter", "IDLE_CORES_MIN", "OTHERS_CORES_MIN"]
