"""No native one-time initialisation off the caller's thread during saves (forksafe.py).

A thread that registers a C++ static's destructor holds glibc's atexit lock for a moment; a fork
by the training thread at that moment (a DataLoader worker) gives a child that deadlocks in its
own first registration (``torch.set_num_threads``). This was seen in CI about once in 15 runs of
the DataLoader fork test. The race itself is too narrow to hit on demand, so these tests count
its precondition: an interposed ``__cxa_atexit`` (LD_PRELOAD) records every registration made by
a thread other than the main one, and a save must make none, whether the operators come from
DCP's planning on the async executor or from the engine's copy and flush threads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef int (*real_fn)(void (*)(void*), void*, void*);
static atomic_int off_main;
static char names[4096];
static atomic_flag names_lock = ATOMIC_FLAG_INIT;

int __cxa_atexit(void (*fn)(void*), void* arg, void* dso) {
  static real_fn real;  /* a C static: no registration of its own */
  if (!real) real = (real_fn)dlsym(RTLD_NEXT, "__cxa_atexit");
  if (syscall(SYS_gettid) != getpid()) {
    atomic_fetch_add(&off_main, 1);
    Dl_info info;
    const char* what = "?";
    if (dladdr(__builtin_return_address(0), &info))
      what = info.dli_sname ? info.dli_sname : (info.dli_fname ? info.dli_fname : "?");
    while (atomic_flag_test_and_set(&names_lock)) {}
    size_t used = strlen(names);
    if (used + strlen(what) + 2 < sizeof names)
      snprintf(names + used, sizeof names - used, "%s;", what);
    atomic_flag_clear(&names_lock);
  }
  return real(fn, arg, dso);
}

int shim_off_main_count(void) { return atomic_load(&off_main); }
const char* shim_off_main_names(void) { return names; }
"""

SCRIPT = """
import ctypes, io, os, sys, torch, torch.distributed.checkpoint as dcp, warnings
warnings.simplefilter("ignore")
from dcp_datastates import DataStatesWriter
shim = ctypes.CDLL(os.environ["SHIM_PATH"])
shim.shim_off_main_names.restype = ctypes.c_char_p
root = sys.argv[1]
w = DataStatesWriter(root, host_cache_size="64MiB", chunk_size="1MiB", **KW)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
                            torch.nn.Linear(64, 8)).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, 1)
if PROTECT:
    w.protect(opt)
x = torch.randn(16, 64, dtype=torch.bfloat16)
futs = []
for step in range(3):
    model(x).float().sum().backward(); opt.step(); opt.zero_grad(); sched.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
          "extra": {"view": torch.arange(10.0)[::2], "s": "text", "b": io.BytesIO(b"abc"),
                    "i": step}}
    futs.append(dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/s{step}"))
for f in futs:
    f.result(timeout=120)
assert w.wait(timeout=120)
w.close()
print("OFF_MAIN", shim.shim_off_main_count(), shim.shim_off_main_names().decode())
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:  # the package itself builds with a C++ compiler; CI has one
        pytest.skip("no C compiler to build the __cxa_atexit interposer")
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "shim.so"), str(d / "shim.c"),
                    "-ldl"], check=True, capture_output=True)  # fmt: skip
    return d / "shim.so"


def run_counted(shim: Path, tmp_path: Path, kw: str, protect: bool,
                warm_up: bool = True) -> tuple[int, str]:
    code = textwrap.dedent(SCRIPT).replace("**KW", kw).replace("PROTECT:", f"{protect}:")
    if not warm_up:  # pretend the warm-up ran already
        code = code.replace("from dcp_datastates import DataStatesWriter",
                            "from dcp_datastates import DataStatesWriter\n"
                            "from dcp_datastates.save import forksafe\n"
                            "forksafe._done = True")  # fmt: skip
    env = dict(os.environ, LD_PRELOAD=str(shim), SHIM_PATH=str(shim))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True,
                       text=True, timeout=300, env=env, cwd=os.path.dirname(__file__))  # fmt: skip
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("OFF_MAIN"))
    _, count, *names = line.split(" ", 2)
    return int(count), "".join(names)


@pytest.mark.parametrize(
    ("kw", "protect"),
    [("", False), ("", True), ("early_flush=True", False), ('format="safetensors"', True)],
    ids=["plain", "protect", "early-flush", "safetensors"],
)
def test_saves_register_no_static_destructor_off_the_main_thread(
    shim: Path, tmp_path: Path, kw: str, protect: bool
) -> None:
    count, names = run_counted(shim, tmp_path, kw, protect)
    assert count == 0, f"{count} registrations off the main thread, by: {names}"


def test_the_interposer_sees_registrations_off_the_main_thread(shim: Path, tmp_path: Path) -> None:
    # The counter works: without the warm-up, DCP's first Tensor.is_pinned on the executor
    # thread registers a dozen destructors there (operator handles, accelerator hooks).
    count, names = run_counted(shim, tmp_path, "", False, warm_up=False)
    assert count > 0 and "is_pinned" in names, names
