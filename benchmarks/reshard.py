"""Save on N real ranks under torchrun, reshard on load to other worlds, bit for bit.

The parent launches ``python -m torch.distributed.run --standalone --nproc-per-node N`` for the
save world (``--ranks``), then once per load world (``--load-ranks``); every rank is a process
running :mod:`benchmarks.reshard_worker` in a gloo group. The state is FSDP2's
(:mod:`benchmarks.reshard_state`: a transformer-shaped model sharded by ``fully_shard``, AdamW
state after one step, seeded values, uneven shards), ~320 MiB in all by default.

Contenders, interleaved (round *r* rotates their order by *r*), each to its own directory:
``ours`` (``DataStatesWriter`` + ``dcp_datastates.planner()``, ``dcp.async_save``, future
waited) and ``stock`` (``dcp.async_save`` with ``checkpoint_id``: ``FileSystemWriter`` and DCP's
default staging, future waited). Per save the slowest rank counts: *call* (until
``async_save`` returned) and *committed* (until the future completed, ``.metadata`` present);
per contender the ranks' ``VmHWM`` during the save. Each load world reads each contender's last
checkpoint with the stock ``dcp.load`` (page cache evicted first) into the same structure
sharded over that world (one rank: plain tensors) and checks every value against the seeded
state with ``torch.equal``. Writes ``reshard.json``, ``reshard.png`` and ``reshard.md`` to
``--out``::

    python -m benchmarks.reshard --ranks 16 --load-ranks 4,1 --out benchmarks/results/reshard-16
    python -m benchmarks.reshard --ranks 4 --load-ranks 2,1 --tiny --rounds 1   # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

from benchmarks import reshard_state as rs  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTENDERS = ("ours", "stock")
MIB = 1 << 20


def torchrun(mode: str, nproc: int, cfg_path: str, timeout_s: float) -> dict[str, Any]:
    """Runs one torchrun launch of the worker; returns its wall time, exit code and log tail.

    The worker runs as a script by path from the checkpoint root, not as ``-m`` from the
    repository: its first lines put the repository *last* on ``sys.path``, so an installed
    ``dcp_datastates`` (with its compiled engine) wins over the source tree (_as_script.py).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), os.path.join(REPO, "benchmarks", "reshard_worker.py"),
           "--mode", mode, "--config", cfg_path]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=os.path.dirname(cfg_path), env=env, capture_output=True,
                           text=True, timeout=timeout_s, check=False)
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        parts = [x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                 for x in (e.stdout, e.stderr)]
        rc, log = 124, f"timed out after {timeout_s:.0f} s\n" + "".join(parts)
    return {"command": " ".join(["python", *cmd[1:]]), "mode": mode, "ranks": nproc, "rc": rc,
            "wall_s": time.perf_counter() - t0, "log_tail": log[-4000:] if rc else ""}


