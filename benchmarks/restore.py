"""Restore time from a cold page cache: DataStatesReader against the stock FileSystemReader.

Saves one checkpoint with DataStatesWriter, then loads it with each reader in turn, interleaved,
``--rounds`` times. Before every load every file of the checkpoint is evicted from the page cache
(``fsync`` + ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no root). Each load goes into the
same preallocated state and is checked bit for bit. Prints (or writes with --out) one JSON object.

    BENCH_DIR=/work/bench python -m benchmarks.restore --total-mib 1024 --tensor-mib 16 --out r.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any


def evict(root: str) -> int:
    """Drops every file under ``root`` from the page cache; returns how many files."""
    n = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--tensor-mib", type=float, default=16.0)
    ap.add_argument("--small", type=int, default=0, help="extra tiny tensors (per-item cost)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="where the load targets live: cpu or cuda")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    from benchmarks.report import emit_json
    from dcp_datastates import DataStatesReader, DataStatesWriter

    numel = int(a.tensor_mib * (1 << 20)) // 4
    count = max(1, int(a.total_mib / a.tensor_mib))
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {f"w{i}": torch.randn(numel, generator=g) for i in range(count)}
    sd.update({f"s{i}": torch.randn(4, generator=g) for i in range(a.small)})
    state = {"model": sd}
    dev = torch.device(a.device)
    dest = {"model": {k: torch.zeros_like(v, device=dev) for k, v in sd.items()}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        root = os.path.join(d, "ckpt")
        w = DataStatesWriter(root, host_cache_size=f"{min(4096, a.total_mib + 64)}MiB")
        dcp.save(state, storage_writer=w, checkpoint_id=root)
        w.close()
        times: dict[str, list[float]] = {"stock": [], "datastates": []}
        for _ in range(a.rounds):
            for name in ("stock", "datastates"):
                for t in dest["model"].values():
                    t.zero_()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                evict(root)
                reader = None if name == "stock" else DataStatesReader(root, threads=a.threads)
                t0 = time.perf_counter()
                dcp.load(dest, storage_reader=reader, checkpoint_id=root, no_dist=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
                for k, v in sd.items():
                    if not torch.equal(dest["model"][k].cpu(), v):
                        raise SystemExit(f"{name}: '{k}' differs after load")
        total_bytes = sum(v.nbytes for v in sd.values())
    med = {k: statistics.median(v) for k, v in times.items()}
    doc = {
        "command": " ".join(["python -m benchmarks.restore", *(argv or sys.argv[1:])]),
        "device": str(dev),
        "bytes": total_bytes,
        "tensors": len(sd),
        "load_s": times,
        "median_s": med,
        "gb_per_s": {k: total_bytes / v / 1e9 for k, v in med.items()},
        "speedup_vs_stock": med["stock"] / med["datastates"],
    }
    emit_json(doc, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
