"""The memory bound of DataStatesWriter: peak RSS growth per save mode, one fresh process a row.

The promise: whatever the capture mode, a save through ``DataStatesWriter`` grows the process's
resident memory by at most ``host_cache_size + 64 MiB`` (:data:`SLACK_BYTES`), even when the
cache is much smaller than the checkpoint or than one of its tensors.

One *row* is a mode and a state:

* modes: ``dcp.save`` (synchronous, through the writer), ``auto``, ``lazy``, ``eager``
  (``dcp.async_save`` with the writer built with that ``capture``). The async rows are the plain
  call: no ``protect()``, no ``wait_captured()``; the row waits only for the upload future.
* states: ``mixed`` (the GPT-like synthetic mix, cache = ``1/8`` of it) and ``bigtensor`` (one
  tensor of 3x the cache, plus a few small ones).

Each row runs in a fresh interpreter (:func:`run_row`), so its ``VmHWM`` holds nothing of other
rows. In that process, everything is imported and the state is built first; the RSS then is the
baseline (no writer yet). The writer is created and two saves follow, the *first* and a *later*
one (after an in-place change of every tensor). Before each save the high-water mark is reset
(``5`` into ``/proc/self/clear_refs``); after the save is durable it is read. *growth* is that
peak minus the baseline, so the host cache itself is part of it. Both checkpoints are then read
back with the stock ``dcp.load`` and compared bit for bit.

Contract: :func:`run_row` never raises for a failing save; the row's JSON carries the error.
It raises ``RuntimeError`` (with the child's output) only when the child itself died or timed
out, and never leaves the child running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

MiB = 1024 * 1024
SLACK_BYTES = 64 * MiB
MODES: tuple[str, ...] = ("dcp.save", "auto", "lazy", "eager")
STATES: tuple[str, ...] = ("mixed", "bigtensor")
SAVES: tuple[str, ...] = ("first", "later")


@dataclass(frozen=True)
class MemoryRow:
    """One measured row: ``mode`` (a :data:`MODES` entry) on ``state`` (a :data:`STATES` entry).

    ``state_bytes`` is the size of the ``mixed`` state; the host cache is ``state_bytes *
    cache_fraction`` for both states, and the ``bigtensor`` state holds one tensor of 3x that.
    """

    mode: str
    state: str
    state_bytes: int
    cache_fraction: float = 0.125
    timeout_s: float = 120.0
    durable: bool = True  # the writer's fdatasync (off in tests: it costs time, not RSS)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {MODES}")
        if self.state not in STATES:
            raise ValueError(f"unknown state {self.state!r}; choose from {STATES}")

    @property
    def cache_bytes(self) -> int:
        """Host cache size, rounded down to whole MiB (the writer's unit here)."""
        return max(1, int(self.state_bytes * self.cache_fraction) // MiB) * MiB

    @property
    def name(self) -> str:
        return f"{self.mode}/{self.state}"


def build_state(row: MemoryRow, seed: int = 7) -> dict[str, Any]:
    """The row's state dict, filled deterministically from ``seed``."""
    import torch

    from benchmarks.workloads import SyntheticSpec, synthetic_state_dict

    if row.state == "mixed":
        return synthetic_state_dict(
            SyntheticSpec(row.state_bytes, "mixed"), torch.device("cpu"), seed
        )
    gen = torch.Generator().manual_seed(seed)
    big = torch.empty(3 * row.cache_bytes // 4, dtype=torch.float32).uniform_(-1, 1, generator=gen)
    state: dict[str, Any] = {"big": big}
    for i in range(8):
        state[f"small{i}"] = torch.empty(64 * 1024, dtype=torch.float32).uniform_(generator=gen)
    state["step"] = 3  # a non-tensor leaf, as in real state dicts
    return state


def _perturb(state: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.add_(1.0)


def _wait_durable(fut: Any, timeout: float) -> None:
    upload = getattr(fut, "upload_completion", fut)
    upload.result(timeout=timeout)


def measure(row: MemoryRow, ckpt_root: str) -> dict[str, Any]:
    """Runs the row in this process (call it in a fresh one); returns its JSON-able result."""
    import torch
    import torch.distributed.checkpoint as dcp

    from benchmarks.metrics import PeakRSS, release_memory, rss_bytes
    from benchmarks.verify import compare_trees, empty_like_tree
    from dcp_datastates import DataStatesWriter

    torch.set_num_threads(1)
    peak = PeakRSS()
    out: dict[str, Any] = {
        "row": asdict(row),
        "name": row.name,
        "cache_bytes": row.cache_bytes,
        "bound_bytes": row.cache_bytes + SLACK_BYTES,
        "peak_method": peak.method,
        "saves": [],
        "error": None,
    }
    state = build_state(row)
    out["state_bytes"] = sum(
        v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)
    )
    release_memory()
    rss0 = rss_bytes()  # baseline: state built, everything imported, no writer
    out["rss_baseline"] = rss0
    ckpts = [os.path.join(ckpt_root, f"save{i}") for i in range(len(SAVES))]
    writer: Any = None
    try:
        for i, label in enumerate(SAVES):
            if i > 0:
                _perturb(state)
                release_memory()
            rss_before = rss_bytes()
            peak.reset()
            if writer is None:  # created inside the first save's window: its cache counts
                capture = "auto" if row.mode == "dcp.save" else row.mode
                writer = DataStatesWriter(
                    ckpt_root,
                    host_cache_size=f"{row.cache_bytes // MiB}MiB",
                    capture=capture,
                    durable=row.durable,
                )
            rec: dict[str, Any] = {"save": label, "rss_before": rss_before, "error": None}
            t0 = time.perf_counter()
            try:
                if row.mode == "dcp.save":
                    dcp.save(state, storage_writer=writer, checkpoint_id=ckpts[i])
                    rec["call_s"] = time.perf_counter() - t0
                else:
                    fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=ckpts[i])
                    rec["call_s"] = time.perf_counter() - t0
                    _wait_durable(fut, row.timeout_s)
            except BaseException as e:  # CheckpointException derives from BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                rec["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
            rec["durable_s"] = time.perf_counter() - t0
            rec["peak"] = peak.peak()
            rec["growth"] = rec["peak"] - rss0
            rec["growth_vs_save"] = rec["peak"] - rss_before
            rec["within_bound"] = rec["growth"] <= out["bound_bytes"]
            out["saves"].append(rec)
        writer.close()
        writer = None
        # read back with the stock loader: save 0 from a fresh copy of the seed, save 1 = now
        for i, expected in enumerate((build_state(row), state)):
            rec = out["saves"][i]
            if rec["error"]:
                rec["verify"] = None
                continue
            target = empty_like_tree(expected)
            dcp.load(target, checkpoint_id=ckpts[i])
            rec["verify"] = compare_trees(expected, target).to_json()
            del target
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        out["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]
    finally:
        if writer is not None:
            try:
                writer.close()
            except BaseException as e:  # noqa: BLE001 - must not mask the first error
                out["error"] = out["error"] or f"close: {type(e).__name__}: {e}"
        peak.close()
    return out


def run_row(row: MemoryRow, ckpt_root: str, timeout_s: float | None = None) -> dict[str, Any]:
    """Runs ``row`` in a fresh Python process; returns its result (see :func:`measure`).

    The child is this file run as a script, with the repository appended to ``sys.path`` so
    that the installed ``dcp_datastates`` (with its compiled engine) is the one imported.
    """
    os.makedirs(ckpt_root, exist_ok=True)
    fd, out_path = tempfile.mkstemp(prefix="memrow_", suffix=".json", dir=ckpt_root)
    os.close(fd)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--row",
        json.dumps(asdict(row)),
        "--dir",
        ckpt_root,
        "--out",
        out_path,
    ]
    limit = timeout_s if timeout_s is not None else row.timeout_s + 60.0
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=limit, check=False, cwd=ckpt_root
        )
    except subprocess.TimeoutExpired as e:  # subprocess.run kills the child
        raise RuntimeError(f"memory row {row.name}: no result within {limit:.0f} s") from e
    try:
        with open(out_path) as f:
            text = f.read()
    finally:
        os.remove(out_path)
    if proc.returncode != 0 or not text:
        raise RuntimeError(
            f"memory row {row.name}: child exited with {proc.returncode}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    result: dict[str, Any] = json.loads(text)
    return result


def all_rows(state_bytes: int, cache_fraction: float = 0.125) -> list[MemoryRow]:
    """Every mode on every state."""
    return [MemoryRow(m, s, state_bytes, cache_fraction) for s in STATES for m in MODES]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one memory-bound row (run by run_row)")
    p.add_argument("--row", required=True, help="MemoryRow as JSON")
    p.add_argument("--dir", required=True, help="checkpoint directory of this row")
    p.add_argument("--out", required=True, help="where to write the result JSON")
    args = p.parse_args(argv)
    row = MemoryRow(**json.loads(args.row))
    res = measure(row, args.dir)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
