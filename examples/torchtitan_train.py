"""torchtitan's checkpoint config route with dcp_datastates, runnable on one CPU process.

In a torchtitan job the whole change is the ``checkpoint=`` entry of your config_registry
function (``Trainer.Config(..., checkpoint=datastates_checkpoint())``), as in
:func:`datastates_checkpoint` below. torchtitan's ``Trainer`` itself imports ``torchdata`` and
its models ``triton``, so this example does not use it: it builds, from a config of the same
shape, what the ``Trainer`` builds (``OptimizersContainer``, ``LRSchedulersContainer``, and the
checkpointer by ``config.checkpoint.build(...)`` with the Trainer's arguments) and drives them
in the Trainer's order: ``checkpointer.load(step=config.checkpoint.load_step)`` first,
``checkpointer.maybe_wait_for_staging()`` right before ``optimizers.step()``,
``checkpointer.save(step, last_step=...)`` after every step and ``checkpointer.close()`` at the
end. The checkpoints are torchtitan's (``<dump_folder>/checkpoint/step-N``, stock DCP).

Run (one process; it resumes from the newest checkpoint in ``--dump-folder`` if there is one)::

    python examples/torchtitan_train.py --dump-folder /tmp/tt --training.steps 4
    python examples/torchtitan_train.py --dump-folder /tmp/tt --training.steps 8   # resumes

Command-line overrides are parsed by ``tyro`` with torchtitan's rules, as torchtitan's
``ConfigManager`` does (``--checkpoint.interval 3``, ``--checkpoint.async-mode disabled``,
``--checkpoint.datastates.host-cache-size 256MiB``, ``--help``). The last line printed is
``final step=N param_hash=H`` (a hash of the weights and the optimizer state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import tyro
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.config import TrainingConfig
from torchtitan.config.manager import custom_registry

from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager


@dataclasses.dataclass(kw_only=True)
class JobConfig:
    """The fields of torchtitan's ``Trainer.Config`` that this example uses, same names."""

    dump_folder: str = "./outputs"
    optimizer: OptimizersContainer.Config = dataclasses.field(
        default_factory=OptimizersContainer.Config
    )
    lr_scheduler: LRSchedulersContainer.Config = dataclasses.field(
        default_factory=LRSchedulersContainer.Config
    )
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    checkpoint: BaseCheckpointManager.Config = dataclasses.field(
        default_factory=CheckpointManager.Config
    )


def datastates_checkpoint() -> DataStatesCheckpointManager.Config:
    """The one entry a torchtitan config_registry function changes (docs/integrations.md)."""
    return DataStatesCheckpointManager.Config(
        enable=True,
        interval=2,
        async_mode="async",
        last_save_model_only=False,  # torchtitan's default keeps only weights at the last step
        datastates={"host_cache_size": "64MiB", "parser_threads": 1},
    )


def tiny_datastates() -> JobConfig:
    """A config_registry-style function: a tiny MLP job checkpointing through DataStates."""
    return JobConfig(
        optimizer=default_adamw(lr=1e-2),
        # the schedule spans total_steps, not training.steps: a run stopped early and resumed
        # with more steps follows the same curve as one that never stopped
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, total_steps=20),
        training=TrainingConfig(local_batch_size=8, steps=6),
        checkpoint=datastates_checkpoint(),
    )


class TinyTrainer(Stateful):
    """What torchtitan's ``Trainer`` does around its checkpointer, for a tiny MLP on CPU."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.step = 0
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.optimizers = config.optimizer.build(model_parts=[self.model])
        self.lr_schedulers = config.lr_scheduler.build(
            optimizers=self.optimizers, training_steps=config.training.steps
        )
        self.checkpointer = config.checkpoint.build(
            dataloader=None,  # the batches below depend on the step only
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            sd_adapter=None,
            base_folder=config.dump_folder,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.step)
        n = self.config.training.local_batch_size
        return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)

    def train(self) -> None:
        config = self.config
        self.checkpointer.load(step=config.checkpoint.load_step)
        if self.step:
            print(f"resumed from step {self.step}", flush=True)
        while self.step < config.training.steps:
            self.step += 1
            x, y = self.batch()
            nn.functional.mse_loss(self.model(x), y).backward()
            self.checkpointer.maybe_wait_for_staging()  # a no-op here: see docs
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            if self.checkpointer.save(self.step, last_step=self.step == config.training.steps):
                print(f"checkpoint at step {self.step} issued", flush=True)

    def param_hash(self) -> str:
        h = hashlib.sha256()
        state = {"model": self.model.state_dict(), "optim": self.optimizers.state_dict()}
        for key, value in sorted(_flatten(state).items()):
            h.update(key.encode())
            h.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else
                     repr(value).encode())
        return h.hexdigest()

    def close(self) -> None:
        self.checkpointer.close()  # waits for the save in flight, frees the host cache


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}/{k}"))
        return out
    if isinstance(obj, (list, tuple)):
        return _flatten(dict(enumerate(obj)), prefix)
    return {prefix: obj}


def main(argv: list[str]) -> None:
    config = tyro.cli(JobConfig, args=argv, default=tiny_datastates(), registry=custom_registry)
    with tempfile.TemporaryDirectory() as store:
        if "RANK" not in os.environ:  # one process without torchrun: a private rendezvous
            dist.init_process_group(
                "gloo", init_method=f"file://{store}/pg", rank=0, world_size=1
            )
        else:
            dist.init_process_group("gloo")
        trainer = TinyTrainer(config)
        try:
            trainer.train()
        finally:
            trainer.close()
        print(f"final step={trainer.step} param_hash={trainer.param_hash()}", flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
