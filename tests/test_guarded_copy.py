"""Background copies of lazily captured tensors are fast *and* fault-safe (guarded_copy.hpp).

A lazy source may be freed by its owner between the save call and its copy (FSDP-style
``untyped_storage().resize_(0)``). The engine copies with a guarded memcpy (a SIGSEGV handler
that turns a fault inside the copy into an error of that save), falls back to
``process_vm_readv`` when another SIGSEGV handler was installed after ours or when
``DCPDS_NO_FAULT_GUARD=1``, and must never swallow a fault anywhere else. Each case runs in a
child process: a regression would kill the process, not the test session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest

_CHILD = """
import faulthandler, warnings; warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesWriter, _core

root = {root!r}
w = DataStatesWriter(root, host_cache_size="256MiB", capture="lazy", checksums={checksums})
# A first save starts the engine (and installs the guard).
dcp.async_save({{"warm": torch.ones(4)}}, storage_writer=w, checkpoint_id=root + "/warm").result(60)
if {foreign}:
    faulthandler.enable()  # a SIGSEGV handler installed after ours: copies must not rely on ours
before = _core.copy_path_counts()
t = torch.randn(16 * 1024 * 1024)  # 64 MiB: its own mapping, unmapped when freed
keep = torch.randn(1000)
w.engine.pause_copies(True)
fut = dcp.async_save({{"t": t, "keep": keep}}, storage_writer=w, checkpoint_id=root + "/c")
t.untyped_storage().resize_(0)  # the storage is released after the save call
w.engine.pause_copies(False)
try:
    fut.result(timeout=60)
    print("SAVE SUCCEEDED")
except BaseException as e:
    msg = str(e)
    assert "'t'" in msg and "no longer readable" in msg, msg
    print("SAVE FAILED CLEANLY")
after = _core.copy_path_counts()
print("PATHS", {{k: after[k] - before[k] for k in after}})
# The writer keeps working: a later save is exact.
x = torch.arange(1 << 20, dtype=torch.float32)
dcp.async_save({{"x": x}}, storage_writer=w, checkpoint_id=root + "/d").result(60)
out = {{"x": torch.zeros_like(x)}}
dcp.load(out, checkpoint_id=root + "/d")
assert torch.equal(out["x"], x)
print("NEXT SAVE EXACT")
w.close()
"""


@pytest.mark.parametrize(
    ("case", "expected_path"),
    [("default", "guarded"), ("foreign_handler", "kernel"), ("env_off", "kernel"),
     ("no_checksums", "guarded")],
)
def test_freed_lazy_source_fails_that_save_only(
    tmp_path: Any, case: str, expected_path: str
) -> None:
    code = _CHILD.format(
        root=str(tmp_path), foreign=case == "foreign_handler", checksums=case != "no_checksums"
    )
    env = dict(os.environ)
    env.pop("DCPDS_NO_FAULT_GUARD", None)
    if case == "env_off":
        env["DCPDS_NO_FAULT_GUARD"] = "1"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "SAVE FAILED CLEANLY" in r.stdout, r.stdout
    assert "NEXT SAVE EXACT" in r.stdout
    paths = eval(r.stdout.split("PATHS", 1)[1].splitlines()[0])  # a dict literal we printed
    assert paths[expected_path] >= 1, paths
    others = {k: v for k, v in paths.items() if k != expected_path}
    assert not any(others.values()), paths
    assert not os.path.exists(tmp_path / "c" / ".metadata")
    if case == "foreign_handler":
        assert "Fatal Python error" not in r.stderr


_CRASH = """
import ctypes, faulthandler, sys, warnings; warnings.simplefilter("ignore")
if {faulthandler_first}:
    faulthandler.enable()
import torch, torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesWriter
w = DataStatesWriter({root!r}, host_cache_size="64MiB")
dcp.async_save({{"a": torch.ones(8)}}, storage_writer=w, checkpoint_id={root!r} + "/a").result(60)
print("ENGINE STARTED", flush=True)
ctypes.string_at(8)  # a genuine crash, outside any copy
print("SURVIVED", flush=True)
"""


@pytest.mark.parametrize("faulthandler_first", [False, True])
def test_faults_outside_copies_still_crash(tmp_path: Any, faulthandler_first: bool) -> None:
    code = _CRASH.format(root=str(tmp_path), faulthandler_first=faulthandler_first)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ENGINE STARTED" in r.stdout, r.stderr[-3000:]
    assert "SURVIVED" not in r.stdout
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr[-2000:])
    if faulthandler_first:  # the handler installed before ours still runs (we pass faults on)
        assert "Fatal Python error: Segmentation fault" in r.stderr, r.stderr[-2000:]
