"""The README's main job and its pieces, run as a user would.

- examples/train_gpt.py straight, and crashed + resumed: the run that crashes right after
  a save was issued and is then restarted must end bit-identical (same parameter and
  optimizer-state hashes, same final loss) to the run that never stopped.
- examples/main_job.py (what scripts/run_example.sh runs), in its short form, in an
  environment without numpy (the environment scripts/setup_env.sh makes has none), and its
  summary arithmetic on made-up reports.
- scripts/setup_env.sh: a rerun with unchanged sources does not rebuild, a changed source
  does (run against a copy of the sources and a fake venv whose pip only logs).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import dcp_datastates.lifecycle.checkpoints as ck

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"
FINAL_RE = re.compile(r"final_loss=(\S+) param_hash=([0-9a-f]{64}) optim_hash=([0-9a-f]{64})")
RESUMED_RE = re.compile(r"resumed from (\S+) at step (\d+)")
CKPT_LINE_RE = re.compile(r"\[ckpt\] step-\d+: [\d.]+ MB, blocked [\d.]+ ms, durable [\d.]+ s")


def _env(no_numpy: Path | None = None) -> dict[str, str]:
    """The subprocess environment; ``no_numpy``: a directory that makes numpy unimportable."""
    env = dict(os.environ)
    # the subprocess must import dcp_datastates from where this test process does
    pkg_parent = str(Path(ck.__file__).resolve().parents[1])
    first = [str(_block_numpy(no_numpy))] if no_numpy is not None else []
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (*first, pkg_parent, env.get("PYTHONPATH", "")) if p
    )
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    return env


def _block_numpy(where: Path) -> Path:
    """A ``numpy`` package that fails to import as a missing numpy does (torch copes)."""
    pkg = where / "numpy"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        'raise ModuleNotFoundError("numpy is blocked by tests/test_example.py", name="numpy")\n'
    )
    return where


class _Run:
    """A command started in ``cwd`` with :func:`_env`; :meth:`output` asserts it exited 0."""

    def __init__(self, cmd: list[str], cwd: Path, no_numpy: Path | None, what: str) -> None:
        self.what = what
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=_env(no_numpy),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def output(self, timeout: float) -> str:
        """Waits at most ``timeout`` seconds; returns stdout + stderr of a run that exited 0."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            raise AssertionError(f"{self.what} ran past {timeout:.0f} s:\n{out}") from None
        assert self.proc.returncode == 0, f"{self.what} failed ({self.proc.returncode}):\n{out}"
        return out

    def kill(self) -> None:
        """Ends the run if it is still going (a test that failed before waiting for it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def _run_ok(cmd: list[str], cwd: Path, no_numpy: Path | None, timeout: float, what: str) -> str:
    """Runs ``cmd`` in ``cwd`` with :func:`_env`; asserts exit 0; returns stdout + stderr."""
    return _Run(cmd, cwd, no_numpy, what).output(timeout)


def start_example(tmp_path: Path, *args: str, no_numpy: bool = False) -> _Run:
    """Starts the example (the machine's second core runs it beside another)."""
    cmd = [sys.executable, str(EXAMPLE), "--size", "tiny", *args]
    no_np = tmp_path / "no-numpy" if no_numpy else None
    return _Run(cmd, tmp_path, no_np, what="example")


def run_example(tmp_path: Path, *args: str, no_numpy: bool = False) -> str:
    return start_example(tmp_path, *args, no_numpy=no_numpy).output(timeout=120)


def final_of(out: str) -> tuple[str, str, str]:
    match = FINAL_RE.search(out)
    assert match, f"no final line in output:\n{out}"
    loss, param_hash, optim_hash = match.groups()
    return loss, param_hash, optim_hash


@pytest.fixture(
    params=[("datastates", "async"), ("datastates", "sync"), ("filesystem", "async")],
    ids=lambda p: "-".join(p),
)
def variant(request: pytest.FixtureRequest) -> list[str]:
    writer, mode = request.param
    if writer == "datastates":
        mod = pytest.importorskip("dcp_datastates", reason="dcp_datastates core not importable")
        if not hasattr(mod, "DataStatesWriter"):
            pytest.skip("dcp_datastates.DataStatesWriter not available yet")
    args = ["--writer", writer, "--host-cache-size", "4MiB"]
    return [*args, "--sync"] if mode == "sync" else args


def test_stop_and_resume_is_bit_identical(tmp_path: Path, variant: list[str]) -> None:
    common = ["--steps", "8", "--ckpt-every", "2", "--keep-last", "2", *variant]

    # the uninterrupted run and the one that crashes are independent: run them side by side
    straight_run = start_example(tmp_path, *common, "--ckpt-dir", "straight")
    crashed_run = start_example(tmp_path, *common, "--ckpt-dir", "resumed", "--stop-after", "6")
    try:
        straight = straight_run.output(timeout=180)
        crashed = crashed_run.output(timeout=180)
    finally:
        crashed_run.kill()
    assert "resumed from" not in straight
    assert straight.count("[ckpt] step-") == 4
    assert len(CKPT_LINE_RE.findall(straight)) == 4, straight
    root = tmp_path / "straight"
    assert ck.latest_complete(root) == root / "step-8"
    assert (root / ck.LATEST_FILE).read_text().strip() == "step-8"
    assert [i.name for i in ck.list_checkpoints(root)] == ["step-6", "step-8"]  # --keep-last 2

    # crash right after the step-6 save was issued: with async saves, step-4 is the newest
    # confirmed checkpoint (a save is confirmed before the next one starts) and latest
    # points at it; a --sync save is durable (and latest moved) before the crash
    expect = 6 if "--sync" in variant else 4
    assert "simulated crash after step 6" in crashed
    assert FINAL_RE.search(crashed) is None
    root = tmp_path / "resumed"
    assert ck.latest_complete(root) == root / f"step-{expect}"
    # what a save killed mid-flush leaves behind: the rerun must sweep it away
    leftover = root / "step-7"
    leftover.mkdir()
    (leftover / ck.INCOMPLETE_MARKER).touch()
    (leftover / "__0_0.distcp").write_bytes(b"half-written")

    resumed = run_example(tmp_path, *common, "--ckpt-dir", "resumed")
    assert f"removed partial checkpoint {Path('resumed') / 'step-7'}" in resumed
    assert not leftover.exists()
    match = RESUMED_RE.search(resumed)
    assert match, f"the rerun did not resume:\n{resumed}"
    assert int(match.group(2)) == expect

    assert final_of(resumed) == final_of(straight)
    assert ck.latest_complete(root) == root / "step-8"
    assert not any(i.partial for i in ck.list_checkpoints(root))


def test_rerun_after_finish_trains_nothing(tmp_path: Path) -> None:
    """A finished run restarted with the same --steps resumes at the end and exits."""
    args = ["--writer", "filesystem", "--steps", "4", "--ckpt-every", "2", "--ckpt-dir", "c"]
    first = run_example(tmp_path, *args)
    again = run_example(tmp_path, *args)
    assert "resumed from" in again
    assert "at step 4" in again
    assert final_of(again)[1:] == final_of(first)[1:]


def test_help(tmp_path: Path) -> None:
    out = run_example(tmp_path, "--help")
    for flag in (
        "--ckpt-dir",
        "--steps",
        "--ckpt-every",
        "--host-cache-size",
        "--keep-last",
        "--seed",
        "--stop-after",
        "--sync",
        "--size",
        "--device",
    ):
        assert flag in out


def test_example_runs_without_numpy(tmp_path: Path) -> None:
    """setup_env.sh installs torch and the package only: the example must not need numpy."""
    args = ["--steps", "4", "--ckpt-every", "2", "--ckpt-dir", "c"]
    out = run_example(tmp_path, *args, no_numpy=True)
    assert "Numpy is not available" not in out
    assert "Failed to initialize NumPy" not in out  # torch's warning is silenced
    final_of(out)  # the final hashes were computed (that is where numpy was needed)
    assert ck.latest_complete(tmp_path / "c") == tmp_path / "c" / "step-4"


# --------------------------------------------------------------------------- main job

MAIN_JOB = REPO / "examples" / "main_job.py"


def _main_job_module() -> Any:
    spec = importlib.util.spec_from_file_location("main_job", MAIN_JOB)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["main_job"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_main_job_quick_without_numpy(tmp_path: Path) -> None:
    """What .ci/run runs: the three runs, the summary, a bit-identical resume; no numpy."""
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "step-3").mkdir()  # left over from an earlier job: the job starts afresh
    out = _run_ok(
        [
            *(sys.executable, str(MAIN_JOB), "--quick", "--ckpt-dir", str(root)),
            *("--timeout", "120", "--reports-dir", str(tmp_path / "reports")),
        ],
        tmp_path,
        tmp_path / "no-numpy",
        timeout=400,
        what="main job",
    )
    assert "simulated crash after step 7" in out
    assert "resumed from" in out
    assert "final state bit-identical to the uninterrupted run: yes" in out
    assert "[dcp.save] FileSystemWriter" in out
    summary = out[out.index("== summary") :]
    for row in ("training blocked", "until durable", "cost to training, end to end"):
        assert re.search(rf"{row}\s+-?\d+\.\d+ s\s+\d+\.\d+ s", summary), summary
    # one row per durable checkpoint: step-3 and step-6 (crashed run), step-9, step-12
    assert re.findall(r"^step-(\d+) ", summary, re.M)[-2:] == ["9", "12"]
    finals = FINAL_RE.findall(out)
    assert len(finals) == 2 and finals[0] == finals[1]  # reference and resumed
    assert ck.latest_complete(root) == root / "step-12"
    assert not (root / "reference").exists()
    reports = {p.name for p in (tmp_path / "reports").iterdir()}
    assert reports == {"reference.json", "crashed.json", "resumed.json"}


def test_main_job_refuses_to_empty_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, str(MAIN_JOB), "--quick", "--ckpt-dir", str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert f"refusing to empty --ckpt-dir {tmp_path}" in proc.stderr
    assert "notes.txt" in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _reports(resumed_hash: str = "p") -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Made-up reports: 1 s per step, each checkpoint adds 0.5 s to its step's interval.

    crashed: steps 0..5, saves at 2 and 4; resumed: from step 4 to 10, saves at 6, 8, 10,
    then a 0.3 s wait at exit.
    """
    final = {"loss": "1.0", "param_hash": "p", "optim_hash": "o"}
    rec = {"bytes": 400e6, "blocked_s": 0.05, "durable_s": 1.0}
    reference = {
        "size": "medium",
        "params": 33_000_000,
        "start_step": 0,
        "step_times": [[i, float(i)] for i in range(11)],
        "saves_issued": [],
        "saves": [],
        "final": final,
        "fs_saves": [{"bytes": 400e6, "seconds": 2.0}, {"bytes": 400e6, "seconds": 3.0}],
    }
    crashed = {
        "start_step": 0,
        "step_times": [[i, i + 0.5 * sum(s <= i for s in (2, 4))] for i in range(6)],
        "saves_issued": [2, 4],
        "saves": [{"step": 2, **rec}],  # the step-4 save was in flight at the crash
        "crashed": True,
        "final": None,
    }
    resumed = {
        "start_step": 4,
        "resumed_from": "ckpt/step-4",
        "load_s": 0.2,
        "step_times": [[j, (j - 4) + 0.5 * sum(s <= j for s in (6, 8, 10))] for j in range(4, 11)],
        "saves_issued": [6, 8, 10],
        "saves": [{"step": s, **rec} for s in (6, 8, 10)],
        "exit_wait_s": 0.3,
        "final": {**final, "param_hash": resumed_hash},
    }
    return reference, crashed, resumed


def test_summary_compares_the_same_steps() -> None:
    mj = _main_job_module()
    s = mj.summarize(*_reports())
    # windows (1, 5] and (5, 10]: 9 steps; 1.0 + 1.5 s of checkpoint time + 0.3 s exit wait
    assert s.checkpoints == 5
    assert s.cost_per_ckpt_s == pytest.approx(2.8 / 5)
    assert s.fs_save_s == pytest.approx(2.5)
    assert s.identical
    text = "\n".join(s.lines)
    assert "(11.8 s - 9.0 s) / 5" in text
    assert "stock dcp.load of ckpt/step-4 in 0.20 s" in text
    assert re.search(r"cost to training, end to end\s+0\.56 s\s+2\.50 s", text), text
    assert len(re.findall(r"^step-\d+ ", text, re.M)) == 4

    differs = mj.summarize(*_reports(resumed_hash="q"))
    assert not differs.identical
    assert "bit-identical to the uninterrupted run: NO" in "\n".join(differs.lines)

    reference, crashed, resumed = _reports()
    reference["step_times"] = reference["step_times"][:7]  # the reference stopped early
    with pytest.raises(mj.JobError, match="reference run has no time for step 10"):
        mj.summarize(reference, crashed, resumed)


# --------------------------------------------------------------------------- setup_env.sh


class FakeVenv:
    """A copy of the build's sources plus a venv whose python logs pip and runs the rest.

    ``setup_env.sh`` runs from the copy (it cds to its own parent's parent); pip calls are
    logged, not run, so a test sees exactly when the script would build.
    """

    def __init__(self, tmp_path: Path) -> None:
        self.repo = tmp_path / "repo"
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
        for name in ("csrc", "dcp_datastates", "scripts"):
            shutil.copytree(REPO / name, self.repo / name, ignore=ignore)
        for name in ("CMakeLists.txt", "pyproject.toml"):
            shutil.copy2(REPO / name, self.repo / name)
        self.venv = tmp_path / "venv"
        self.log = tmp_path / "python-calls.log"
        bin_dir = self.venv / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
        python = bin_dir / "python"
        python.write_text(
            "#!/bin/sh\n"
            f'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> "{self.log}"; exit 0; fi\n'
            f'exec "{sys.executable}" "$@"\n'
        )
        python.chmod(0o755)

    def setup(self, **env: str) -> tuple[str, list[str]]:
        """Runs setup_env.sh; returns its output and the pip commands it issued."""
        self.log.write_text("")
        full = dict(os.environ)
        for key in ("DCPDS_EDITABLE", "DCPDS_FORCE_INSTALL", "PYTHONPATH"):
            full.pop(key, None)
        import torch

        full.update(
            DCPDS_VENV=str(self.venv),
            DCPDS_TORCH_VERSION=torch.__version__.split("+")[0],  # the one installed here
            **env,
        )
        proc = subprocess.run(
            ["bash", str(self.repo / "scripts" / "setup_env.sh")],
            env=full,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        return out, self.log.read_text().splitlines()


def _installs(pip_calls: list[str]) -> list[str]:
    return [c for c in pip_calls if c.endswith(" .")]


def test_setup_env_rebuilds_only_when_the_sources_change(tmp_path: Path) -> None:
    pytest.importorskip("dcp_datastates._core")  # the skip needs an installed engine
    fake = FakeVenv(tmp_path)
    out, pip = fake.setup()
    assert _installs(pip) == ["-m pip install -q ."]  # no stamp yet: build
    out, pip = fake.setup()
    assert pip == [], out  # unchanged: no pip at all (torch is the pinned version)
    assert "up to date" in out

    engine = fake.repo / "csrc" / "engine" / "engine.cpp"
    engine.write_text(engine.read_text() + "\n// changed\n")
    out, pip = fake.setup()
    assert _installs(pip) == ["-m pip install -q ."], out
    assert fake.setup()[1] == []

    # bytecode and built extensions are not sources
    (fake.repo / "dcp_datastates" / "__pycache__").mkdir(exist_ok=True)
    (fake.repo / "dcp_datastates" / "__pycache__" / "writer.cpython-311.pyc").write_bytes(b"x")
    (fake.repo / "dcp_datastates" / "_core.cpython-311-x86_64-linux-gnu.so").write_bytes(b"x")
    assert fake.setup()[1] == []

    for changed in ("dcp_datastates/save/writer.py", "CMakeLists.txt", "pyproject.toml"):
        path = fake.repo / changed
        path.write_text(path.read_text() + "\n")
        assert _installs(fake.setup()[1]) == ["-m pip install -q ."], changed
    new_file = fake.repo / "csrc" / "engine" / "extra.hpp"
    new_file.write_text("// a new header\n")
    assert _installs(fake.setup()[1]) == ["-m pip install -q ."]
    assert fake.setup()[1] == []

    # another install mode, a forced install: rebuild
    editable = fake.setup(DCPDS_EDITABLE="1")[1]
    assert _installs(editable) == ["-m pip install -q --no-build-isolation -e ."]
    assert fake.setup(DCPDS_EDITABLE="1")[1] == []
    assert _installs(fake.setup(DCPDS_FORCE_INSTALL="1")[1]) == ["-m pip install -q ."]


def test_setup_env_rebuilds_when_the_installed_engine_is_gone(tmp_path: Path) -> None:
    """A stamp that matches is not enough: the installed distribution must have its engine."""
    fake = FakeVenv(tmp_path)
    fake.setup()
    # shadow the installed distribution's metadata with one whose _core is missing
    shadow = tmp_path / "shadow"
    dist_info = shadow / "dcp_datastates-0.1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: dcp_datastates\n")
    (dist_info / "RECORD").write_text("dcp_datastates/_core.cpython-311-x86_64-linux-gnu.so,,\n")
    out, pip = fake.setup(PYTHONPATH=str(shadow))
    assert _installs(pip) == ["-m pip install -q ."], out


def test_summary_of_interleaved_runs_says_whether_the_noise_allows_a_conclusion() -> None:
    """Turns of 2 steps: the reference's turn durations give the noise; a difference between
    the writers within twice the noise is reported as inconclusive, not as a result."""
    mj = _main_job_module()
    reference, crashed, resumed = _reports()
    steady = mj.summarize(reference, crashed, resumed, turn=2)
    assert steady.noise_s == pytest.approx(0.0)  # every turn of the reference took 2 s
    assert steady.conclusive
    assert "cost 0.22x a plain dcp.save" in "\n".join(steady.lines)
    # a reference whose turns took 1 s or 3 s: the same figures no longer conclude
    reference["step_times"] = [[i, float(i + (i // 2 % 2) * 2)] for i in range(11)]
    noisy = mj.summarize(reference, crashed, resumed, turn=2)
    assert noisy.noise_s is not None and noisy.noise_s > 1.0
    assert not noisy.conclusive
    assert "too noisy to conclude" in "\n".join(noisy.lines)
