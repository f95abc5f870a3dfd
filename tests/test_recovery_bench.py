"""Keep the recovery benchmarks from rotting: ``benchmarks.recovery --quick`` (a training job
SIGKILLed and restarted in each mode) and a tiny ``benchmarks.restore_memory`` run.

No timing is asserted. What is checked: the runs succeed; the JSON is strict; every mode restarted,
resumed from the same step, no older than the newest commit recorded before the kill, and ran its
first step; our restarts read natively with every byte verified; the PNGs decode as PNGs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MODES = {"ours_fast", "ours_disk", "stock_disk"}


def _strict_json(path: Path) -> Any:
    def no_constants(name: str) -> None:
        raise ValueError(f"{path.name}: non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=no_constants)


def _run(args: list[str], timeout: float) -> None:
    import dcp_datastates

    # the dcp_datastates imported here (an installed one, with its compiled engine, in CI) before
    # the repository (benchmarks.*); run from elsewhere so the source tree does not shadow it
    pkg_parent = Path(dcp_datastates.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg_parent), str(ROOT)]),
               BENCH_DIR=os.environ.get("BENCH_DIR", "/tmp"))
    r = subprocess.run([sys.executable, "-m", *args], cwd=tempfile.gettempdir(), env=env,
                       timeout=timeout,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


def _png_ok(path: Path) -> None:
    if path.exists():  # absent only without matplotlib
        assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size < 300_000


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_recovery_quick(tmp_path: Path) -> None:
    out = tmp_path / "recovery.json"
    _run(["benchmarks.recovery", "--quick", "--out", str(out)], timeout=300)
    doc = _strict_json(out)
    assert doc["command"].startswith("python -m benchmarks.recovery")
    (trial,) = doc["trials"]
    assert {r["mode"] for r in trial["restarts"]} == MODES
    steps = {r["resumed_step"] for r in trial["restarts"]}
    assert len(steps) == 1 and min(steps) >= max(trial["committed_steps_before_kill"])
    for r in trial["restarts"]:
        assert r["restart_to_first_step_s"] >= r["start_and_import_s"] > 0
        assert r["load_s"] > 0 and r["first_step_s"] > 0
        if r["mode"] == "ours_fast":
            assert r["path"].startswith("/dev/shm/")
        else:
            assert not r["path"].startswith("/dev/shm/")
        if r["mode"].startswith("ours"):
            lr = r["last_read"]
            assert lr["stock_items"] == 0 and lr["verified_bytes"] == lr["native_bytes"] > 0
            assert lr["memory_fs"] == (r["mode"] == "ours_fast")
        else:
            assert r["last_read"] is None
    s = doc["summary"]
    assert set(s) >= MODES and s["ratio_ours_fast_over_stock_disk"] > 0
    _png_ok(out.with_suffix(".png"))
    assert not list(Path("/dev/shm").glob("recovery-*/fast/step-*"))  # cleaned up


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_restore_memory_tiny(tmp_path: Path) -> None:
    out = tmp_path / "rm.json"
    _run(["benchmarks.restore_memory", "--total-mib", "32", "--tensor-mib", "8", "--rounds", "1",
          "--out", str(out)], timeout=120)
    doc = _strict_json(out)
    assert doc["memory_fs"] is True and doc["bytes"] == 32 << 20
    assert set(doc["gb_per_s"]) == {"stock", "ours", "ours_noverify"}
    assert doc["last_read"]["ours"]["verified_bytes"] == doc["bytes"]
    assert doc["last_read"]["ours"]["direct_bytes"] == 0
    _png_ok(out.with_suffix(".png"))
