"""Two ranks over gloo: DTensor shards (uneven, empty, replicated), resharding on load, and
DDP / FSDP2 loops that save every iteration with async_save, each checkpoint checked against a
snapshot of its step."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, zeros_like_state
from dist_utils import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return {
        "uneven": torch.randn(3, 4, generator=g),  # Shard(0) on 2 ranks: 2 rows + 1 row
        "one_row": torch.randn(1, 5, generator=g),  # Shard(0): rank 1's shard is empty
        "cols": torch.randn(6, 7, generator=g).to(torch.bfloat16),  # Shard(1): 4 + 3 columns
        "replicated": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "plain": torch.randn(10, generator=g),  # a plain tensor on every rank: deduplicated
    }


def _dtensor_body(rank: int, world: int, root: str, mode: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcp_datastates import DataStatesWriter

    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    sd: dict[str, Any] = {
        "uneven": distribute_tensor(full["uneven"], mesh, [Shard(0)]),
        "one_row": distribute_tensor(full["one_row"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "replicated": distribute_tensor(full["replicated"], mesh, [Replicate()]),
        "plain": full["plain"].clone(),
        "meta": {"step": 11, "name": "rank-agnostic"},
    }
    pg = dist.new_group(backend="gloo")
    w = DataStatesWriter(
        root, host_cache_size="1MiB", chunk_size="16KiB", prefault=False, capture="lazy"
    )
    if mode == "async":
        dcp.async_save(sd, storage_writer=w, checkpoint_id=root, process_group=pg).result()
        # The three sharded DTensors (an empty shard included) are this rank's alone: placed,
        # and flushing, before DCP planned; the replicated and the plain tensor waited for its
        # deduplication (dcp_datastates.save.early).
        assert w.save_stats()[-1]["early_tensors"] == 3, w.save_stats()[-1]
    else:
        dcp.save(sd, storage_writer=w, checkpoint_id=root, process_group=pg)
    w.close()
    dist.barrier()
    # Load back with other placements: everything replicated, and columns sharded by rows.
    dest = {
        "uneven": distribute_tensor(torch.zeros(3, 4), mesh, [Replicate()]),
        "one_row": distribute_tensor(torch.zeros(1, 5), mesh, [Replicate()]),
        "cols": distribute_tensor(torch.zeros(6, 7, dtype=torch.bfloat16), mesh, [Shard(0)]),
        "replicated": distribute_tensor(torch.zeros(3, 4, dtype=torch.int64), mesh, [Shard(1)]),
        "plain": torch.zeros(10),
        "meta": {"step": 0, "name": ""},
    }
    dcp.load(dest, checkpoint_id=root, process_group=pg)
    for k in ("uneven", "one_row", "cols", "replicated"):
        assert torch.equal(dest[k].full_tensor(), full[k]), k
    assert torch.equal(dest["plain"], full["plain"])
    assert dest["meta"]["step"] == 11


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dtensor_shards_and_resharding(tmp_path: Any, mode: str) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(_dtensor_body, root, mode, tmp_path=tmp_path, timeout_s=120)
    # And in one process, without any process group, into plain tensors.
    full = full_tensors()
    dest: dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items()}
    dest["meta"] = {"step": 0, "name": ""}
    dcp.load(dest, checkpoint_id=root, no_dist=True)
    for k, v in full.items():
        assert torch.equal(dest[k], v), k
    from dcp_datastates import verify_checkpoint

    rep = verify_checkpoint(root)
    assert rep.ok and rep.ranks == 2, rep.summary()


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _every_iteration_body(rank: int, world: int, root: str, kind: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dcp_datastates import DataStatesWriter

    torch.manual_seed(0)
    model = Tiny()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: torch.nn.Module = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a)
        fully_shard(model)
        wrapped = model
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    ckpt_pg = dist.new_group(backend="gloo")
    w = DataStatesWriter(root, host_cache_size="256KiB", chunk_size="8KiB", prefault=False)
    w.protect(opt)
    w.engine.set_delays(1000, 2000, seed=rank)
    gen = torch.Generator().manual_seed(rank)
    futs = []
    for step in range(6):
        x = torch.randn(8, 16, generator=gen)
        wrapped(x).pow(2).mean().backward()
        opt.step()  # waits for the previous save's copies
        opt.zero_grad()
        msd, osd = get_state_dict(wrapped, opt)
        # One tensor twice: a tensor that keys itself in its save (capture.py) is recorded once
        # as itself and once behind an alias.
        state = {"model": msd, "optim": osd, "step": step, "again": next(iter(msd.values()))}
        # The synchronous reference snapshot of this step, on this rank.
        torch.save(copy.deepcopy(state), f"{root}/ref-{step}-rank{rank}.pt")
        futs.append(
            dcp.async_save(
                state, storage_writer=w, checkpoint_id=f"{root}/step-{step}", process_group=ckpt_pg
            )
        )
    for f in futs:
        f.result()
    early = [st["early_tensors"] for st in w.save_stats()]
    # FSDP2 keeps parameters and optimizer state as shards no other rank holds: placed before
    # DCP planned (dcp_datastates.save.early). DDP's replicated tensors wait for its deduplication.
    assert all(e > 0 for e in early) if kind == "fsdp2" else not any(early), early
    w.close()
    dist.barrier()
    for step in range(6):
        ref = torch.load(f"{root}/ref-{step}-rank{rank}.pt", weights_only=False)
        out = zeros_like_state_dist(ref)
        dcp.load(out, checkpoint_id=f"{root}/step-{step}", process_group=ckpt_pg)
        assert_local_equal(ref, out, f"step {step} rank {rank}")


def zeros_like_state_dist(sd: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(sd, DTensor):
        return DTensor.from_local(
            torch.zeros_like(sd.to_local()),
            sd.device_mesh,
            sd.placements,
            shape=sd.shape,
            stride=sd.stride(),
        )
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros_like_state_dist(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_state_dist(v) for v in sd]
    return copy.deepcopy(sd)


def assert_local_equal(a: Any, b: Any, where: str) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        assert torch.equal(a.to_local(), b.to_local()), where
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        for k in a:
            assert_local_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        for x, y in zip(a, b, strict=True):
            assert_local_equal(x, y, where)
    else:
        assert a == b, where


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_save_every_iteration_two_ranks(tmp_path: Any, kind: str) -> None:
    root = str(tmp_path / "run")
    import os

    os.makedirs(root)
    run_ranks(_every_iteration_body, root, kind, tmp_path=tmp_path, timeout_s=180)


def test_zeros_like_helper_sanity() -> None:
    sd = {"a": torch.ones(2), "b": [torch.ones(1), 3]}
    z = zeros_like_state(sd)
    assert_state_equal(z, {"a": torch.zeros(2), "b": [torch.zeros(1), 3]})


def _no_collection_body(rank: int, world: int, root: str) -> list[int]:
    import gc
    import time

    import dcp_datastates.save.rank_commit as rank_commit
    from dcp_datastates import DataStatesWriter

    sd = {"model": {f"r{rank}.t{i}": torch.full((4,), float(i)) for i in range(1500)}}
    pg = dist.new_group(backend="gloo")
    w = DataStatesWriter(root, host_cache_size="4MiB")
    marks: dict[str, float] = {}
    collections: list[float] = []
    real_write = w.write_data

    def write_data(*a: Any, **k: Any) -> Any:
        out = real_write(*a, **k)
        marks["written"] = time.perf_counter()
        return out

    # The coordinator completes its write in finish(), while the data flushes, and then waits
    # for the other ranks' data (rank_commit.py): the collector runs meanwhile (training does);
    # DCP's end of the save starts once that wait is over.
    real_wait = rank_commit.wait_for_ranks

    def wait_for_ranks(*a: Any, **k: Any) -> Any:
        out = real_wait(*a, **k)
        marks["written"] = time.perf_counter()
        return out

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(time.perf_counter())

    from torch.distributed.checkpoint.utils import _DistWrapper

    real_all_reduce = _DistWrapper.all_reduce

    def all_reduce(self: Any, *a: Any, **k: Any) -> Any:  # DCP's last step: results, metadata
        out = real_all_reduce(self, *a, **k)
        marks["protocol_end"] = time.perf_counter()
        return out

    _DistWrapper.all_reduce = all_reduce  # type: ignore[method-assign]
    w.write_data = write_data  # type: ignore[method-assign]
    rank_commit.wait_for_ranks = wait_for_ranks  # type: ignore[assignment]
    gc.callbacks.append(on_gc)
    during: list[int] = []
    try:
        for k in range(3):
            marks.clear()
            collections.clear()
            dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/c{k}",
                           process_group=pg).result(60)
            end = marks["protocol_end"]
            during.append(sum(1 for t in collections if marks["written"] <= t <= end))
    finally:
        gc.callbacks.remove(on_gc)
        _DistWrapper.all_reduce = real_all_reduce  # type: ignore[method-assign]
        rank_commit.wait_for_ranks = real_wait  # type: ignore[assignment]
        w.close()
    return during


def test_no_collection_while_dcp_ends_the_save_on_any_rank(tmp_path: Any) -> None:
    """After write_data, DCP still gathers the results and, on every other rank, unpickles the
    coordinator's metadata (an object per item): no collection may run before DCP's protocol
    is over, on any rank (one there scanned the whole process: 0.18 s every other save with
    2 x 2,000 tensors). Collections start again once the save has ended. (The coordinator's
    finish() lets the collector run while it waits for the ranks' data, as training does.)"""
    during = run_ranks(_no_collection_body, str(tmp_path / "ck"), tmp_path=tmp_path,
                       timeout_s=180)
    assert during == [[0, 0, 0], [0, 0, 0]], during


def _hidden_rank_body(rank: int, world: int, root: str) -> None:
    from dcp_datastates import DataStatesWriter

    class Wrapped(DataStatesWriter):
        # DCP passes rank= only where the signature names **kwargs: here it does not.
        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kw: Any) -> None:
            super().set_up_storage_writer(is_coordinator, *args, **kw)

    sd = {f"r{rank}": torch.full((1000,), float(rank)), "shared": torch.arange(10.0)}
    pg = dist.new_group(backend="gloo")
    with Wrapped(root, host_cache_size="1MiB") as w:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=root, process_group=pg).result(60)
    dist.barrier()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, checkpoint_id=root, process_group=pg)
    assert_state_equal(out, sd)


def test_a_writer_whose_set_up_hides_the_rank_still_names_files_per_rank(tmp_path: Any) -> None:
    """A subclass whose set_up_storage_writer takes ``**kw`` gets no rank from DCP: each rank
    must still write files of its own (they once all wrote rank 0's, over each other)."""
    root = str(tmp_path / "ck")
    run_ranks(_hidden_rank_body, root, tmp_path=tmp_path, timeout_s=120)
    from dcp_datastates import verify_checkpoint

    rep = verify_checkpoint(root)
    assert rep.ok and rep.ranks == 2, rep.summary()
