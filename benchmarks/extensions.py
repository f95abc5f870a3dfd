"""Compressed checkpoints: DataStatesWriter and FileSystemWriter with the same ZStandard extension.

A compressible state of ``--mb`` MB (a third float32 weights rounded to bfloat16, whose low
halves are zero; a third small integers stored as float32, like quantized or count tensors; a
third zeros, like fresh optimizer moments), saved to a local directory by each contender
``--repeats`` times (contenders interleaved). Recorded per save: the time the call blocked the
caller, the time until durable (``dcp.save`` returned, or the ``async_save`` future completed;
both writers fsync their data before the commit), and the bytes of the data files written. The
last checkpoint of each contender is loaded with the stock ``dcp.load`` (FileSystemReader with
its default extension registry) and compared bit for bit.

Contenders: ``fs_zstd`` (``dcp.save`` with ``FileSystemWriter(_extensions=[ZStandard()])``,
``fs_zstd_t2`` the same with ``thread_count=2``), ``fs_zstd_async`` (``dcp.async_save`` with it:
the default stager copies the state first), ``ds_zstd`` and ``ds_zstd_async``
(``DataStatesWriter(_extensions=[ZStandard()])``, one writer reused), and ``ds_plain_async``
(no extension: the bytes an uncompressed checkpoint writes, for reference).

    python -m benchmarks.extensions --mb 256 --repeats 2 --out ext.json

JSON goes to ``--out`` (default ``benchmarks/results/tmp/extensions-<time>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

CONTENDERS = ("fs_zstd", "fs_zstd_t2", "fs_zstd_async", "ds_zstd", "ds_zstd_async",
              "ds_plain_async")
_TENSOR_BYTES = 8 * 2**20  # each tensor of the state (smaller for a tiny --mb)


def make_state(mb: float) -> dict[str, Any]:
    """The compressible state (see the module docstring), deterministic."""
    g = torch.Generator().manual_seed(0)
    total = int(mb * 2**20)
    per = max(4096, min(_TENSOR_BYTES, total // 12))
    n = max(3, total // per)
    numel = per // 4
    state: dict[str, Any] = {"step": 1000}
    for i in range(n):
        kind = i % 3
        if kind == 0:
            t = torch.randn(numel, generator=g).to(torch.bfloat16).float()
        elif kind == 1:
            t = torch.randint(0, 16, (numel,), generator=g).float()
        else:
            t = torch.zeros(numel)
        state[f"layer{i // 3}.{('weight', 'codes', 'exp_avg')[kind]}"] = t
    return state


def _data_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp")
    )


def _loads_exact(state: dict[str, Any], path: str) -> bool:
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}
    dcp.load(out, storage_reader=FileSystemReader(path))
    return all(
        torch.equal(out[k].view(torch.uint8), v.view(torch.uint8))
        if isinstance(v, torch.Tensor) else out[k] == v
        for k, v in state.items()
    )


def save_once(name: str, state: dict[str, Any], path: str, writer: Any) -> dict[str, float]:
    """One save by contender ``name``; returns blocked_s, durable_s and bytes."""
    t0 = time.perf_counter()
    if name.startswith("fs_"):
        w = FileSystemWriter(path, _extensions=[ZStandard()],
                             thread_count=2 if name == "fs_zstd_t2" else 1)
        if name == "fs_zstd_async":
            fut = dcp.async_save(state, storage_writer=w)
            t1 = time.perf_counter()
            fut.result()
        else:
            dcp.save(state, storage_writer=w)
            t1 = time.perf_counter()
    elif name == "ds_zstd":
        dcp.save(state, storage_writer=writer, checkpoint_id=path)
        t1 = time.perf_counter()
    else:
        fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=path)
        t1 = time.perf_counter()
        fut.result()
    t2 = time.perf_counter()
    return {"blocked_s": t1 - t0, "durable_s": t2 - t0, "bytes": _data_bytes(path)}


def run(mb: float, repeats: int, contenders: list[str], root: str, cache: str) -> dict[str, Any]:
    from dcp_datastates import DataStatesWriter

    state = make_state(mb)
    state_bytes = sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    writers: dict[str, Any] = {}
    if "ds_zstd" in contenders or "ds_zstd_async" in contenders:
        writers["zstd"] = DataStatesWriter(root, cache, _extensions=[ZStandard()])
    if "ds_plain_async" in contenders:
        writers["plain"] = DataStatesWriter(root, cache)
    per: dict[str, list[dict[str, float]]] = {c: [] for c in contenders}
    exact: dict[str, bool] = {}
    try:
        for r in range(repeats):
            for c in contenders:
                path = os.path.join(root, f"{c}-{r}")
                w = writers.get("plain" if c == "ds_plain_async" else "zstd")
                per[c].append(save_once(c, state, path, w))
                if r == repeats - 1:
                    exact[c] = _loads_exact(state, path)
                shutil.rmtree(path, ignore_errors=True)
                print(c, json.dumps(per[c][-1]), flush=True)
    finally:
        for w in writers.values():
            w.close()
    results = []
    for c in contenders:
        med = {k: statistics.median(s[k] for s in per[c]) for k in ("blocked_s", "durable_s",
                                                                    "bytes")}
        results.append({
            "contender": c,
            "saves": per[c],
            "median": med,
            "ratio": state_bytes / med["bytes"] if med["bytes"] else 0.0,
            "durable_gbps": state_bytes / med["durable_s"] / 1e9,
            "loads_bit_exact": exact.get(c, False),
        })
    return {
        "state_bytes": state_bytes,
        "tensors": sum(isinstance(v, torch.Tensor) for v in state.values()),
        "repeats": repeats,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mb", type=float, default=256, help="state size in MiB")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--cache", default="1GiB", help="DataStatesWriter host_cache_size")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DIR"),
                    help="where checkpoints go (default: a temp dir; BENCH_DIR)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        ap.error(f"unknown contenders {unknown}; known: {', '.join(CONTENDERS)}")
    if not ZStandard.is_available():
        sys.exit("benchmarks.extensions needs the zstandard package (pip install zstandard)")
    root = tempfile.mkdtemp(prefix="dcpds-ext-", dir=args.dir)
    try:
        result = run(args.mb, args.repeats, contenders, root, args.cache)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "tmp",
        f"extensions-{time.strftime('%Y%m%d-%H%M%S')}.json",
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    for r in result["results"]:
        m = r["median"]
        print(f"{r['contender']:>15}: blocked {m['blocked_s']:.3f} s, durable "
              f"{m['durable_s']:.3f} s, {m['bytes'] / 1e6:.1f} MB written "
              f"({r['ratio']:.2f}x), bit-exact {r['loads_bit_exact']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
