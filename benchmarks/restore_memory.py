"""Restore from memory: DataStatesReader against the stock FileSystemReader, both from tmpfs.

Saves one checkpoint with DataStatesWriter into a memory file system (``/dev/shm`` unless
``--dir``), then loads it into the same preallocated (touched) state with each reader in turn,
interleaved, ``--rounds`` times: the stock ``dcp.load(state, checkpoint_id=path)``, ours with
checksums verified (the default) and ours with ``verify=False``. Every load is checked bit for bit
(each tensor regenerated from its seed, so the source state is not held beside the target). The
same run measures the ceilings: a memory copy between two touched tensors (``memmove``,
one thread; ``memmove_thp`` between two numpy arrays, which sit on transparent huge pages),
CRC-32C of the engine over a touched tensor, and plain ``pread`` of the checkpoint's data files
into the target tensors (one thread per core, 1 MiB reads, no checksum). Writes one JSON
object (``--out``) and a PNG beside it.

    python -m benchmarks.restore_memory --total-mib 4096 --tensor-mib 64 --rounds 5 \\
           --out benchmarks/results/restore-memory/restore-memory.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

GB = 1e9
CONTENDERS = ("stock", "ours", "ours_noverify")


def _tensor(i: int, numel: int) -> Any:
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + i))


def _ceilings(dest: list[Any], data_files: list[str], threads: int) -> dict[str, float]:
    """memmove, CRC-32C and raw pread rates (GB/s) on this machine, now."""
    import torch

    from dcp_datastates import _core

    src, dst = dest[0], torch.empty_like(dest[0])
    dst.copy_(src)
    n = src.nbytes
    best: dict[str, float] = {"memmove": 0.0, "memmove_thp": 0.0, "crc32c": 0.0,
                              "pread_tmpfs": 0.0}
    import numpy as np  # numpy asks for transparent huge pages on large arrays; torch does not

    a, b = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    for _ in range(3):
        t0 = time.perf_counter()
        ctypes.memmove(b.ctypes.data, a.ctypes.data, n)
        best["memmove_thp"] = max(best["memmove_thp"], n / (time.perf_counter() - t0) / GB)
    del a, b
    for _ in range(3):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        best["memmove"] = max(best["memmove"], n / (time.perf_counter() - t0) / GB)
        t0 = time.perf_counter()
        _core.crc32c_address(src.data_ptr(), n)
        best["crc32c"] = max(best["crc32c"], n / (time.perf_counter() - t0) / GB)
    # pread of the data files into the targets' memory (reused): what the kernel copy allows.
    total = sum(os.path.getsize(p) for p in data_files)
    views = [memoryview(t.numpy()).cast("B") for t in dest]
    jobs = [(p, off) for p in data_files for off in range(0, os.path.getsize(p), 1 << 20)]

    def work(k: int) -> None:
        fds: dict[str, int] = {}
        for j in range(k, len(jobs), threads):
            p, off = jobs[j]
            fd = fds.get(p) or fds.setdefault(p, os.open(p, os.O_RDONLY))
            v = views[j % len(views)]
            start = (j * (1 << 20)) % max(1, v.nbytes - (1 << 20))
            os.preadv(fd, [v[start:start + (1 << 20)]], off)
        for fd in fds.values():
            os.close(fd)

    for _ in range(2):
        ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best["pread_tmpfs"] = max(best["pread_tmpfs"], total / (time.perf_counter() - t0) / GB)
    return best


def _plot(doc: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(CONTENDERS) + ["pread_tmpfs", "memmove"]
    labels = ["stock dcp.load", "ours (verify)", "ours (no verify)",
              "pread ceiling", "memmove (1 thread)"]
    vals = [doc["gb_per_s"][k] for k in CONTENDERS] + [doc["ceilings_gb_per_s"][k]
                                                       for k in ("pread_tmpfs", "memmove")]
    colors = ["#999999", "#1f77b4", "#6baed6", "#dddddd", "#eeeeee"]
    ax.barh(range(len(names)), vals, color=colors, edgecolor="#444444")
    for i, k in enumerate(CONTENDERS):
        rates = [doc["bytes"] / t / GB for t in doc["load_s"][k]]
        ax.plot(rates, [i] * len(rates), "k.", ms=4)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (median; dots: each round)")
    ax.set_title(f"Restore of {doc['bytes'] / GB:.1f} GB from tmpfs ({doc['tensors']} tensors)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=4096)
    ap.add_argument("--tensor-mib", type=float, default=64.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm", help="a memory file system")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    from benchmarks.report import emit_json
    from dcp_datastates import DataStatesReader, DataStatesWriter
    from dcp_datastates.restore.reader import memory_backed

    numel = int(a.tensor_mib * (1 << 20)) // 4
    count = max(1, int(a.total_mib / a.tensor_mib))
    base = tempfile.mkdtemp(prefix="restore-memory-", dir=a.dir)
    try:
        root = os.path.join(base, "ckpt")
        w = DataStatesWriter(root, host_cache_size="512MiB")
        state = {"model": {f"w{i}": _tensor(i, numel) for i in range(count)}}
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=w, checkpoint_id=root)
        w.close()
        save_s = time.perf_counter() - t0
        del state
        dest = {"model": {f"w{i}": torch.empty(numel) for i in range(count)}}
        targets = list(dest["model"].values())
        data_files = [os.path.join(root, n) for n in os.listdir(root) if n.endswith(".distcp")]
        threads = max(2, len(os.sched_getaffinity(0)))
        ceilings = _ceilings(targets, data_files, threads)
        times: dict[str, list[float]] = {k: [] for k in CONTENDERS}
        last_read: dict[str, Any] = {}
        for r in range(a.rounds):
            order = CONTENDERS[r % 3:] + CONTENDERS[:r % 3]  # rotated: drift hits all alike
            for name in order:
                for t in targets:
                    t.fill_(0.5)  # touched: page faults are not part of any load
                reader = None if name == "stock" else DataStatesReader(
                    root, verify=name == "ours")
                t0 = time.perf_counter()
                dcp.load(dest, storage_reader=reader, checkpoint_id=root, no_dist=True)
                times[name].append(time.perf_counter() - t0)
                if reader is not None:
                    last_read[name] = reader.last_read
                for i, t in enumerate(targets):
                    if not torch.equal(t, _tensor(i, numel)):
                        raise SystemExit(f"{name}: 'w{i}' differs after load")
        total_bytes = sum(t.nbytes for t in targets)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    doc: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.restore_memory", *(argv or sys.argv[1:])]),
        "dir": a.dir,
        "memory_fs": memory_backed(a.dir),
        "bytes": total_bytes,
        "tensors": count,
        "save_s": save_s,
        "load_s": times,
        "median_s": med,
        "gb_per_s": {k: total_bytes / v / GB for k, v in med.items()},
        "best_gb_per_s": {k: total_bytes / min(v) / GB for k, v in times.items()},
        "speedup_vs_stock": med["stock"] / med["ours"],
        "ceilings_gb_per_s": ceilings,
        "last_read": last_read,
        "loadavg": list(os.getloadavg()),
        "cpus": os.cpu_count(),
    }
    if a.out:
        png = _plot(doc, os.path.splitext(a.out)[0] + ".png")
        doc["png"] = os.path.basename(png) if png else None
    emit_json(doc, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
