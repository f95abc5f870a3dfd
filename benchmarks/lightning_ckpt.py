"""Lightning checkpointing cost per checkpoint: DataStatesCheckpointIO vs Lightning's own plugins.

Not a test: a measurement. One process trains an MLP + Adam with a CPU ``Trainer`` and a
``ModelCheckpoint`` every ``--every`` steps, once per contender per round, contenders
interleaved round-robin (so drifting machine load hits each alike), all in one run:

* ``datastates``: ``DataStatesCheckpointIO`` (async, lazy copies, step barrier);
* ``torch``: Lightning's default ``TorchCheckpointIO`` (``torch.save`` at the call);
* ``async``: Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())`` (clones at the call, then
  ``torch.save`` in a thread).

Per checkpoint it records
* ``save_call_s``: how long ``checkpoint_io.save_checkpoint`` took (the call Lightning waits for);
* ``blocked_s``: training time lost to that checkpoint: the wall time of the iteration holding
  the save plus the next iteration (where a lazy save's barrier waits), minus twice the median
  iteration of the same fit far from any checkpoint.
and per fit ``drain_s``: the time from the end of the last step to the end of ``fit``
(teardown: an async plugin waits for its saves there).

    python -m benchmarks.lightning_ckpt --out results/lightning_ckpt.json [--width 1536]

Prints a summary table; writes every figure to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from dcp_datastates.integrations.lightning import DataStatesCheckpointIO


class MLP(LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(256, width), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        layers.append(nn.Linear(width, 16))
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Timed(Callback):
    """Iteration start times, the save-call durations (see wrap_save), the end of training."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.saved_at: list[int] = []
        self.save_call_s: list[float] = []
        self.last_end = 0.0

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.last_end = time.perf_counter()


def wrap_save(io: Any, timed: Timed, trainer_ref: list[Trainer]) -> None:
    inner = io.save_checkpoint

    def save_checkpoint(checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        t0 = time.perf_counter()
        inner(checkpoint, path, storage_options)
        timed.save_call_s.append(time.perf_counter() - t0)
        timed.saved_at.append(trainer_ref[0].global_step)

    io.save_checkpoint = save_checkpoint


def make_io(name: str, cache_gib: float) -> Any:
    if name == "datastates":
        return DataStatesCheckpointIO(host_cache_size=cache_gib)
    if name == "torch":
        return TorchCheckpointIO()
    return AsyncCheckpointIO(TorchCheckpointIO())


def one_fit(name: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    seed_everything(0)
    model = MLP(args.width, args.depth)
    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch
    data = TensorDataset(torch.randn(n, 256, generator=g), torch.randn(n, 16, generator=g))
    io = make_io(name, args.cache_gib)
    timed = Timed()
    ref: list[Trainer] = []
    wrap_save(io, timed, ref)
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=args.every, save_top_k=1,
                           monitor="step", mode="max")  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, callbacks=[timed, ckpt],
        plugins=[io], logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    ref.append(trainer)
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    end = time.perf_counter()
    starts = timed.starts
    iters = [b - a for a, b in zip(starts, starts[1:], strict=False)]  # iteration i: start i..i+1
    near = set()
    for step in timed.saved_at:  # the save after step k runs between starts[k-1] and starts[k]
        near.update({step - 1, step, step + 1})
    quiet = [t for i, t in enumerate(iters) if i not in near and i > 2]
    base = statistics.median(quiet)
    blocked = []
    for step in timed.saved_at:
        window = iters[step - 1 : step + 1]  # the iteration holding the save and the next one
        if len(window) == 2:
            blocked.append(sum(window) - 2 * base)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    return {
        "contender": name, "save_call_s": timed.save_call_s, "blocked_s": blocked,
        "base_iter_s": base, "drain_s": end - timed.last_end, "ckpt_bytes_approx": nbytes,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-gib", type=float, default=1.0)
    ap.add_argument("--contenders", default="datastates,torch,async")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--out", default="benchmarks/results/lightning_ckpt.json")
    args = ap.parse_args()
    names = args.contenders.split(",")
    base_dir = args.dir or tempfile.mkdtemp(prefix="pl_ckpt_bench_")
    runs: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            for name in names:
                root = os.path.join(base_dir, f"{name}-{r}")
                runs.append(one_fit(name, args, root) | {"round": r})
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base_dir, ignore_errors=True)
    summary = {}
    for name in names:
        mine = [x for x in runs if x["contender"] == name]
        calls = [v for x in mine for v in x["save_call_s"]]
        blocked = [v for x in mine for v in x["blocked_s"]]
        summary[name] = {
            "checkpoints": len(calls),
            "save_call_median_s": statistics.median(calls),
            "blocked_median_s": statistics.median(blocked) if blocked else None,
            "drain_median_s": statistics.median(x["drain_s"] for x in mine),
            "base_iter_median_s": statistics.median(x["base_iter_s"] for x in mine),
        }
    report = {"args": vars(args), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "summary": summary, "runs": runs}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    mb = runs[0]["ckpt_bytes_approx"] / 2**20
    print(f"checkpoint ~{mb:.0f} MiB; medians over {args.rounds} interleaved rounds")
    print(f"{'contender':<12}{'save call s':>12}{'blocked s':>12}{'drain s':>10}{'iter s':>9}")
    for name, s in summary.items():
        b = s["blocked_median_s"]
        bs = f"{b:>12.3f}" if b is not None else f"{'-':>12}"
        print(f"{name:<12}{s['save_call_median_s']:>12.3f}{bs}"
              f"{s['drain_median_s']:>10.3f}{s['base_iter_median_s']:>9.3f}")


if __name__ == "__main__":
    main()
