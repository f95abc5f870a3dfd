"""DeepSpeed checkpoint cost: dcp_datastates ("datastates_ckpt") vs TorchCheckpointEngine.

One process (1 rank, CPU, gloo), ZeRO-1, Adam. Two DeepSpeed engines with the same model and
config train side by side; the only difference is the checkpoint engine (ours through the config
key, DeepSpeed's default torch.save engine swapped in on the other). Rounds interleave the two.
Per checkpoint it measures:

* ``call_s``: the ``save_checkpoint()`` call;
* ``blocked_s``: training time lost to the checkpoint = the call + the extra time of the next
  ``--after`` steps over the median step time measured just before (for ours that includes the
  commit at the next step, which waits until the state is in the host cache);
* ``durable_s`` (ours): from the call until the files are durable and ``latest`` is written.

Before each save of the other contender, ours is drained (no background flush overlaps the
other's measurement). Writes JSON (``--out``) and prints a summary. Not a test; a measurement::

    python -m benchmarks.deepspeed_ckpt --hidden 2048 --layers 6 --rounds 5 --out ds.json
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29533"}.items():
    os.environ.setdefault(k, v)

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # noqa: E402

import dcp_datastates.integrations.deepspeed as dsds  # noqa: E402


def build(hidden: int, layers: int, cache: str) -> Any:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*mods)
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "datastates_ckpt": {"host_cache_size": cache},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    return engine


def step(engine: Any, hidden: int) -> float:
    t0 = time.perf_counter()
    x = torch.randn(8, hidden)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warm", type=int, default=4, help="steps timed before each checkpoint")
    ap.add_argument("--after", type=int, default=3, help="steps timed after each checkpoint")
    ap.add_argument("--cache", default="2GiB")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default="deepspeed_ckpt.json")
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    root = args.dir or tempfile.mkdtemp(prefix="ds_bench_")
    if args.dir is None:  # every round's checkpoints, both contenders: gone when the run ends
        atexit.register(shutil.rmtree, root, True)
    ours = build(args.hidden, args.layers, args.cache)
    assert isinstance(ours.checkpoint_engine, dsds.DataStatesCheckpointEngine)
    plain = build(args.hidden, args.layers, args.cache)
    plain.checkpoint_engine.cleanup()
    plain.checkpoint_engine = TorchCheckpointEngine(plain._config)
    contenders = {"dcp_datastates": ours, "deepspeed_torch": plain}
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            eng = contenders[name]
            base = statistics.median(step(eng, args.hidden) for _ in range(args.warm))
            d = os.path.join(root, name)
            t0 = time.perf_counter()
            eng.save_checkpoint(d, tag=f"r{r}")
            call = time.perf_counter() - t0
            after = [step(eng, args.hidden) for _ in range(args.after)]
            extra = sum(after) - args.after * base
            durable = None
            if name == "dcp_datastates":
                eng.checkpoint_engine.wait()
                durable = time.perf_counter() - t0
            size = sum(os.path.getsize(os.path.join(d, f"r{r}", f))
                       for f in os.listdir(os.path.join(d, f"r{r}")))
            rows.append({"round": r, "contender": name, "call_s": call,
                         "blocked_s": call + max(0.0, extra), "extra_after_s": extra,
                         "step_s": base, "durable_s": durable, "bytes": size})
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for name in contenders:
        rs = [x for x in rows if x["contender"] == name]
        summary[name] = {k: statistics.median(x[k] for x in rs)
                         for k in ("call_s", "blocked_s", "step_s", "bytes")}
        if name == "dcp_datastates":
            summary[name]["durable_s"] = statistics.median(x["durable_s"] for x in rs)
    result = {"args": vars(args), "rows": rows, "median": summary,
              "torch": torch.__version__, "deepspeed": deepspeed.__version__}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))
    ours.destroy()
    plain.destroy()


if __name__ == "__main__":
    main()
