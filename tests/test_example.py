"""Run examples/train_gpt.py as a user would: straight, and crashed + resumed.

The run that crashes right after a save was issued and is then restarted must end
bit-identical (same parameter and optimizer-state hashes, same final loss) to the run
that never stopped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dcp_datastates.checkpoints as ck

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"
FINAL_RE = re.compile(r"final_loss=(\S+) param_hash=([0-9a-f]{64}) optim_hash=([0-9a-f]{64})")
RESUMED_RE = re.compile(r"resumed from (\S+) at step (\d+)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # the subprocess must import dcp_datastates from where this test process does
    pkg_parent = str(Path(ck.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    return env


def run_example(tmp_path: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--size", "tiny", *args],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"example failed ({proc.returncode}):\n{out}"
    return out


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

    straight = run_example(tmp_path, *common, "--ckpt-dir", "straight")
    assert "resumed from" not in straight
    assert straight.count("[ckpt] step-") == 4
    if "datastates" in variant:
        assert "[writer stats]" in straight  # telemetry came from DataStatesWriter.save_stats()
    root = tmp_path / "straight"
    assert ck.latest_complete(root) == root / "step-8"
    assert (root / ck.LATEST_FILE).read_text().strip() == "step-8"
    assert [i.name for i in ck.list_checkpoints(root)] == ["step-6", "step-8"]  # --keep-last 2

    # crash right after the step-6 save was issued: with async saves, step-4 is the newest
    # confirmed checkpoint (a save is confirmed before the next one starts) and latest
    # points at it; a --sync save is durable (and latest moved) before the crash
    expect = 6 if "--sync" in variant else 4
    crashed = run_example(tmp_path, *common, "--ckpt-dir", "resumed", "--stop-after", "6")
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
