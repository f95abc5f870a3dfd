"""Repeated saves of the same structure do not re-plan; a changed structure does, and stays exact.

DCP's ``enable_plan_caching`` (``DataStatesSavePlanner(enable_plan_caching=True)``) skips the
global planning (and its gather/scatter of plans) when every rank's local plan is unchanged. Its
cache is keyed by the planner *class*, shared by every state dict saved in the process: saves of
different structures alternating in one process must each re-plan and load bit for bit. Counted,
not timed, on 2 gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _body(rank: int, world: int, root: str) -> list[int]:
    from torch.distributed.checkpoint.planner import SavePlanner

    from dcp_datastates import DataStatesSavePlanner, DataStatesWriter

    calls = {"global": 0}

    class CountingPlanner(DataStatesSavePlanner):
        def _create_global_plan(self, all_plans: Any) -> Any:
            calls["global"] += 1
            return super()._create_global_plan(all_plans)

    for cache in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
                  "_cached_metadata", "_cached_final_save_plan"):
        getattr(SavePlanner, cache).clear()
    pg = dist.new_group(backend="gloo")
    # Per-rank keys (each rank's own items) and shared ones (replicated: saved by one rank).
    model = {f"r{rank}.w{i}": torch.full((64 + rank,), float(i)) for i in range(3)}
    model["shared"] = torch.arange(16.0)
    optim = {"m": torch.zeros(32), "step": torch.tensor(0)}
    counts: list[int] = []

    def save_and_check(name: str, sd: dict[str, Any]) -> None:
        path = f"{root}/{name}"
        with DataStatesWriter(root, host_cache_size="2MiB") as w:
            dcp.async_save(sd, storage_writer=w, checkpoint_id=path, process_group=pg,
                           planner=CountingPlanner(enable_plan_caching=True)).result(60)
        counts.append(calls["global"])
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, checkpoint_id=path, process_group=pg)
        for k, v in sd.items():
            assert torch.equal(out[k], v), (name, k)

    for it in range(3):  # the same structure, new values each time
        for v in model.values():
            v.add_(1.0)
        save_and_check(f"a{it}", dict(model))
    both = {**model, **{f"optim.{k}": v for k, v in optim.items()}}
    save_and_check("b", both)  # another structure in the same process
    save_and_check("a3", dict(model))  # and back
    model[f"r{rank}.w0"] = torch.ones(65 + rank)  # a changed shape
    save_and_check("c", dict(model))
    return counts


def test_repeated_saves_do_not_replan_and_changes_do(tmp_path: Any) -> None:
    counts = run_ranks(_body, str(tmp_path / "ck"), tmp_path=tmp_path, timeout_s=180)
    coordinator = counts[0]
    # a0 plans; a1 and a2 reuse the plan; b, a3 and c each change it.
    assert coordinator == [1, 1, 1, 2, 3, 4], coordinator
    assert counts[1] == [0] * 6  # only the coordinator plans globally
