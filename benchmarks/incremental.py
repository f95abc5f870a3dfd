"""Incremental vs full saves on a LoRA-like model: bytes written and time per save (not a test).

A frozen base (``--base-mb`` of float32 linear weights, requires_grad=False) with trainable rank-r
adapters and AdamW (about ``--adapter-mb`` of parameters, three times that with the optimizer's
moments). For each mode (full: ``incremental=False``; incremental: ``True``; verify:
``"verify"``) one writer saves ``--saves`` checkpoints with ``dcp.async_save`` after a training
step each, and we record per save: the time the call blocked, the time until durable (the
future), and the bytes of data files written into the new checkpoint directory. The last
checkpoint of each mode is loaded with the stock ``dcp.load`` and compared bit for bit.

One run, JSON out::

    python benchmarks/incremental.py --base-mb 1024 --adapter-mb 10 --saves 4 --out inc.json
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
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from dcp_datastates import DataStatesWriter


class LoraModel(nn.Module):
    def __init__(self, width: int, layers: int, rank: int) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.base.requires_grad_(False)
        self.a = nn.ParameterList(
            nn.Parameter(torch.randn(rank, width) * 0.01) for _ in range(layers)
        )
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(width, rank)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, a, b in zip(self.base, self.a, self.b, strict=True):
            x = lin(x) + (x @ a.t()) @ b.t()
        return x


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp")
    )


def run_mode(
    mode: Any, model: LoraModel, opt: torch.optim.Optimizer, root: str, saves: int, cache: str
) -> dict[str, Any]:
    out: list[dict[str, float]] = []
    with DataStatesWriter(root, cache, incremental=mode) as w:
        for i in range(1, saves + 1):
            model(torch.randn(4, model.base[0].in_features)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i}
            path = os.path.join(root, f"step-{i}")
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=w, checkpoint_id=path)
            t1 = time.perf_counter()
            fut.result()
            t2 = time.perf_counter()
            out.append({"blocked_s": t1 - t0, "durable_s": t2 - t0, "bytes": _dir_bytes(path)})
    want = model.state_dict()
    got = {"model": {k: torch.empty_like(v) for k, v in want.items()}}
    dcp.load(got, checkpoint_id=os.path.join(root, f"step-{saves}"))
    exact = all(
        torch.equal(got["model"][k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items()
    )
    later = out[1:] or out
    return {
        "saves": out,
        "later_saves_median": {
            k: statistics.median(s[k] for s in later) for k in ("blocked_s", "durable_s", "bytes")
        },
        "loads_bit_exact": exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-mb", type=float, default=1024)
    ap.add_argument("--adapter-mb", type=float, default=10)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--cache", default="2GiB")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--modes", default="full,incremental,verify")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    width = args.width
    layers = max(1, round(args.base_mb * 2**20 / (width * width * 4)))
    rank = max(1, round(args.adapter_mb * 2**20 / (layers * 2 * width * 4)))
    modes = {"full": False, "incremental": True, "verify": "verify"}
    base = tempfile.mkdtemp(prefix="dcpds-incr-", dir=args.dir)
    result: dict[str, Any] = {
        "base_bytes": layers * width * width * 4,
        "adapter_bytes": layers * 2 * rank * width * 4,
        "layers": layers,
        "width": width,
        "lora_rank": rank,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "modes": {},
    }
    try:
        for name in args.modes.split(","):
            torch.manual_seed(0)
            model = LoraModel(width, layers, rank)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            root = os.path.join(base, name)
            result["modes"][name] = run_mode(modes[name], model, opt, root, args.saves, args.cache)
            shutil.rmtree(root, ignore_errors=True)
            print(name, json.dumps(result["modes"][name]["later_saves_median"]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
