#!/usr/bin/env python
"""The README's main job: train, checkpoint, "crash", resume, and show what checkpoints cost.

Three runs of ``examples/train_gpt.py``, each in its own process:

1. **reference**: the whole job (``--steps`` steps) without checkpoints. It gives the loop
   time without checkpoints and the final state's hashes; at every checkpoint step it also
   times a plain ``dcp.save`` of the state with torch's ``FileSystemWriter`` (left out of its
   loop time: a synchronous save's cost is its duration).
2. **crashed**: the same job with a checkpoint every ``--ckpt-every`` steps through
   ``DataStatesWriter`` (the plain ``dcp.async_save`` call, nothing else), stopped abruptly
   after step ``--stop-after`` as if the machine died, abandoning any save in flight.
3. **resumed**: the same command again. It removes partial checkpoints, loads the newest
   complete one with the stock ``dcp.load`` and trains to the end.

The reference and the checkpointing runs are *interleaved*: they take turns of
``ckpt_every / 2`` steps (``train_gpt.py --turns``), each stopping itself (SIGSTOP, every
thread, background saves included) while the other runs, and every timing leaves the stopped
time out. Whatever else the machine does lands on both sides alike, and no background work of
one run is hidden in the other's turn. How much the reference's turns varied gives the noise
of the comparison; when the difference between the two writers is within it, the summary says
that the machine was too noisy to conclude.

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
import os
import shutil
import signal
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
    noise_s: float | None = None  # uncertainty of cost_per_ckpt_s from the reference's turns
    conclusive: bool | None = None  # the two writers' costs differ by more than the noise


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


def turn_noise(reference: dict[str, Any], turn: int, n_turns: float) -> float | None:
    """Uncertainty of a per-run difference of loop times over ``n_turns`` turns of ``turn``
    steps: the standard deviation of the reference's turn durations (its first turn left out:
    warm-up) times sqrt(2 n_turns) (two runs, independent turns). None below 3 turns."""
    times = _times(reference)
    marks = sorted(s for s in times if s % turn == 0 and s > turn)
    durations = [times[b] - times[a] for a, b in zip(marks, marks[1:], strict=False)]
    if len(durations) < 3 or n_turns <= 0:
        return None
    mean = sum(durations) / len(durations)
    sd = (sum((d - mean) ** 2 for d in durations) / (len(durations) - 1)) ** 0.5
    return float(sd * (2 * n_turns) ** 0.5)


def summarize(
    reference: dict[str, Any], crashed: dict[str, Any], resumed: dict[str, Any], turn: int = 0
) -> Summary:
    """Compares the three runs' reports (``train_gpt.py --report``); pure, for tests.

    ``turn``: the steps per turn of the interleaved runs (0: not interleaved, no noise figure).
    """
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
        noise = turn_noise(reference, turn, steps / turn) if turn else None
        out.noise_s = None if noise is None else noise / n

    records = [("crashed", r) for r in crashed["saves"]] + [
        ("resumed", r) for r in resumed["saves"]
    ]
    blocked = _mean([float(r["blocked_s"]) for _, r in records])
    durable = _mean([float(r["durable_s"]) for _, r in records])
    ckpt_mb = _mean([r["bytes"] / 1e6 for _, r in records])
    fs = reference.get("fs_saves") or []
    out.fs_save_s = _mean([float(f["seconds"]) for f in fs])
    if out.noise_s is not None and out.cost_per_ckpt_s is not None and out.fs_save_s is not None:
        out.conclusive = abs(out.fs_save_s - out.cost_per_ckpt_s) > 2 * out.noise_s
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
    if out.noise_s is None:
        lines.append("  one measurement each: other processes on the machine move these figures")
    else:
        lines.append(
            f"  the runs took turns of {turn} steps; noise of the end-to-end figure: "
            f"+-{out.noise_s:.2f} s (the reference's turns varied)"
        )
        if out.conclusive and out.cost_per_ckpt_s is not None and out.fs_save_s:
            lines.append(
                f"  DataStatesWriter cost {out.cost_per_ckpt_s / out.fs_save_s:.2f}x a plain "
                "dcp.save per checkpoint"
            )
        else:
            lines.append(
                "  the machine was too noisy to conclude: the two costs differ by less than "
                "twice the noise (rerun on a quieter machine)"
            )
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


class TurnTaker:
    """One ``train_gpt.py --turns`` process: it stops itself (SIGSTOP) at each turn's end."""

    def __init__(self, name: str, args: list[str], report: Path) -> None:
        self.name = name
        self.report = report
        cmd = [sys.executable, str(TRAIN), *args, "--report", str(report)]
        self.proc = subprocess.Popen(cmd)
        self.exited = False

    def wait_turn(self, deadline: float) -> bool:
        """Waits until the process stopped (True) or exited (False); JobError past deadline."""
        while True:
            pid, status = os.waitpid(self.proc.pid, os.WUNTRACED | os.WNOHANG)
            if pid:
                if os.WIFSTOPPED(status):
                    return True
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.exited = True
                return False
            if time.monotonic() > deadline:
                raise JobError(f"the {self.name} run did not finish in time")
            time.sleep(0.002)

    def play(self, deadline: float) -> bool:
        """Continues the process for one turn; False once it exited."""
        os.kill(self.proc.pid, signal.SIGCONT)
        return self.wait_turn(deadline)

    def result(self) -> dict[str, Any]:
        if self.proc.returncode != 0:
            raise JobError(f"the {self.name} run failed with exit status {self.proc.returncode}")
        try:
            data: dict[str, Any] = json.loads(self.report.read_text())
        except (OSError, ValueError) as exc:
            raise JobError(
                f"the {self.name} run left no readable report {self.report}: {exc}"
            ) from None
        return data

    def kill(self) -> None:
        if not self.exited and self.proc.poll() is None:
            self.proc.kill()
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.wait()


