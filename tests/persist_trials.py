"""SIGKILL trials of a trainer writing with ``persist_to`` (the persistence agent).

One trial: a trainer (tests/persist_child.py, in its own process group like a launcher's worker)
saves a checkpoint every ``PAUSE_S`` to a tmpfs fast tier with ``persist_to`` a local directory
(odd trials also with ``persist_retention=2``); at a random time (before its first save, during
the saves, while the agent is still starting or copying) its whole process group gets SIGKILL.
Then, with no trainer running, the agent must finish and exit, and:

* every checkpoint complete on the fast tier (all committed before the kill) is complete on the
  persistent tier (the newest two with retention), every file bit-exact;
* ``latest`` there and ``resume_path`` pick the newest of them; nothing else there looks complete;
* nothing is left queued, no agent runs.

``python tests/persist_trials.py --trials 100`` runs them and prints a JSON summary (the numbers
of docs/configuration.md, "Recovery"); tests/test_persist_agent.py runs a few in the suite.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # as a script; last: an installed package wins
    sys.path.append(str(HERE.parent))

from dcp_datastates.lifecycle.checkpoints import (  # noqa: E402
    INCOMPLETE_MARKER,
    latest_complete,
    list_checkpoints,
)
from dcp_datastates.lifecycle.persist_client import persisted_by_agent  # noqa: E402
from dcp_datastates.lifecycle.persist_queue import AGENT_DIR, AgentDir  # noqa: E402
from dcp_datastates.lifecycle.tiers import resume_path  # noqa: E402

STEPS = 40
PAUSE_S = 0.15
KILL_WINDOW_S = 6.0  # after the trainer is ready (the agent takes seconds to start)
AGENT_WAIT_S = 120.0


@dataclass
class Trial:
    seed: int
    kill_s: float
    retention: int | None
    committed: int = 0  # complete on the fast tier after the kill
    pending_at_kill: int = 0  # of those, newer than the newest complete there at the kill
    queued_at_kill: int = 0  # requests in the agent's queue at the kill
    agent_up_at_kill: bool = False
    agent_s: float = 0.0  # from the kill until the agent exited
    failures: list[str] = field(default_factory=list)


def _env() -> dict[str, str]:
    """The trainers' environment: the dcp_datastates this process imported (an installed one,
    with its compiled engine, in CI) first, then the repository (for tests/)."""
    import dcp_datastates

    pkg_parent = str(Path(dcp_datastates.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in (pkg_parent, str(HERE.parent), env.get("PYTHONPATH", "")) if x
    )
    return env


def _complete(root: Path) -> list[str]:
    return [i.name for i in list_checkpoints(root) if i.complete]


def run_trial(base: Path, seed: int) -> Trial:
    """Runs one trial under ``base`` (removed afterwards unless it failed)."""
    rng = random.Random(seed)
    fast = Path("/dev/shm" if os.path.isdir("/dev/shm") else base) / f"pa-{uuid.uuid4().hex[:8]}"
    slow = base / f"slow-{seed}"
    early = rng.random() < 0.1  # killed during its start-up, before its first save
    t = Trial(seed, rng.uniform(0.0, 2.0 if early else KILL_WINDOW_S), 2 if seed % 2 else None)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "persist_child.py"), str(fast), str(slow), "1", str(STEPS),
         str(PAUSE_S), str(t.retention or "none")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_env(), start_new_session=True,
    )
    try:
        if not early:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "ready": imports done, writer created
            if not line.startswith(b"ready"):
                t.failures.append(f"the trainer did not start: {line!r}")
        time.sleep(t.kill_s)
        os.killpg(proc.pid, signal.SIGKILL)  # a launcher killing its worker's group
    finally:
        proc.wait()
    t0 = time.monotonic()
    t.committed = len(_complete(fast))
    newest_slow = max((i.step for i in list_checkpoints(slow) if i.complete), default=-1)
    t.pending_at_kill = sum(i.complete and i.step > newest_slow for i in list_checkpoints(fast))
    t.queued_at_kill = len(AgentDir(str(fast)).names("queue"))
    t.agent_up_at_kill = (fast / AGENT_DIR).is_dir() and AgentDir(str(fast)).agent_alive()
    if not persisted_by_agent(str(fast), AGENT_WAIT_S):
        t.failures.append("the agent did not finish")
    t.agent_s = time.monotonic() - t0
    t.failures += check(fast, slow, t.retention)
    if not t.failures:
        shutil.rmtree(fast, ignore_errors=True)
        shutil.rmtree(slow, ignore_errors=True)
    return t


def check(fast: Path, slow: Path, retention: int | None) -> list[str]:
    """What is wrong on the persistent tier, given what the fast tier holds (see the doc)."""
    bad: list[str] = []
    committed = sorted((i.step, i.name) for i in list_checkpoints(fast) if i.complete)
    expected = [n for _, n in committed][-retention:] if retention else [n for _, n in committed]
    on_slow = _complete(slow)
    if sorted(on_slow) != sorted(expected):
        bad.append(f"complete on the persistent tier {on_slow}, expected {expected}")
    for name in expected:
        a, b = fast / name, slow / name
        names = sorted(n for n in os.listdir(a) if n != INCOMPLETE_MARKER)
        if not b.is_dir() or sorted(os.listdir(b)) != names:
            bad.append(f"{name}: files {sorted(os.listdir(b)) if b.is_dir() else None} != {names}")
            continue
        _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
        if mismatch or errors:
            bad.append(f"{name}: differs in {mismatch + errors}")
    newest = expected[-1] if expected else None
    pointed = latest_complete(slow) if slow.is_dir() else None
    if (pointed.name if pointed else None) != newest:
        bad.append(f"latest_complete picks {pointed}, expected {newest}")
    resumed = resume_path(None, slow) if slow.is_dir() else None
    if (Path(resumed).name if resumed else None) != newest:
        bad.append(f"resume_path picks {resumed}, expected {newest}")
    if (fast / AGENT_DIR).is_dir():
        q = AgentDir(str(fast))
        if q.names("queue") or q.live_trainers() or q.agent_alive():
            bad.append("requests, trainers or an agent left")
    return bad


def run(trials: int, seed0: int = 0, base: Path | None = None) -> dict[str, object]:
    """Runs ``trials`` trials; returns the summary (failed trials listed in full)."""
    own = base is None
    root = Path(tempfile.mkdtemp(prefix="persist-trials-")) if base is None else base
    t0 = time.monotonic()
    results = [run_trial(root, seed0 + i) for i in range(trials)]
    failed = [asdict(r) for r in results if r.failures]
    if own and not failed:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "trials": trials,
        "failed": len(failed),
        "killed_with_copies_pending": sum(r.pending_at_kill > 0 for r in results),
        "killed_before_the_agent_was_up": sum(not r.agent_up_at_kill for r in results),
        "killed_before_any_commit": sum(r.committed == 0 for r in results),
        "checkpoints_checked": sum(r.committed for r in results),
        "pending_at_kill": sum(r.pending_at_kill for r in results),
        "killed_with_requests_queued": sum(r.queued_at_kill > 0 for r in results),
        "max_agent_s_after_kill": round(max((r.agent_s for r in results), default=0.0), 2),
        "wall_s": round(time.monotonic() - t0, 1),
        "failures": failed,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    summary = run(args.trials, args.seed)
    print(json.dumps(summary, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
