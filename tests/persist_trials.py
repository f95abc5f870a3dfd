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

A trial that kills the trainer after its writer exists (9 in 10) forks it from a server that
imported torch once (``persist_child.py serve``): the kill is timed from the trainer's ``ready``,
so only the seconds of its interpreter start are saved; a trial that kills it in its start-up runs
it in a fresh interpreter (``--fresh``: every trial does). ``--jobs N`` runs N trials at a time:
each has its own tiers and agent and mostly waits (the trainer's pauses between saves, the
agent's start), and the load only shifts when the kills land in their work.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import filecmp
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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


class TrainerServer:
    """Drives ``persist_child.py serve``: forks trainers from an interpreter that has imported
    torch already. Safe to share between threads (one request and its reply at a time)."""

    def __init__(self, scratch: Path) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._log = scratch / "trainer-server.err"
        with open(self._log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "persist_child.py"), "serve", str(scratch)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env=dict(_env(), OPENBLAS_NUM_THREADS="1"),  # numpy's BLAS: no thread pool
                text=True, bufsize=1,
            )

    def _ask(self, line: str, expect: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline().split()
        if len(reply) != 2 or reply[0] != expect:
            log = self._log.read_text(errors="replace")[-4000:]
            raise AssertionError(f"trainer server replied {reply!r} to {line!r}; stderr:\n{log}")
        return int(reply[1])

    def start(self, out: Path, args: list[str]) -> int:
        """Forks a trainer (``persist_child.py`` ARGS, its prints to ``out``); its pid, which is
        also its process group."""
        return self._ask(f"run {out} {' '.join(args)}", "pid")

    def reap(self, pid: int) -> int:
        return self._ask(f"reap {pid}", "status")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _fresh_trainer(t: Trial, args: list[str], early: bool) -> None:
    """The trainer in a fresh interpreter; killed ``t.kill_s`` after its start if ``early``,
    else after it said ``ready``."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "persist_child.py"), *args],
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


def _forked_trainer(t: Trial, args: list[str], server: TrainerServer, out: Path) -> None:
    """The trainer forked from ``server``; killed ``t.kill_s`` after it said ``ready``."""
    pid = server.start(out, args)
    try:
        deadline = time.monotonic() + AGENT_WAIT_S
        while not (out.is_file() and out.read_bytes().endswith(b"\n")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        line = out.read_bytes().split(b"\n")[0] if out.is_file() else b""
        if not line.startswith(b"ready"):  # "ready": writer created
            t.failures.append(f"the trainer did not start: {line!r}")
        time.sleep(t.kill_s)
        os.killpg(pid, signal.SIGKILL)  # a launcher killing its worker's group
    finally:
        server.reap(pid)
        out.unlink(missing_ok=True)


def run_trial(base: Path, seed: int, server: TrainerServer | None = None) -> Trial:
    """Runs one trial under ``base`` (removed afterwards unless it failed); the trainer is forked
    from ``server`` unless the trial kills it in its start-up (or there is no server)."""
    rng = random.Random(seed)
    fast = Path("/dev/shm" if os.path.isdir("/dev/shm") else base) / f"pa-{uuid.uuid4().hex[:8]}"
    slow = base / f"slow-{seed}"
    early = rng.random() < 0.1  # killed during its start-up, before its first save
    t = Trial(seed, rng.uniform(0.0, 2.0 if early else KILL_WINDOW_S), 2 if seed % 2 else None)
    args = [str(fast), str(slow), "1", str(STEPS), str(PAUSE_S), str(t.retention or "none")]
    if early or server is None:
        _fresh_trainer(t, args, early)
    else:
        _forked_trainer(t, args, server, base / f"trainer-{seed}.out")
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


def run(
    trials: int, seed0: int = 0, base: Path | None = None, jobs: int = 1, fork: bool = True
) -> dict[str, object]:
    """Runs ``trials`` trials, ``jobs`` at a time, trainers forked from a :class:`TrainerServer`
    if ``fork`` (those killed in their start-up always start fresh); returns the summary (failed
    trials listed in full)."""
    own = base is None
    root = Path(tempfile.mkdtemp(prefix="persist-trials-")) if base is None else base
    t0 = time.monotonic()
    server = TrainerServer(root / "trainer-server") if fork else None
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(lambda i: run_trial(root, seed0 + i, server), range(trials)))
    finally:
        if server is not None:
            server.close()
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
    p.add_argument("--jobs", type=int, default=1, help="trials run at a time")
    p.add_argument("--fresh", action="store_true",
                   help="every trainer in a fresh interpreter (no fork server)")
    args = p.parse_args()
    summary = run(args.trials, args.seed, jobs=args.jobs, fork=not args.fresh)
    print(json.dumps(summary, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
