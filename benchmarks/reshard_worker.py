"""One rank of :mod:`benchmarks.reshard`, started by torchrun (never by hand)::

    python -m torch.distributed.run --standalone --nproc-per-node 16 \\
        benchmarks/reshard_worker.py --mode save --config ROOT/config.json

torchrun sets ``RANK``/``WORLD_SIZE`` and the rendezvous; the rank joins a gloo group. The
configuration file (written by the parent) names the checkpoint root, the contenders, the rounds
and the :class:`benchmarks.reshard_state.Shape`. Each rank writes its measurements to
``ROOT/results/<mode>-w<world>-r<rank>.json``.

``--mode save``: builds the seeded FSDP2 state, then per round saves it once per contender, the
order rotated by the round, each to ``ROOT/<contender>/r<round>``:

* ``ours``: ``dcp.async_save(state, storage_writer=writer, planner=dcp_datastates.planner())``,
  one ``DataStatesWriter`` per rank for the whole run (as in training), its future waited;
* ``stock``: ``dcp.async_save(state, checkpoint_id=...)``, DCP's default writer
  (``FileSystemWriter``) and staging, its future waited.

Per save: ``call_s`` (until ``async_save`` returned), ``committed_s`` (until its future
completed; ``.metadata`` is then checked to exist), the process's ``VmHWM`` over the save (reset
at the call) and its RSS at the call. ``--mode load``: for each contender (rotated per round),
a fresh target of the same structure sharded over this world (plain tensors for one rank), every
value wrong, the checkpoint's pages evicted, then the stock ``dcp.load`` (timed, ``load_s``),
``set_state_dict`` and a bit-for-bit check of every value against the seeded state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from typing import Any

if __package__ in (None, ""):
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from benchmarks import reshard_state as rs  # noqa: E402
from benchmarks.metrics import PeakRSS, evict_page_cache, release_memory, rss_bytes  # noqa: E402


def _rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def _ckpt(cfg: dict[str, Any], name: str, rnd: int) -> str:
    return os.path.join(cfg["root"], name, f"r{rnd}")


def _writers(cfg: dict[str, Any], state_bytes: int) -> dict[str, Any]:
    """One DataStatesWriter per rank for ``ours``, its host cache sized to hold one save."""
    from dcp_datastates import DataStatesWriter

    if "ours" not in cfg["contenders"]:
        return {}
    cache_mib = state_bytes * 5 // 4 // (1 << 20) + 8
    return {"ours": DataStatesWriter(os.path.join(cfg["root"], "ours"),
                                     host_cache_size=f"{cache_mib}MiB")}


def _save_once(name: str, ckpt: str, state: dict[str, Any], writers: dict[str, Any],
               peak: PeakRSS) -> dict[str, Any]:
    """One timed save of ``state`` by contender ``name``; waits for its future."""
    import dcp_datastates

    kw: dict[str, Any] = {"checkpoint_id": ckpt}
    if name == "ours":
        kw.update(storage_writer=writers["ours"], planner=dcp_datastates.planner())
    release_memory()
    rss0 = rss_bytes()
    peak.reset()
    t0 = time.perf_counter()
    fut = dcp.async_save(state, **kw)
    t1 = time.perf_counter()
    assert isinstance(fut, Future), type(fut)  # no async_stager given: a plain future
    fut.result()
    t2 = time.perf_counter()
    return {"call_s": t1 - t0, "committed_s": t2 - t0, "vmhwm_bytes": peak.peak(),
            "rss_at_call_bytes": rss0,
            "metadata": os.path.exists(os.path.join(ckpt, ".metadata"))}


def run_save(cfg: dict[str, Any], shape: rs.Shape, rank: int, world: int) -> dict[str, Any]:
    """Every round's saves on this rank; the last round's checkpoints are kept for the loads."""
    t = time.perf_counter()
    model, opt = rs.build(shape, world)
    rs.fill(model, opt, shape)
    bad = rs.mismatches(model, opt, shape)  # the premise of every later check
    state = rs.app_state(model, opt)
    nbytes = rs.local_bytes(model, opt)
    build_s = time.perf_counter() - t
    rss_base = rss_bytes()
    writers = _writers(cfg, nbytes)
    held = rss_bytes() - rss_base  # the host cache, when prefaulted (else faulted on first use)
    peak = PeakRSS()
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in cfg["contenders"]}
    for rnd in range(cfg["rounds"]):
        for name in _rotated(cfg["contenders"], rnd):
            dist.barrier()
            out[name].append(_save_once(name, _ckpt(cfg, name, rnd), state, writers, peak))
            dist.barrier()
            if rank == 0 and rnd > 0:
                shutil.rmtree(_ckpt(cfg, name, rnd - 1), ignore_errors=True)
    for w in writers.values():
        w.close()
    return {"saves": out, "state_bytes": nbytes, "build_s": build_s, "writer_held_bytes": held,
            "source_mismatches": bad[:20], "n_source_mismatches": len(bad)}


def _load_once(cfg: dict[str, Any], shape: rs.Shape, name: str, rank: int,
               world: int) -> dict[str, Any]:
    """One timed stock ``dcp.load`` of contender ``name``'s kept checkpoint, then the check."""
    model, opt = rs.build(shape, world)
    rs.scramble(model, opt)
    state = rs.app_state(model, opt)
    ckpt = _ckpt(cfg, name, cfg["rounds"] - 1)
    if rank == 0:
        evict_page_cache(ckpt)  # a restart reads the disk, not the saver's page cache
    release_memory()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=ckpt)
    t1 = time.perf_counter()
    rs.apply(model, opt, state)
    bad = rs.mismatches(model, opt, shape)
    return {"load_s": t1 - t0, "mismatches": bad[:20], "n_mismatches": len(bad),
            "n_checked": 3 * sum(1 for _ in model.parameters()),
            "bytes_checked": rs.local_bytes(model, opt)}


def run_load(cfg: dict[str, Any], shape: rs.Shape, rank: int, world: int) -> dict[str, Any]:
    """Every round's loads on this rank, contenders rotated."""
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in cfg["contenders"]}
    for rnd in range(cfg["load_rounds"]):
        for name in _rotated(cfg["contenders"], rnd):
            out[name].append(_load_once(cfg, shape, name, rank, world))
            dist.barrier()
    return {"loads": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one rank of benchmarks.reshard (run by torchrun)")
    ap.add_argument("--mode", choices=("save", "load"), required=True)
    ap.add_argument("--config", required=True, help="the JSON file the parent wrote")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    with open(a.config) as f:
        cfg = json.load(f)
    shape = rs.Shape(**cfg["shape"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        run = run_save if a.mode == "save" else run_load
        res = {"rank": rank, "world": world, **run(cfg, shape, rank, world)}
        path = os.path.join(cfg["root"], "results", f"{a.mode}-w{world}-r{rank}.json")
        with open(path, "w") as f:
            json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
