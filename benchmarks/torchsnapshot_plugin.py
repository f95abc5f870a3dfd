"""torchsnapshot with the ``datastates`` storage plugin against its own ``fs`` plugin.

One process (a gloo group of one: torchsnapshot's ``async_take`` needs a process group), the
synthetic states of :mod:`benchmarks.workloads` (``mixed`` and ``large`` by default). For each
state, each round runs every peer once, interleaved (fs, datastates, fs, ...), with
``Snapshot.take`` and ``Snapshot.async_take``:

* ``blocked_s``: how long the call kept the caller (``take``: all of it; ``async_take``: until it
  returned);
* ``durable_s``: from the call until the snapshot is on disk: for the datastates plugin until
  ``take`` / ``wait()`` returned (every object ``fdatasync``ed before torchsnapshot's commit); for
  the fs plugin, which does not sync, that plus an ``fsync`` of every file and directory of the
  snapshot (``benchmarks.metrics.fsync_tree``).

Each snapshot is restored once per peer and state and compared bit for bit, then removed.
Writes JSON (``--out``) and a PNG bar chart (``--plot``)::

    BENCH_DIR=/work/bench python -m benchmarks.torchsnapshot_plugin --size 1GB --rounds 3 \\
        --out tsnap.json --plot tsnap.png

Where dcp_datastates is not installed (a source tree on PYTHONPATH) the plugin's entry point is
registered for this process from pyproject.toml, so ``datastates://`` resolves as when installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

if __package__ in (None, ""):
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

PEERS = ("fs", "datastates")
MODES = ("take", "async_take")


def ensure_entry_point(tmp: str) -> bool:
    """Makes ``datastates://`` resolvable; True if a temporary registration was needed."""
    import importlib.metadata

    eps = importlib.metadata.entry_points(group="storage_plugins")
    if any(ep.name == "datastates" for ep in eps):
        return False
    info = os.path.join(tmp, "dcp_datastates_entry_points-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: dcp_datastates_entry_points\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[storage_plugins]\n"
                "datastates = dcp_datastates.integrations.torchsnapshot:storage_plugin\n")
    sys.path.append(tmp)
    return True


def one_take(
    peer: str, mode: str, root: str, app: dict[str, Any], opts: dict[str, Any]
) -> dict[str, float]:
    """One snapshot by ``peer`` with ``mode``: its blocked and durable seconds."""
    from torchsnapshot import Snapshot

    from benchmarks.metrics import fsync_tree

    url = f"datastates://{root}" if peer == "datastates" else root
    so = opts if peer == "datastates" else None
    t0 = time.perf_counter()
    if mode == "take":
        Snapshot.take(url, app, storage_options=so)
        blocked = time.perf_counter() - t0
    else:
        pending = Snapshot.async_take(url, app, storage_options=so)
        blocked = time.perf_counter() - t0
        pending.wait()
    if peer == "fs":
        fsync_tree(root)
    return {"blocked_s": blocked, "durable_s": time.perf_counter() - t0}


def check_restore(peer: str, root: str, sd: dict[str, Any]) -> None:
    """Restores ``root`` through ``peer`` into a zeroed state and compares it bit for bit."""
    import torch
    from torchsnapshot import Snapshot, StateDict

    dest = StateDict(**{k: torch.zeros_like(v) for k, v in sd.items()})
    Snapshot(f"datastates://{root}" if peer == "datastates" else root).restore({"state": dest})
    for k, v in sd.items():
        if not torch.equal(dest[k], v):
            raise SystemExit(f"{peer}: '{k}' differs after restore")


def run_state(spec_text: str, a: argparse.Namespace, base: str) -> dict[str, Any]:
    """Every round of one synthetic state; per peer and mode the samples and medians."""
    import torch
    from torchsnapshot import StateDict

    from benchmarks.workloads import SyntheticSpec, count_tensors, state_bytes, synthetic_state_dict

    spec = SyntheticSpec.parse(spec_text)
    sd = synthetic_state_dict(spec, torch.device("cpu"))
    app = {"state": StateDict(**sd)}
    opts = {"buffer_size": a.buffer, "chunk_size": a.chunk}
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        m: {p: [] for p in PEERS} for m in MODES
    }
    for r in range(a.rounds):
        for mode in MODES:
            order = PEERS if r % 2 == 0 else PEERS[::-1]
            for peer in order:
                root = os.path.join(base, f"{spec.label}-{mode}-{peer}-{r}")
                samples[mode][peer].append(one_take(peer, mode, root, app, opts))
                if r == 0 and mode == "take":
                    check_restore(peer, root, sd)
                shutil.rmtree(root)
    keys = ("blocked_s", "durable_s")
    med = {
        m: {p: {k: statistics.median(s[k] for s in samples[m][p]) for k in keys} for p in PEERS}
        for m in MODES
    }
    return {"state": spec.label, "bytes": state_bytes(sd), "tensors": count_tensors(sd),
            "samples": samples, "median": med}


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Grouped bars: per state and mode, blocked and durable seconds of each peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    labels = [f"{r['state']}\n{m}" for r in rows for m in MODES]
    for ax, key in zip(axes[0], ("blocked_s", "durable_s"), strict=True):
        for i, peer in enumerate(PEERS):
            vals = [r["median"][m][peer][key] for r in rows for m in MODES]
            xs = [j + (i - 0.5) * 0.38 for j in range(len(vals))]
            ax.bar(xs, vals, width=0.38, label=f"torchsnapshot + {peer}")
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("seconds (median)")
        ax.set_title("blocked (call returns)" if key == "blocked_s" else "until durable")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GB", help="bytes of each synthetic state")
    ap.add_argument("--mixes", default="mixed,large")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--buffer", default="256MiB", help="the plugin's host buffer")
    ap.add_argument("--chunk", default="4MiB", help="the plugin's chunk (write and CRC) size")
    ap.add_argument("--out", default="")
    ap.add_argument("--plot", default="")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from benchmarks.report import emit_json, machine_info

    base = tempfile.mkdtemp(prefix="tsnap-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        registered = ensure_entry_point(os.path.join(base, "ep"))
        machine = machine_info(base, "cpu")  # its load average: before the run
        dist.init_process_group("gloo", init_method=f"file://{base}/rdzv", rank=0, world_size=1)
        rows = [run_state(f"{a.size}:{mix}", a, base) for mix in a.mixes.split(",")]
        dist.destroy_process_group()
        doc = {
            "command": " ".join(
                ["python -m benchmarks.torchsnapshot_plugin", *(argv or sys.argv[1:])]
            ),
            "machine": machine,
            "entry_point_registered_for_the_run": registered,
            "rows": rows,
            "loadavg_end": list(os.getloadavg()),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if a.plot:
        plot(rows, a.plot)
        doc["plot"] = a.plot
    emit_json(doc, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
