"""torchtitan's CheckpointManager through DataStatesCheckpointManager: save while training
continues, resume bit-exactly (run by tests/test_integration_torchtitan.py in a subprocess).

argv: workdir async_mode
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager


def build(workdir: str, async_mode: str) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, total_steps=100).build(
        optimizers=optimizers, training_steps=100
    )
    ckpt = DataStatesCheckpointManager.Config(
        enable=True,
        folder="ckpt",
        interval=2,
        async_mode=async_mode,
        datastates={"host_cache_size": "64MiB", "parser_threads": 1},
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=None,
        base_folder=workdir,
    )
    return model, optimizers, schedulers, ckpt


def snapshot(model: nn.Module, optimizers: Any) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizers.state_dict()})


def same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def main() -> None:
    workdir, async_mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", rank=0, world_size=1)
    model, optimizers, schedulers, ckpt = build(workdir, async_mode)
    gen = torch.Generator().manual_seed(1)
    refs: dict[int, dict[str, Any]] = {}
    for step in range(1, 7):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        ckpt.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        if ckpt.save(step):
            refs[step] = snapshot(model, optimizers)
    final = snapshot(model, optimizers)
    ckpt.close()
    assert sorted(os.listdir(os.path.join(workdir, "ckpt"))) == ["step-2", "step-4", "step-6"]
    for step in (2, 4, 6):  # written by our writer, committed
        files = os.listdir(os.path.join(workdir, "ckpt", f"step-{step}"))
        assert ".metadata" in files and "__datastates_manifest_0.json" in files, files

    for step in (4, -1):  # a middle checkpoint (training went on after it), then the newest
        model2, optimizers2, _, ckpt2 = build(workdir, async_mode)
        assert ckpt2.load(step=step)
        same(refs[step] if step > 0 else final, snapshot(model2, optimizers2), f"step {step}")
        ckpt2.close()
    dist.destroy_process_group()
    print("OK")


if __name__ == "__main__":
    main()
