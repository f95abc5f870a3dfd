"""The memory bound: a save through DataStatesWriter grows the process's RSS by at most
``host_cache_size + 64 MiB``, in every capture mode, first save and later save alike.

Each (mode, state) runs in a fresh Python process (``benchmarks.memory.run_row``) so that its
``VmHWM`` holds nothing of other tests: the state is built, the RSS is read (the baseline, no
writer yet), the writer is created with a cache of 1/8 of the ``mixed`` state, and two saves
follow, the high-water mark reset just before each. Growth is the peak minus the baseline, so
the host cache itself counts. Both checkpoints are then read back with the stock ``dcp.load``
and compared bit for bit.

Sizes are chosen so that a violation cannot hide in the 64 MiB slack: the ``mixed`` state is
256 MiB with a 32 MiB cache (a copy of the state outside the cache exceeds the bound 3x), and
the ``bigtensor`` state holds one 96 MiB tensor (3x the cache).

The rows run once per module (one process per mode and state) and each test reads its row.
Nothing here is timed; every child has a timeout so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # for `benchmarks`; appended so the installed package wins

from benchmarks.memory import MODES, SAVES, STATES, MemoryRow, run_row  # noqa: E402

MiB = 1024 * 1024
STATE_BYTES = 256 * MiB  # cache = 1/8 = 32 MiB; the bigtensor state holds one 96 MiB tensor
ROW_TIMEOUT_S = 120.0

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux VmHWM reset (clear_refs)"
)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """Every row, keyed by (mode, state), each measured in its own process (two at a time:
    VmHWM is per process, and the rows wait on the disk more than on the CPU)."""
    base = tmp_path_factory.mktemp("memory_bound")

    def one(key: tuple[str, str]) -> dict[str, Any]:
        mode, state = key
        row = MemoryRow(mode, state, STATE_BYTES, 0.125, timeout_s=ROW_TIMEOUT_S, durable=False)
        return run_row(row, str(base / mode.replace(".", "_") / state), ROW_TIMEOUT_S + 60)

    keys = [(m, s) for s in STATES for m in MODES]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("mode", MODES)
def test_growth_within_cache_plus_64mib(
    rows: dict[tuple[str, str], dict[str, Any]], mode: str, state: str, save: str
) -> None:
    res = rows[(mode, state)]
    assert res["error"] is None, f"{mode}/{state}: the row failed:\n{res['error']}"
    assert res["peak_method"] == "VmHWM"
    rec = next(s for s in res["saves"] if s["save"] == save)
    assert rec["error"] is None, f"{mode}/{state} {save} save failed: {rec['error']}"
    assert res["cache_bytes"] == STATE_BYTES // 8
    assert rec["growth"] <= res["bound_bytes"], (
        f"{mode}/{state} {save} save: RSS grew {_mib(rec['growth'])} over the pre-writer "
        f"baseline, above the bound {_mib(res['bound_bytes'])} (cache "
        f"{_mib(res['cache_bytes'])} + 64 MiB) for a {_mib(res['state_bytes'])} state; "
        f"growth over the RSS just before this save: {_mib(rec['growth_vs_save'])}"
    )


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_load_bit_exact_with_stock_dcp_load(
    rows: dict[tuple[str, str], dict[str, Any]], mode: str, state: str
) -> None:
    res = rows[(mode, state)]
    assert res["error"] is None, f"{mode}/{state}: the row failed:\n{res['error']}"
    for rec in res["saves"]:
        assert rec["error"] is None, f"{mode}/{state} {rec['save']} save failed: {rec['error']}"
        v = rec["verify"]
        assert v is not None and v["tensors"] > 0, f"{mode}/{state} {rec['save']}: not verified"
        assert v["ok"], f"{mode}/{state} {rec['save']} save differs: {v['mismatches']}"


def test_bigtensor_state_holds_a_tensor_three_times_the_cache() -> None:
    """The row definitions themselves: what the bound is tested against."""
    from benchmarks.memory import build_state

    row = MemoryRow("lazy", "bigtensor", 8 * MiB)
    state = build_state(row)
    big = state["big"]
    assert big.numel() * big.element_size() == 3 * row.cache_bytes == 3 * MiB
    assert MemoryRow("lazy", "mixed", STATE_BYTES).cache_bytes == 32 * MiB
    with pytest.raises(ValueError, match="unknown mode"):
        MemoryRow("lazzy", "mixed", MiB)


_ADDRESS_SPACE_CHILD = r"""
import os, resource, sys
import torch
import torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesWriter

root, nbytes, margin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


# Everything that maps memory once per process first: the writer with its cache and threads,
# then one save of each kind (DCP's save thread, its malloc arena, lazily imported modules).
w = DataStatesWriter(root, "16MiB", chunk_size="4MiB", capture="lazy",
                     copy_threads=1, flush_threads=1)
small = {"warm": torch.ones(1024)}
dcp.async_save(small, storage_writer=w, checkpoint_id=os.path.join(root, "warm-a")).result(60)
dcp.save(small, storage_writer=w, checkpoint_id=os.path.join(root, "warm-s"))
t = torch.arange(nbytes // 4, dtype=torch.int32)  # allocated before the limit
limit = vm_size() + margin  # less room than the tensor's size
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
try:
    dcp.async_save({"t": t}, storage_writer=w, checkpoint_id=os.path.join(root, "lazy")).result(60)
    dcp.save({"t": t.view(2, -1)}, storage_writer=w, checkpoint_id=os.path.join(root, "sync"))
    assert w.wait(timeout=60)
    peak = vm_size()
finally:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
w.close()
for name, shape in (("lazy", t.shape), ("sync", (2, t.numel() // 2))):
    out = {"t": torch.zeros(shape, dtype=torch.int32)}
    dcp.load(out, checkpoint_id=os.path.join(root, name))
    assert torch.equal(out["t"].view(-1), t), name
print(f"OK limit={limit} peak={peak}")
"""


def test_save_under_an_address_space_limit_smaller_than_the_tensor(tmp_path: Path) -> None:
    """A job limited with RLIMIT_AS saves a tensor larger than the address space it has left
    (a lazy async_save and a dcp.save): building the tensor's archive header and trailer
    reserves nothing the tensor's size. Both checkpoints load bit for bit."""
    nbytes, margin = 128 * MiB, 64 * MiB
    proc = subprocess.run(
        [sys.executable, "-c", _ADDRESS_SPACE_CHILD, str(tmp_path), str(nbytes), str(margin)],
        capture_output=True, text=True, timeout=ROW_TIMEOUT_S,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
