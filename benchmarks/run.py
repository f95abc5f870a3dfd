"""Benchmark CLI: every contender on the same workloads, interleaved, in one invocation.

    python -m benchmarks.run --quick                 # CI smoke run, ~1.5 min on 2 cores
    python -m benchmarks.run --out benchmarks/results/cpu-2core   # the default set (~10 min)
    python -m benchmarks.run --full ...              # adds the 8 GB synthetic scenario
    python -m benchmarks.run --device cuda ...       # same harness on a GPU

See docs/benchmarks.md for what is measured and the latest results.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

from benchmarks.contenders import (  # noqa: E402
    ALL_NAMES,
    DATASTATES_NAMES,
    EXTRA_NAMES,
    MLP_DEFAULT,
    MLP_NAMES,
    SYNTHETIC_EXCLUDED,
    TRAINING_EXCLUDED,
)
from benchmarks.metrics import cpu_busy_seconds, own_cpu_seconds  # noqa: E402
from benchmarks.report import machine_info, markdown, now_iso, write_json  # noqa: E402
from benchmarks.scenarios import RunOptions, Scenario  # noqa: E402
from benchmarks.workloads import SyntheticSpec  # noqa: E402

QUICK = {
    "synthetic": "8MB:mixed,4MB:small",
    "small_cache": "8MB:mixed",
    "two_ranks": "8MB:mixed",
    "gpt": "tiny",
    "ckpt_every": "1,2",
    "iters": 2,
    "warmup": 1,
    "repeats": 1,
    "saves": 2,
    "disk_probe": "64MiB",
    "mlp": "tiny",
    "mlp_iters": 4,
    "mlp_ckpt_every": 2,
    "mlp_rounds": 1,
    "memory": "16MiB",
    "memory_states": "mixed",
}
DEFAULT = {
    "synthetic": "128MB:small,512MB:mixed,512MB:large",
    "small_cache": "512MB:mixed",
    "two_ranks": "512MB:mixed",
    "gpt": "small",
    "ckpt_every": "1,4",
    "iters": 8,
    "warmup": 2,
    "repeats": 3,
    "saves": 2,
    "disk_probe": "1GiB",
    "mlp": "large",
    "mlp_iters": 30,
    "mlp_ckpt_every": 6,
    "mlp_rounds": 3,
    "memory": "512MB",
    "memory_states": "mixed,bigtensor",
}
FULL_EXTRA = "8GB:mixed"  # added by --full, run with one repeat (24 GB machines: run it once)


def _csv(text: str | None) -> list[str]:
    if text is None or text.strip().lower() in ("", "none", "off"):
        return []
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Compare dcp_datastates with torch.save, DCP, DCP async and torchsnapshot.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, 1 repeat, jobs and child processes side by side: a smoke run "
        "whose timings are not for comparison (CI)",
    )
    p.add_argument("--full", action="store_true", help=f"add the {FULL_EXTRA} synthetic scenario")
    p.add_argument("--out", help="output directory (default benchmarks/results/tmp/<time>)")
    p.add_argument("--dir", help="checkpoint root (default: a fresh temp dir under /tmp)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--contenders", default=",".join(ALL_NAMES), help="comma list")
    p.add_argument("--synthetic", help="synthetic scenarios SIZE:MIX,... (mix: small|mixed|large)")
    p.add_argument("--small-cache", help="DataStates host-cache-smaller-than-checkpoint specs")
    p.add_argument("--cache-fraction", type=float, default=0.125, help="host cache / checkpoint")
    p.add_argument("--two-ranks", help="2-rank gloo scenario specs (size is the total)")
    p.add_argument("--gpt", help="GPT preset tiny|small|medium|large, NAME@bN: batch of N")
    p.add_argument("--ckpt-every", help="comma list of k (checkpoint every k iterations)")
    p.add_argument("--iters", type=int, help="training iterations per run (multiple of each k)")
    p.add_argument("--warmup", type=int, help="untimed training iterations per run")
    p.add_argument("--repeats", type=int, help="repeats (contender order rotates per repeat)")
    p.add_argument("--saves", type=int, help="saves per run in synthetic scenarios")
    p.add_argument(
        "--fs-threads",
        type=int,
        default=max(2, os.cpu_count() or 2),
        help="thread_count of the multi-threaded FileSystemWriter",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads per rank (default: cores / ranks; 1 with --quick)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=1,
        help="async saves pending at once (a new save first waits for the oldest)",
    )
    p.add_argument(
        "--ds-max-in-flight",
        type=int,
        default=0,
        help="DataStates async saves pending at once (0: unbounded, the host cache bounds it)",
    )
    p.add_argument("--host-cache", default="auto", help="DataStates host cache (auto: fits)")
    p.add_argument("--ds-flush-threads", type=int, help="DataStatesWriter flush_threads")
    p.add_argument("--ds-copy-threads", type=int, help="DataStatesWriter copy_threads")
    p.add_argument("--ds-o-direct", choices=("on", "off"), help="DataStatesWriter o_direct")
    p.add_argument(
        "--check-barrier",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="mutate tensors right after the step barrier and verify against a copy "
        "(default: on with --quick)",
    )
    p.add_argument(
        "--mlp", help="mlp-loop scenario: MLP preset tiny|large (large: ~0.9 GB of state); off"
    )
    p.add_argument("--mlp-iters", type=int, help="mlp-loop timed iterations (multiple of k)")
    p.add_argument("--mlp-ckpt-every", type=int, help="mlp-loop: checkpoint every k iterations")
    p.add_argument("--mlp-rounds", type=int, help="mlp-loop rounds (every contender once each)")
    p.add_argument(
        "--mlp-contenders",
        default=",".join(MLP_DEFAULT),
        help=f"mlp-loop contenders besides `none` (from {', '.join(MLP_NAMES)})",
    )
    p.add_argument(
        "--memory", help="memory scenario: size of the mixed state (cache: --cache-fraction); off"
    )
    p.add_argument("--memory-states", help="memory scenario states: mixed,bigtensor")
    p.add_argument("--disk-probe", help="max bytes for the dd measurement")
    p.add_argument("--scenarios", help="only scenarios whose name contains one of these")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one process per scenario (default: on, off with --quick)",
    )
    p.add_argument(
        "--contend",
        type=int,
        default=0,
        help="mlp-loop: N busy processes beside every run (a data-loader worker, a neighbour job)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per worker job")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--render",
        metavar="DIR",
        help="only rewrite DIR's results.md and PNGs from its results.json",
    )
    return p


@dataclass
class Plan:
    scenarios: list[Scenario]
    options: RunOptions
    isolate: bool
    timeout: float
    side_by_side: bool = False  # start every job at once (--quick: no timing is compared)


def make_plan(args: argparse.Namespace, root: str) -> Plan:
    from benchmarks.workloads import parse_size

    base = dict(QUICK if args.quick else DEFAULT)

    def pick(key: str, attr: str) -> Any:
        v = getattr(args, attr)
        return base[key] if v is None else v

    contenders = tuple(_csv(args.contenders))
    for c in contenders:
        if c not in ALL_NAMES + EXTRA_NAMES:
            raise SystemExit(
                f"unknown contender {c!r}; choose from {', '.join(ALL_NAMES + EXTRA_NAMES)}"
            )
    repeats = int(pick("repeats", "repeats"))
    saves = int(pick("saves", "saves"))
    check = args.quick if args.check_barrier is None else args.check_barrier
    scenarios: list[Scenario] = []
    specs = _csv(pick("synthetic", "synthetic"))
    if args.full and FULL_EXTRA not in specs:
        specs.append(FULL_EXTRA)
    synth = tuple(c for c in contenders if c not in SYNTHETIC_EXCLUDED)
    for text in specs:
        spec = SyntheticSpec.parse(text)
        size = text.split(":")[0]
        big = spec.total_bytes >= 4 * 10**9
        scenarios.append(
            Scenario(
                name=f"synthetic-{size}-{spec.mix}",
                kind="synthetic",
                contenders=synth,
                repeats=1 if big and text == FULL_EXTRA else repeats,
                synthetic=spec,
                saves=saves,
                check_barrier=check,
                description=(
                    f"Synthetic state dict, {size} of float32 in the `{spec.mix}` mix; the step "
                    "barrier follows the save call at once (no compute to hide copies behind)."
                ),
            )
        )
    ds = tuple(c for c in synth if c in DATASTATES_NAMES)
    frac = args.cache_fraction
    for text in _csv(pick("small_cache", "small_cache")):
        if not ds:
            break
        spec = SyntheticSpec.parse(text)
        size = text.split(":")[0]
        scenarios.append(
            Scenario(
                name=f"smallcache-{size}-{spec.mix}",
                kind="synthetic",
                contenders=ds,
                repeats=repeats,
                synthetic=spec,
                cache_fraction=frac,
                saves=saves,
                check_barrier=check,
                description=(
                    f"DataStatesWriter with a host cache of {frac:g} x the checkpoint ({size}, "
                    f"`{spec.mix}` mix): capture must wait for flushes to free cache space."
                ),
            )
        )
    for text in _csv(pick("two_ranks", "two_ranks")):
        spec = SyntheticSpec.parse(text)
        size = text.split(":")[0]
        scenarios.append(
            Scenario(
                name=f"2ranks-{size}-{spec.mix}",
                kind="synthetic",
                contenders=synth,
                repeats=repeats,
                world_size=2,
                synthetic=spec,
                saves=saves,
                check_barrier=check,
                description=(
                    f"2 processes over gloo (file rendezvous), {size} in total, each rank saving "
                    "its own half (distinct keys, as ZeRO-1 shards)."
                ),
            )
        )
    preset = str(pick("gpt", "gpt"))
    iters = int(pick("iters", "iters"))
    warmup = int(pick("warmup", "warmup"))
    for k_text in _csv(pick("ckpt_every", "ckpt_every")):
        k = int(k_text)
        n = max(k, iters - iters % k)
        scenarios.append(
            Scenario(
                name=f"gpt-{preset}-k{k}",
                kind="training",
                contenders=tuple(c for c in contenders if c not in TRAINING_EXCLUDED),
                repeats=repeats,
                gpt_preset=preset,
                ckpt_every=k,
                iters=n,
                warmup=warmup,
                description=(
                    f"Tiny GPT training loop ({preset}), checkpoint every {k} iteration(s) after "
                    "the optimizer step; asynchronous methods wait before the next step."
                ),
            )
        )
    mlp_preset = str(pick("mlp", "mlp"))
    if _csv(mlp_preset):
        from benchmarks.mlp_loop import mlp_config

        mlp_names = tuple(_csv(args.mlp_contenders))
        for c in mlp_names:
            if c not in MLP_NAMES:
                raise SystemExit(f"unknown mlp contender {c!r}; choose from {', '.join(MLP_NAMES)}")
        cfg = mlp_config(mlp_preset)
        k = int(pick("mlp_ckpt_every", "mlp_ckpt_every"))
        n = int(pick("mlp_iters", "mlp_iters"))
        n = max(k, n - n % k)
        scenarios.append(
            Scenario(
                name="mlp-loop",
                kind="mlp",
                contenders=mlp_names,
                repeats=int(pick("mlp_rounds", "mlp_rounds")),
                mlp_preset=mlp_preset,
                mlp_parallel=2 if args.quick else 1,
                ckpt_every=k,
                iters=n,
                warmup=2,
                description=(
                    f"MLP `{mlp_preset}` ({cfg.depth} x Linear({cfg.width}, {cfg.width}), "
                    f"batch {cfg.batch}) + AdamW, {n} iterations, a checkpoint after every "
                    f"{k}th optimizer step ({n // k} checkpoints); each run a fresh process, the "
                    "wait until the last checkpoint is durable inside the loop time. The "
                    "DataStates contender is the plain `dcp.async_save` call: no protect(), "
                    "no wait before the step."
                ),
            )
        )
    memory = pick("memory", "memory")
    if _csv(memory):
        size_bytes = parse_size(str(memory))
        states = ",".join(_csv(pick("memory_states", "memory_states")))
        scenarios.append(
            Scenario(
                name="memory",
                kind="memory",
                contenders=("ds_save", "ds_plain"),
                repeats=1,
                cache_fraction=args.cache_fraction,
                memory_bytes=size_bytes,
                memory_states=states,
                memory_parallel=2 if args.quick else 1,
                description=(
                    "Peak RSS growth of a save through DataStatesWriter with a host cache of "
                    f"{args.cache_fraction:g} x a {memory} mixed state (and a state holding one "
                    "tensor of 3x that cache), per mode, first and later save, each row in a "
                    "fresh process. Growth = VmHWM (reset just before the save) minus the RSS "
                    "before the writer existed, so the cache counts. Promise: growth <= cache "
                    "+ 64 MiB."
                ),
            )
        )
    if args.scenarios:
        keep = _csv(args.scenarios)
        scenarios = [s for s in scenarios if any(k in s.name for k in keep)]
    ds_options: dict[str, Any] = {}
    if args.ds_flush_threads is not None:
        ds_options["flush_threads"] = args.ds_flush_threads
    if args.ds_copy_threads is not None:
        ds_options["copy_threads"] = args.ds_copy_threads
    if args.ds_o_direct is not None:
        ds_options["o_direct"] = args.ds_o_direct == "on"
    options = RunOptions(
        root=root,
        device=args.device,
        fs_threads=args.fs_threads,
        max_in_flight=args.max_in_flight,
        ds_max_in_flight=args.ds_max_in_flight,
        host_cache=args.host_cache,
        ds_options=ds_options,
        disk_probe_max_bytes=parse_size(str(pick("disk_probe", "disk_probe"))),
        keep_checkpoints=args.keep_checkpoints,
        torch_threads=args.torch_threads or (1 if args.quick else 0),
        contend=args.contend,
    )
    isolate = (not args.quick) if args.isolate is None else args.isolate
    timeout = args.timeout or (300.0 if args.quick else 3600.0)
    return Plan(scenarios, options, isolate, timeout, side_by_side=args.quick and not isolate)


def _jobs(plan: Plan) -> list[list[Scenario]]:
    """Group scenarios into worker jobs: unless isolated, every single-rank scenario shares one
    job (one process start, one torch import); each multi-rank scenario is a job of its own."""
    jobs: list[list[Scenario]] = []
    single: list[Scenario] | None = None
    for s in plan.scenarios:
        if plan.isolate or s.world_size != 1:
            jobs.append([s])
        elif single is None:
            single = [s]
            jobs.append(single)
        else:
            single.append(s)
    return jobs


def start_job(plan: Plan, job: list[Scenario], job_dir: str) -> list[mp.process.BaseProcess]:
    """Spawn the ranks of one job; :func:`wait_job` waits for them."""
    from benchmarks.worker import worker_entry

    os.makedirs(job_dir, exist_ok=True)
    world = job[0].world_size
    rdzv = os.path.join(job_dir, "rendezvous")
    if os.path.exists(rdzv):
        os.remove(rdzv)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=worker_entry,
            args=(
                rank,
                world,
                [s.to_json() for s in job],
                plan.options.to_json(),
                rdzv,
                job_dir,
                plan.timeout,
            ),
            name=f"bench-rank{rank}",
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def wait_job(
    plan: Plan, job: list[Scenario], procs: list[mp.process.BaseProcess], started: float
) -> dict[str, str]:
    """Wait for a job's ranks (started at monotonic ``started``); {scenario: error} on failure."""
    deadline = started + plan.timeout
    failed_at: float | None = None
    while any(p.is_alive() for p in procs):
        time.sleep(0.2)
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()  # a rank died: give the others a grace period
        grace_over = failed_at is not None and time.monotonic() - failed_at > 30
        if time.monotonic() > deadline or grace_over:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            break
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if all(c == 0 for c in codes):
        return {}
    why = f"worker exit codes {codes}" + (" (timeout)" if time.monotonic() > deadline else "")
    return {s.name: why for s in job}


