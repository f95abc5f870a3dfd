"""The ``dcp-datastates`` console command: it works from any directory (a source checkout
without the built engine included, where ``python -m dcp_datastates`` cannot), the import from
such a checkout says what to do, and ``verify`` draws progress on stderr only when asked (or on
a terminal). Every child process has a timeout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import in_thread

import dcp_datastates
from dcp_datastates import DataStatesWriter

TIMEOUT_S = 60
COMMAND = Path(sys.executable).parent / "dcp-datastates"


def _shadow(tmp_path: Path) -> Path:
    """A source tree of the package without its compiled engine (a fresh clone)."""
    root = tmp_path / "clone"
    shutil.copytree(
        Path(dcp_datastates.__file__).parent,
        root / "dcp_datastates",
        ignore=shutil.ignore_patterns("_core*.so", "_core*.pyd", "__pycache__"),
    )
    return root


def _checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    with DataStatesWriter(path, host_cache_size="1MiB") as w:
        in_thread(lambda: dcp.save({"w": torch.randn(64, 64)}, storage_writer=w,
                                   checkpoint_id=path))
    return path


@pytest.mark.skipif(not COMMAND.exists(), reason="the console command is not installed")
def test_console_command_works_from_a_source_checkout(tmp_path: Path) -> None:
    clone, ckpt = _shadow(tmp_path), _checkpoint(tmp_path)
    r = subprocess.run([str(COMMAND), "--help"], capture_output=True, text=True, cwd=clone,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0 and r.stdout.startswith("usage: dcp-datastates"), r.stderr
    r = subprocess.run([str(COMMAND), "verify", str(ckpt)], capture_output=True, text=True,
                       cwd=clone, timeout=TIMEOUT_S)
    assert r.returncode == 0 and ": OK" in r.stdout, r.stderr


def test_source_checkout_import_names_the_console_command(tmp_path: Path) -> None:
    """``python -m dcp_datastates`` in a clone without the engine: a clear error, not a crash."""
    clone = _shadow(tmp_path)
    code = (
        "import sys, runpy\n"
        # an editable install's import hook would redirect to the built tree; a plain install
        # has none, so that the current directory wins, as it does for a user
        "sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in type(f).__name__"
        " and 'Redirect' not in type(f).__name__]\n"
        "sys.path.insert(0, '.')\n"
        "runpy.run_module('dcp_datastates', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code, "verify", "x"], capture_output=True,
                       text=True, cwd=clone, timeout=TIMEOUT_S)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "no built native module '_core'" in last and "`dcp-datastates` command" in last, last


def test_verify_progress_only_when_asked(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    cmd = [sys.executable, "-m", "dcp_datastates", "verify", str(ckpt)]
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr  # not a terminal
    shown = subprocess.run([*cmd, "--progress"], capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    assert shown.returncode == 0, shown.stderr
    assert "verify ckpt" in shown.stderr and "100" in shown.stderr, shown.stderr
    assert shown.stdout == quiet.stdout  # the report itself is unchanged
