"""The coordinator's global planning at scale: DCP's DefaultSavePlanner against ours.

``create_global_plan`` is what the coordinator of every ``dcp.save`` runs while every other rank
waits: it turns all ranks' local plans into their global plans and the checkpoint's metadata.
This times it for DCP's ``DefaultSavePlanner`` and for ``DataStatesSavePlanner``
(docs/planning.md), on the local plans the coordinator receives for FSDP-style row sharding
(DTensor ``Shard(0)``: one chunk per rank per tensor, uneven last shards, empty ones at the end):

* ``70b``: a 70B-like model (80 layers x (attention q, k, v, o + MLP gate, up, down + 2 norms),
  embeddings, final norm, LM head), each with its parameter, ``exp_avg`` and ``exp_avg_sq``, plus
  3 bytes items on every rank (deduplicated onto one): 2,172 items per rank;
* ``small``: the first 33 of those tensors with their two AdamW states, plus 1 bytes item: 100.

The plans are what the coordinator gets: each rank's plan as our writer sends it (the wire form
of ``dcp_datastates/save/wire.py``), pickled and unpickled; ours carry their structure key
(``plan_cache.KeyedPlannerData``), DCP's the planner data alone. Per layout and rank count:

* ``first``: the first save (nothing cached). DCP's with ``enable_plan_caching`` off (what
  ``dcp.save`` does by default), ours with its default (caching on: the cost of keying included);
* ``cached``: a repeated save of the same structure, every rank sending a reference instead of
  its plan: DCP's with ``enable_plan_caching=True`` (its cache filled with the same plans, by its
  own first planning or, where that would take too long, by ours: the cached path does not read
  how), ours by default;
* ``rank_key_ms``, ``rank_token_ms``: what caching adds on every rank, in parallel (hashing its
  local plan; reading what the global plan kept of it), on a few ranks.

DCP's first planning runs only at the rank counts given by ``--stock-ranks`` (it grows with
ranks squared: hours at 4,096 x 2,172 items); where it runs, the results are checked equal
(plans, index hints, metadata). Wall and CPU (this process) seconds, the best of ``--repeat``
runs (1 for DCP's first planning). The garbage collector is on, as in a plain ``dcp.save``
(ours pauses it while it plans; DataStatesWriter pauses it around DCP's planning whatever the
planner): ``--gc off`` disables it for both.

    python -m benchmarks.global_plan --layout 70b --ranks 256 1024 2048 4096 \\
        --stock-ranks 256 512 --out benchmarks/results/global-plan/70b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import pickle
import platform
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

Layout = list[tuple[str, tuple[int, ...]]]

_STOCK_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
                 "_cached_metadata", "_cached_final_save_plan")


def _params_70b(layers: int = 80, h: int = 8192, inter: int = 28672, kv: int = 1024,
                vocab: int = 128256) -> Layout:
    out: Layout = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def layout(name: str) -> tuple[Layout, int]:
    """The tensors (name, shape) and the number of bytes items of a layout."""
    params = _params_70b()
    n_bytes = 3
    if name == "small":
        params, n_bytes = params[:33], 1
    elif name != "70b":
        raise ValueError(name)
    tensors = [("model." + f, s) for f, s in params]
    for f, s in params:
        tensors += [(f"optim.state.{f}.exp_avg", s), (f"optim.state.{f}.exp_avg_sq", s)]
    return tensors, n_bytes


def rank_plan(rank: int, world: int, tensors: Layout, n_bytes: int) -> SavePlan:
    """DefaultSavePlanner.create_local_plan's plan for this rank's DTensor Shard(0) state."""
    items = []
    mappings: dict[str, tuple[str, ...]] = {}
    props = TensorProperties(dtype=torch.float32)
    for fqn, shape in tensors:
        d0 = shape[0]
        per = -(-d0 // world)
        start = min(rank * per, d0)
        off = torch.Size([start] + [0] * (len(shape) - 1))
        size = torch.Size([max(0, min(d0, start + per) - start)] + list(shape[1:]))
        items.append(WriteItem(
            index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, size),
                                        properties=props, size=torch.Size(shape))))
        mappings[fqn] = tuple(fqn.split(".", 1))
    for b in range(n_bytes):
        fqn = f"optim.param_groups.{b}"
        items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        mappings[fqn] = ("optim", "param_groups", str(b))
    return SavePlan(items, planner_data=mappings)


@dataclasses.dataclass
class Received:
    keyed: list[SavePlan]  # as our planner's ranks send them (structure key attached)
    plain: list[SavePlan]  # the same plans as DCP's ranks send them
    keys: list[bytes]
    rank_key_ms: float
    gen_s: float


def received_plans(world: int, tensors: Layout, n_bytes: int) -> Received:
    """Every rank's plan, as the coordinator unpickles it from the gather."""
    from dcp_datastates.save import plan_cache
    from dcp_datastates.save.planner import DataStatesSavePlanner, share_equal_values
    from dcp_datastates.save.wire import compact_plan

    config = DataStatesSavePlanner()._config()
    t0 = time.perf_counter()
    keyed, plain, keys, key_s = [], [], [], []
    enabled = gc.isenabled()
    gc.disable()  # not what is measured; the collector is as it was for the measurements
    for r in range(world):
        plan = rank_plan(r, world, tensors, n_bytes)
        t = time.perf_counter()
        key = plan_cache.structure_key(plan, config)
        key_s.append(time.perf_counter() - t)
        sent = dataclasses.replace(
            plan, planner_data=plan_cache.KeyedPlannerData(plan.planner_data, key))
        got = pickle.loads(pickle.dumps(compact_plan(share_equal_values(sent)), protocol=4))
        keyed.append(got)
        plain.append(dataclasses.replace(got, planner_data=got.planner_data.data))
        keys.append(key)
    if enabled:
        gc.enable()
    return Received(keyed, plain, keys, 1e3 * min(key_s), time.perf_counter() - t0)


