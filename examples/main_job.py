#!/usr/bin/env python
"""The README's main job: train, checkpoint, "crash", resume, and show what checkpoints cost.

Three runs of ``examples/train_gpt.py``, one after another, each in its own process:

1. **reference**: the whole job (``--steps`` steps) without checkpoints. It gives the loop
   time without checkpoints, the final state's hashes, and, after training, the cost of a
   plain ``dcp.save`` of the same state with torch's ``FileSystemWriter``.
2. **crashed**: the same job with a checkpoint every ``--ckpt-every`` steps through
   ``DataStatesWriter`` (the plain ``dcp.async_save`` call, nothing else), stopped abruptly
   after step ``--stop-after`` as if the machine died, abandoning any save in flight.
3. **resumed**: the same command again. It removes partial checkpoints, loads the newest
   complete one with the stock ``dcp.load`` and trains to the end.

Then it prints a summary: per checkpoint how long training was blocked and how long until it
was durable, what a checkpoint cost training end to end (the loop time with checkpoints
minus the loop time of the reference over the same steps, per checkpoint) next to what the
plain ``dcp.save`` costs, and whether the resumed run ended bit-identical to the reference.

The timing windows leave out the first step of each process (warm-up: allocation of the
optimizer state, first page faults, a freshly loaded state), the same steps in both runs.
The resumed run's final wait for its last checkpoint is counted, so no checkpoint's cost
falls outside the measurement. Work of a save still in flight at the crash is lost with it.

Exit status: 0 when every run succeeded and the resumed run matches the reference bit for
bit, 1 when it does not match, 2 when a run failed or the arguments are unusable.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_gpt.py"


@dataclass(frozen=True)
class JobPlan:
    """The job's shape: model size and the step schedule shared by the three runs."""

    size: str
    steps: int
    ckpt_every: int
    stop_after: int
    fs_saves: int


FULL = JobPlan(size="medium", steps=65, ckpt_every=10, stop_after=35, fs_saves=2)
QUICK = JobPlan(size="tiny", steps=12, ckpt_every=3, stop_after=7, fs_saves=1)

# What may be in a checkpoint root that this job deletes and recreates: step directories,
# the latest pointer, and the reference run's directory.
_OURS = ("latest", "reference")


class JobError(Exception):
    """A run failed or produced no usable report."""


# --------------------------------------------------------------------------- summary


@dataclass
class Summary:
    """The comparison printed at the end (all durations in seconds)."""

    lines: list[str] = field(default_factory=list)
    identical: bool = False
    checkpoints: int = 0
    cost_per_ckpt_s: float | None = None
    fs_save_s: float | None = None


def _times(report: dict[str, Any]) -> dict[int, float]:
    return {int(step): float(t) for step, t in report["step_times"]}


def _window(times: dict[int, float], first: int, last: int, what: str) -> float:
    """Loop seconds spent on steps first+1 .. last (0 for an empty window)."""
    if last <= first:
        return 0.0
    try:
        return times[last] - times[first]
    except KeyError as exc:
        raise JobError(f"the {what} run has no time for step {exc.args[0]}") from None


def _every(report: dict[str, Any]) -> str:
    issued = sorted(int(s) for s in report.get("saves_issued") or [])
    gaps = {b - a for a, b in zip(issued, issued[1:], strict=False)}
    return str(gaps.pop()) if len(gaps) == 1 else "few"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(x: float | None, unit: str = "s", digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f} {unit}"