def _load_rank_results(job_dir: str, scn: Scenario) -> list[dict[str, Any]] | None:
    from benchmarks.worker import result_path

    out = []
    for rank in range(scn.world_size):
        path = result_path(job_dir, scn.name, rank)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            out.append(json.load(f))
    return out


def _print_summary(results: dict[str, Any]) -> None:
    for scn in results["scenarios"]:
        s = scn["summary"]
        if "error" in s:
            print(f"[{scn['name']}] FAILED: {s['error'].strip().splitlines()[-1]}")
            continue
        print(f"[{scn['name']}]")
        if scn["kind"] == "memory":
            _print_memory(s)
            continue
        for c in s["contenders"].values():
            if c["status"] != "ok":
                why = c.get("skip_reason") or (c.get("errors") or ["?"])[0]
                why = why.strip().splitlines()[-1]
                print(f"  {c['label']:<52} {c['status']}: {why[:100]}")
                continue
            b = c["blocked_s"]["median"] if c["blocked_s"] else float("nan")
            d = c["durable_s"]["median"] if c["durable_s"] else float("nan")
            extra = ""
            if c.get("slowdown_pct"):
                extra = f"  slowdown {c['slowdown_pct']['median']:6.1f}%"
            if c.get("slowdown_until_durable_pct"):
                extra += f" (incl. drain {c['slowdown_until_durable_pct']['median']:6.1f}%)"
            if c.get("cost_per_ckpt_s"):
                extra = f"  cost/ckpt {c['cost_per_ckpt_s']['median']:8.4f}s"
            ok = "bit-exact" if c["verified"] else "NOT VERIFIED"
            print(f"  {c['label']:<52} blocked {b:8.4f}s  durable {d:8.4f}s{extra}  {ok}")
        for key, v in (s.get("ratios") or {}).items():
            print(f"  cost per checkpoint {key}: {'-' if v is None else f'{v:.3f}'}")


