"""DeepSpeed + dcp_datastates through ``"datastates_ckpt"``: save, resume, exactness (CPU, gloo).

Run by tests/test_integration_deepspeed.py as
``torchrun --standalone --nproc_per_node=N ds_train.py OUT_DIR --stages 1,2``. For each ZeRO
stage it checks, on every rank, and prints one ``CHECK <name> ok`` line per check (the test
counts them); any failure raises (non-zero exit):

* ``routed``: the ds_config key gave our engine;
* ``exact``: resuming from our checkpoint with ``load_checkpoint()`` (tag from ``latest``) and
  training on ends bit-identical (weights, fp32 master, Adam exp_avg/exp_avg_sq) to an
  uninterrupted run, which itself equals a run that never saved;
* ``latest_after_durable``: with slow flushes, ``latest`` does not name the new tag after the
  commit step; once it does, every file of the tag is complete and loads;
* ``load_after_save``: ``load_checkpoint()`` right after ``save_checkpoint()`` loads that tag;
* ``torch_load``: every per-rank file loads with ``torch.load(weights_only=False)``, and with
  ``weights_only=True`` exactly when DeepSpeed's own torch.save file of the same tag does;
* ``zero_to_fp32``: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` on our
  checkpoint gives the fp32 weights of the saved step (rank 0).
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
import torch.nn as nn

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build on CPU

import dcp_datastates.integrations.deepspeed as dsds  # noqa: E402  (the one line)

RANK = int(os.environ.get("RANK", 0))


def check(name: str, cond: bool, detail: str = "") -> None:
    if not cond:
        raise AssertionError(f"[rank {RANK}] check {name} failed {detail}")
    print(f"CHECK {name} ok", flush=True)


def build(stage: int, datastates: bool, seed: int = 0) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8), nn.LayerNorm(8))
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if datastates:
        cfg["datastates_ckpt"] = {"host_cache_size": "64MiB"}
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    return engine


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def train_step(engine: deepspeed.DeepSpeedEngine, step: int) -> None:
    x, y = batch(step)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()


def inner(engine: deepspeed.DeepSpeedEngine) -> torch.optim.Optimizer:
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def snapshot(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    out = {f"w.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    opt = inner(engine)
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            out[f"master.{gi}.{pi}"] = p.detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{k}.{gi}.{pi}"] = opt.state[p][k].clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, str]:
    if a.keys() != b.keys():
        return False, f"keys differ: {sorted(a.keys() ^ b.keys())}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    return not bad, f"differ: {bad[:5]}"


def read_latest(d: str) -> str | None:
    try:
        with open(os.path.join(d, "latest")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def run_stage(out: str, stage: int) -> None:
    total, save_at = 6, 3
    # Reference: never saves.
    ref_engine = build(stage, datastates=False)
    for s in range(1, total + 1):
        train_step(ref_engine, s)
    ref = snapshot(ref_engine)
    ref_engine.destroy()

    # Uninterrupted run with our engine, saving at step `save_at`.
    d = os.path.join(out, f"z{stage}")
    e = build(stage, datastates=True)
    check("routed", isinstance(e.checkpoint_engine, dsds.DataStatesCheckpointEngine),
          type(e.checkpoint_engine).__name__)
    for s in range(1, save_at + 1):
        train_step(e, s)
    at_save = snapshot(e)
    e.save_checkpoint(d, tag=f"s{save_at}")
    for s in range(save_at + 1, total + 1):
        train_step(e, s)
    ok, why = same(snapshot(e), ref)
    check("exact", ok, f"(saving changed training) {why}")
    e.checkpoint_engine.wait()

    # zero_to_fp32 on our checkpoint (rank 0; every rank's files are durable: latest is set).
    dist.barrier()
    if RANK == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = get_fp32_state_dict_from_zero_checkpoint(d)
        want = {k[2:]: v for k, v in at_save.items() if k.startswith("w.")}
        bad = [k for k in want if k in fp32 and not torch.equal(fp32[k], want[k].float())]
        check("zero_to_fp32", not bad and set(fp32) <= set(want), f"{bad} {sorted(fp32)}")

    # torch.load of every per-rank file, against DeepSpeed's own files of the same state.
    dist.barrier()
    plain_dir = os.path.join(out, f"z{stage}-torch")
    ref2 = build(stage, datastates=True)  # same config, DeepSpeed's own torch.save engine
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    ref2.checkpoint_engine.cleanup()
    ref2.checkpoint_engine = TorchCheckpointEngine(ref2._config)
    for s in range(1, save_at + 1):
        train_step(ref2, s)
    ref2.save_checkpoint(plain_dir, tag=f"s{save_at}")
    dist.barrier()
    for path in sorted(glob.glob(os.path.join(d, f"s{save_at}", "*.pt"))):
        ours = torch.load(path, weights_only=False)
        theirs_path = os.path.join(plain_dir, f"s{save_at}", os.path.basename(path))
        theirs = torch.load(theirs_path, weights_only=False)
        diff = _diff(ours, theirs, "")
        check("torch_load", not diff, f"{path}: {diff}")
        try:
            torch.load(theirs_path, weights_only=True)
            ds_wo = True
        except Exception:
            ds_wo = False
        try:
            torch.load(path, weights_only=True)
            our_wo = True
        except Exception:
            our_wo = False
        check("torch_load", ds_wo == our_wo, f"weights_only: ours {our_wo}, DeepSpeed {ds_wo}")
    ref2.destroy()

    # Resume in a fresh engine from 'latest' and train on: bit-exact with the reference.
    e2 = build(stage, datastates=True, seed=123)
    path, _ = e2.load_checkpoint(d)
    check("exact", path is not None and f"s{save_at}" in path, f"loaded {path}")
    ok, why = same(snapshot(e2), at_save)
    check("exact", ok, f"(restored state) {why}")
    for s in range(save_at + 1, total + 1):
        train_step(e2, s)
    ok, why = same(snapshot(e2), ref)
    check("exact", ok, f"(resumed run) {why}")

    # 'latest' moves only once every rank's files are durable (slow flushes).
    e2.checkpoint_engine.native.set_delays(0, 1_500_000, seed=7 + RANK)
    before = read_latest(d)
    e2.save_checkpoint(d, tag="slow")
    train_step(e2, total + 1)  # the commit step: captured, not durable
    check("latest_after_durable", read_latest(d) == before, f"latest={read_latest(d)}")
    deadline = time.monotonic() + 60
    while read_latest(d) != "slow" and time.monotonic() < deadline:
        time.sleep(0.01)
    check("latest_after_durable", read_latest(d) == "slow", "never written")
    files = glob.glob(os.path.join(d, "slow", "*"))
    check("latest_after_durable", files and not [f for f in files if f.endswith(dsds.TMP_SUFFIX)],
          f"{files}")
    for f in files:
        torch.load(f, weights_only=False)
    e2.checkpoint_engine.native.set_delays(0, 0)
    dist.barrier()

    # load_checkpoint right after save_checkpoint (no step between): loads that tag.
    train_step(e2, total + 2)
    want = snapshot(e2)
    e2.save_checkpoint(d, tag="again")
    train_step(e2, total + 3)  # changes the state; the load must bring back `want`
    e2.save_checkpoint(d, tag="again2")
    mid = snapshot(e2)
    path, _ = e2.load_checkpoint(d)
    check("load_after_save", path is not None and "again2" in path, f"loaded {path}")
    ok, why = same(snapshot(e2), mid)
    check("load_after_save", ok, why)
    path, _ = e2.load_checkpoint(d, tag="again")
    ok, why = same(snapshot(e2), want)
    check("load_after_save", ok, why)
    e2.destroy()
    e.destroy()


def _diff(a: object, b: object, path: str) -> list[str]:
    """Key paths where two loaded checkpoint objects differ (types, keys, tensors, values)."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        same_t = (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                  and torch.equal(a, b))
        return [] if same_t else [f"{path}: tensor"]
    if isinstance(a, dict):
        assert isinstance(b, dict)
        if list(a.keys()) != list(b.keys()):
            return [f"{path}: keys {list(a.keys())} vs {list(b.keys())}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        if len(a) != len(b):
            return [f"{path}: length"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _diff(x, y, f"{path}.{i}")]
    if type(a).__module__.startswith("deepspeed") or type(a).__name__ == "Namespace":
        return []  # config objects without __eq__: same type is what matters
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--stages", default="1,2")
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in (int(s) for s in args.stages.split(",")):
        run_stage(args.out, stage)
    dist.barrier()
    print("ALL DONE", flush=True)


if __name__ == "__main__":
    main()
