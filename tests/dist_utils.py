"""Run a function on N spawned ranks joined by a gloo process group (for pytest).

Usage::

    def _body(rank: int, world_size: int, out_dir: str) -> int:
        ...  # dist is initialised (gloo, file:// rendezvous)
        return 42

    def test_x(tmp_path):
        results = run_ranks(_body, str(tmp_path), tmp_path=tmp_path)   # [42, 42]

``_body`` must be a module-level function (the ranks are started with the ``spawn``
method and import it by name) and its arguments and return value must be picklable.

Failure semantics: if any rank raises (any ``BaseException``, including DCP's
``CheckpointException``, which does not derive from ``Exception``), exits abnormally or
the whole group runs past ``timeout_s``, :class:`RankFailure` is raised in the pytest
process. Its message names every failed rank with its full traceback, the first rank to
fail first (a failure on one rank often makes the others fail in a collective, so the
first one is usually the cause). The surviving ranks are given a short grace period to
report their own errors and are then terminated.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailure", "run_ranks"]

_GRACE_S = 5.0


class RankFailure(AssertionError):
    """One or more spawned ranks failed; the message holds each rank's traceback."""


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    work_dir: str,
    args: tuple[Any, ...],
    threads_per_rank: int,
    pg_timeout_s: float,
) -> None:
    """Runs in each spawned process: init the group, call ``fn``, record the outcome."""
    work = Path(work_dir)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads_per_rank)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{work / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            result = fn(rank, world_size, *args)
        except BaseException:
            # stamp the root cause before tearing the group down makes the peers fail too
            _write_error(work, rank)
            raise
        finally:
            dist.destroy_process_group()
        with open(work / f"rank{rank}.result.tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(work / f"rank{rank}.result.tmp", work / f"rank{rank}.result")
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        if not (work / f"rank{rank}.error").exists():
            _write_error(work, rank)
        # torch's spawn wrapper only reports Exception subclasses
        raise RuntimeError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from None
    # The outcome is recorded: end the rank without interpreter teardown. Third-party state torn
    # down at exit (Accelerate's PartialState, gloo) once aborted a rank whose body had passed
    # ("terminate called without an active exception", exit code -6, in CI). Whether our own
    # writer exits cleanly is tested in dedicated subprocess tests (test_protocol, test_tiers).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write_error(work: Path, rank: int) -> None:
    text = traceback.format_exc()
    with open(work / f"rank{rank}.error.tmp", "w", encoding="utf-8") as f:
        f.write(f"{time.time():.6f}\n{text}")
    os.replace(work / f"rank{rank}.error.tmp", work / f"rank{rank}.error")


def _collect_errors(work: Path, world_size: int) -> list[tuple[float, int, str]]:
    errors = []
    for rank in range(world_size):
        path = work / f"rank{rank}.error"
        if path.exists():
            stamp, _, text = path.read_text(encoding="utf-8").partition("\n")
            errors.append((float(stamp), rank, text))
    return sorted(errors)


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    tmp_path: Path,
    world_size: int = 2,
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: a module-level function.
        args: extra picklable arguments.
        tmp_path: a fresh directory for the rendezvous file and per-rank outcomes (a
            subdirectory ``dist`` is created in it).
        world_size: number of ranks.
        timeout_s: wall-clock limit for the whole group; also bounds each collective.
        threads_per_rank: ``torch.set_num_threads`` in each rank (2 ranks x 1 thread
            fills a 2-core machine).

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        RankFailure: a rank raised, died, or the group timed out.
    """
    work = Path(tmp_path) / "dist"
    work.mkdir(parents=True, exist_ok=False)
    ctx = mp.start_processes(
        _rank_entry,
        args=(fn, world_size, str(work), args, threads_per_rank, timeout_s),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    procs = ctx.processes
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    timed_out = False
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode is not None and p.exitcode != 0 for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > _GRACE_S:
                break
            if now > deadline:
                timed_out = True
                break
            for p in procs:
                p.join(timeout=0.05)
    finally:
        terminated = {rank for rank, p in enumerate(procs) if p.is_alive()}
        for rank in terminated:
            procs[rank].terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()

    errors = _collect_errors(work, world_size)
    problems: list[str] = []
    reported = {rank for _, rank, _ in errors}
    for _, rank, text in errors:
        problems.append(f"===== rank {rank} raised =====\n{text}")
    for rank, p in enumerate(procs):
        if rank in reported:
            continue
        if rank in terminated and timed_out:
            problems.append(
                f"===== rank {rank} still running after {timeout_s:.0f}s (killed) ====="
            )
        elif rank in terminated:
            problems.append(f"===== rank {rank} terminated after another rank failed =====")
        elif p.exitcode != 0:
            problems.append(f"===== rank {rank} exited with code {p.exitcode} =====")
    if timed_out and not problems:
        problems.append(f"===== ranks timed out after {timeout_s:.0f}s =====")
    if problems:
        raise RankFailure(f"{len(problems)} of {world_size} ranks failed\n" + "\n".join(problems))

    results = []
    for rank in range(world_size):
        with open(work / f"rank{rank}.result", "rb") as f:
            results.append(pickle.load(f))  # noqa: S301 - written by our own ranks
    return results
