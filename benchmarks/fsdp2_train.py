"""An FSDP2 training loop on one device with a checkpoint every few steps, every figure as a
ratio to the same run's peers.

One process (world size 1: NCCL on ``cuda``, gloo on ``cpu`` for a dry run), a stack of
``--layers`` linear blocks of width ``--width`` wrapped with ``fully_shard`` (FSDP2) per block and
at the root, AdamW: parameters and optimizer state are DTensors, and the state DCP sees
(``get_state_dict``) is ``--layers * width**2 * 12`` bytes (fp32 weights + two moments; the
default 40 x 4096 is 8.05 GB). The same model trains on through every contender, in turn:

* ``none``: no checkpoint, the reference step time;
* ``ds_plain``: ``dcp.async_save(state, storage_writer=DataStatesWriter(...))`` and nothing
  else (the plain call; the step waits for the lazy copies by itself);
* ``dcp_async_stager``: ``dcp.async_save`` with torch's ``DefaultStager`` (pinned, async);
* ``dcp_fs_tN``: ``dcp.save`` with the multi-threaded ``FileSystemWriter``.

Each contender runs ``--iters`` steps and checkpoints every ``--ckpt-every``-th (the last step
included), then drains. Reported per contender, as ratios: median step time to ``none``'s
(``x_step``); time the training thread was blocked per checkpoint (call + wait at the step) to
``none``'s step (``blocked_x_step``); time until durable to the fastest contender's
(``durable_x_best``); plus the raw seconds. ``ds_plain``'s last checkpoint is read back with
``dcp.load`` and compared bit for bit (``--no-verify`` skips it). ``--budget-s`` stops starting
contenders once spent, so a run fits the time it is given.

    python -m benchmarks.fsdp2_train --device cuda --out fsdp2.json
    python -m benchmarks.fsdp2_train --device cpu --layers 4 --width 256 --iters 2 --ckpt-every 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.contenders import SaveContext, SaveRecord, make_contender  # noqa: E402

BASELINE = "none"


def _fully_shard() -> Any:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def build(layers: int, width: int, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The FSDP2 model and its AdamW, with the optimizer state created (one step)."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.GELU())
              for _ in range(layers)]
    model = torch.nn.Sequential(*blocks).to(device)
    shard = _fully_shard()
    for b in blocks:
        shard(b)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt, torch.randn(8, width, device=device))
    return model, opt


def step(model: torch.nn.Module, opt: Any, x: torch.Tensor) -> None:
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def dcp_state(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def host_copy(sd: Any) -> Any:
    """A CPU copy of the state (DTensors as their full tensors: one rank holds everything)."""
    if isinstance(sd, torch.Tensor):
        t = sd.full_tensor() if hasattr(sd, "full_tensor") else sd
        return t.detach().to("cpu", copy=True)
    if isinstance(sd, dict):
        return {k: host_copy(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [host_copy(v) for v in sd]
    return sd


def nbytes_of(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return int(sd.numel() * sd.element_size())
    if isinstance(sd, dict):
        return sum(nbytes_of(v) for v in sd.values())
    if isinstance(sd, list):
        return sum(nbytes_of(v) for v in sd)
    return 0


def verify(ckpt: str, expected: Any) -> str:
    """'' when ``ckpt`` read back with dcp.load equals ``expected`` bit for bit, else why not."""
    import torch.distributed.checkpoint as dcp

    def zeros(sd: Any) -> Any:
        if isinstance(sd, torch.Tensor):
            return torch.zeros_like(sd)
        if isinstance(sd, dict):
            return {k: zeros(v) for k, v in sd.items()}
        if isinstance(sd, list):
            return [zeros(v) for v in sd]
        return sd

    def diff(a: Any, b: Any, path: str) -> str:
        if isinstance(a, torch.Tensor):
            raw_a, raw_b = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
            return "" if raw_a.equal(raw_b) else path
        if isinstance(a, dict):
            return next((d for k in a if (d := diff(a[k], b[k], f"{path}.{k}"))), "")
        if isinstance(a, list):
            return next((d for i, v in enumerate(a) if (d := diff(v, b[i], f"{path}[{i}]"))), "")
        return "" if a == b else path

    out = zeros(expected)
    dcp.load(out, checkpoint_id=ckpt)
    bad = diff(expected, out, "")
    return f"differs at {bad}" if bad else ""


def run_one(name: str, model: torch.nn.Module, opt: Any, a: argparse.Namespace,
            ctx: SaveContext, root: str) -> dict[str, Any]:
    """``a.iters`` steps of ``model`` checkpointed by contender ``name`` (none: no checkpoint)."""
    dev = ctx.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    c = None if name == BASELINE else make_contender(name)
    run_dir = os.path.join(root, name)
    run: dict[str, Any] = {"error": None, "step_s": [], "saves": []}
    records: list[SaveRecord] = []
    x = torch.randn(a.batch, a.width, device=dev)
    try:
        if c is not None:
            c.setup(ctx, run_dir, opt)
        pending: SaveRecord | None = None
        for it in range(a.iters):
            sync()
            t0 = time.perf_counter()
            loss = model(x).float().pow(2).mean()
            loss.backward()
            if pending is not None and c is not None:
                c.barrier(pending)
                pending = None
            opt.step()  # ds_plain: waits here for its copies (the step pre-hook)
            opt.zero_grad(set_to_none=True)
            if c is not None and (it + 1) % a.ckpt_every == 0:
                state = dcp_state(model, opt)
                pending = c.begin(state, os.path.join(run_dir, f"it{it + 1:04d}"), len(records),
                                  nbytes_of(state))
                records.append(pending)
                if pending.error:
                    raise RuntimeError(f"save failed: {pending.error}")
            sync()
            run["step_s"].append(time.perf_counter() - t0)
        expected = host_copy(dcp_state(model, opt)) if name == "ds_plain" and a.verify else None
        if c is not None:
            c.drain()
            if expected is not None and records:
                run["verify"] = verify(records[-1].ckpt_dir, expected) or "exact"
    except BaseException as e:  # CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        run["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        if c is not None:
            try:
                c.teardown()
            except Exception as e:  # noqa: BLE001 - reported, the next contender still runs
                run["error"] = run["error"] or f"teardown: {type(e).__name__}: {e}"[:500]
        run["saves"] = [r.to_json() for r in records]
        shutil.rmtree(run_dir, ignore_errors=True)
    return run


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each contender's figures as ratios to its peers of the same run."""
    med = {n: statistics.median(r["step_s"]) for n, r in runs.items() if r["step_s"]}
    base = med.get(BASELINE)
    durable: dict[str, float] = {}
    blocked: dict[str, float] = {}
    for n, r in runs.items():
        saves = [s for s in r["saves"] if s["durable_s"] is not None]
        if saves:
            durable[n] = statistics.median(s["durable_s"] for s in saves)
            blocked[n] = statistics.median(s["blocked_s"] or 0.0 for s in saves)
    best = min(durable.values()) if durable else None
    out: dict[str, Any] = {}
    for n in runs:
        row: dict[str, Any] = {"step_s": med.get(n), "durable_s": durable.get(n),
                               "blocked_s": blocked.get(n)}
        if base and n in med:
            row["x_step"] = med[n] / base
        if base and n in blocked:
            row["blocked_x_step"] = blocked[n] / base
        if best and n in durable:
            row["durable_x_best"] = durable[n] / best
        out[n] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8192, help="rows per step")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--contenders", default="none,ds_plain,dcp_async_stager,dcp_fs_tN")
    ap.add_argument("--fs-threads", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=0.0, help="0: no limit")
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from benchmarks.report import emit_json

    t_start = time.perf_counter()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                init_method=f"file://{d}/rdzv", rank=0, world_size=1)
        try:
            model, opt = build(a.layers, a.width, dev)
            nbytes = nbytes_of(dcp_state(model, opt))
            ctx = SaveContext(rank=0, world_size=1, device=dev, pg=dist.new_group(backend="gloo"),
                              fs_threads=a.fs_threads, host_cache_bytes=nbytes + (256 << 20))
            run_one(BASELINE, model, opt, a, ctx, d)  # warm-up: kernels, allocator
            runs: dict[str, dict[str, Any]] = {}
            for name in [c for c in a.contenders.split(",") if c]:
                if a.budget_s and time.perf_counter() - t_start > a.budget_s:
                    runs[name] = {"error": "skipped: --budget-s spent", "step_s": [], "saves": []}
                    continue
                runs[name] = run_one(name, model, opt, a, ctx, d)
                print(f"{name}: {summarize({name: runs[name]})[name]}", file=sys.stderr)
        finally:
            dist.destroy_process_group()
    doc = {
        "command": " ".join(["python -m benchmarks.fsdp2_train",
                             *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "state_bytes": nbytes,
        "layers": a.layers, "width": a.width, "batch": a.batch,
        "iters": a.iters, "ckpt_every": a.ckpt_every,
        "summary": summarize(runs),
        "errors": {n: r["error"] for n, r in runs.items() if r["error"]},
        "verify": {n: r["verify"] for n, r in runs.items() if "verify" in r},
        "runs": runs,
    }
    emit_json(doc, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