def _print_memory(s: dict[str, Any]) -> None:
    mib = 1024 * 1024
    for r in s["rows"]:
        if "growth_bytes" not in r:
            print(f"  {r['mode']:<9} {r['state']:<10} FAILED: {str(r['error']).splitlines()[-1]}")
            continue
        verdict = "ok" if r["within_bound"] else "OVER BOUND"
        err = f"  error: {r['error'].splitlines()[-1][:80]}" if r.get("error") else ""
        print(
            f"  {r['mode']:<9} {r['state']:<10} {r['save']:<6} growth "
            f"{r['growth_bytes'] / mib:7.1f} MiB  bound {r['bound_bytes'] / mib:7.1f} MiB  "
            f"{verdict}{err}"
        )


def main(argv: list[str] | None = None) -> int:
    from benchmarks.summary import summarize_scenario

    args = build_parser().parse_args(argv)
    if args.render:  # re-render an earlier run's outputs (after a change to report/plots)
        with open(os.path.join(args.render, "results.json")) as f:
            render(json.load(f), os.path.abspath(args.render), plots=not args.no_plots)
        return 0
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("--device cuda requested but CUDA is not available", file=sys.stderr)
            return 2
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    here = os.path.dirname(os.path.abspath(__file__))
    out_dir = os.path.abspath(args.out or os.path.join(here, "results", "tmp", stamp))
    os.makedirs(out_dir, exist_ok=True)
    own_root = args.dir is None
    root = tempfile.mkdtemp(prefix="dcp_ds_bench_", dir="/tmp") if own_root else args.dir
    os.makedirs(root, exist_ok=True)
    plan = make_plan(args, os.path.join(root, "ckpt"))
    started, t0 = now_iso(), time.monotonic()
    busy0, own0 = cpu_busy_seconds(), own_cpu_seconds()
    cmd_args = sys.argv[1:] if argv is None else argv
    results: dict[str, Any] = {
        "meta": {
            "command": "python -m benchmarks.run " + shlex.join(cmd_args),
            "started": started,
            "machine": machine_info(root, args.device),
            "options": plan.options.to_json(),
            "isolate": plan.isolate,
        },
        "scenarios": [],
    }
    raw: dict[str, Any] = {}
    done: dict[str, dict[str, Any]] = {}
    try:
        jobs = _jobs(plan)
        job_dirs = [os.path.join(root, "results", f"job{i}") for i in range(len(jobs))]
        running: dict[int, tuple[float, list[mp.process.BaseProcess]]] = {}
        if plan.side_by_side:  # every job started now, each waited for below
            for i, job in enumerate(jobs):
                print(f"== job {i} started: {', '.join(s.name for s in job)}", flush=True)
                running[i] = (time.monotonic(), start_job(plan, job, job_dirs[i]))
        for i, job in enumerate(jobs):
            job_dir = job_dirs[i]
            if i in running:
                t_job, procs = running[i]
            else:
                print(f"== job {i}: {', '.join(s.name for s in job)}", flush=True)
                t_job, procs = time.monotonic(), start_job(plan, job, job_dir)
            failures = wait_job(plan, job, procs, t_job)
            print(f"   job {i} done, {time.monotonic() - t_job:.1f} s after its start", flush=True)
            for scn in job:
                per_rank = _load_rank_results(job_dir, scn)
                if per_rank is None:
                    summary: dict[str, Any] = {"error": failures.get(scn.name, "no results")}
                else:
                    summary = summarize_scenario(scn.kind, per_rank, scn.to_json())
                    raw[scn.name] = per_rank
                done[scn.name] = {
                    "name": scn.name,
                    "kind": scn.kind,
                    "description": scn.description,
                    "scenario": scn.to_json(),
                    "summary": summary,
                }
        # in the order of the plan, whichever job ran each scenario
        results["scenarios"] = [done[s.name] for s in plan.scenarios]
    finally:
        if own_root and not args.keep_checkpoints:
            shutil.rmtree(root, ignore_errors=True)
    results["meta"]["elapsed_s"] = time.monotonic() - t0
    busy1 = cpu_busy_seconds()
    if busy0 is not None and busy1 is not None:
        # CPU used by processes other than this run: a busy machine skews every timing
        other = max(0.0, (busy1 - busy0) - (own_cpu_seconds() - own0))
        cap = results["meta"]["elapsed_s"] * (os.cpu_count() or 1)
        results["meta"]["other_cpu_s"] = other
        results["meta"]["other_cpu_frac"] = other / cap if cap else None
    results["meta"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    write_json(os.path.join(out_dir, "raw.json"), raw, indent=None)
    render(results, out_dir, plots=not args.no_plots)
    print(f"results: {out_dir}/results.md (took {results['meta']['elapsed_s']:.0f} s)")
    return 0


def render(results: dict[str, Any], out_dir: str, plots: bool = True) -> None:
    """Write results.json, results.md and the PNGs of ``results`` into ``out_dir``."""
    made: dict[str, list[str]] = {}
    if plots:
        from benchmarks.plots import make_all

        made = make_all(results, out_dir)
    results["meta"]["plots"] = {k: [os.path.basename(p) for p in v] for k, v in made.items()}
    write_json(os.path.join(out_dir, "results.json"), results)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(results, made, out_dir))
    _print_summary(results)


if __name__ == "__main__":
    raise SystemExit(main())
