"""Soak: 300 back-to-back async saves on one writer leak no memory, fds or threads.

One process trains a small MLP with Adam (model + optimizer state ~2 MB) and after every step
calls ``dcp.async_save`` through one ``DataStatesWriter`` whose host cache (1 MiB) is half the
checkpoint, so every save streams through the cache (copies wait for flushes to free space).
``writer.protect(optimizer)`` makes each ``step()`` wait until the previous save is captured,
so parameters and Adam moments are captured lazily while training goes on. Every save goes to
its own directory; completed ones are CRC-checked with ``verify_checkpoint`` and pruned with
``prune(RetentionPolicy(keep_last=2), exclude=<saves in flight>)``, so the disk use stays at a
few checkpoints.

At quiescent points (every save so far finished, DCP's per-save executor threads gone) the test
samples RSS, open file descriptors, Python threads and native threads. From the sample after
save ``WARMUP`` to the end it asserts that RSS grew less than ``RSS_SLACK_MB`` and that the fd
and thread counts are unchanged (within a small tolerance), and at the end that the engine holds
no job, no open file and no cache bytes. The last checkpoint is read back with stock
``dcp.load`` and compared bit-exactly with the state at its save call.

What this proves: per-save resources (engine jobs, cache reservations, data-file descriptors,
save contexts and their thread-local state, staged dicts, stats) are all released, over many
more saves than the other tests make. RSS is a coarse measure (allocator caching), hence the
slack; a leak of one 2 MB state per save would be ~500 MB over the measured window.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import assert_state_equal, zeros_like_state
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_datastates import DataStatesWriter, verify_checkpoint
from dcp_datastates.lifecycle.checkpoints import RetentionPolicy, list_checkpoints, prune

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SAVES = int(os.environ.get("DCPDS_SOAK_SAVES", "300"))
WARMUP = 50  # the baseline sample is taken after this many saves
SAMPLE_EVERY = 50
RSS_SLACK_MB = 30.0
FD_SLACK = 2
THREAD_SLACK = 1
KEEP_LAST = 2
QUIESCE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Sample:
    """Process resources at a quiescent point."""

    saves: int
    rss_mb: float
    fds: int
    py_threads: int  # live Python threads started since the baseline
    native_threads: int

    def row(self) -> str:
        return (
            f"{self.saves:>5} {self.rss_mb:>9.1f} {self.fds:>4} {self.py_threads:>10} "
            f"{self.native_threads:>14}"
        )


def make_model() -> nn.Module:
    # 164,480 parameters: 0.66 MB, ~2 MB with Adam's two moments.
    return nn.Sequential(
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128)
    )


def quiesce(writer: DataStatesWriter, baseline_threads: set[threading.Thread]) -> None:
    """Waits until every save is durable and every thread started since ``baseline`` ended.

    ``dcp.async_save`` runs each save on its own one-thread executor; the thread exits shortly
    after the save's future completes, and a save's collector pause ends on a timer thread a
    tenth of a second after its last protocol call. Threads are compared as objects, not by
    ident: a new thread may reuse the ident of one that ended. A thread that never exits fails
    here, by name.
    """
    assert writer.wait(timeout=QUIESCE_TIMEOUT_S)
    deadline = time.monotonic() + QUIESCE_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _new_threads(baseline_threads):
            return
        time.sleep(0.005)
    raise AssertionError(f"threads still alive: {[t.name for t in _new_threads(baseline_threads)]}")


def _new_threads(baseline: set[threading.Thread]) -> list[threading.Thread]:
    """Live threads that were not alive at the baseline (earlier tests' threads may end)."""
    return [t for t in threading.enumerate() if t not in baseline]


def sample(saves: int, baseline_threads: set[threading.Thread]) -> Sample:
    proc = psutil.Process()
    return Sample(
        saves=saves,
        rss_mb=proc.memory_info().rss / 2**20,
        fds=len(os.listdir("/proc/self/fd")),
        py_threads=len(_new_threads(baseline_threads)),
        native_threads=proc.num_threads(),
    )


def test_many_async_saves_leak_nothing(tmp_path: Path) -> None:
    """Hundreds of async saves through a cache half the checkpoint: RSS, fds, threads stay flat."""
    torch.manual_seed(0)
    root = tmp_path / "ckpt"
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g)
    y = torch.randn(64, 128, generator=g)
    baseline_threads = set(threading.enumerate())

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()  # its pre-hook (writer.protect) waits for the previous save's capture

    train_step()  # Adam's moments exist from here on: every save has the same items
    writer = DataStatesWriter(str(root), host_cache_size="1MiB", chunk_size="256KiB")
    writer.protect(opt)
    in_flight: deque[tuple[Path, Future[Any]]] = deque()
    samples: list[Sample] = []
    verified = 0
    state_bytes = 0
    last_saved: dict[str, Any] = {}

    def retire(block: bool) -> None:
        nonlocal verified
        while in_flight and (block or in_flight[0][1].done()):
            path, fut = in_flight.popleft()
            fut.result(timeout=60)  # a failed save fails the test
            rep = verify_checkpoint(str(path))
            assert rep.ok, rep.summary()
            verified += 1
        prune(root, RetentionPolicy(keep_last=KEEP_LAST), exclude=[p for p, _ in in_flight])

    t0 = time.perf_counter()
    try:
        for i in range(1, SAVES + 1):
            if i > 1:
                train_step()
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd, "step": i}
            if i == 1:
                state_bytes = sum(
                    t.numel() * t.element_size()
                    for part in (msd, osd["state"])
                    for t in _tensors(part)
                )
            if i == SAVES:
                last_saved = _clone(sd)
            path = root / f"step-{i}"
            fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=path)
            assert isinstance(fut, Future)  # stage() returns a dict: a plain upload future
            in_flight.append((path, fut))
            retire(block=False)
            if i % SAMPLE_EVERY == 0 and WARMUP <= i < SAVES:
                retire(block=True)
                quiesce(writer, baseline_threads)
                samples.append(sample(i, baseline_threads))
        retire(block=True)
        quiesce(writer, baseline_threads)
        end = sample(SAVES, baseline_threads)
        samples.append(end)
        counters = writer.engine_counters()
        stats = writer.save_stats()
    finally:
        writer.close()
    elapsed = time.perf_counter() - t0

    # The last checkpoint is exactly the state at its save call.
    last = root / f"step-{SAVES}"
    out = zeros_like_state(last_saved)
    out["step"] = -1
    dcp.load(out, checkpoint_id=str(last))
    assert_state_equal(last_saved, out)
    remaining = list_checkpoints(root)

    base = samples[0]
    print(
        f"\nsoak: {SAVES} async saves of {state_bytes / 1e6:.2f} MB through a "
        f"{counters['cache_bytes'] / 2**20:.0f} MiB host cache in {elapsed:.1f} s "
        f"({elapsed / SAVES * 1e3:.1f} ms per step+save); {verified} verified, "
        f"{len(remaining)} left on disk"
    )
    print(" saves    rss_MB  fds py_threads native_threads")
    for s in samples:
        print(s.row())
    print(f"end counters: {counters}")
    rss_growth = max(s.rss_mb for s in samples) - base.rss_mb
    print(
        f"RSS growth after save {base.saves}: {end.rss_mb - base.rss_mb:+.1f} MB at the end, "
        f"{rss_growth:+.1f} MB at most"
    )

    assert state_bytes > counters["cache_bytes"]  # every save streamed through the cache
    assert verified == SAVES
    assert len(stats) == SAVES and all(s["error"] is None for s in stats)
    assert len(remaining) == KEEP_LAST and all(c.complete for c in remaining), remaining
    assert counters["jobs"] == 0, counters
    assert counters["open_files"] == 0, counters
    assert counters["cache_used_bytes"] == 0, counters
    assert counters["live_blocks"] == 0, counters
    assert counters["pending_copies"] == 0 and counters["pending_flushes"] == 0, counters
    assert rss_growth < RSS_SLACK_MB, [s.rss_mb for s in samples]
    for s in samples:
        assert abs(s.fds - base.fds) <= FD_SLACK, [t.fds for t in samples]
        assert abs(s.py_threads - base.py_threads) <= THREAD_SLACK, samples
        assert abs(s.native_threads - base.native_threads) <= THREAD_SLACK, samples
    assert end.py_threads == 0, end


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
