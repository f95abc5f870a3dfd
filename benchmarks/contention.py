"""A busy machine on demand: ``--contend N`` starts N CPU-bound processes beside each run.

Training jobs rarely own their cores: data-loader workers decode and augment, a neighbour job
shares the node. Each contender process spins in pure Python (what a tokenising or augmenting
data-loader worker does) at normal priority, so a core is never idle while it runs. The
processes are started right before a measured run and stopped right after it, so every
contender of an interleaved comparison meets the same load.

Per-thread CPU time (:func:`thread_cpu_seconds`) says where a run's time went: the training
thread, torch's intra-op pool, DCP's save thread, the engine's copy and flush threads (named
``dcpds-copy*`` / ``dcpds-flush*``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Iterator


def _spin() -> None:  # pragma: no cover - runs in the contender processes
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


@contextlib.contextmanager
def contention(n: int) -> Iterator[list[int]]:
    """Runs ``n`` busy processes (spawned, normal priority) for the duration of the block.

    Yields their pids. ``n == 0`` starts nothing. The processes are terminated (then killed)
    when the block ends, whatever it raised.
    """
    procs: list[mp.process.BaseProcess] = []
    if n > 0:
        ctx = mp.get_context("spawn")
        for i in range(n):
            p = ctx.Process(target=_spin, name=f"contend-{i}", daemon=True)
            p.start()
            procs.append(p)
    try:
        yield [p.pid for p in procs if p.pid is not None]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, summed per thread name.

    Names are the kernel's ``comm`` (15 characters); digits at the end are dropped so that a
    pool's threads add up (``dcpds-flush0`` and ``dcpds-flush1`` -> ``dcpds-flush``). The main
    thread is reported as ``main``. Empty where /proc is unavailable.
    """
    out: dict[str, float] = {}
    me = os.getpid()
    try:
        tids = os.listdir(f"/proc/{me}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{me}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        lpar, rpar = stat.find("("), stat.rfind(")")
        name = "main" if int(tid) == me else stat[lpar + 1 : rpar].rstrip("0123456789")
        fields = stat[rpar + 2 :].split()
        # fields[11], fields[12]: utime, stime (fields 14 and 15 of proc(5), counted from 1)
        secs = (int(fields[11]) + int(fields[12])) / _TICK
        out[name] = out.get(name, 0.0) + secs
    return out