def summarize(
    reference: dict[str, Any], crashed: dict[str, Any], resumed: dict[str, Any]
) -> Summary:
    """Compares the three runs' reports (``train_gpt.py --report``); pure, for tests."""
    out = Summary()
    ref_t, crash_t, res_t = _times(reference), _times(crashed), _times(resumed)

    # the windows: (first, last] in steps; each process's first step is left out
    crash_first = int(crashed["start_step"]) + 1
    crash_last = max(crash_t)
    res_first = int(resumed["start_step"]) + 1
    res_last = max(res_t)
    with_ckpt = (
        _window(crash_t, crash_first, crash_last, "crashed")
        + _window(res_t, res_first, res_last, "resumed")
        + float(resumed.get("exit_wait_s") or 0.0)
    )
    without = _window(ref_t, crash_first, crash_last, "reference") + _window(
        ref_t, res_first, res_last, "reference"
    )
    n = sum(1 for s in crashed["saves_issued"] if crash_first < s <= crash_last) + sum(
        1 for s in resumed["saves_issued"] if res_first < s <= res_last
    )
    steps = max(0, crash_last - crash_first) + max(0, res_last - res_first)
    out.checkpoints = n
    if n:
        out.cost_per_ckpt_s = (with_ckpt - without) / n

    records = [("crashed", r) for r in crashed["saves"]] + [
        ("resumed", r) for r in resumed["saves"]
    ]
    blocked = _mean([float(r["blocked_s"]) for _, r in records])
    durable = _mean([float(r["durable_s"]) for _, r in records])
    ckpt_mb = _mean([r["bytes"] / 1e6 for _, r in records])
    fs = reference.get("fs_saves") or []
    out.fs_save_s = _mean([float(f["seconds"]) for f in fs])
    fs_mb = _mean([f["bytes"] / 1e6 for f in fs])

    final_ref, final_res = reference.get("final"), resumed.get("final")
    out.identical = final_ref is not None and final_ref == final_res

    w, c = 32, 20
    lines = out.lines
    lines.append(
        f"== summary: GPT[{reference['size']}] {reference['params'] / 1e6:.1f} M params, "
        f"checkpoint {_fmt(ckpt_mb or fs_mb, 'MB', 1)} (weights + AdamW state), "
        f"{max(ref_t)} steps, a checkpoint every {_every(crashed)} steps"
    )
    lines.append(f"{'checkpoint':<12}{'run':<9}{'MB':>9}{'blocked ms':>12}{'durable s':>11}")
    for run, r in records:
        lines.append(
            f"{'step-' + str(r['step']):<12}{run:<9}{r['bytes'] / 1e6:>9.1f}"
            f"{r['blocked_s'] * 1e3:>12.1f}{r['durable_s']:>11.2f}"
        )
    lines.append("")
    lines.append(f"{'per checkpoint':<{w}}{'DataStatesWriter':>{c}}{'plain dcp.save':>{c}}")
    lines.append(f"{'':<{w}}{'(dcp.async_save)':>{c}}{'(FileSystemWriter)':>{c}}")
    lines.append(f"{'training blocked':<{w}}{_fmt(blocked, 's', 3):>{c}}{_fmt(out.fs_save_s):>{c}}")
    lines.append(f"{'until durable':<{w}}{_fmt(durable):>{c}}{_fmt(out.fs_save_s):>{c}}")
    lines.append(
        f"{'cost to training, end to end':<{w}}{_fmt(out.cost_per_ckpt_s):>{c}}"
        f"{_fmt(out.fs_save_s):>{c}}"
    )
    lines.append(
        f"  end to end = (loop with checkpoints - loop without) / checkpoints, over the same "
        f"{steps} steps: ({with_ckpt:.1f} s - {without:.1f} s) / {n}"
    )
    lines.append("  a plain dcp.save blocks training until it is durable: its duration is its cost")
    lines.append("  one measurement each: other processes on the machine move these figures")
    if resumed.get("resumed_from"):
        lines.append(
            f"resume: stock dcp.load of {resumed['resumed_from']} in "
            f"{_fmt(resumed.get('load_s'))}, then steps {resumed['start_step']}..{res_last}"
        )
    else:
        lines.append("resume: the second run found no complete checkpoint and started over")
    lines.append(
        "final state bit-identical to the uninterrupted run: "
        + ("yes (loss, parameter and optimizer hashes match)" if out.identical else "NO")
    )
    return out


# --------------------------------------------------------------------------- runs


def prepare_root(root: Path) -> None:
    """Empties the checkpoint root, refusing to delete anything this job did not write."""
    if root.exists():
        if not root.is_dir():
            raise JobError(f"--ckpt-dir {root} exists and is not a directory")
        foreign = [
            p.name
            for p in root.iterdir()
            if p.name not in _OURS and not (p.is_dir() and p.name.startswith("step-"))
        ]
        if foreign:
            raise JobError(
                f"refusing to empty --ckpt-dir {root}: it holds {', '.join(sorted(foreign)[:5])}, "
                "which this job did not write; pass another --ckpt-dir"
            )
        shutil.rmtree(root)
    root.mkdir(parents=True)


