"""Lightning on CPU with dcp_datastates: train with checkpoints, resume, compare bit for bit.

Run by tests/test_integration_lightning.py in a subprocess (with a timeout):

    python pl_train.py MODE OUT_DIR        # MODE: single | ddp | mp

* run A: ``max_epochs=4`` with a checkpoint at the end of every epoch (``ModelCheckpoint``,
  ``save_top_k=2`` by step, so older checkpoints are rotated out through remove_checkpoint);
* in single/ddp mode, from the second save on, the writer's copies are held until the next
  optimizer step is about to run: the step pre-hook must make that step wait, and every kept
  checkpoint must hold the values recorded at its save call;
* run B: a fresh Trainer resumes from the older kept checkpoint and finishes; its final weights
  and Adam state must equal run A's bit for bit.

Rank 0 writes OUT_DIR/result.json; any mismatch raises (non-zero exit).

With 2 ranks each rank reads its own half of the data (``use_distributed_sampler=False``):
with Lightning's DistributedSampler, a resumed run differs from the uninterrupted one by about
one optimizer step even with Lightning's default TorchCheckpointIO (seen with lightning 2.6.6),
so that setup cannot tell a checkpoint bug from the sampler's behaviour.
Set PL_TRAIN_DEFAULT_IO=1 to run single/ddp with Lightning's own CheckpointIO instead.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from dcp_datastates.integrations.lightning import (
    DataStatesCheckpointIO,
    DataStatesModelParallelStrategy,
)

MODE = sys.argv[1]
# SCHED_IDLE copy/flush threads starve on a machine whose cores are all busy (shared CI runners)
IDLE = os.environ.get("PL_TRAIN_IDLE_PRIORITY", "0") == "1"
OUT = sys.argv[2]


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"width": 16})
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def configure_model(self) -> None:
        if MODE == "mp":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.body:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.body, mesh=mesh)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        if MODE != "single":  # each rank its own half (no DistributedSampler: see the module doc)
            r = self.trainer.global_rank
            x, y = x[r * 8 : (r + 1) * 8], y[r * 8 : (r + 1) * 8]
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else t).detach().clone()


def snapshot(model: Net, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Weights and Adam state by parameter name, gathered to full tensors."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for p, st in opt.state.items():
        state[names[id(p)]] = {k: full(v) for k, v in st.items() if isinstance(v, torch.Tensor)}
    return {"weights": {n: full(p) for n, p in model.named_parameters()}, "adam": state}


def assert_equal(a: Any, b: Any, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        assert torch.equal(a, b), f"{what}: values differ by up to {diff:.3g}"
        return
    assert isinstance(b, dict) and a.keys() == b.keys(), f"{what}: {list(a)} != {list(b)}"
    for k in a:
        assert_equal(a[k], b[k], f"{what}/{k}")


class HoldCopies(Callback):
    """Records the state at each save call and holds the writer's copies for a while after it.

    Lightning's automatic optimization runs forward/backward in a closure *inside*
    ``optimizer.step()``, so the step pre-hook (the barrier) fires before the next forward: it
    must wait there until the held copies are released and have landed.
    """

    def __init__(self, io: DataStatesCheckpointIO) -> None:
        self.io = io
        self.expected: dict[int, dict[str, Any]] = {}
        self.held = 0

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # runs before ModelCheckpoint's own epoch-end save (Lightning orders it last)
        if trainer.is_global_zero:
            self.expected[trainer.global_step] = snapshot(pl_module, trainer.optimizers[0])
            w = self.io._writer
            if w is not None:  # created by the first save
                w.engine.pause_copies(True)
                self.held += 1
                threading.Timer(0.5, w.engine.pause_copies, args=(False,)).start()


def make_trainer(root: str, io: Any, extra: list[Callback], max_epochs: int) -> Trainer:
    ckpt = ModelCheckpoint(
        dirpath=root, filename="{epoch}-{step}", monitor="step", mode="max", save_top_k=2,
        every_n_epochs=1, save_on_train_epoch_end=True,
    )  # fmt: skip
    kw: dict[str, Any] = {}
    if MODE == "single":
        kw = {"devices": 1, "plugins": [io]}
    elif MODE == "ddp":
        kw = {"devices": 2, "strategy": "ddp", "plugins": [io], "use_distributed_sampler": False}
    else:
        kw = {"devices": 2, "strategy": io, "use_distributed_sampler": False}
    if os.environ.get("PL_TRAIN_DEFAULT_IO") == "1" and MODE != "mp":
        kw.pop("plugins")  # Lightning's own TorchCheckpointIO, to compare
    return Trainer(
        accelerator="cpu", max_epochs=max_epochs, callbacks=[*extra, ckpt], logger=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True, **kw,
    )  # fmt: skip


def main() -> None:
    root = os.path.join(OUT, "ckpts")
    seed_everything(0, workers=True)
    if MODE == "mp":
        io: Any = DataStatesModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, datastates={"host_cache_size": 0.0625},
            idle_priority=IDLE,
        )
        hold: list[Callback] = []
    else:
        io = DataStatesCheckpointIO(
            {"host_cache_size": 0.0625}, flush_threads=1, idle_priority=IDLE
        )
        holder = HoldCopies(io)
        hold = [holder]
    model_a = Net()
    trainer_a = make_trainer(root, io, hold, max_epochs=4)
    trainer_a.fit(model_a)
    final_a = snapshot(model_a, trainer_a.optimizers[0])
    rank0 = trainer_a.is_global_zero
    kept = sorted(os.listdir(root)) if rank0 else []
    result: dict[str, Any] = {"kept": kept}

    if rank0 and MODE != "mp" and os.environ.get("PL_TRAIN_DEFAULT_IO") != "1":
        assert holder.held >= 3, f"copies were held at only {holder.held} saves"
        reader = DataStatesCheckpointIO()
        for name in kept:
            ck = reader.load_checkpoint(os.path.join(root, name))
            step = ck["global_step"]
            exp = holder.expected[step]
            got_w = {k.removeprefix("body."): v for k, v in ck["state_dict"].items()}
            assert_equal({k.removeprefix("body."): v for k, v in exp["weights"].items()}, got_w,
                         f"{name} weights")  # fmt: skip
            st = ck["optimizer_states"][0]["state"]
            assert list(st) == list(range(len(st))), f"{name}: optimizer state keys {list(st)}"
            names = list(exp["weights"])
            for i, n in enumerate(names):
                assert_equal(exp["adam"][n]["exp_avg"], st[i]["exp_avg"], f"{name} exp_avg {n}")
        result["checked_at_save_call"] = kept

    # run B: a fresh Trainer resumes from the older kept checkpoint
    older = ""
    if rank0:
        by_step = sorted(kept, key=lambda n: int(n.split("step=")[1].split(".")[0]))
        older = os.path.join(root, by_step[0])
    if torch.distributed.is_initialized():
        box = [older]
        torch.distributed.broadcast_object_list(box, src=0)
        older = box[0]
    seed_everything(1, workers=True)  # different init: everything must come from the checkpoint
    if MODE == "mp":
        io_b: Any = DataStatesModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, idle_priority=IDLE
        )
    else:
        io_b = DataStatesCheckpointIO(host_cache_size=0.0625, idle_priority=IDLE)
    model_b = Net()
    trainer_b = make_trainer(os.path.join(OUT, "ckpts_b"), io_b, [], max_epochs=4)
    trainer_b.fit(model_b, ckpt_path=older)
    final_b = snapshot(model_b, trainer_b.optimizers[0])
    print("steps", trainer_a.global_step, trainer_b.global_step, flush=True)
    assert_equal(final_a, final_b, "resumed vs uninterrupted")
    if trainer_b.is_global_zero:
        result.update(resumed_from=os.path.basename(older), exact=True,
                      global_step=trainer_b.global_step)  # fmt: skip
        with open(os.path.join(OUT, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    import faulthandler

    # a hang prints every thread's stack and fails instead of waiting for the test's kill
    faulthandler.dump_traceback_later(float(os.environ.get("PL_TRAIN_HANG_S", "150")), exit=True)
    torch.set_num_threads(1)
    main()