def _timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    best_wall = best_cpu = float("inf")
    out = None
    for _ in range(repeat):
        out = None
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        best_wall = min(best_wall, time.perf_counter() - w)
        best_cpu = min(best_cpu, time.process_time() - c)
    return best_wall, best_cpu, out


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _ours(rec: Received, repeat: int) -> dict[str, Any]:
    from dcp_datastates.save import plan_cache
    from dcp_datastates.save.global_plan import plan_hints
    from dcp_datastates.save.planner import DataStatesSavePlanner

    def first() -> Any:
        plan_cache.clear()
        p = DataStatesSavePlanner()
        return p, p.create_global_plan(rec.keyed)

    wall, cpu, (planner, (delta, metadata)) = _timed(first, repeat)
    entry = planner._pending.entry
    planner.finish_plan(delta[0])  # the plans reached the ranks: cached
    refs = [SavePlan([], usable=False, planner_data=plan_cache.CachedPlanRef(k, t))
            for k, t in zip(rec.keys, entry.tokens, strict=True)]
    cwall, ccpu, (cdelta, _) = _timed(
        lambda: DataStatesSavePlanner().create_global_plan(refs), repeat)
    assert not any(p.usable for p in cdelta), "the repeated save was planned again"
    t = time.perf_counter()
    for r in (0, len(delta) // 2, len(delta) - 1):
        plan_cache.plan_token(rec.keys[r], plan_hints(rec.plain[r], delta[r]))
    token_ms = 1e3 * (time.perf_counter() - t) / 3
    return {"ours_first_s": wall, "ours_first_cpu_s": cpu, "ours_cached_s": cwall,
            "ours_cached_cpu_s": ccpu, "rank_token_ms": token_ms,
            "_plans": delta, "_metadata": metadata}


def _stock(rec: Received, run_first: bool, ours: dict[str, Any], repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _STOCK_CACHES:
        getattr(SavePlanner, name).clear()
    if run_first:
        planner = DefaultSavePlanner(enable_plan_caching=True)
        wall, cpu, (plans, metadata) = _timed(lambda: planner.create_global_plan(rec.plain), 1)
        out.update(stock_first_s=wall, stock_first_cpu_s=cpu)
        out["equal"] = bool(
            plans == ours["_plans"] and metadata == ours["_metadata"]
            and [[i.index.index for i in p.items] for p in plans]
            == [[i.index.index for i in p.items] for p in ours["_plans"]])
        del plans, metadata
    else:  # DCP's cache as its first planning fills it (its cached path does not read how)
        key = DefaultSavePlanner()._cached_plans_key
        SavePlanner._cached_all_plans[key] = rec.plain
        SavePlanner._cached_global_plan[key] = ours["_plans"]
        SavePlanner._cached_metadata[key] = ours["_metadata"]
    stubs = [SavePlan([], usable=False) for _ in rec.plain]
    wall, cpu, _ = _timed(
        lambda: DefaultSavePlanner(enable_plan_caching=True).create_global_plan(stubs), repeat)
    out.update(stock_cached_s=wall, stock_cached_cpu_s=cpu)
    for name in _STOCK_CACHES:
        getattr(SavePlanner, name).clear()
    return out


def _warm_up() -> None:
    """Both planners once on a small plan (imports, first-call costs)."""
    from dcp_datastates.save import plan_cache

    rec = received_plans(4, layout("small")[0], 1)
    DefaultSavePlanner().create_global_plan(rec.plain)
    _ours(rec, 1)
    plan_cache.clear()


def run_one(layout_name: str, world: int, stock_first: bool, repeat: int) -> dict[str, Any]:
    _warm_up()
    tensors, n_bytes = layout(layout_name)
    rec = received_plans(world, tensors, n_bytes)
    per_rank = len(rec.plain[0].items)
    row: dict[str, Any] = {"layout": layout_name, "ranks": world, "items_per_rank": per_rank,
                           "items": per_rank * world, "gen_s": rec.gen_s,
                           "rank_key_ms": rec.rank_key_ms}
    ours = _ours(rec, repeat)
    row.update({k: v for k, v in ours.items() if not k.startswith("_")})
    row.update(_stock(rec, stock_first, ours, repeat))
    if "stock_first_s" in row:
        row["first_speedup"] = row["stock_first_s"] / row["ours_first_s"]
        row["first_speedup_cpu"] = row["stock_first_cpu_s"] / row["ours_first_cpu_s"]
    row["peak_rss_gib"] = _rss_gib()
    row["load_average_1min"] = os.getloadavg()[0]  # other processes on the machine
    from dcp_datastates.save import plan_cache

    plan_cache.clear()
    return row


def _row_in_child(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """One row in a fresh process: its peak RSS is that row's, and nothing carries over."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "benchmarks.global_plan", "--in-process", "--layout",
               args.layout, "--ranks", str(world), "--repeat", str(args.repeat), "--gc",
               args.gc, "--out", out, "--stock-ranks", *map(str, args.stock_ranks)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH"), root) if p)}
        subprocess.run(cmd, check=True, env=env)
        with open(out) as f:
            return dict(json.load(f)["rows"][0])


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of result rows (CPU seconds of this process; wall in the JSON)."""
    def s(row: dict[str, Any], key: str) -> str:
        v = row.get(key)
        if v is None:
            return "-"
        if v >= 0.1:
            return f"{v:.2f} s"
        return f"{v * 1e3:.1f} ms" if v >= 1e-3 else f"{v * 1e6:.0f} us"

    lines = ["| layout | ranks | items | DCP first | ours first | speedup | DCP cached | "
             "ours cached | rank key | peak RSS |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speed = r.get("first_speedup_cpu")
        lines.append(
            f"| {r['layout']} | {r['ranks']} | {r['items']:,} | {s(r, 'stock_first_cpu_s')} | "
            f"{s(r, 'ours_first_cpu_s')} | {'-' if speed is None else f'{speed:.0f}x'} | "
            f"{s(r, 'stock_cached_cpu_s')} | {s(r, 'ours_cached_cpu_s')} | "
            f"{r['rank_key_ms']:.1f} ms | {r['peak_rss_gib']:.1f} GiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=["70b", "small"], default="70b")
    ap.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--stock-ranks", type=int, nargs="*", default=[256],
                    help="rank counts at which DCP's first planning runs (quadratic)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gc", choices=["on", "off"], default="on")
    ap.add_argument("--out", help="JSON file (written after every row)")
    ap.add_argument("--in-process", action="store_true", help="no process per row")
    ap.add_argument("--table", metavar="JSON", help="print the table of a results file")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)["rows"]))
        return 0
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)  # DCP logs its validation's findings
    gc_was = gc.isenabled()
    if args.gc == "off":
        gc.disable()
    try:
        return _run(args, argv)
    finally:
        logging.disable(quiet)
        if gc_was:
            gc.enable()


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    doc: dict[str, Any] = {
        "benchmark": "global_plan", "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "gc": args.gc,
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.global_plan",
                             *(argv if argv is not None else sys.argv[1:])]),
        "rows": [],
    }
    for world in args.ranks:
        if args.in_process:
            row = run_one(args.layout, world, world in args.stock_ranks, args.repeat)
        else:
            row = _row_in_child(args, world)
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
        gc.collect()
    if not args.in_process:
        print(table(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
