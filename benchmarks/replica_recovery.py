"""Node loss: restart from the peer replicas against restart from the persistent tier.

Simulated nodes on one machine: ``--ranks`` gloo ranks under torchrun, two per node, each node a
directory of its own under ``/dev/shm`` (the node-local fast tier); the persistent tier is a
directory on local disk. The save world builds a seeded state (``--state-mib`` in all, sharded
``Shard(0)`` over every rank), saves it once with ``DataStatesWriter(replicas=1,
persist_to=disk)`` and waits for both the replication and the persistent copy (the round's
seconds and bytes are reported). Then the last node's directory is deleted (the node is lost)
and a restarted job of ``--load-ranks`` ranks (one per node; the lost node's replacement starts
empty) restores the state, per round in rotated order, by each way:

* ``replica``: ``recover_from_replicas`` on the fast roots, then ``DataStatesReader`` (checksums
  verified as it reads) from the rebuilt fast-tier checkpoint;
* ``disk-ours``: ``DataStatesReader`` from the persistent tier, page cache evicted first;
* ``disk-stock``: the stock ``dcp.load`` from the persistent tier, page cache evicted first.

Each restore is a fresh torchrun launch (the fast roots reset to their state after the loss
before each ``replica`` round, by hard links); every value is checked bit for bit. Reported,
per way, the medians over rounds of: the launch's wall time (process start, imports, restore,
check, exit) and the slowest rank's restore (recover + load). Writes ``replica_recovery.json``,
``.md`` and ``.png`` to ``--out``::

    python -m benchmarks.replica_recovery --state-mib 2048 --rounds 3 \\
        --out benchmarks/results/replica-recovery
    python -m benchmarks.replica_recovery --state-mib 64 --rounds 1      # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

if __package__ in (None, ""):
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

HERE = os.path.abspath(__file__)
WAYS = ("replica", "disk-ours", "disk-stock")
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------
# The ranks (this file run by torchrun with --worker)


def _state(mib: int, world: int, mesh: Any, zeros: bool = False) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(7)
    n_tensors = 8
    rows = max(world, (mib * MIB // 4 // n_tensors) // 1024)
    out = {}
    for i in range(n_tensors):
        full = torch.empty(rows, 1024).uniform_(generator=g) if not zeros else torch.zeros(
            rows, 1024)
        out[f"layer{i}"] = distribute_tensor(full, mesh, [Shard(0)])
    return out


def _worker(cfg: dict[str, Any], mode: str, way: str | None, tag: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_datastates as dd

    t_start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = 2 if mode == "save" else 1
    root = os.path.join(cfg["fast"], f"node{rank // per_node}")
    os.makedirs(root, exist_ok=True)
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {"rank": rank}
    if mode == "save":
        state = _state(cfg["state_mib"], world, mesh)
        w = dd.DataStatesWriter(root, host_cache_size=cfg["cache"], replicas=1,
                                persist_to=cfg["persist"], persist_agent=False)
        t0 = time.perf_counter()
        dcp.async_save(state, storage_writer=w, planner=dd.planner(),
                       checkpoint_id=os.path.join(root, "step-1")).result()
        out["save_s"] = time.perf_counter() - t0
        assert w.wait_replicated(600) and w.wait_persisted(600)
        out["replicated_s"] = time.perf_counter() - t0
        out["rounds"] = w.replica_stats()
        w.close()
    else:
        target = _state(cfg["state_mib"], world, mesh, zeros=True)
        pg = dist.new_group(backend="gloo")
        dist.barrier(pg)
        t0 = time.perf_counter()
        if way == "replica":
            path = dd.recover_from_replicas(root, group=pg)
            assert path is not None, "nothing to recover"
            out["recover_s"] = time.perf_counter() - t0
            from dcp_datastates.lifecycle import replica_restore

            out["recovery"] = dict(replica_restore.last_recovery.__dict__)
            dcp.load(target, storage_reader=dd.DataStatesReader(path), process_group=pg)
        else:
            path = os.path.join(cfg["persist"], "step-1")
            if way == "disk-ours":
                dcp.load(target, storage_reader=dd.DataStatesReader(path), process_group=pg)
            else:
                dcp.load(target, checkpoint_id=path, process_group=pg)
        out["restore_s"] = time.perf_counter() - t0
        expect = _state(cfg["state_mib"], world, mesh)
        for k, v in expect.items():
            assert torch.equal(v.to_local(), target[k].to_local()), k
        out["since_start_s"] = time.perf_counter() - t_start
    with open(os.path.join(cfg["results"], f"{tag}-r{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The parent


def _launch(cfg_path: str, nproc: int, args: list[str], timeout_s: float) -> tuple[int, float,
                                                                                    str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), HERE, "--worker", "--config", cfg_path, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                       check=False, cwd=os.path.dirname(cfg_path))
    return p.returncode, time.perf_counter() - t0, (p.stdout + p.stderr)[-3000:]


def _results(cfg: dict[str, Any], tag: str, n: int) -> list[dict[str, Any]]:
    out = []
    for r in range(n):
        with open(os.path.join(cfg["results"], f"{tag}-r{r}.json")) as f:
            out.append(json.load(f))
    return out


def _evict(path: str) -> None:
    from benchmarks.metrics import evict_page_cache

    for d, _, files in os.walk(path):
        for f in files:
            evict_page_cache(os.path.join(d, f))


def benchmark(a: argparse.Namespace) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="replica-recovery-", dir=a.disk)
    fast = os.path.join("/dev/shm", f"dcpds-replica-{uuid.uuid4().hex[:8]}")
    cfg = {"fast": fast, "persist": os.path.join(work, "persist"), "results":
           os.path.join(work, "results"), "state_mib": a.state_mib, "cache": f"{a.state_mib}MiB"}
    os.makedirs(cfg["results"])
    cfg_path = os.path.join(work, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    out: dict[str, Any] = {"config": vars(a), "command": " ".join(sys.argv), "cpus":
                           os.cpu_count(), "ways": {w: [] for w in WAYS}}
    try:
        rc, wall, log = _launch(cfg_path, a.ranks, ["--mode", "save", "--tag", "save"], a.timeout)
        if rc:
            raise RuntimeError(f"the save world failed ({rc}):\n{log}")
        saves = _results(cfg, "save", a.ranks)
        out["save"] = {"wall_s": wall, "save_s": max(s["save_s"] for s in saves),
                       "replicated_s": max(s["replicated_s"] for s in saves),
                       "round_s": max(r["seconds"] for s in saves for r in s["rounds"]),
                       "bytes_sent": sum(r["sent"] for s in saves for r in s["rounds"]),
                       "errors": [r["error"] for s in saves for r in s["rounds"] if r["error"]]}
        lost = os.path.join(fast, f"node{a.ranks // 2 - 1}")
        shutil.rmtree(lost)  # the node is lost
        pristine = fast + "-after-loss"
        shutil.copytree(fast, pristine, copy_function=os.link)
        for rnd in range(a.rounds):
            order = [w for w in WAYS[rnd % 3:] + WAYS[:rnd % 3] if w in a.ways.split(",")]
            for way in order:
                if way == "replica":
                    shutil.rmtree(fast)
                    shutil.copytree(pristine, fast, copy_function=os.link)
                else:
                    _evict(cfg["persist"])
                tag = f"{way}-{rnd}"
                rc, wall, log = _launch(cfg_path, a.load_ranks,
                                        ["--mode", "restore", "--way", way, "--tag", tag],
                                        a.timeout)
                if rc:
                    raise RuntimeError(f"restore by {way} failed ({rc}):\n{log}")
                res = _results(cfg, tag, a.load_ranks)
                out["ways"][way].append({
                    "wall_s": wall, "restore_s": max(r["restore_s"] for r in res),
                    "recover_s": max((r.get("recover_s", 0.0) for r in res), default=0.0),
                    "ranks": [r.get("recovery") for r in res],
                })
                print(f"round {rnd} {way}: launch {wall:.2f} s, restore "
                      f"{out['ways'][way][-1]['restore_s']:.2f} s", flush=True)
    finally:
        shutil.rmtree(fast, ignore_errors=True)
        shutil.rmtree(fast + "-after-loss", ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    out["medians"] = {
        w: {k: statistics.median(x[k] for x in rows) for k in ("wall_s", "restore_s",
                                                                "recover_s")}
        for w, rows in out["ways"].items() if rows
    }
    return out


def _report(res: dict[str, Any], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "replica_recovery.json"), "w") as f:
        json.dump(res, f, indent=1)
    m, s = res["medians"], res["save"]
    stock = m.get("disk-stock", {"restore_s": math.nan})
    lines = [
        f"# Node loss: restart from peer replicas ({res['config']['state_mib']} MiB, "
        f"{res['config']['ranks']} ranks as {res['config']['ranks'] // 2} simulated nodes, "
        f"restart on {res['config']['load_ranks']})", "",
        f"Command: `{res['command']}`; {res['cpus']} cores. Save: call-to-commit "
        f"{s['save_s']:.2f} s; replicated and persisted after {s['replicated_s']:.2f} s "
        f"(slowest round {s['round_s']:.2f} s, {s['bytes_sent'] / MIB:.0f} MiB sent).", "",
        "| restore by | launch (start -> restored, checked, exit) | restore | of which rebuild |"
        " x stock restore |", "|---|---:|---:|---:|---:|",
    ]
    for w in [w for w in WAYS if w in m]:
        x = m[w]
        lines.append(f"| {w} | {x['wall_s']:.2f} s | {x['restore_s']:.2f} s | "
                     f"{x['recover_s']:.2f} s | {x['restore_s'] / stock['restore_s']:.2f}x |")
    with open(os.path.join(out_dir, "replica_recovery.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ways = [w for w in WAYS if w in m]
    ys = range(len(ways))
    ax.barh([y + 0.2 for y in ys], [m[w]["wall_s"] for w in ways], 0.4, label="launch")
    ax.barh([y - 0.2 for y in ys], [m[w]["restore_s"] for w in ways], 0.4, label="restore")
    ax.set_yticks(list(ys), ways)
    ax.set_xlabel("seconds (median)")
    ax.legend()
    ax.set_title(f"node loss, {res['config']['state_mib']} MiB, simulated nodes")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "replica_recovery.png"), dpi=110)
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("save", "restore"), help=argparse.SUPPRESS)
    ap.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    ap.add_argument("--state-mib", type=int, default=1024, help="state size in all")
    ap.add_argument("--ranks", type=int, default=4, help="save world (2 ranks per node)")
    ap.add_argument("--load-ranks", type=int, default=2, help="restart world (1 rank per node)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset of: "
                    + ", ".join(WAYS))
    ap.add_argument("--disk", default=None, help="parent of the persistent tier (default: tmp)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    ap.add_argument("--out", default="benchmarks/results/replica-recovery")
    a = ap.parse_args(argv)
    if a.worker:
        with open(a.config) as f:
            _worker(json.load(f), a.mode, a.way, a.tag)
        return 0
    _report(benchmark(a), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
