"""The ``mlp-loop`` scenario: what checkpointing costs a training loop, end to end.

An MLP (``depth`` square ``Linear`` layers of ``width``, GELU between them) trained with AdamW
on random regression batches; the ``large`` preset holds ~0.9 GB of fp32 state (parameters and
the two Adam moments). Every ``ckpt_every``-th iteration, after the optimizer step, the loop
checkpoints ``{"model", "optim"}`` from ``get_state_dict`` with one contender:

* ``none``: no checkpoint (the baseline);
* ``ds_plain``: ``dcp.async_save(state, storage_writer=DataStatesWriter(...))``, nothing else:
  no ``protect()``, no wait before the step, the default capture;
* ``dcp_fs_t2``: synchronous ``dcp.save`` with ``FileSystemWriter(thread_count=2)``;
* ``dcp_default_stager``: ``dcp.async_save(..., async_stager=DefaultStager(...))``, waiting on
  ``staging_completion`` before the next step, one upload in flight (torchtitan's pattern);
* ``dcp_async``: plain ``dcp.async_save`` with its default staging and ``FileSystemWriter``.

The loop time runs from the first timed iteration until the last checkpoint is durable (the
drain is inside it for every contender, so background work cannot hide). *Cost per checkpoint*
is ``(loop time - loop time of none) / checkpoints``, paired within a round. Every run is a
fresh process (:func:`run_in_child`), so each contender's ``VmHWM`` is its own.

Each run's last checkpoint is loaded with the stock ``dcp.load`` and compared bit for bit with
the live state. With ``verify_first`` the first checkpoint is checked too, against a replay of
the same iterations in a fresh model (CPU training is deterministic for a fixed thread count):
that catches a method that captured state modified by the steps after the save call.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

NONE = "none"


@dataclass(frozen=True)
class MLPConfig:
    """Shape of the model and of one batch."""

    width: int
    depth: int
    batch: int

    def param_count(self) -> int:
        return self.depth * (self.width * self.width + self.width)

    def state_bytes(self) -> int:
        """fp32 parameters + two AdamW moments (+ one step counter per parameter)."""
        return 3 * 4 * self.param_count() + 4 * 2 * self.depth


MLP_PRESETS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(width=256, depth=4, batch=8),  # ~3 MB of state: --quick and CI
    "large": MLPConfig(width=3584, depth=6, batch=32),  # 77 M params, 0.93 GB of state
}


def mlp_config(preset: str) -> MLPConfig:
    if preset not in MLP_PRESETS:
        raise ValueError(f"unknown MLP preset {preset!r}; choose from {sorted(MLP_PRESETS)}")
    return MLP_PRESETS[preset]


def make_mlp(cfg: MLPConfig, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A freshly initialised MLP and AdamW (fused where torch supports it on CPU)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(cfg.depth):
        layers.append(nn.Linear(cfg.width, cfg.width))
        if i < cfg.depth - 1:
            layers.append(nn.GELU())
    model = nn.Sequential(*layers)
    try:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, TypeError):  # no fused CPU kernel in this torch
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def make_batches(cfg: MLPConfig, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(cfg.batch, cfg.width, generator=gen),
            torch.randn(cfg.batch, cfg.width, generator=gen),
        )
        for _ in range(n)
    ]


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def mlp_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


@dataclass(frozen=True)
class MLPRunSpec:
    """One run of one contender, executed in a fresh process."""

    contender: str
    preset: str
    iters: int
    ckpt_every: int
    warmup: int
    threads: int
    run_dir: str
    host_cache: str = "auto"  # "auto": the checkpoint fits, else a size like "512MiB"
    fs_threads: int = 2
    max_in_flight: int = 1
    ds_options: dict[str, Any] = field(default_factory=dict)
    verify_first: bool = False
    rep: int = 0


def _host_cache_bytes(spec: MLPRunSpec, nbytes: int, ntensors: int) -> int:
    from benchmarks.workloads import MiB, parse_size

    if spec.host_cache != "auto":
        return parse_size(spec.host_cache)
    return nbytes + ntensors * 8 * 1024 + 64 * MiB


def run_once(spec: MLPRunSpec) -> dict[str, Any]:
    """One run of ``spec`` in this process; returns its JSON-able measurements."""
    from benchmarks.contenders import SaveContext, SaveRecord, make_contender
    from benchmarks.contention import thread_cpu_seconds
    from benchmarks.metrics import now, release_memory, rss_bytes, vmhwm_bytes
    from benchmarks.scenarios import finish_saves, teardown_quietly
    from benchmarks.verify import compare_trees, empty_like_tree
    from benchmarks.workloads import count_tensors, state_bytes

    if spec.iters % spec.ckpt_every != 0:
        raise ValueError("iters must be a multiple of ckpt_every (the last iteration saves)")
    torch.set_num_threads(spec.threads)
    cfg = mlp_config(spec.preset)
    batches = make_batches(cfg, spec.warmup + spec.iters)
    run: dict[str, Any] = {"rep": spec.rep, "saves": [], "error": None, "threads": spec.threads}
    c = None if spec.contender == NONE else make_contender(spec.contender)
    records: list[SaveRecord] = []
    try:
        model, opt = make_mlp(cfg)
        for x, y in batches[: spec.warmup]:
            train_step(model, opt, x, y)  # also creates the AdamW state
        probe = mlp_state(model, opt)
        nbytes, ntensors = state_bytes(probe), count_tensors(probe)
        del probe
        run["bytes"] = nbytes
        if c is not None:
            ctx = SaveContext(
                rank=0,
                world_size=1,
                device=torch.device("cpu"),
                pg=None,
                fs_threads=spec.fs_threads,
                host_cache_bytes=_host_cache_bytes(spec, nbytes, ntensors),
                max_in_flight=spec.max_in_flight,
                ds_options=dict(spec.ds_options),
            )
            run["host_cache_bytes"] = ctx.host_cache_bytes
            c.setup(ctx, spec.run_dir, opt)
            run["label"] = c.label
        release_memory()
        rss0 = rss_bytes()
        cpu0 = thread_cpu_seconds()
        iters: list[list[float]] = []
        pending: SaveRecord | None = None
        t_loop0 = now()
        for it in range(spec.iters):
            x, y = batches[spec.warmup + it]
            t0 = now()
            loss = nn.functional.mse_loss(model(x), y)
            t1 = now()
            loss.backward()
            t2 = now()
            w0 = w1 = t2
            if pending is not None and c is not None:
                c.barrier(pending)  # ds_plain: nothing; DefaultStager: staging_completion
                w0, w1 = pending.t_wait0 or t2, pending.t_wait1 or t2
                pending = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = now()
            if c is not None and (it + 1) % spec.ckpt_every == 0:
                state = mlp_state(model, opt)
                ckpt = os.path.join(spec.run_dir, f"it{it + 1:05d}")
                pending = c.begin(state, ckpt, len(records), nbytes)
                pending.t_call = t3  # get_state_dict is part of what the save costs training
                records.append(pending)
                del state
            t4 = now()
            iters.append([t0, t1, t2, w0, w1, t3, t4])
        t_loop1 = now()
        if c is not None:
            c.drain()
        t_end = now()
        cpu1 = thread_cpu_seconds()
        run["thread_cpu_s"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
        run.update(
            {
                "t_loop0": t_loop0,
                "loop_s": t_end - t_loop0,  # includes the drain
                "loop_no_drain_s": t_loop1 - t_loop0,
                "drain_s": t_end - t_loop1,
                "iters": iters,
                "rss_before_loop": rss0,
                "vmhwm": vmhwm_bytes(),
            }
        )
        finish_saves(c, records, run)
        if c is not None:
            run["saves"] = [r.to_json() for r in records]
            verify = []
            if records:
                live = mlp_state(model, opt)
                target = empty_like_tree(live)
                c.load(records[-1].ckpt_dir, target)
                verify.append({"save": len(records) - 1, **compare_trees(live, target).to_json()})
                del live, target
            if spec.verify_first and len(records) > 1:
                del model, opt
                release_memory()
                model, opt = make_mlp(cfg)
                for x, y in batches[: spec.warmup + spec.ckpt_every]:
                    train_step(model, opt, x, y)
                replay = mlp_state(model, opt)
                target = empty_like_tree(replay)
                c.load(records[0].ckpt_dir, target)
                verify.append(
                    {"save": 0, "replayed": True, **compare_trees(replay, target).to_json()}
                )
                del replay, target
            run["verify"] = verify
    except BaseException as e:  # CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        run["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]
    finally:
        if c is not None:
            failed = teardown_quietly(c)
            if failed and not run["error"]:
                run["error"] = f"teardown: {failed}"
        if not run["saves"]:
            run["saves"] = [r.to_json() for r in records]
        shutil.rmtree(spec.run_dir, ignore_errors=True)
    return run


def _child(spec: dict[str, Any], out_path: str) -> None:
    """Entry point of the spawned process (importable, so spawn can pickle it by reference)."""
    res = run_once(MLPRunSpec(**spec))
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, out_path)


def run_in_child(spec: MLPRunSpec, out_path: str, timeout_s: float) -> dict[str, Any]:
    """Runs ``spec`` in a freshly spawned process; a dead or hung child becomes ``error``.

    The child is killed if it outlives ``timeout_s``; this never raises for a failed run.
    """
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_child, args=(asdict(spec), out_path), name=f"mlp-{spec.contender}")
    p.start()
    p.join(timeout_s)
    if p.is_alive():
        p.terminate()
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
        return {"rep": spec.rep, "saves": [], "error": f"no result within {timeout_s:.0f} s"}
    if p.exitcode != 0 or not os.path.exists(out_path):
        return {"rep": spec.rep, "saves": [], "error": f"child exited with {p.exitcode}"}
    with open(out_path) as f:
        result: dict[str, Any] = json.load(f)
    os.remove(out_path)
    return result
