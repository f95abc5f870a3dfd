"""Scenarios: what is measured, and the per-rank loops that measure it.

Two kinds:

* ``synthetic``: a synthetic state dict (:mod:`benchmarks.workloads`) saved ``saves`` times per
  repeat by each contender. The optimizer-step barrier is taken right after the save call (no
  compute to hide behind: the worst case for asynchronous methods), then the harness waits until
  the checkpoint is durable. Between saves every tensor is changed in place, so consecutive
  checkpoints differ. With ``check_barrier`` the change happens right after the barrier, while
  flushes may still be running, and the loaded checkpoint is compared with a copy taken before
  the save: this catches a method that reads live tensors after it said it was done with them.
* ``training``: the tiny GPT trains ``iters`` iterations and checkpoints every ``ckpt_every``
  (after the optimizer step, like DataStates); asynchronous methods wait at the next step. The
  same loop without checkpointing is the baseline, run in the same rotation.

Contenders run interleaved: in repeat ``r`` the order is rotated by ``r``, so slow drift of the
machine (page cache, thermal, neighbours) hits all alike. Each contender's last checkpoint of a
repeat is read back with the stock loader of its format after evicting it from the page cache,
and compared bit for bit.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.contenders import (
    Contender,
    SaveContext,
    SaveRecord,
    make_contender,
)
from benchmarks.disk import measure_write_bandwidth, measure_write_tax
from benchmarks.metrics import (
    PeakRSS,
    disk_bytes,
    evict_page_cache,
    now,
    release_memory,
    rss_bytes,
)
from benchmarks.verify import clone_tree, compare_trees, empty_like_tree
from benchmarks.workloads import (
    MiB,
    SyntheticSpec,
    count_tensors,
    gpt_config,
    make_gpt,
    perturb_,
    state_bytes,
    synthetic_state_dict,
)

BASELINE = "baseline"


@dataclass(frozen=True)
class Scenario:
    """One measured situation. ``synthetic.total_bytes`` is the total over all ranks."""

    name: str
    kind: str  # "synthetic" | "training"
    contenders: tuple[str, ...]
    repeats: int
    world_size: int = 1
    synthetic: SyntheticSpec | None = None
    cache_fraction: float | None = None  # DataStates host cache / per-rank bytes; None: fits
    saves: int = 2
    check_barrier: bool = False
    gpt_preset: str = "small"
    ckpt_every: int = 1
    iters: int = 12
    warmup: int = 2
    mlp_preset: str = "large"  # kind "mlp"
    memory_bytes: int = 0  # kind "memory": size of the mixed state
    memory_states: str = "mixed,bigtensor"  # kind "memory": comma list
    memory_parallel: int = 1  # kind "memory": rows measured at once (VmHWM is per process)
    mlp_parallel: int = 1  # kind "mlp": contender processes run at once (1: timings mean something)
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["contenders"] = list(self.contenders)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Scenario:
        d = dict(d)
        d["contenders"] = tuple(d["contenders"])
        if d.get("synthetic") is not None:
            d["synthetic"] = SyntheticSpec(**d["synthetic"])
        return cls(**d)


@dataclass(frozen=True)
class RunOptions:
    """Settings shared by all scenarios of one invocation."""

    root: str  # checkpoint directories go below this
    device: str = "cpu"
    fs_threads: int = 2
    max_in_flight: int = 1
    ds_max_in_flight: int = 0
    host_cache: str = "auto"  # "auto" (checkpoint fits, with headroom) or a size like "2GiB"
    ds_options: dict[str, Any] = field(default_factory=dict)
    disk_probe_max_bytes: int = 1024 * MiB
    keep_checkpoints: bool = False
    torch_threads: int = 0  # intra-op threads per rank; 0: cores / ranks
    contend: int = 0  # busy processes beside each measured run (benchmarks.contention)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Env:
    """This rank's view of the run."""

    rank: int
    world_size: int
    device: torch.device
    pg: dist.ProcessGroup | None
    peak: PeakRSS

    def sync(self) -> None:
        """Barrier across ranks (default group, never the checkpoint group) + device sync."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if self.world_size > 1:
            dist.barrier()

    def device_sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def host_cache_bytes(opts: RunOptions, scn: Scenario, per_rank_bytes: int, n_tensors: int) -> int:
    """DataStates host cache for this scenario: a fraction of the checkpoint, or one that fits."""
    from benchmarks.workloads import parse_size

    if scn.cache_fraction is not None:
        return max(MiB, int(per_rank_bytes * scn.cache_fraction))
    if opts.host_cache != "auto":
        return parse_size(opts.host_cache)
    # fits: the payload plus headroom for per-tensor archive headers and 4 KiB alignment
    return per_rank_bytes + n_tensors * 8 * 1024 + 64 * MiB


def _rotate(items: list[str], r: int) -> list[str]:
    if not items:
        return items
    r %= len(items)
    return items[r:] + items[:r]


def _error_text(e: BaseException) -> str:
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    return "".join(lines[-6:]).strip()


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _load_and_verify(env: Env, c: Contender, ckpt_dir: str, expected: Any) -> dict[str, Any]:
    """Evict ``ckpt_dir`` from the page cache, load it with the stock loader, compare."""
    target = empty_like_tree(expected)
    env.sync()
    evicted = evict_page_cache(ckpt_dir)
    env.sync()
    t0 = now()
    loaded = c.load(ckpt_dir, target)
    load_s = now() - t0
    res = compare_trees(expected, loaded)
    del target, loaded
    release_memory()
    return {"load_s": load_s, "cold": evicted, "verify": res.to_json(), "loader": c.loader}


def _contender_header(name: str, c: Contender | None, skip: str | None) -> dict[str, Any]:
    """The record of contender ``name`` in a scenario's output (``c`` None: the baseline)."""
    return {
        "name": name,
        "label": c.label if c is not None else "no checkpointing",
        "format": c.fmt if c is not None else None,
        "loader": c.loader if c is not None else None,
        "asynchronous": c.asynchronous if c is not None else False,
        "status": "skipped" if skip else "ok",
        "skip_reason": skip,
        "runs": [],
    }


