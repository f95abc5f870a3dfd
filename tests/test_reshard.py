"""Resharding on load, 8 -> 2 -> 1: saved by 8 ranks with DataStatesWriter, loaded by 2 ranks
with the stock ``dcp.load`` into other shardings, saved again by those 2 ranks, loaded in one
process: every tensor bit for bit against the original full tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    return {
        "emb": torch.randn(37, 16, generator=g),  # Shard(0) over 8: uneven, last shards empty
        "proj": torch.randn(8, 21, generator=g).to(torch.bfloat16),  # Shard(1): uneven columns
        "norm": torch.randn(16, generator=g),  # replicated
        "exp_avg": torch.randn(37, 16, generator=g),  # optimizer-like, nested below
        "step": torch.tensor(123, dtype=torch.int64),
    }


def _layout(full: dict[str, torch.Tensor], mesh: Any, row_shard: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    first = Shard(0) if row_shard else Replicate()
    return {
        "model": {
            "emb": distribute_tensor(full["emb"], mesh, [first]),
            "proj": distribute_tensor(full["proj"], mesh, [Shard(1) if row_shard else Shard(0)]),
            "norm": distribute_tensor(full["norm"], mesh, [Replicate()]),
        },
        "optim": {
            "state": {"emb": {"exp_avg": distribute_tensor(full["exp_avg"], mesh, [first]),
                              "step": full["step"].clone()}},
            "param_groups": [{"lr": 0.5, "params": ["emb"]}],
        },
    }


def _zeros(like: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in like.items():
        if isinstance(v, dict):
            out[k] = _zeros(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)  # a DTensor keeps its mesh and placements
        elif isinstance(v, list):
            out[k] = [dict(x, lr=0.0) if isinstance(x, dict) else x for x in v]
        else:
            out[k] = v
    return out


def _check(got: dict[str, Any], full: dict[str, torch.Tensor]) -> None:
    def whole(t: Any) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    m, o = got["model"], got["optim"]["state"]["emb"]
    for k in ("emb", "proj", "norm"):
        assert torch.equal(whole(m[k]), full[k]), k
    assert torch.equal(whole(o["exp_avg"]), full["exp_avg"])
    assert torch.equal(o["step"], full["step"])
    assert got["optim"]["param_groups"][0]["lr"] == 0.5


def _save_8(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates import DataStatesWriter

    assert world == 8
    mesh = init_device_mesh("cpu", (world,))
    sd = _layout(full_state(), mesh, row_shard=True)
    pg = dist.new_group(backend="gloo")
    with DataStatesWriter(root, host_cache_size="4MiB") as w:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=root + "/from8", process_group=pg
                       ).result(120)


def _load_2_save_2(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates import DataStatesWriter

    assert world == 2
    mesh = init_device_mesh("cpu", (world,))
    full = full_state()
    target = _zeros(_layout(full, mesh, row_shard=False))  # other placements than the save
    pg = dist.new_group(backend="gloo")
    dcp.load(target, checkpoint_id=root + "/from8", process_group=pg)  # the stock reader
    _check(target, full)
    with DataStatesWriter(root, host_cache_size="4MiB") as w:
        dcp.async_save(target, storage_writer=w, checkpoint_id=root + "/from2", process_group=pg
                       ).result(120)


def test_reshard_8_to_2_to_1(tmp_path: Any) -> None:
    root = str(tmp_path)
    (tmp_path / "w8").mkdir()
    (tmp_path / "w2").mkdir()
    run_ranks(_save_8, root, world_size=8, tmp_path=tmp_path / "w8", timeout_s=240)
    run_ranks(_load_2_save_2, root, world_size=2, tmp_path=tmp_path / "w2", timeout_s=180)
    full = full_state()
    plain = {
        "model": {k: torch.zeros_like(full[k]) for k in ("emb", "proj", "norm")},
        "optim": {"state": {"emb": {"exp_avg": torch.zeros_like(full["exp_avg"]),
                                    "step": torch.tensor(0)}},
                  "param_groups": [{"lr": 0.0, "params": ["emb"]}]},
    }
    dcp.load(plain, checkpoint_id=root + "/from2")  # one process, no process group
    _check(plain, full)
