"""torchtitan's CheckpointManager routed through DataStatesWriter (DataStatesCheckpointManager).

The training run is a subprocess (torchtitan's asynchronous modes create a gloo group, so the
process group must be initialised), one per async_mode: save every 2 steps while training goes
on, then resume a middle checkpoint and the newest one into fresh objects, bit for bit.
examples/torchtitan_train.py (the documented config route) runs as a user would: stopped after
a checkpoint and restarted, it ends where the run that never stopped ends.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.components.checkpointer.dcp")  # CI installs it

import dcp_datastates  # noqa: E402
from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager  # noqa: E402

SCRIPT = Path(__file__).parent / "integration" / "tt_resume.py"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchtitan_train.py"
FINAL_RE = re.compile(r"final step=(\d+) param_hash=([0-9a-f]{64})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("async_mode", ["async", "disabled", "async_with_pinned_mem"])
def test_train_save_resume_bit_exact(tmp_path: Path, async_mode: str) -> None:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), async_mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]


def test_config_rejects_unknown_datastates_key() -> None:
    with pytest.raises(ValueError, match="'host_cache_sze'"):
        DataStatesCheckpointManager.Config(enable=True, datastates={"host_cache_sze": 16})
    cfg = DataStatesCheckpointManager.Config(enable=True, datastates={"host_cache_size": 2})
    assert cfg.async_mode == "async"


def _run_example(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    pkg_parent = str(Path(dcp_datastates.__file__).resolve().parents[1])  # this checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], env=env, capture_output=True, text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_example_config_route_stops_and_resumes_exactly(tmp_path: Path) -> None:
    straight = _run_example("--dump-folder", str(tmp_path / "a"), "--training.steps", "6")
    for step in (2, 4, 6):
        assert f"checkpoint at step {step} issued" in straight
        files = os.listdir(tmp_path / "a" / "checkpoint" / f"step-{step}")
        assert ".metadata" in files and "__datastates_manifest_0.json" in files, files
    # a run stopped after its step-4 checkpoint, restarted with a command-line override
    for step in (2, 4):
        shutil.copytree(tmp_path / "a" / "checkpoint" / f"step-{step}",
                        tmp_path / "b" / "checkpoint" / f"step-{step}")
    resumed = _run_example("--dump-folder", str(tmp_path / "b"), "--training.steps", "6",
                           "--checkpoint.async-mode", "disabled")
    assert "resumed from step 4" in resumed and "checkpoint at step 6 issued" in resumed
    a, b = FINAL_RE.search(straight), FINAL_RE.search(resumed)
    assert a and b and a.groups() == b.groups() and a.group(1) == "6", (straight, resumed)