def run(name: str, args: list[str], report: Path, timeout_s: float) -> dict[str, Any]:
    """Runs train_gpt.py with ``args`` (output streamed), returns its JSON report."""
    cmd = [sys.executable, str(TRAIN), *args, "--report", str(report)]
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise JobError(f"the {name} run did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise JobError(f"the {name} run failed with exit status {proc.returncode}")
    try:
        data: dict[str, Any] = json.loads(report.read_text())
    except (OSError, ValueError) as exc:
        raise JobError(f"the {name} run left no readable report {report}: {exc}") from None
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"short form (CI): --size {QUICK.size} --steps {QUICK.steps} "
        f"--ckpt-every {QUICK.ckpt_every} --stop-after {QUICK.stop_after}",
    )
    ap.add_argument("--ckpt-dir", default="./checkpoints", help="checkpoint root (emptied first)")
    ap.add_argument("--size", default=None, help=f"model size (default {FULL.size})")
    ap.add_argument("--steps", type=int, default=None, help=f"default {FULL.steps}")
    ap.add_argument("--ckpt-every", type=int, default=None, help=f"default {FULL.ckpt_every}")
    ap.add_argument("--stop-after", type=int, default=None, help=f"default {FULL.stop_after}")
    ap.add_argument(
        "--fs-saves",
        type=int,
        default=None,
        help=f"plain dcp.save calls timed by the reference run (default {FULL.fs_saves})",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run")
    ap.add_argument(
        "--reports-dir",
        default=None,
        help="keep the runs' JSON reports (train_gpt.py --report) here instead of a temp dir",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = QUICK if args.quick else FULL
    plan = JobPlan(
        size=args.size or base.size,
        steps=args.steps if args.steps is not None else base.steps,
        ckpt_every=args.ckpt_every if args.ckpt_every is not None else base.ckpt_every,
        stop_after=args.stop_after if args.stop_after is not None else base.stop_after,
        fs_saves=args.fs_saves if args.fs_saves is not None else base.fs_saves,
    )
    if not (0 < plan.ckpt_every <= plan.stop_after < plan.steps):
        print(
            f"main_job: need 0 < --ckpt-every ({plan.ckpt_every}) <= --stop-after "
            f"({plan.stop_after}) < --steps ({plan.steps})",
            file=sys.stderr,
        )
        return 2
    root = Path(args.ckpt_dir)
    common = ["--size", plan.size, "--steps", str(plan.steps)]
    t0 = time.perf_counter()
    try:
        prepare_root(root)
        with tempfile.TemporaryDirectory(prefix="main-job-") as tmp:
            reports = Path(args.reports_dir or tmp)
            reports.mkdir(parents=True, exist_ok=True)
            print(
                f"== 1/3 reference: {plan.steps} steps without checkpoints, then "
                f"{plan.fs_saves} plain dcp.save of the state",
                flush=True,
            )
            reference = run(
                "reference",
                [
                    *common,
                    "--ckpt-every",
                    "0",
                    "--ckpt-dir",
                    str(root / "reference"),
                    "--fs-baseline",
                    str(plan.fs_saves),
                ],
                reports / "reference.json",
                args.timeout,
            )
            shutil.rmtree(root / "reference", ignore_errors=True)
            ckpt = [*common, "--ckpt-every", str(plan.ckpt_every), "--ckpt-dir", str(root)]
            print(
                f"== 2/3 train with a checkpoint every {plan.ckpt_every} steps, crash after "
                f"step {plan.stop_after}",
                flush=True,
            )
            crashed = run(
                "crashed",
                [*ckpt, "--stop-after", str(plan.stop_after)],
                reports / "crashed.json",
                args.timeout,
            )
            print(
                "== 3/3 the same command again: resume from the newest complete checkpoint",
                flush=True,
            )
            resumed = run("resumed", ckpt, reports / "resumed.json", args.timeout)
            summary = summarize(reference, crashed, resumed)
    except JobError as exc:
        print(f"main_job: {exc}", file=sys.stderr)
        return 2
    print("\n".join(summary.lines))
    print(f"main job done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if summary.identical else 1


if __name__ == "__main__":
    sys.exit(main())
