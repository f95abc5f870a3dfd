"""torchtitan's CheckpointManager routed through DataStatesWriter (DataStatesCheckpointManager).

The training run is a subprocess (torchtitan's asynchronous modes create a gloo group, so the
process group must be initialised), one per async_mode: save every 2 steps while training goes
on, then resume a middle checkpoint and the newest one into fresh objects, bit for bit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.components.checkpointer.dcp")  # CI installs it

from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager  # noqa: E402

SCRIPT = Path(__file__).parent / "integration" / "tt_resume.py"


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