def rank_results(root: str, mode: str, world: int) -> list[dict[str, Any]]:
    """Every rank's result file of one launch, by rank."""
    out = []
    for r in range(world):
        with open(os.path.join(root, "results", f"{mode}-w{world}-r{r}.json")) as f:
            out.append(json.load(f))
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def save_rounds(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Per round, contender ``name``'s save over all ranks: the slowest rank's times, the
    largest and the summed VmHWM, the largest growth over RSS at the call, commit status."""
    rounds = []
    for i in range(len(ranks[0]["saves"][name])):
        per = [r["saves"][name][i] for r in ranks]
        rounds.append({
            "call_s": max(s["call_s"] for s in per),
            "committed_s": max(s["committed_s"] for s in per),
            "vmhwm_max_bytes": max(s["vmhwm_bytes"] for s in per),
            "vmhwm_sum_bytes": sum(s["vmhwm_bytes"] for s in per),
            "growth_max_bytes": max(s["vmhwm_bytes"] - s["rss_at_call_bytes"] for s in per),
            "committed": all(s["metadata"] for s in per),
            "per_rank_call_s": [s["call_s"] for s in per],
            "per_rank_committed_s": [s["committed_s"] for s in per],
        })
    return rounds


def summarize_save(ranks: list[dict[str, Any]], contenders: list[str]) -> dict[str, Any]:
    """Per contender: the rounds and their medians; ratios ours/stock."""
    out: dict[str, Any] = {"state_bytes": sum(r["state_bytes"] for r in ranks),
                           "source_mismatches": sum(r["n_source_mismatches"] for r in ranks),
                           "writer_held_max_bytes": max(r["writer_held_bytes"] for r in ranks)}
    for name in contenders:
        rounds = save_rounds(ranks, name)
        keys = ("call_s", "committed_s", "vmhwm_max_bytes", "vmhwm_sum_bytes",
                "growth_max_bytes")
        out[name] = {"rounds": rounds, "committed": all(r["committed"] for r in rounds),
                     **{k: _med([r[k] for r in rounds]) for k in keys}}
    if "ours" in out and "stock" in out:
        out["ratio_ours_over_stock"] = {
            k: out["ours"][k] / out["stock"][k] for k in ("call_s", "committed_s",
                                                          "vmhwm_max_bytes")
            if out["stock"][k] > 0
        }
    return out


def summarize_load(ranks: list[dict[str, Any]], contenders: list[str]) -> dict[str, Any]:
    """Per contender: the slowest rank's load time per round, its median, bit-exact status."""
    out: dict[str, Any] = {}
    for name in contenders:
        rounds = []
        for i in range(len(ranks[0]["loads"][name])):
            per = [r["loads"][name][i] for r in ranks]
            rounds.append({"load_s": max(x["load_s"] for x in per),
                           "mismatches": sum(x["n_mismatches"] for x in per),
                           "examples": [m for x in per for m in x["mismatches"]][:10],
                           "bytes_checked": sum(x["bytes_checked"] for x in per)})
        out[name] = {"rounds": rounds, "load_s": _med([r["load_s"] for r in rounds]),
                     "bit_exact": all(r["mismatches"] == 0 for r in rounds),
                     "bytes_checked": rounds[0]["bytes_checked"]}
    if "ours" in out and "stock" in out and out["stock"]["load_s"] > 0:
        out["ratio_ours_over_stock"] = out["ours"]["load_s"] / out["stock"]["load_s"]
    return out


def run(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """The save launch, then one launch per load world; returns launches and summaries."""
    root = cfg["root"]
    os.makedirs(os.path.join(root, "results"), exist_ok=True)
    cfg_path = os.path.join(root, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    res: dict[str, Any] = {"launches": [], "save": None, "load": {}}
    launch = torchrun("save", cfg["ranks"], cfg_path, timeout_s)
    res["launches"].append(launch)
    if launch["rc"] != 0:
        return res
    res["save"] = summarize_save(rank_results(root, "save", cfg["ranks"]), cfg["contenders"])
    for world in cfg["load_ranks"]:
        launch = torchrun("load", world, cfg_path, timeout_s)
        res["launches"].append(launch)
        if launch["rc"] == 0:
            res["load"][str(world)] = summarize_load(rank_results(root, "load", world),
                                                     cfg["contenders"])
    return res


def ok(res: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """What went wrong (empty: every launch ran, every save committed, every load bit-exact)."""
    bad = [f"torchrun {x['mode']} on {x['ranks']} ranks exited {x['rc']}"
           for x in res["launches"] if x["rc"] != 0]
    save = res["save"] or {}
    if save.get("source_mismatches"):
        bad.append("the saved state differs from the seeded one")
    bad += [f"{n}: a save not committed" for n in cfg["contenders"]
            if save and not save[n]["committed"]]
    bad += [f"{n} loaded on {w} ranks: not bit-exact {s[n]['rounds'][0]['examples']}"
            for w, s in res["load"].items() for n in cfg["contenders"] if not s[n]["bit_exact"]]
    return bad


def _fmt_ratio(num: float, den: float | None) -> str:
    return f" ({num / den:.2f}x)" if den else ""


def markdown(res: dict[str, Any], cfg: dict[str, Any]) -> str:
    """The table: per contender the save's call, committed and memory, and each load world."""
    save, names = res["save"], cfg["contenders"]
    worlds = [str(w) for w in cfg["load_ranks"] if str(w) in res["load"]]
    head = ["contender", f"save call ({cfg['ranks']} ranks)", "until committed",
            "VmHWM, max rank (growth in the save)", *[f"load on {w} (bit-exact)" for w in worlds]]
    rows = []
    for n in names:
        ref = save.get("stock") if n != "stock" else None
        s = save[n]
        row = [f"`{n}`", f"{s['call_s']:.3f} s{_fmt_ratio(s['call_s'], ref and ref['call_s'])}",
               f"{s['committed_s']:.3f} s"
               f"{_fmt_ratio(s['committed_s'], ref and ref['committed_s'])}",
               f"{s['vmhwm_max_bytes'] / MIB:.0f} MiB (+{s['growth_max_bytes'] / MIB:.0f})"]
        for w in worlds:
            ld = res["load"][w][n]
            row.append(f"{ld['load_s']:.3f} s ({'yes' if ld['bit_exact'] else 'NO'})")
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plot(res: dict[str, Any], cfg: dict[str, Any], path: str) -> None:
    """Bars of the medians with every round as a dot: save call, committed, each load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("save call", "save", "call_s"), ("until committed", "save", "committed_s")]
    panels += [(f"load on {w} rank(s)", w, "load_s") for w in res["load"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.4), squeeze=False)
    for ax, (title, where, key) in zip(axes[0], panels, strict=True):
        src = res["save"] if where == "save" else res["load"][where]
        for i, n in enumerate(cfg["contenders"]):
            ax.bar(i, src[n][key], color=("#c44e52", "#4c72b0")[i % 2], width=0.6)
            pts = [r[key] for r in src[n]["rounds"]]
            ax.plot([i] * len(pts), pts, "k.", ms=5)
        ax.set_xticks(range(len(cfg["contenders"])), cfg["contenders"])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("s (slowest rank)", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{cfg['ranks']} gloo ranks under torchrun on {os.cpu_count()} cores, "
                 f"{res['save']['state_bytes'] / MIB:.0f} MiB FSDP2 + AdamW state "
                 "(bars: medians; dots: rounds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16, help="the save world")
    ap.add_argument("--load-ranks", default="4,1", help="comma-separated load worlds")
    ap.add_argument("--rounds", type=int, default=3, help="saves per contender")
    ap.add_argument("--load-rounds", type=int, default=1, help="loads per contender and world")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--layers", type=int, default=rs.Shape.layers, help="transformer blocks")
    ap.add_argument("--tiny", action="store_true", help="a state of a few KiB (tests)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per torchrun launch")
    ap.add_argument("--dir", default="", help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--out", default="", help="directory for reshard.json, .png and .md")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (see the JSON)")
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.contenders = [c for c in a.contenders.split(",") if c]
    if not a.contenders or set(a.contenders) - set(CONTENDERS):
        ap.error(f"--contenders: of {','.join(CONTENDERS)}")
    return a


def benchmark(a: argparse.Namespace) -> dict[str, Any]:
    """Runs every launch; returns the document written to ``reshard.json``. The checkpoints
    are deleted unless ``a.keep`` (then they stay under ``doc["config"]["root"]``)."""
    shape = rs.TINY if a.tiny else rs.Shape(layers=a.layers)
    base = tempfile.mkdtemp(prefix="dcpds-reshard-", dir=a.dir or None)
    cfg = {"root": base, "ranks": a.ranks, "contenders": a.contenders,
           "load_ranks": [int(w) for w in a.load_ranks.split(",") if w], "rounds": a.rounds,
           "load_rounds": a.load_rounds, "shape": dataclasses.asdict(shape)}
    from benchmarks.report import machine_info, now_iso

    doc: dict[str, Any] = {"command": " ".join(["python -m benchmarks.reshard", *a.argv]),
                           "date": now_iso(), "machine": machine_info(base, "cpu"),
                           "config": cfg}
    t0 = time.perf_counter()
    try:
        doc.update(run(cfg, a.timeout))
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    doc["wall_s"] = time.perf_counter() - t0
    doc["problems"] = ok(doc, cfg)
    return doc


def write(doc: dict[str, Any], out: str) -> str:
    """Writes reshard.json, reshard.png and reshard.md to ``out``; returns the table."""
    cfg = doc["config"]
    table = markdown(doc, cfg) if doc["save"] else ""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "reshard.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if doc["save"]:
        plot(doc, cfg, os.path.join(out, "reshard.png"))
        with open(os.path.join(out, "reshard.md"), "w") as f:
            f.write(f"`{doc['command']}`\n\n{table}\n")
    return table


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    doc = benchmark(a)
    table = write(doc, a.out) if a.out else (markdown(doc, doc["config"]) if doc["save"] else "")
    print(table)
    for launch in doc["launches"]:
        print(f"torchrun {launch['mode']} x{launch['ranks']}: rc {launch['rc']}, "
              f"{launch['wall_s']:.1f} s\n{launch['log_tail']}", end="")
    print("\n".join(["", *doc["problems"]]) if doc["problems"] else "\nall bit-exact, committed")
    return 1 if doc["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