def _declare_contenders(
    out: dict[str, Any], names: Sequence[str], device: torch.device
) -> list[str]:
    """Adds each contender's header to ``out["contenders"]``; returns those that run here."""
    active: list[str] = []
    for name in names:
        c = make_contender(name)
        skip = c.skip_reason(device)
        out["contenders"][name] = _contender_header(name, c, skip)
        if skip is None:
            active.append(name)
    return active


def finish_saves(c: Contender | None, records: list[SaveRecord], run: dict[str, Any]) -> None:
    """After a loop's saves: raises if one failed, else records ``c``'s telemetry and tears it down.

    Raises ``RuntimeError`` naming how many saves failed and the first error.
    """
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} save(s) failed; first: {errors[0]}")
    if c is not None:
        run["telemetry"] = c.telemetry()
        c.annotate(records)
        c.teardown()


def teardown_quietly(c: Contender) -> str | None:
    """``c.teardown()`` after an error; returns its own failure as text instead of raising it.

    Only ``KeyboardInterrupt`` and ``SystemExit`` propagate, so the first error is never masked.
    """
    try:
        c.teardown()
    except BaseException as e:  # noqa: BLE001 - teardown after an error must not mask it
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------------
def run_synthetic(scn: Scenario, opts: RunOptions, env: Env) -> dict[str, Any]:
    assert scn.synthetic is not None
    spec = SyntheticSpec(scn.synthetic.total_bytes // env.world_size, scn.synthetic.mix)
    prefix = f"rank{env.rank}." if env.world_size > 1 else ""
    state = synthetic_state_dict(spec, env.device, seed=1000 + env.rank, prefix=prefix)
    nbytes = state_bytes(state)
    ctx = SaveContext(
        rank=env.rank,
        world_size=env.world_size,
        device=env.device,
        pg=env.pg,
        fs_threads=opts.fs_threads,
        host_cache_bytes=host_cache_bytes(opts, scn, nbytes, len(state)),
        max_in_flight=opts.max_in_flight,
        ds_max_in_flight=opts.ds_max_in_flight,
        ds_options=dict(opts.ds_options),
    )
    out: dict[str, Any] = {
        "rank": env.rank,
        "bytes": nbytes,
        "tensors": len(state),
        "host_cache_bytes": ctx.host_cache_bytes,
        "disk": [],
        "contenders": {},
    }
    active = _declare_contenders(out, scn.contenders, env.device)

    base = os.path.join(opts.root, scn.name)
    counter = 0
    for rep in range(scn.repeats):
        if env.rank == 0:
            probe = min(nbytes * env.world_size, opts.disk_probe_max_bytes)
            out["disk"].append(measure_write_bandwidth(base, probe).to_json())
        env.sync()
        for name in _rotate(active, rep):
            run, counter = _synthetic_run(scn, opts, env, ctx, state, nbytes, name, rep, counter)
            _record(out, name, run)
    return out


def _record(out: dict[str, Any], name: str, run: dict[str, Any]) -> None:
    """Appends one run of contender ``name`` to a scenario's output."""
    entry = out["contenders"][name]
    entry["runs"].append(run)
    if run.get("label"):
        entry["label"] = run["label"]
    if run.get("error"):
        entry["status"] = "error"


def _synthetic_run(
    scn: Scenario,
    opts: RunOptions,
    env: Env,
    ctx: SaveContext,
    state: dict[str, torch.Tensor],
    nbytes: int,
    name: str,
    rep: int,
    counter: int,
) -> tuple[dict[str, Any], int]:
    run_dir = os.path.join(opts.root, scn.name, name, f"rep{rep}")
    c = make_contender(name)
    run: dict[str, Any] = {"rep": rep, "saves": [], "error": None}
    records: list[SaveRecord] = []
    expected: Any = None
    try:
        release_memory()
        env.sync()
        rss0 = rss_bytes()
        c.setup(ctx, run_dir)
        run["label"] = c.label
        for s in range(scn.saves):
            if counter > 0 and not scn.check_barrier:
                perturb_(state, counter)  # outside the timed window
            expected = clone_tree(state) if scn.check_barrier else None
            ckpt = os.path.join(run_dir, f"save{s}")
            env.sync()
            env.peak.reset()
            rss_before = rss_bytes()
            rec = c.begin(state, ckpt, s, nbytes)
            c.barrier(rec)
            if scn.check_barrier:
                perturb_(state, counter)  # the "optimizer step": flushes may still run
            c.drain()
            env.device_sync()
            rec.peak_rss = env.peak.peak()
            rec.rss_before = rss_before
            records.append(rec)
            counter += 1
            if rec.error:
                raise RuntimeError(f"save {s} failed: {rec.error}")
            env.sync()
            if s < scn.saves - 1 and env.rank == 0 and not opts.keep_checkpoints:
                _rmtree(ckpt)
        release_memory()  # count live buffers, not freed heap glibc has not returned yet
        run["held_bytes"] = rss_bytes() - rss0
        finish_saves(c, records, run)
        last = records[-1].ckpt_dir
        run["disk_bytes"] = disk_bytes(last) if env.rank == 0 else None
        if expected is None:
            expected = state
        run.update(_load_and_verify(env, c, last, expected))
    except BaseException as e:  # CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        run["error"] = _error_text(e)
    finally:
        teardown_quietly(c)
        run["saves"] = [r.to_json() for r in records]
        expected = None
        release_memory()
        if env.rank == 0 and not opts.keep_checkpoints:
            _rmtree(run_dir)
    return run, counter


# ---------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------
def _gpt_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def run_training(scn: Scenario, opts: RunOptions, env: Env) -> dict[str, Any]:
    cfg = gpt_config(scn.gpt_preset)
    if scn.iters % scn.ckpt_every != 0:
        raise ValueError("iters must be a multiple of ckpt_every (the last iteration saves)")
    gen = torch.Generator().manual_seed(1234)
    from benchmarks.tiny_gpt import random_batch

    batches = [random_batch(cfg, gen, env.device) for _ in range(scn.warmup + scn.iters)]
    model, opt = make_gpt(cfg, env.device, seed=0)
    x, y = batches[0]
    model(x, y).backward()
    opt.step()  # creates the AdamW state, so the checkpoint has its final size
    probe = _gpt_state(model, opt)
    nbytes, ntensors = state_bytes(probe), count_tensors(probe)
    del model, opt, probe
    ctx = SaveContext(
        rank=env.rank,
        world_size=env.world_size,
        device=env.device,
        pg=env.pg,
        fs_threads=opts.fs_threads,
        host_cache_bytes=host_cache_bytes(opts, scn, nbytes, ntensors),
        max_in_flight=opts.max_in_flight,
        ds_max_in_flight=opts.ds_max_in_flight,
        ds_options=dict(opts.ds_options),
    )
    out: dict[str, Any] = {
        "rank": env.rank,
        "params": cfg.param_count(),
        "gpt": asdict(cfg),
        "host_cache_bytes": ctx.host_cache_bytes,
        "contenders": {BASELINE: _contender_header(BASELINE, None, None)},
    }
    active = [BASELINE, *_declare_contenders(out, scn.contenders, env.device)]
    # one discarded loop first: lazy initialisation (allocator, kernels, thread pools) would
    # otherwise be charged to whichever run comes first
    _training_run(scn, opts, env, ctx, batches, BASELINE, -1)
    for rep in range(scn.repeats):
        for name in _rotate(active, rep):
            run = _training_run(scn, opts, env, ctx, batches, name, rep)
            _record(out, name, run)
    return out


def _training_run(
    scn: Scenario,
    opts: RunOptions,
    env: Env,
    ctx: SaveContext,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    name: str,
    rep: int,
) -> dict[str, Any]:
    run_dir = os.path.join(opts.root, scn.name, name, f"rep{rep}")
    c: Contender | None = None if name == BASELINE else make_contender(name)
    run: dict[str, Any] = {"rep": rep, "saves": [], "error": None}
    records: list[SaveRecord] = []
    sync: Callable[[], None] = env.device_sync
    try:
        model, opt = make_gpt(gpt_config(scn.gpt_preset), env.device, seed=0)
        for x, y in batches[: scn.warmup]:
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        release_memory()
        rss0 = rss_bytes()
        if c is not None:
            c.setup(ctx, run_dir, opt)
            run["label"] = c.label
        nbytes = state_bytes(_gpt_state(model, opt))
        run["bytes"] = nbytes
        iters: list[list[float]] = []
        statedict_s: list[float] = []
        pending: SaveRecord | None = None
        env.peak.reset()
        t_loop0 = now()
        for it in range(scn.iters):
            x, y = batches[scn.warmup + it]
            t0 = now()
            loss = model(x, y)
            sync()
            t1 = now()
            loss.backward()
            sync()
            t2 = now()
            w0 = w1 = t2
            if pending is not None and c is not None:
                c.barrier(pending)  # wait at the step (DataStates: until captured)
                w0, w1 = pending.t_wait0 or t2, pending.t_wait1 or t2
                pending = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            t3 = now()
            if c is not None and (it + 1) % scn.ckpt_every == 0:
                state = _gpt_state(model, opt)
                t_sd = now()
                statedict_s.append(t_sd - t3)
                ckpt = os.path.join(run_dir, f"it{it + 1:05d}")
                pending = c.begin(state, ckpt, len(records), nbytes)
                records.append(pending)
                if pending.error:
                    raise RuntimeError(f"save failed: {pending.error}")
            t4 = now()
            iters.append([t0, t1, t2, w0, w1, t3, t4])
        t_loop1 = now()
        if c is not None:
            c.drain()
        t_drained = now()
        peak = env.peak.peak()
        release_memory()  # count live buffers, not freed heap glibc has not returned yet
        run.update(
            {
                "t_loop0": t_loop0,
                "loop_s": t_loop1 - t_loop0,
                "until_durable_s": t_drained - t_loop0,
                "iters": iters,
                "statedict_s": statedict_s,
                "peak_rss": peak,
                "held_bytes": rss_bytes() - rss0,
            }
        )
        finish_saves(c, records, run)
        if c is not None and records:
            run.update(_load_and_verify(env, c, records[-1].ckpt_dir, _gpt_state(model, opt)))
    except BaseException as e:  # CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        run["error"] = _error_text(e)
    finally:
        if c is not None:
            teardown_quietly(c)
        run["saves"] = [r.to_json() for r in records]
        release_memory()
        if env.rank == 0 and not opts.keep_checkpoints:
            _rmtree(run_dir)
    return run


# ---------------------------------------------------------------------------------------
# mlp-loop: one fresh process per contender run
# ---------------------------------------------------------------------------------------
MLP_CHILD_TIMEOUT_S = 900.0


def run_mlp_loop(scn: Scenario, opts: RunOptions, env: Env) -> dict[str, Any]:
    """Rounds of every contender (order rotated per round), each run in its own process."""
    from benchmarks.contention import contention
    from benchmarks.mlp_loop import NONE, MLPRunSpec, mlp_config, run_in_child

    if env.world_size != 1:
        raise ValueError("mlp-loop runs on one rank")
    cfg = mlp_config(scn.mlp_preset)
    threads = opts.torch_threads or (os.cpu_count() or 1)
    out: dict[str, Any] = {
        "rank": env.rank,
        "mlp": asdict(cfg),
        "params": cfg.param_count(),
        "threads": threads,
        "contend": opts.contend,
        "contenders": {NONE: _contender_header(NONE, None, None)},
    }
    active = [NONE, *_declare_contenders(out, scn.contenders, env.device)]
    base = os.path.join(opts.root, scn.name)
    os.makedirs(base, exist_ok=True)
    out["write_tax"] = []
    for rep in range(scn.repeats):
        # What writing one checkpoint's bytes in the background costs a job using every core
        # (benchmarks.disk.measure_write_tax): the floor of every asynchronous contender here.
        probe_s = 2.0 if cfg.state_bytes() >= 256 * 1024**2 else 0.3  # --quick stays quick
        out["write_tax"].append(measure_write_tax(base, cfg.state_bytes(), threads, probe_s))
        specs = [
            MLPRunSpec(
                contender=name,
                preset=scn.mlp_preset,
                iters=scn.iters,
                ckpt_every=scn.ckpt_every,
                warmup=scn.warmup,
                threads=threads,
                run_dir=os.path.join(base, name, f"rep{rep}"),
                host_cache=opts.host_cache,
                fs_threads=opts.fs_threads,
                max_in_flight=opts.max_in_flight,
                ds_options=dict(opts.ds_options),
                verify_first=rep == 0 and name != NONE,
                rep=rep,
            )
            for name in _rotate(active, rep)
        ]

        def one(spec: MLPRunSpec, rep: int = rep) -> dict[str, Any]:
            print(f"   {scn.name} round {rep}: {spec.contender}", flush=True)
            with contention(opts.contend):
                return run_in_child(
                    spec,
                    os.path.join(base, f"{spec.contender}.rep{rep}.json"),
                    MLP_CHILD_TIMEOUT_S,
                )

        # side by side only on request (--quick: a smoke run, its timings not compared)
        workers = 1 if opts.contend else max(1, scn.mlp_parallel)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            runs = list(pool.map(one, specs))
        for spec, run in zip(specs, runs, strict=True):
            _record(out, spec.contender, run)
    return out


# ---------------------------------------------------------------------------------------
# memory: one fresh process per row
# ---------------------------------------------------------------------------------------
def run_memory(scn: Scenario, opts: RunOptions, env: Env) -> dict[str, Any]:
    """Every capture mode on every state, each in its own process (see benchmarks.memory)."""
    from benchmarks.memory import MODES, SLACK_BYTES, MemoryRow, run_row

    states = [s for s in scn.memory_states.split(",") if s]
    frac = scn.cache_fraction if scn.cache_fraction is not None else 0.125
    todo = [
        MemoryRow(m, st, scn.memory_bytes, frac, timeout_s=300.0) for st in states for m in MODES
    ]

    def one(row: MemoryRow) -> dict[str, Any]:
        print(f"   {scn.name}: {row.name}", flush=True)
        try:
            return run_row(
                row, os.path.join(opts.root, scn.name, row.mode.replace(".", "_"), row.state)
            )
        except RuntimeError as e:
            return {"row": asdict(row), "name": row.name, "saves": [], "error": str(e)}

    with concurrent.futures.ThreadPoolExecutor(max(1, scn.memory_parallel)) as pool:
        rows = list(pool.map(one, todo))
    _rmtree(os.path.join(opts.root, scn.name))
    return {"rank": env.rank, "slack_bytes": SLACK_BYTES, "rows": rows}


def run_scenario(scn: Scenario, opts: RunOptions, env: Env) -> dict[str, Any]:
    if scn.kind == "synthetic":
        return run_synthetic(scn, opts, env)
    if scn.kind == "training":
        return run_training(scn, opts, env)
    if scn.kind == "mlp":
        return run_mlp_loop(scn, opts, env)
    if scn.kind == "memory":
        return run_memory(scn, opts, env)
    raise ValueError(f"unknown scenario kind {scn.kind!r}")
