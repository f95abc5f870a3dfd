"""Child process for tests/test_crash_consistency.py: saves checkpoints until it is SIGKILLed.

One *trial* creates a ``DataStatesWriter`` with a host cache smaller than the state (every save
streams through the cache: copies wait for flushes) and then loops, like a training loop:

    barrier (optimizer.step() with writer.protect, plus writer.wait_captured())
    -> mutate the state in place to ``content(n)``
    -> dcp.async_save or dcp.save of ``{"model": ..., "step": n}`` to ``ROOT/step-<n>``

with ``n = trial * 10000 + i`` (unique per trial). The saved data is a pure function of ``n``
(:func:`content`), so the test can check every committed checkpoint bit-exactly without knowing
when the child died. The state tensors are an optimizer's parameters, so async saves capture
them lazily: the in-place mutation after the barrier is exactly the pattern the writer must
make safe.

Starting a Python interpreter with torch takes seconds here, so besides running one trial in a
fresh interpreter (``run``), the script is a fork server (``serve``): it imports torch and the
package once, then forks one child per trial. The parent kills the forked child, not the server.
The server creates no writer and starts no thread before forking (checked in :func:`warm_up`).

Protocol of ``serve`` (one line per message; the server's stdout is the reply channel, a forked
child never writes to it):

    parent -> server: ``run ROOT TRIAL SEED``  server -> parent: ``pid PID``
    parent -> server: ``reap PID``             server -> parent: ``status EXITCODE``
    parent -> server: ``quit``

``serve TMPDIR`` warms up first (see :func:`warm_up`), writing a scratch checkpoint in TMPDIR.

``run ROOT TRIAL SEED`` on the command line runs one trial in this process; it prints
``started`` to stdout once the slow imports are done (the parent times the kill from there).

A trial that is not killed stops after ``MAX_SAVES`` saves and exits 0; any exception exits 1
with a traceback on stderr.
"""

from __future__ import annotations

import os
import random
import sys
import traceback
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter

MAX_SAVES = 200
STEP_STRIDE = 10000  # n = trial * STEP_STRIDE + i
HOST_CACHE = "2MiB"
CHUNK = "256KiB"
ASYNC_FRACTION = 0.7

# name -> (shape, dtype); ~2.7 MB in all, more than the 2 MiB host cache.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w0": ((512, 512), torch.float32),  # 1 MiB
    "w1": ((256, 1024), torch.float32),  # 1 MiB
    "w2": ((300, 333), torch.float32),  # ~0.4 MB, not a multiple of the chunk size
    "b_bf16": ((700, 3), torch.bfloat16),
    "idx": ((1000,), torch.int64),
    "scalar": ((), torch.float64),
}


def step_of(trial: int, i: int) -> int:
    """The step number (and directory suffix) of save ``i`` of ``trial``."""
    return trial * STEP_STRIDE + i


def content(n: int) -> dict[str, Any]:
    """The exact state saved at step ``n``: tensors from a generator seeded with ``n``."""
    g = torch.Generator().manual_seed(n)
    model: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in SHAPES.items():
        if dtype.is_floating_point:
            model[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            model[name] = torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)
    return {"model": model, "step": n}


def checkpoint_dir(root: str, n: int) -> str:
    return os.path.join(root, f"step-{n}")


def run_trial(root: str, trial: int, seed: int) -> None:
    """Saves ``MAX_SAVES`` checkpoints (or until killed), mixing async_save and save."""
    warnings.filterwarnings("ignore")  # "torch.distributed is disabled" etc.
    rng = random.Random(seed)
    writer = DataStatesWriter(root, host_cache_size=HOST_CACHE, chunk_size=CHUNK)
    params: dict[str, torch.Tensor] = content(step_of(trial, 0))["model"]
    # lr=0 and no grads: step() changes nothing, but its pre-hook is the barrier, and protect()
    # makes capture="auto" take these tensors lazily (no clone at save time).
    opt = torch.optim.SGD(list(params.values()), lr=0.0)
    writer.protect(opt)
    pending: list[Future[Any]] = []
    for i in range(MAX_SAVES):
        n = step_of(trial, i)
        if i > 0:
            opt.step()  # the barrier, through writer.protect
            writer.wait_captured()  # and explicitly
            new = content(n)["model"]
            for name, t in params.items():
                t.copy_(new[name])  # training-like in-place mutation, after the barrier
        sd = {"model": dict(params), "step": n}
        if rng.random() < ASYNC_FRACTION:
            fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=checkpoint_dir(root, n))
            assert isinstance(fut, Future)  # stage() returns a dict: a plain upload future
            pending.append(fut)
        else:
            dcp.save(sd, storage_writer=writer, checkpoint_id=checkpoint_dir(root, n))
        for f in [f for f in pending if f.done()]:
            f.result()  # a failed save fails the trial
            pending.remove(f)
    for f in pending:
        f.result()
    writer.close()


def warm_up(tmp_root: str) -> None:
    """Pays the one-time costs before forking, so a trial starts saving within milliseconds.

    The first optimizer imports torch._dynamo (~1 s) and the first save imports DCP's planner
    machinery. Uses FileSystemWriter (single-threaded) and tiny tensors: the server must still
    be a single thread when it forks (checked).
    """
    warnings.filterwarnings("ignore")
    torch.optim.SGD([torch.zeros(1)], lr=0.0)
    sd = {"t": torch.zeros(4), "step": 0}
    path = os.path.join(tmp_root, "warm-up")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=1), checkpoint_id=path)
    dcp.load(sd, checkpoint_id=path)
    content(0)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise SystemExit(f"crash_child: the fork server has {threads} threads after warm-up")


def serve(tmp_root: str) -> None:
    """The fork server loop (see the module docstring)."""
    warm_up(tmp_root)
    out = sys.stdout
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "run":
            root, trial, seed = cmd[1], int(cmd[2]), int(cmd[3])
            pid = os.fork()
            if pid == 0:  # the trial process: never returns into the loop
                code = 0
                try:
                    sys.stdin.close()
                    run_trial(root, trial, seed)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            out.write(f"pid {pid}\n")
            out.flush()
        elif cmd[0] == "reap":
            _, status = os.waitpid(int(cmd[1]), 0)
            out.write(f"status {os.waitstatus_to_exitcode(status)}\n")
            out.flush()
        elif cmd[0] == "quit":
            return
        else:
            raise SystemExit(f"crash_child: unknown command {line!r}")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "serve":
        serve(argv[1])
        return 0
    if len(argv) == 4 and argv[0] == "run":
        torch.optim.SGD([torch.zeros(1)], lr=0.0)  # imports torch._dynamo (~1 s) first
        print("started", flush=True)
        run_trial(argv[1], int(argv[2]), int(argv[3]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
