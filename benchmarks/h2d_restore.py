"""Restore into device tensors from a memory tier: our reader against the link's peak.

One checkpoint of a synthetic state (``benchmarks.workloads``, e.g. ``2GB:mixed``: 5,732
tensors; ``2GB:large``: 4) is saved with ``DataStatesWriter`` into ``--dir`` (default
``/dev/shm``, a memory tier; a disk directory whose files are in the page cache works the same
way: every round reads the files once before it starts; a ``--dir`` without room for twice the
state falls back to ``$BENCH_DIR`` or the temporary directory, and ``dir`` in the output says
which was used). Then, interleaved over ``--rounds``,
each contender fills the same preallocated state on ``--device`` and waits for the last byte:

* ``pinned_h2d``: ``dst.copy_(src, non_blocking=True)`` from preallocated pinned host tensors,
  then one ``torch.cuda.synchronize()``: the host-to-device peak torch reaches here (no file is
  read at all);
* ``datastates``: ``dcp.load`` with ``DataStatesReader``: whole, contiguous device targets are
  read through the native device path (pinned staging, reads overlapped with the copies; the
  reader is kept across rounds, so its staging is set up in the first round only, whose time
  is reported as ``first_s``);
* ``datastates_temporaries``: the same reader with ``device_reads=False`` (pinned temporaries and
  ``copy_``), the path the device path replaces;
* ``stock``: ``dcp.load`` with the stock ``FileSystemReader``.

Every load is checked bit for bit (on the device). Prints (or writes with --out) one JSON object:
times, medians, GB/s, each contender's ratio to ``pinned_h2d``, the reader's ``last_read``, and
for our reader the data phase alone (``read_data_s``: its ``read_data``, without DCP's planning,
which grows with the number of tensors) with its ratio to ``pinned_h2d`` (``data_x_pinned_h2d``).
``--device cpu`` is a dry run (``pinned_h2d`` is then a plain host copy).

    python -m benchmarks.h2d_restore --device cuda --state 2GB:mixed --rounds 3
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

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

CONTENDERS = "pinned_h2d,datastates,datastates_temporaries,stock"


def _warm(root: str) -> None:
    """Reads every file under ``root`` once (into the page cache where it is not in memory)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(64 << 20):
                    pass


def _run_one(name: str, root: str, dest: dict[str, Any], pinned: dict[str, Any],
             sync: Any, readers: dict[str, Any]) -> dict[str, int]:
    """One contender's load into ``dest``; returns the reader's last_read (or {}). Our readers
    are kept across rounds (``readers``), as a job reloading keeps its reader: the device
    path's staging is allocated and registered at the first load only."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader

    if name == "pinned_h2d":
        for k, t in dest["model"].items():
            t.copy_(pinned[k], non_blocking=True)
        sync()
        return {}
    reader: Any = None
    if name in ("datastates", "datastates_temporaries"):
        reader = readers.get(name)
        if reader is None:
            reader = readers[name] = DataStatesReader(
                root, device_reads=name == "datastates")
    elif name != "stock":
        raise ValueError(f"unknown contender {name!r}")
    dcp.load(dest, storage_reader=reader, checkpoint_id=root, no_dist=True)
    sync()
    return dict(reader.last_read) if reader is not None else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--state", default="2GB:mixed", help="synthetic state SIZE:MIX")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoint is written")
    ap.add_argument("--contenders", default=CONTENDERS)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    from benchmarks.report import emit_json
    from benchmarks.workloads import SyntheticSpec, synthetic_state_dict
    from dcp_datastates import DataStatesWriter

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host = synthetic_state_dict(SyntheticSpec.parse(a.state), torch.device("cpu"))
    nbytes = sum(t.nbytes for t in host.values())
    pinned = {k: v.pin_memory() if cuda else v for k, v in host.items()}
    dest = {"model": {k: torch.empty_like(v, device=dev) for k, v in host.items()}}
    names = [c for c in a.contenders.split(",") if c]
    times: dict[str, list[float]] = {c: [] for c in names}
    data_s: dict[str, list[float]] = {c: [] for c in names if c.startswith("datastates")}
    reads: dict[str, dict[str, int]] = {}
    errors: dict[str, str] = {}
    readers: dict[str, Any] = {}
    where = a.dir
    if shutil.disk_usage(where).free < 2 * nbytes + (256 << 20):  # a small /dev/shm (containers)
        where = os.environ.get("BENCH_DIR") or tempfile.gettempdir()
        print(f"h2d_restore: {a.dir} has too little room; using {where} (the page cache)",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=where) as d:
        root = os.path.join(d, "ckpt")
        w = DataStatesWriter(root, host_cache_size=f"{nbytes // (1 << 20) + 256}MiB")
        dcp.save({"model": host}, storage_writer=w, checkpoint_id=root)
        w.close()
        for r in range(a.rounds):
            _warm(root)
            for name in names[r % len(names):] + names[: r % len(names)]:
                if name in errors:
                    continue
                for t in dest["model"].values():
                    t.zero_()
                sync()
                t0 = time.perf_counter()
                try:
                    reads[name] = _run_one(name, root, dest, pinned, sync, readers)
                except Exception as e:  # noqa: BLE001 - a contender's failure is a result
                    errors[name] = f"{type(e).__name__}: {e}"[:500]
                    continue
                times[name].append(time.perf_counter() - t0)
                if name in data_s:
                    data_s[name].append(reads[name]["read_data_us"] / 1e6)
                bad = [k for k, v in host.items() if not torch.equal(dest["model"][k].cpu(), v)]
                if bad:
                    errors[name] = f"{len(bad)} tensors differ after the load, first '{bad[0]}'"
    med = {k: statistics.median(v) for k, v in times.items() if v}
    peak = med.get("pinned_h2d")
    doc = {
        "command": " ".join(["python -m benchmarks.h2d_restore",
                             *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "dir": where,
        "bytes": nbytes,
        "tensors": len(host),
        "times_s": times,
        "median_s": med,
        "first_s": {k: v[0] for k, v in times.items() if v},
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "x_pinned_h2d": {k: peak / v for k, v in med.items()} if peak else {},
        "read_data_s": {k: statistics.median(v) for k, v in data_s.items() if v},
        "data_x_pinned_h2d": {k: peak / statistics.median(v) for k, v in data_s.items()
                              if v and peak},
        "last_read": reads,
        "errors": errors,
    }
    emit_json(doc, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
