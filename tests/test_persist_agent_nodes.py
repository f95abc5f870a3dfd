"""The persistence agent with node-local fast tiers on several nodes: one agent per node.

4 gloo ranks as 2 simulated nodes (each node's ranks share a fast root of their own) save two
checkpoints with ``persist_to`` a shared directory, then every trainer is SIGKILLed right after
the second save committed (its copies queued, running or done, as timing has it): each node's
agent copies its node's part, the coordinator's agent commits ``.metadata`` once every rank's
files are there, both persistent checkpoints load bit for bit, nothing partial is left and both
agents exit."""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import RankFailure, run_ranks

from dcp_datastates.lifecycle.checkpoints import METADATA_FILE
from dcp_datastates.lifecycle.persist_queue import AgentDir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
AGENT_S = 180.0  # two agents start (each imports torch) on a loaded machine


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(48, generator=g)}


def _train_and_die(rank: int, world: int, base: str, slow: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_datastates import DataStatesWriter

    mesh = init_device_mesh("cpu", (world,))
    pg = dist.new_group(backend="gloo")
    root = os.path.join(base, f"node{rank // 2}")
    os.makedirs(root, exist_ok=True)
    w = DataStatesWriter(root, host_cache_size="4MiB", persist_to=slow)
    for step in (1, 2):
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full(step).items()}
        dcp.async_save(state, storage_writer=w, process_group=pg,
                       checkpoint_id=os.path.join(root, f"step-{step}")).result(120)
    dist.barrier(pg)
    os.kill(os.getpid(), signal.SIGKILL)  # every trainer, before its copies are done


@pytest.fixture
def base() -> Iterator[Path]:
    root = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path("/tmp")
    d = root / f"dcpds-nodes-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_each_node_agent_finishes_after_all_trainers_die(base: Path, tmp_path: Path) -> None:
    slow = tmp_path / "slow"
    with pytest.raises(RankFailure):  # the ranks killed themselves
        run_ranks(_train_and_die, str(base), str(slow), tmp_path=tmp_path / "w", world_size=4)
    deadline = time.monotonic() + AGENT_S
    agents = [AgentDir(str(base / f"node{n}")) for n in (0, 1)]
    while any(a.agent_alive() for a in agents) or not (slow / "step-2" / METADATA_FILE).exists():
        assert time.monotonic() < deadline, sorted(os.listdir(slow)) if slow.exists() else None
        time.sleep(0.2)
    for step in (1, 2):
        names = set(os.listdir(slow / f"step-{step}"))
        assert {f"__datastates_manifest_{r}.json" for r in range(4)} <= names, names
        got: dict[str, Any] = {k: torch.zeros_like(v) for k, v in _full(step).items()}
        dcp.load(got, checkpoint_id=str(slow / f"step-{step}"), no_dist=True)
        for k, v in _full(step).items():
            assert torch.equal(got[k], v), (step, k)
    # nothing partial on the persistent tier, and no agent left running
    assert not any((slow / d / ".datastates.incomplete").exists() for d in os.listdir(slow)
                   if (slow / d).is_dir())
    assert not any(a.agent_alive() for a in agents)
