"""Scale-out on one machine: planning and blocked time of one checkpoint as the world grows.

For each world size (``--worlds 1,2,4,8``) the script spawns that many gloo ranks, one thread
each. Every rank holds a shard of each of ``--tensors`` parameters (FSDP-style: the tensor count
per rank is fixed, the bytes per rank are ``--total-mib`` / world), and the ranks save the same
global checkpoint ``--saves`` times with each contender, contenders interleaved (order rotated
per round):

* ``ours``: ``dcp.async_save(state, storage_writer=DataStatesWriter(...))``, the plain call;
* ``ours_plan_cache``: the same with ``planner=DataStatesSavePlanner(enable_plan_caching=True)``
  (repeated saves of the same structure skip the global planning and its collectives);
* ``stock``: ``dcp.async_save(state, checkpoint_id=...)`` (FileSystemWriter, DefaultStager);
* ``ours_late`` (only with ``--contenders``): ``ours`` with ``early_flush=False``, every item
  placed after DCP's planning.

``--owned`` makes an optimizer that has stepped own the state, as in training, and steps it
after each save call (``step_s``: the step, with its wait for the lazy copies).
``--state dtensor`` holds the parameters as FSDP2 does, DTensors sharded over all ranks (their
shards are placed, and flush, before DCP plans: dcp_datastates.save.early); the default ``plain``
holds each rank's shard as a plain tensor under a name of its own.

Per save and rank: ``call_s`` (async_save blocked the caller), ``plan_s`` (from the planner's
set-up to the end of ``finish_plan``: local plan, gather, global plan, scatter), ``plan_cpu_s``
(the CPU time the save thread spent in that span: with fewer cores than ranks, the part of the
planning's growth that is work and not waiting for a core), ``durable_s`` (until the future
completed). A save counts by its slowest rank; the first save (which builds
the plan and faults in buffers) is reported apart from the median of the later ones. Writes JSON
and a PNG::

    python -m benchmarks.scale_out --out benchmarks/results/scale-out
    python -m benchmarks.scale_out --quick --out /tmp/so     # seconds: 1 and 2 ranks at once, tiny
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

CONTENDERS = ("ours", "ours_plan_cache", "stock")  # the default set
ALL_CONTENDERS = ("ours", "ours_late", "ours_plan_cache", "stock")


def _rank(rank: int, world: int, init: str, root: str, cfg: dict[str, Any], q: Any) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_datastates import DataStatesSavePlanner, DataStatesWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        per_rank = cfg["total_bytes"] // world
        numel = max(1, per_rank // 4 // cfg["tensors"])
        g = torch.Generator().manual_seed(rank)
        local = {f"p{i}": torch.randn(numel, generator=g) for i in range(cfg["tensors"])}
        state: dict[str, Any]
        if cfg["state"] == "dtensor":
            # FSDP2's state: every parameter a DTensor, sharded by rows over all ranks.
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            mesh = init_device_mesh("cpu", (world,))
            state = {"model": {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False)
                               for k, v in local.items()}}
        else:
            # FSDP-style shards as plain tensors, every rank's piece under its own name.
            state = {"model": {f"{k}.shard{rank}": v for k, v in local.items()}}
        opt = None
        if cfg["owned"]:
            # As in training: an optimizer that has stepped owns the state (its step after each
            # save waits for the lazy copies; that wait is reported as step_s).
            params = {k: torch.nn.Parameter(v) for k, v in state["model"].items()}
            opt = torch.optim.SGD(list(params.values()), lr=0.0)
            for p in params.values():
                p.grad = torch.zeros_like(p)
            opt.step()
            state = {"model": {k: p.detach() for k, p in params.items()}}
        marks: dict[str, float] = {}

        def timed(base: type) -> type:
            class Timed(base):  # type: ignore[misc,valid-type]
                def set_up_planner(self, *a: Any, **k: Any) -> None:
                    marks["plan0"] = time.perf_counter()
                    marks["cpu0"] = time.thread_time()
                    super().set_up_planner(*a, **k)

                def finish_plan(self, new_plan: Any) -> Any:
                    out = super().finish_plan(new_plan)
                    marks["plan1"] = time.perf_counter()
                    marks["cpu1"] = time.thread_time()
                    return out

            return Timed

        planners = {
            "ours": timed(DataStatesSavePlanner),
            "ours_late": timed(DataStatesSavePlanner),
            "ours_plan_cache": timed(DataStatesSavePlanner),
            "stock": timed(DefaultSavePlanner),
        }
        cache_mib = max(8, per_rank * 2 // (1 << 20) + 8)
        contenders = cfg["contenders"]
        writers = {
            name: DataStatesWriter(os.path.join(root, name), host_cache_size=f"{cache_mib}MiB",
                                   early_flush=name != "ours_late")
            for name in contenders if name != "stock"
        }
        out: dict[str, list[dict[str, float]]] = {c: [] for c in contenders}
        for i in range(cfg["saves"]):
            k = i % len(contenders)
            order = contenders[k:] + contenders[:k]
            for name in order:
                ckpt = os.path.join(root, name, f"s{i}")
                kw: dict[str, Any] = {
                    "checkpoint_id": ckpt,
                    "planner": planners[name](enable_plan_caching=name == "ours_plan_cache"),
                }
                if name != "stock":
                    kw["storage_writer"] = writers[name]
                dist.barrier()
                t0 = time.perf_counter()
                fut = dcp.async_save(state, **kw)
                t1 = time.perf_counter()
                if opt is not None:
                    opt.step()
                t_step = time.perf_counter()
                fut.result()
                t2 = time.perf_counter()
                out[name].append({
                    "call_s": t1 - t0,
                    "step_s": t_step - t1,
                    "plan_s": marks["plan1"] - marks["plan0"],
                    "plan_cpu_s": marks["cpu1"] - marks["cpu0"],
                    "durable_s": t2 - t0,
                })
                dist.barrier()
                if rank == 0 and i > 0:
                    shutil.rmtree(os.path.join(root, name, f"s{i - 1}"), ignore_errors=True)
        for w in writers.values():
            w.close()
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def run_world(world: int, cfg: dict[str, Any], base: str) -> dict[str, Any]:
    """Runs one world size; returns per contender the slowest rank of each save."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    root = tempfile.mkdtemp(prefix=f"w{world}-", dir=base)
    init = f"file://{os.path.join(root, 'rdzv')}"
    procs = [ctx.Process(target=_rank, args=(r, world, init, root, cfg, q)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + cfg["timeout_s"]
    while len(results) < world and time.monotonic() < deadline:
        try:
            r, out = q.get(timeout=1.0)
            results[r] = out
        except Exception:  # noqa: BLE001 - queue.Empty; check for dead ranks
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    shutil.rmtree(root, ignore_errors=True)
    if len(results) < world:
        return {"error": f"only {len(results)} of {world} ranks reported"}
    summary: dict[str, Any] = {}
    for name in cfg["contenders"]:
        saves = [
            {k: max(results[r][name][i][k] for r in range(world)) for k in results[0][name][i]}
            for i in range(cfg["saves"])
        ]
        later = saves[1:] or saves
        summary[name] = {
            "first": saves[0],
            **{k: statistics.median(s[k] for s in later) for k in saves[0]},
            "saves": saves,
        }
    return summary


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [w for w in res["worlds"] if "error" not in res["by_world"][str(w)]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("plan_s", "call_s", "durable_s"),
                              ("planning (later saves)", "blocked: async_save call",
                               "until durable"), strict=True):
        for name in res["config"]["contenders"]:
            ax.plot(worlds, [res["by_world"][str(w)][name][key] for w in worlds], marker="o",
                    label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.set_xlabel("ranks")
        ax.set_ylabel("s")
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"one checkpoint of {res['config']['total_bytes'] / 2**20:.0f} MiB, "
                 f"{res['config']['tensors']} {res['config']['state']} tensors per rank "
                 "(medians of saves 2..n, slowest rank)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=200, help="parameters (shards per rank)")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--quick", action="store_true", help="1 and 2 ranks at once, 4 MiB, 2 saves")
    ap.add_argument("--dir", default="", help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--out", default="", help="directory for scale_out.json and scale_out.png")
    ap.add_argument("--state", choices=("plain", "dtensor"), default="plain",
                    help="each rank's shards as plain tensors (default) or as DTensors (FSDP2)")
    ap.add_argument("--owned", action="store_true",
                    help="the state owned by an optimizer that has stepped; step() after each save")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated, of {','.join(ALL_CONTENDERS)}")
    a = ap.parse_args(argv)
    contenders = tuple(c for c in a.contenders.split(",") if c)
    unknown = [c for c in contenders if c not in ALL_CONTENDERS]
    if unknown or not contenders:
        ap.error(f"unknown contenders {unknown}; choose from {','.join(ALL_CONTENDERS)}")
    if a.quick:
        a.worlds, a.total_mib, a.tensors, a.saves = "1,2", 4, 20, 2
    worlds = [int(w) for w in a.worlds.split(",") if w]
    cfg = {"total_bytes": a.total_mib << 20, "tensors": a.tensors, "saves": a.saves,
           "timeout_s": a.timeout, "state": a.state, "contenders": contenders,
           "owned": a.owned}
    base = tempfile.mkdtemp(prefix="dcpds-scale-", dir=a.dir or None)
    res: dict[str, Any] = {"config": cfg, "worlds": worlds, "by_world": {},
                           "command": " ".join(["python -m benchmarks.scale_out", *sys.argv[1:]])}
    try:
        # --quick: the world sizes side by side (a smoke run: its times are not comparable)
        with concurrent.futures.ThreadPoolExecutor(len(worlds) if a.quick else 1) as pool:
            for w, summary in zip(worlds, pool.map(lambda w: run_world(w, cfg, base), worlds),
                                  strict=True):
                print(f"   scale-out: {w} rank(s)", flush=True)
                res["by_world"][str(w)] = summary
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(res, indent=1)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "scale_out.json"), "w") as f:
            f.write(text)
        plot(res, os.path.join(a.out, "scale_out.png"))
    for w in worlds:
        r = res["by_world"][str(w)]
        if "error" in r:
            print(f"{w} ranks: {r['error']}")
            continue
        parts = [
            f"{n} plan {r[n]['plan_s']:.3f} (cpu {r[n]['plan_cpu_s']:.3f}) "
            f"call {r[n]['call_s']:.3f} "
            f"step {r[n]['step_s']:.3f} durable {r[n]['durable_s']:.3f}"
            for n in contenders
        ]
        print(f"{w} ranks: " + "; ".join(parts))
    bad = [w for w in worlds if "error" in res["by_world"][str(w)]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
