"""A trainer for tests/persist_trials.py and tests/test_persist_agent.py: saves with persist_to
until it is killed (or ``STEPS`` saves are done).

``python persist_child.py FAST SLOW FIRST STEPS PAUSE_S [RETENTION]`` creates a DataStatesWriter
on FAST with ``persist_to=SLOW`` (the persistence agent: the default), prints ``ready <spawned>``
(``spawned``: 1 if this writer started the agent, 0 if it adopted a running one), then saves
``step-FIRST`` .. ``step-(FIRST+STEPS-1)``, printing ``saved N`` after each commit and sleeping
``PAUSE_S`` between saves (a training step). The content of ``step-N`` is :func:`content` ``(N)``.
It exits without ``close()``: what the agent does must not depend on the writer closing.

``python persist_child.py serve SCRATCH`` is a fork server for tests/persist_trials.py (starting
an interpreter with torch takes seconds here): it imports torch and the package once, warms up in
SCRATCH without creating a writer or starting a thread (checked), then forks one trainer per
request. Protocol (one line per message; the server's stdout is the reply channel):

    parent -> server: ``run OUT FAST SLOW FIRST STEPS PAUSE_S [RETENTION]``
    server -> parent: ``pid PID`` (the trainer: a new session, so PID is also its process group;
                      what it prints goes to the file OUT)
    parent -> server: ``reap PID``   server -> parent: ``status EXITCODE``
    parent -> server: ``quit``
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter


def content(step: int) -> dict[str, Any]:
    """The state saved as step ``step`` (about 8 MB), a pure function of ``step``."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(2_000_000, generator=g),
        "b": torch.randint(0, 255, (70_000,), dtype=torch.uint8, generator=g),
        "h": torch.randn(5000, generator=g).to(torch.bfloat16),
        "step": step,
    }


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    fast, slow, first, steps, pause = argv[0], argv[1], int(argv[2]), int(argv[3]), float(argv[4])
    retention = int(argv[5]) if len(argv) > 5 and argv[5] != "none" else None
    w = DataStatesWriter(fast, host_cache_size="8MiB", persist_to=slow,
                         persist_retention=retention)
    spawned = int(w._promoter._child is not None)  # type: ignore[attr-defined]
    print(f"ready {spawned}", flush=True)
    for n in range(first, first + steps):
        dcp.save(content(n), checkpoint_id=os.path.join(fast, f"step-{n}"), storage_writer=w)
        print(f"saved {n}", flush=True)
        time.sleep(pause)
    return 0


def warm_up(scratch: str) -> None:
    """Pays the one-time costs before forking (DCP's planner machinery) with FileSystemWriter's
    single thread: the server must still be a single thread when it forks (so no ``content``:
    generating it starts torch's intra-op threads)."""
    warnings.simplefilter("ignore")
    sd = {"t": torch.zeros(4), "step": 0}
    path = os.path.join(scratch, "warm-up")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=1), checkpoint_id=path)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise SystemExit(f"persist_child: the fork server has {threads} threads after warm-up")


def _forked_trainer(out_path: str, argv: list[str]) -> None:
    """The forked trainer: its own session (a launcher's worker), its prints to ``out_path``."""
    code = 1
    try:
        os.setsid()
        sys.stdin.close()
        fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)  # off the server's reply channel
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        code = main(argv)
    except BaseException:  # noqa: BLE001 - reported on stderr, the exit code says it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(scratch: str) -> None:
    """The fork server loop (see the module docstring)."""
    warm_up(scratch)
    out = sys.stdout
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "run":
            pid = os.fork()
            if pid == 0:  # never returns into the loop
                _forked_trainer(cmd[1], cmd[2:])
            out.write(f"pid {pid}\n")
            out.flush()
        elif cmd[0] == "reap":
            _, status = os.waitpid(int(cmd[1]), 0)
            out.write(f"status {os.waitstatus_to_exitcode(status)}\n")
            out.flush()
        elif cmd[0] == "quit":
            return
        else:
            raise SystemExit(f"persist_child: unknown command {line!r}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
