"""The step barrier makes progress when the idle-priority copy threads get no CPU time.

Copy threads run under SCHED_IDLE (``idle_priority=True``, the default): they only use CPU time
nothing else wants. When other processes keep every core busy (other ranks, data-loader workers,
another job), they may get almost none, and an optimizer step waiting for its lazy copies would
wait for minutes. The waiting thread therefore copies queued chunks itself
(``Engine.help_until_captured``): this test saturates every core with busy processes, saves, and
steps. Before the fix the step waited on the starved threads (``helped_copies`` stayed 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from dcp_datastates import DataStatesWriter


def test_step_barrier_copies_itself_when_copy_threads_starve(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 1024)
    model(x).sum().backward()
    opt.step()  # the optimizer is known to the step barrier; Adam state exists
    opt.zero_grad()
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    writer = DataStatesWriter(
        tmp_path, host_cache_size="256MiB", chunk_size="1MiB", copy_threads=1
    )
    # Where SCHED_IDLE is not granted or the hogs start late, the copy thread could still finish
    # all chunks before the step: slow each copy down (up to 20 ms) so chunks are still queued.
    writer.engine.set_delays(20000, 0, seed=3)
    try:
        time.sleep(0.5)  # the hogs are spinning
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        before = writer.engine_counters()["helped_copies"]
        fut = dcp.async_save(
            {"model": model.state_dict()}, storage_writer=writer, checkpoint_id=tmp_path / "c"
        )
        model(x).sum().backward()
        opt.step()  # waits for the lazy copies of its parameters: takes over queued chunks
        assert writer.engine_counters()["helped_copies"] > before
        fut.result(timeout=300)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
        writer.close()
    got = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load({"model": got}, checkpoint_id=tmp_path / "c")
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
