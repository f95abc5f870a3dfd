"""Per-rank worker process: joins a gloo group, runs its scenarios, writes one JSON per scenario.

Every scenario runs in processes started with ``spawn`` (fresh interpreter, nothing inherited
from the CLI process), so one scenario's memory cannot inflate the next one's RSS and a crash
costs one scenario, not the run. Ranks rendezvous through a file (``file://`` init method);
checkpoint collectives go through a dedicated gloo group, the harness's own barriers through the
default group, so the two never interleave on one communicator.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.metrics import PeakRSS
from benchmarks.scenarios import Env, RunOptions, Scenario, run_scenario


def result_path(out_dir: str, scenario: str, rank: int) -> str:
    safe = scenario.replace("/", "_")
    return os.path.join(out_dir, f"{safe}.rank{rank}.json")


def worker_entry(
    rank: int,
    world_size: int,
    scenarios: list[dict[str, Any]],
    opts: dict[str, Any],
    rendezvous_file: str,
    out_dir: str,
    timeout_s: float,
) -> None:
    """Entry point of a spawned rank (must be importable: spawn pickles it by reference)."""
    options = RunOptions(**opts)
    # share the cores between ranks as a real multi-rank job on one host would
    threads = options.torch_threads or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    device = torch.device(options.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    ckpt_pg = dist.new_group(backend="gloo")
    env = Env(rank=rank, world_size=world_size, device=device, pg=ckpt_pg, peak=PeakRSS())
    try:
        for raw in scenarios:
            scn = Scenario.from_json(raw)
            try:
                res = run_scenario(scn, options, env)
            except BaseException as e:  # a broken scenario must not lose the others
                if isinstance(e, KeyboardInterrupt):
                    raise
                res = {"rank": rank, "error": "".join(traceback.format_exception(e))[-4000:]}
            res["peak_rss_method"] = env.peak.method
            tmp = result_path(out_dir, scn.name, rank) + ".tmp"
            with open(tmp, "w") as f:
                json.dump(res, f)
            os.replace(tmp, result_path(out_dir, scn.name, rank))
    finally:
        env.peak.close()
        dist.destroy_process_group()
