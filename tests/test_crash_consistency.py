"""Crash consistency: a process SIGKILLed at a random moment never leaves a torn checkpoint.

The child (``tests/crash_child.py``) loops over saves through a ``DataStatesWriter`` whose host
cache (2 MiB) is smaller than the state (~2.7 MB), mixing ``dcp.async_save`` (lazy capture under
``writer.protect``) and ``dcp.save``, and mutating the state in place after each barrier. The
content of the save to ``step-<n>`` is a pure function of ``n``. The parent kills the child with
SIGKILL after a random delay, from "while the writer is being created" to "several saves in",
over many trials back to back (forked from a fork server, so a trial costs no interpreter start;
a couple of trials run in a fresh interpreter too). After each kill it checks every directory the
trial left:

* a directory holding ``.metadata`` is a complete checkpoint: stock ``dcp.load`` reads it, the
  data equals ``content(n)`` bit for bit, and ``verify_checkpoint`` finds every chunk's CRC;
* any other directory is recognisably partial (``list_checkpoints`` says partial: the
  ``.datastates.incomplete`` marker is there) or holds no data at all, and ``dcp.load``
  refuses it. "No data" happens: a kill between the directory's creation and the marker's
  rename into place leaves only ``.datastates.incomplete.tmp``, which ``list_checkpoints``
  reports as *unknown*, so ``cleanup_incomplete`` leaves such directories behind (counted and
  printed; harmless to loading, but they accumulate);
* earlier trials' checkpoints are still complete, and a trial's complete checkpoints are a
  prefix of its saves (saves commit in call order).

The last ``KEEP_PER_TRIAL`` complete checkpoints of each trial are kept (the others are deleted
once checked, to bound the disk use) and re-read at the end (later trials and the cleanup did not
disturb them); ``cleanup_incomplete`` removes exactly the partial directories and no complete
one, and ``python -m dcp_datastates cleanup ROOT`` then finds nothing.

What this proves: the commit protocol (marker first, data and manifests, ``.metadata`` written
atomically last) holds at every instant at which a process can die, with saves streaming
through a cache smaller than the checkpoint and with async saves in flight. What it does not:
power loss (the page cache survives a SIGKILL, so fsync ordering is not exercised).

Knobs (environment): ``DCPDS_CRASH_TRIALS`` (forked trials, default 60), ``DCPDS_CRASH_SEED``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, zeros_like_state
from crash_child import STEP_STRIDE, checkpoint_dir, content
from torch.distributed.checkpoint.api import CheckpointException

import dcp_datastates
from dcp_datastates import verify_checkpoint
from dcp_datastates.lifecycle.checkpoints import (
    INCOMPLETE_MARKER,
    METADATA_FILE,
    CheckpointState,
    cleanup_incomplete,
    list_checkpoints,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

CHILD = Path(__file__).resolve().with_name("crash_child.py")
FORKED_TRIALS = int(os.environ.get("DCPDS_CRASH_TRIALS", "60"))
FRESH_TRIALS = 2  # trials in a fresh interpreter (~4 s each here: the torch import)
SEED = int(os.environ.get("DCPDS_CRASH_SEED", "20240607"))
MAX_DELAY_S = 0.35  # a forked trial starts saving after ~30 ms; a save takes ~35 ms here
STARTUP_FRACTION = 0.1  # share of kills aimed at the first 30 ms (writer creation, first save)
# Entries a directory may hold and still count as "no data": a kill between the directory's
# creation and the marker's rename into place.
NO_DATA_ENTRIES = {INCOMPLETE_MARKER, INCOMPLETE_MARKER + ".tmp"}
# Complete checkpoints kept per trial once verified (the rest are deleted to bound the disk use:
# a fast machine commits a few dozen 2.7 MB checkpoints per trial).
KEEP_PER_TRIAL = 2


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # the child must import dcp_datastates (and conftest-free crash_child) as this process does
    pkg_parent = str(Path(dcp_datastates.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (pkg_parent, str(CHILD.parent), env.get("PYTHONPATH", "")) if p
    )
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    return env


def _delay(rng: random.Random) -> float:
    if rng.random() < STARTUP_FRACTION:
        return rng.uniform(0.0, 0.03)
    return rng.uniform(0.03, MAX_DELAY_S)


@dataclass
class Tally:
    """What the kills left behind, over all trials."""

    trials: int = 0
    complete: int = 0
    partial: int = 0
    no_data: int = 0
    no_data_entries: Counter[str] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    kept_complete: list[Path] = field(default_factory=list)  # re-checked at the end


def _load_refused(path: Path) -> bool:
    """True if stock dcp.load raises on ``path`` (CheckpointException is a BaseException)."""
    out = _destination()
    logging.disable(logging.WARNING)  # dcp.load logs each missing metadata file with a traceback
    try:
        dcp.load(out, checkpoint_id=str(path))
    except (Exception, CheckpointException):
        return True
    finally:
        logging.disable(logging.NOTSET)
    return False


_DEST: dict[str, Any] = {}


def _destination() -> dict[str, Any]:
    """A reused dcp.load destination, zeroed (fresh 1 MiB tensors cost ms in page faults here)."""
    if not _DEST:
        _DEST.update(zeros_like_state(content(0)))
    for t in _DEST["model"].values():
        t.zero_()
    _DEST["step"] = -1
    return _DEST


def check_complete(path: Path, n: int) -> None:
    """Stock dcp.load reads ``path`` bit-exactly as ``content(n)``; every CRC matches."""
    expected = content(n)
    out = _destination()
    dcp.load(out, checkpoint_id=str(path))
    assert_state_equal(expected, out, str(path))
    rep = verify_checkpoint(str(path))
    assert rep.ok, rep.summary()
    assert rep.chunks > 0 and rep.bytes_checked > 0, rep.summary()


def check_trial(root: Path, trial: int, tally: Tally) -> None:
    """Checks every directory trial ``trial`` left under ``root`` and tallies the outcome."""
    lo, hi = trial * STEP_STRIDE, (trial + 1) * STEP_STRIDE
    listed = list_checkpoints(root)
    # Earlier trials' checkpoints are still complete (their data is re-read at the end).
    assert set(tally.kept_complete) <= {i.path for i in listed if i.complete}
    states = {i.step: i for i in listed if lo <= i.step < hi}
    dirs = sorted(p for p in root.iterdir() if p.is_dir())
    mine = [p for p in dirs if p.name.startswith("step-") and lo <= int(p.name[5:]) < hi]
    assert len(mine) == len(states), (mine, states)
    complete_steps: list[int] = []
    incomplete_steps: list[int] = []
    for p in mine:
        n = int(p.name[5:])
        assert p == Path(checkpoint_dir(str(root), n))
        info = states[n]
        if (p / METADATA_FILE).exists():
            assert info.state is CheckpointState.COMPLETE
            check_complete(p, n)
            tally.complete += 1
            complete_steps.append(n)
        else:
            entries = {e.name for e in p.iterdir()}
            if info.state is CheckpointState.PARTIAL:
                tally.partial += 1
            else:
                assert entries <= NO_DATA_ENTRIES, (
                    f"{p}: no {METADATA_FILE}, no {INCOMPLETE_MARKER}, but it holds {entries}"
                )
                tally.no_data += 1
                tally.no_data_entries[" ".join(sorted(entries)) or "(empty)"] += 1
            assert _load_refused(p), f"dcp.load accepted the uncommitted {p} ({entries})"
            incomplete_steps.append(n)
    # Saves commit in call order: the complete ones are the first saves of the trial.
    assert complete_steps == list(range(lo, lo + len(complete_steps))), complete_steps
    for n in complete_steps[:-KEEP_PER_TRIAL]:
        shutil.rmtree(checkpoint_dir(str(root), n))
    tally.kept_complete += [
        Path(checkpoint_dir(str(root), n)) for n in complete_steps[-KEEP_PER_TRIAL:]
    ]
    assert all(n > max(complete_steps, default=lo - 1) for n in incomplete_steps)
    if not mine:
        tally.phases["startup (no directory yet)"] += 1
    elif incomplete_steps:
        tally.phases["mid-save (uncommitted directory left)"] += 1
    else:
        tally.phases["between saves (all committed)"] += 1
    tally.trials += 1


class ForkServer:
    """Drives ``crash_child.py serve``: one forked trial process per ``run``."""

    def __init__(self, scratch: Path, stderr: IO[bytes], log_path: Path) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "serve", str(scratch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=_env(),
            text=True,
            bufsize=1,
        )

    def _ask(self, line: str, expect: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().split()
        if len(reply) != 2 or reply[0] != expect:
            log = self.log_path.read_text(errors="replace")[-4000:]
            raise AssertionError(f"fork server replied {reply!r} to {line!r}; its stderr:\n{log}")
        return int(reply[1])

    def run(self, root: Path, trial: int, seed: int) -> int:
        return self._ask(f"run {root} {trial} {seed}", "pid")

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


def run_fresh_trial(root: Path, trial: int, seed: int, delay: float, stderr: IO[bytes]) -> int:
    """One trial in a fresh interpreter, killed ``delay`` s after its imports finished."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), "run", str(root), str(trial), str(seed)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=_env(),
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigkill_at_random_moments_leaves_only_complete_or_partial(tmp_path: Path) -> None:
    """SIGKILL at random moments: complete checkpoints are exact, the rest partial or empty."""
    root = tmp_path / "ckpt"
    root.mkdir()
    log_path = tmp_path / "child-stderr.log"
    rng = random.Random(SEED)
    tally = Tally()
    t0 = time.perf_counter()

    def child_log() -> str:
        return log_path.read_text(errors="replace")[-4000:]

    with open(log_path, "wb") as log:
        server = ForkServer(
            tmp_path, log, log_path
        )  # imports torch in the background while fresh trials run
        try:
            for trial in range(1, FRESH_TRIALS + 1):
                status = run_fresh_trial(root, trial, rng.randrange(2**31), _delay(rng), log)
                assert status == -signal.SIGKILL, f"trial {trial}: exit {status}\n{child_log()}"
                check_trial(root, trial, tally)
            t_fresh = time.perf_counter() - t0
            for trial in range(FRESH_TRIALS + 1, FRESH_TRIALS + 1 + FORKED_TRIALS):
                delay = _delay(rng)
                pid = server.run(root, trial, rng.randrange(2**31))
                time.sleep(delay)
                os.kill(pid, signal.SIGKILL)  # not reaped yet, so the pid cannot be reused
                status = server.reap(pid)
                assert status == -signal.SIGKILL, f"trial {trial}: exit {status}\n{child_log()}"
                check_trial(root, trial, tally)
        finally:
            server.close()
    t_trials = time.perf_counter() - t0

    before = list_checkpoints(root)
    complete = {i.path for i in before if i.complete}
    partial = {i.path for i in before if i.partial}
    # Directories a kill left before (or while) the marker was written hold no data; they count
    # as partial too, so cleanup removes them as well.
    assert sorted(complete) == sorted(tally.kept_complete)
    assert len(partial) == tally.partial + tally.no_data
    removed = cleanup_incomplete(root)
    assert set(removed) == partial
    after = list_checkpoints(root)
    assert {i.path for i in after if i.complete} == complete
    assert not any(i.partial for i in after)
    unknown = [i.path for i in after if i.state is CheckpointState.UNKNOWN]
    assert not unknown, unknown
    cli = subprocess.run(
        [sys.executable, "-m", "dcp_datastates", "cleanup", str(root)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert cli.stdout.strip() == "", cli.stdout
    # Later trials and the cleanups left every complete checkpoint intact.
    for p in tally.kept_complete:
        check_complete(p, int(p.name[5:]))

    total = time.perf_counter() - t0
    print(
        f"\ncrash consistency: {tally.trials} trials ({FRESH_TRIALS} fresh interpreter, "
        f"{FORKED_TRIALS} forked), {tally.complete} complete checkpoints verified "
        f"({len(complete)} kept and re-verified at the end), "
        f"{tally.partial} partial, {tally.no_data} without data; cleanup removed {len(removed)}, "
        f"left {len(unknown)} unrecognised"
    )
    for phase, count in sorted(tally.phases.items()):
        print(f"  killed {phase}: {count}")
    for entries, count in sorted(tally.no_data_entries.items()):
        print(f"  directories without marker nor data, holding {entries}: {count}")
    print(f"  time: fresh trials {t_fresh:.1f} s, all trials {t_trials:.1f} s, total {total:.1f} s")
    assert tally.trials == FRESH_TRIALS + FORKED_TRIALS >= 50
    # Without kills that land mid-save the test proves nothing.
    assert tally.partial >= 5, tally
    assert tally.phases["mid-save (uncommitted directory left)"] >= 5, tally.phases
    assert tally.complete >= 20, tally