def interleave(
    ref_args: list[str], ckpt_args: list[str], stop_args: list[str], reports: Path,
    timeout_s: float,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Runs the reference and the checkpointing runs in turns (see the module docstring):
    reference, crashed, then resumed once the crashed run is gone. Set-up and the resume's load
    run while the other process is stopped."""
    deadline = time.monotonic() + timeout_s
    started: list[TurnTaker] = []
    try:
        ref = TurnTaker("reference", ref_args, reports / "reference.json")
        started.append(ref)
        ref.wait_turn(deadline)
        ck = TurnTaker("crashed", [*ckpt_args, *stop_args], reports / "crashed.json")
        started.append(ck)
        ck.wait_turn(deadline)
        crashed: TurnTaker | None = None
        live = [ref, ck]
        while live:
            for t in list(live):
                if t.exited or t.play(deadline):
                    continue
                live.remove(t)
                if t is ck and crashed is None:  # the simulated crash: start the same command
                    crashed = ck
                    ck = TurnTaker("resumed", ckpt_args, reports / "resumed.json")
                    started.append(ck)
                    if ck.wait_turn(deadline):
                        live.append(ck)
        if crashed is None:
            raise JobError("the crashed run never stopped at --stop-after")
        return ref.result(), crashed.result(), ck.result()
    finally:
        for t in started:
            t.kill()


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


def sequential(
    plan: JobPlan, root: Path, reports: Path, timeout_s: float
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The three runs one after another (``--sequential``): load changes between them land on
    one side of the comparison."""
    common = ["--size", plan.size, "--steps", str(plan.steps)]
    print(
        f"== 1/3 reference: {plan.steps} steps without checkpoints, then "
        f"{plan.fs_saves} plain dcp.save of the state",
        flush=True,
    )
    reference = run(
        "reference",
        [*common, "--ckpt-every", "0", "--ckpt-dir", str(root / "reference"),
         "--fs-baseline", str(plan.fs_saves)],
        reports / "reference.json",
        timeout_s,
    )
    shutil.rmtree(root / "reference", ignore_errors=True)
    ckpt = [*common, "--ckpt-every", str(plan.ckpt_every), "--ckpt-dir", str(root)]
    print(
        f"== 2/3 train with a checkpoint every {plan.ckpt_every} steps, crash after "
        f"step {plan.stop_after}",
        flush=True,
    )
    crashed = run(
        "crashed", [*ckpt, "--stop-after", str(plan.stop_after)], reports / "crashed.json",
        timeout_s,
    )
    print("== 3/3 the same command again: resume from the newest complete checkpoint", flush=True)
    resumed = run("resumed", ckpt, reports / "resumed.json", timeout_s)
    return reference, crashed, resumed


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
        help="with --sequential: plain dcp.save calls timed after the reference run "
        f"(default {FULL.fs_saves}); interleaved runs time one at every checkpoint step",
    )
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="run the reference, crashed and resumed runs one after another (no turns)",
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
            if args.sequential:
                reference, crashed, resumed = sequential(plan, root, reports, args.timeout)
                turn = 0
            else:
                turn = max(1, plan.ckpt_every // 2)
                print(
                    f"== reference ({plan.steps} steps without checkpoints; a plain dcp.save "
                    f"timed at every {plan.ckpt_every}th step) and DataStatesWriter runs (a "
                    f"checkpoint every {plan.ckpt_every} steps, crash after step "
                    f"{plan.stop_after}, resume) taking turns of {turn} steps",
                    flush=True,
                )
                common_t = [*common, "--turns", str(turn)]
                reference, crashed, resumed = interleave(
                    [
                        *common_t, "--ckpt-every", "0", "--ckpt-dir", str(root / "reference"),
                        "--fs-every", str(plan.ckpt_every), "--log-prefix", "[reference] ",
                    ],
                    [*common_t, "--ckpt-every", str(plan.ckpt_every), "--ckpt-dir", str(root)],
                    ["--stop-after", str(plan.stop_after)],
                    reports,
                    3 * args.timeout,
                )
                shutil.rmtree(root / "reference", ignore_errors=True)
            summary = summarize(reference, crashed, resumed, turn)
    except JobError as exc:
        print(f"main_job: {exc}", file=sys.stderr)
        return 2
    print("\n".join(summary.lines))
    print(f"main job done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if summary.identical else 1


if __name__ == "__main__":
    sys.exit(main())
