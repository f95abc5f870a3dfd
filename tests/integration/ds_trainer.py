"""Transformers ``Trainer`` + DeepSpeed ZeRO-1 + ``"datastates_ckpt"``: resume from our checkpoint.

Run by tests/test_integration_deepspeed.py with torchrun (1 rank, CPU). Trains 6 steps saving
every 3 (``checkpoint-3`` and ``checkpoint-6`` through our engine), then a new Trainer resumes
from ``checkpoint-3`` (``resume_from_checkpoint``; DeepSpeed reads its ``latest``) and trains to
step 6. Prints ``CHECK trainer_resume ok`` if the resumed weights equal the uninterrupted run's
bit for bit, and ``CHECK trainer_engine ok`` if our engine did the saving.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import deepspeed.ops
import torch
import torch.nn as nn

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build on CPU

from transformers import Trainer, TrainingArguments  # noqa: E402

import dcp_datastates.integrations.deepspeed as dsds  # noqa: E402  (the one line)


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        out = self.net(x).squeeze(-1)
        loss = nn.functional.mse_loss(out, labels) if labels is not None else out.sum()
        return {"loss": loss, "logits": out}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(48, 8, generator=g)
        self.y = torch.randn(48, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def trainer(out: str) -> Trainer:
    torch.manual_seed(0)
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "datastates_ckpt": {"host_cache_size": "64MiB"},
    }
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=8, max_steps=6, save_steps=3,
        save_strategy="steps", learning_rate=1e-2, logging_steps=100, report_to=[],
        deepspeed=ds_config,
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, save_only_model=False,
        dataloader_num_workers=0,
    )
    return Trainer(model=TinyModel(), args=args, train_dataset=Data())


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model_wrapped.module.state_dict().items()}


def main() -> None:
    out = sys.argv[1]
    t1 = trainer(out)
    t1.train()
    engine = t1.model_wrapped.checkpoint_engine
    ok_engine = isinstance(engine, dsds.DataStatesCheckpointEngine)
    engine.wait()
    final = weights(t1)
    for step in (3, 6):
        with open(os.path.join(out, f"checkpoint-{step}", "latest")) as f:
            assert f.read().strip() == f"global_step{step}", f"checkpoint-{step}/latest"
    if ok_engine:
        print("CHECK trainer_engine ok", flush=True)
    t2 = trainer(out + "-resumed")
    t2.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    resumed = weights(t2)
    bad = [k for k in final if not torch.equal(final[k], resumed[k])]
    if t2.state.global_step != 6 or bad:
        raise AssertionError(f"resume differs: step {t2.state.global_step}, tensors {bad}")
    print("CHECK trainer_resume ok", flush=True)
    t2.model_wrapped.checkpoint_engine.wait()


if __name__ == "__main__":
    main()
