"""Repeated saves of the same structure do not re-plan; a changed structure does, and stays exact.

``DataStatesSavePlanner`` caches plans by default, keyed by the structure every rank saves
(dcp_datastates/save/plan_cache.py): a repeated save of one structure skips the global planning
(and sends no plans), a structure saved before (within the cache's capacity) is not planned
again, and any change (names, shapes, dtypes, nesting, on any rank) is. DCP's own cache, keyed
by the planner's class, serves a state dict of the same names and shapes but other dtypes or
nesting the previous one's metadata: its checkpoint loads wrongly wherever the metadata is read
(the stale-plan test shows it, and that ours is exact). Counted, not timed; on 2 gloo ranks and
in one process, where the protocol's steps are run by hand for 4 ranks (each rank's cache its
own) and every rank's final plan is compared with DCP's uncached planning.
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
    from torch.distributed.checkpoint import FileSystemReader

    from dcp_datastates import DataStatesSavePlanner, DataStatesWriter

    calls = {"global": 0}

    class CountingPlanner(DataStatesSavePlanner):
        def _create_global_plan(self, all_plans: Any) -> Any:
            calls["global"] += 1
            return super()._create_global_plan(all_plans)

    DataStatesSavePlanner.clear_plan_cache()
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
                           planner=CountingPlanner()).result(60)
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
    half = {k: v.to(torch.bfloat16) for k, v in model.items()}  # the same names and shapes
    save_and_check("d", half)
    md = FileSystemReader(f"{root}/d").read_metadata().state_dict_metadata
    assert {m.properties.dtype for m in md.values()} == {torch.bfloat16}  # type: ignore[union-attr]
    return counts


def test_repeated_saves_do_not_replan_and_changes_do(tmp_path: Any) -> None:
    counts = run_ranks(_body, str(tmp_path / "ck"), tmp_path=tmp_path, timeout_s=180)
    coordinator = counts[0]
    # a0 plans; a1 and a2 reuse its plan; b plans; a3 reuses a0's (cached by structure); c (a
    # changed shape) and d (changed dtypes) plan.
    assert coordinator == [1, 1, 1, 2, 2, 3, 4], coordinator
    assert counts[1] == [0] * 7  # only the coordinator plans globally


# --- the protocol in one process ---------------------------------------------------------------


class _Ranks:
    """DCP's save protocol run by hand for ``world`` ranks in this process: each rank its own
    planner and its own rank cache, plans pickled as DCP's collectives pickle them."""

    def __init__(self, world: int, make: Any = None) -> None:
        from dcp_datastates import DataStatesSavePlanner
        from dcp_datastates.save import plan_cache

        self.plan_cache = plan_cache
        self.make = make or DataStatesSavePlanner
        self.world = world
        self.caches = [plan_cache.RankCache() for _ in range(world)]
        self.planned = 0  # global plannings (not served from the cache)
        plan_cache.clear()

    def _as_rank(self, r: int) -> None:
        self.plan_cache.RANK = self.caches[r]

    def save(self, sds: list[dict[str, Any]], **kwargs: Any) -> tuple[Any, Any, Any]:
        """Returns every rank's final plan, the metadata and what the coordinator sent."""
        import pickle

        planners = [self.make(**kwargs) for _ in range(self.world)]
        local = []
        for r, (p, sd) in enumerate(zip(planners, sds, strict=True)):
            self._as_rank(r)
            p.set_up_planner(sd, None, r == 0)
            local.append(pickle.loads(pickle.dumps(p.create_local_plan())))
        inner = planners[0]._create_global_plan

        def counted(plans: Any) -> Any:
            self.planned += 1
            return inner(plans)

        planners[0]._create_global_plan = counted
        try:
            deltas, md = planners[0].create_global_plan(local)
        finally:
            self._as_rank(0)
        deltas = pickle.loads(pickle.dumps(deltas))
        finals = []
        for r, (p, d) in enumerate(zip(planners, deltas, strict=True)):
            self._as_rank(r)
            finals.append(p.finish_plan(d))
        self._as_rank(0)
        return finals, md, deltas


def _stock(sds: list[dict[str, Any]], **kwargs: Any) -> tuple[Any, Any]:
    """DCP's uncached planning of the same state dicts: the final plans and metadata."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planners = [DefaultSavePlanner(**kwargs) for _ in sds]
    local = []
    for r, (p, sd) in enumerate(zip(planners, sds, strict=True)):
        p.set_up_planner(sd, None, r == 0)
        local.append(p.create_local_plan())
    plans, md = planners[0].create_global_plan(local)
    return plans, md


def _state(world: int, rank: int, *, extra: bool = False, dtype: Any = torch.float32,
           rows: int = 12) -> dict[str, Any]:
    """FSDP-like: each rank its rows of two tensors; a replicated tensor and a bytes item."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
    from torch.distributed._shard.sharding_spec import ShardMetadata

    del ShardedTensor, Shard, ShardedTensorMetadata, ShardMetadata  # plain tensors suffice
    sd: dict[str, Any] = {f"w{i}.r{rank}": torch.full((rows + i,), float(rank), dtype=dtype)
                          for i in range(2)}
    sd["shared"] = torch.arange(8.0).to(dtype)
    sd["meta"] = {"step": 3, "note": "x"}
    if extra:
        sd[f"extra.r{rank}"] = torch.zeros(5, dtype=dtype)
    return sd


def _check_exact(ranks: _Ranks, sds: list[dict[str, Any]], **kwargs: Any) -> list[Any]:
    finals, md, deltas = ranks.save(sds, **kwargs)
    want_plans, want_md = _stock(sds, **kwargs)
    assert finals == want_plans
    assert md == want_md
    return deltas


def test_same_structure_reuses_every_plan() -> None:
    world = 4
    ranks = _Ranks(world)
    sds = [_state(world, r) for r in range(world)]
    first = _check_exact(ranks, sds)
    assert ranks.planned == 1 and all(d.usable for d in first)
    for it in range(2):  # new values, same structure
        sds = [{k: (v + it + 1 if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
               for sd in sds]
        again = _check_exact(ranks, sds)
        assert ranks.planned == 1, "an unchanged structure was planned again"
        assert not any(d.usable for d in again)  # every rank reuses its global plan


def test_changed_structures_are_planned_again_and_exact() -> None:
    world = 4
    ranks = _Ranks(world)
    a = [_state(world, r) for r in range(world)]
    b = [_state(world, r, extra=r == 2) for r in range(world)]  # one rank changes
    c = [_state(world, r, dtype=torch.bfloat16) for r in range(world)]  # dtypes only
    d = [_state(world, r, rows=13) for r in range(world)]  # shapes only
    _check_exact(ranks, a)
    deltas = _check_exact(ranks, b)
    assert ranks.planned == 2
    assert deltas[2].usable  # the changed rank gets its new plan
    _check_exact(ranks, c)
    _check_exact(ranks, d)
    assert ranks.planned == 4
    _check_exact(ranks, c)  # still cached (the last two structures)
    assert ranks.planned == 4
    _check_exact(ranks, a)  # evicted (capacity 2): planned again, exact
    assert ranks.planned == 5


def test_replicated_items_moving_reach_the_unchanged_ranks() -> None:
    """A replicated item goes to the least-loaded rank: one rank's new tensor moves it, and a
    rank whose local plan did not change gets its new global plan."""
    world = 3
    ranks = _Ranks(world)

    def state(r: int, lead: bool) -> dict[str, Any]:
        sd: dict[str, Any] = {"lead": torch.zeros(4)} if lead and r == 0 else {}
        sd["rep"] = torch.zeros(6)  # on every rank, saved by the least loaded when DCP meets it
        sd[f"own.r{r}"] = torch.zeros(4)
        return sd

    first = _check_exact(ranks, [state(r, False) for r in range(world)])
    assert [any(i.index.fqn == "rep" for i in d.items) for d in first] == [True, False, False]
    deltas = _check_exact(ranks, [state(r, True) for r in range(world)])
    # rank 0 changed; rank 1, unchanged, now saves rep; rank 2 reuses its plan
    assert [d.usable for d in deltas] == [True, True, False]
    assert any(i.index.fqn == "rep" for i in deltas[1].items)


def test_configurations_are_keyed_apart() -> None:
    world = 2
    ranks = _Ranks(world)
    sds = [_state(world, r) for r in range(world)]
    _check_exact(ranks, sds)
    _check_exact(ranks, sds, dedup_save_to_lowest_rank=True)
    assert ranks.planned == 2
    _check_exact(ranks, sds, flatten_state_dict=False)
    assert ranks.planned == 3


def test_a_rank_without_its_cache_gets_a_full_plan() -> None:
    from dcp_datastates.save import plan_cache

    world = 3
    ranks = _Ranks(world)
    sds = [_state(world, r) for r in range(world)]
    _check_exact(ranks, sds)
    ranks.caches[1] = plan_cache.RankCache()  # e.g. cleared on that rank only
    deltas = _check_exact(ranks, sds)
    assert [d.usable for d in deltas] == [False, True, False]


def test_a_coordinator_without_the_plan_fails_once_then_plans_afresh() -> None:
    from dcp_datastates.save import plan_cache

    world = 2
    ranks = _Ranks(world)
    sds = [_state(world, r) for r in range(world)]
    _check_exact(ranks, sds)
    plan_cache.COORDINATOR.__init__()  # type: ignore[misc]  # e.g. another coordinator
    with pytest.raises(RuntimeError, match="does not hold"):
        ranks.save(sds)
    deltas = _check_exact(ranks, sds)  # the ranks dropped their caches: full plans
    assert all(d.usable for d in deltas)
    assert not any(d.usable for d in _check_exact(ranks, sds))


def test_caching_off_plans_every_time() -> None:
    world = 2
    ranks = _Ranks(world)
    sds = [_state(world, r) for r in range(world)]
    for _ in range(2):
        assert all(d.usable for d in _check_exact(ranks, sds, enable_plan_caching=False))
    assert ranks.planned == 2


# --- stale plans: DCP's cache and ours, saving and loading for real ----------------------------


def _load_from_metadata(path: str) -> dict[str, Any]:
    """What a load that builds its state from the checkpoint's metadata gets (as
    ``dcp_to_torch_save`` does): dtypes and nesting from the metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict[str, Any] = {}  # as dcp_to_torch_save reads a checkpoint
    _load_state_dict(out, storage_reader=FileSystemReader(path),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    return bool(a == b)


def _save_two_models(root: Any, make_planner: Any) -> list[bool]:
    """Model A, then model B of the same names and shapes but other dtypes and nesting, saved
    in one process with plan caching; each loaded back from its metadata and compared bit for
    bit (dtype, structure, bytes)."""
    from dcp_datastates import DataStatesWriter

    torch.manual_seed(0)
    a = {"model": {"w": torch.randn(8, 4), "b": torch.randn(4)}}
    b = {"model.w": torch.randn(8, 4).to(torch.bfloat16), "model.b": torch.randn(4).half()}
    exact = []
    with DataStatesWriter(str(root), host_cache_size="1MiB") as w:
        for name, sd in (("a", a), ("b", b)):
            dcp.save(sd, storage_writer=w, checkpoint_id=f"{root}/{name}",
                     planner=make_planner(), no_dist=True)
    for name, sd in (("a", a), ("b", b)):
        exact.append(_same(sd, _load_from_metadata(f"{root}/{name}")))
    return exact


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_another_model_after_one_never_gets_its_plan(tmp_path: Any) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_datastates import DataStatesSavePlanner, planner
    from dcp_datastates.save import plan_cache

    for cache in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
                  "_cached_metadata", "_cached_final_save_plan"):
        getattr(DefaultSavePlanner, cache).clear()
    stock = _save_two_models(tmp_path / "stock", lambda: DefaultSavePlanner(
        enable_plan_caching=True))
    assert stock == [True, False], "DCP's cache no longer serves B with A's plan"
    plan_cache.clear()
    assert DataStatesSavePlanner()._enable_plan_caching  # on by default
    assert _save_two_models(tmp_path / "ours", planner) == [True, True]


def test_same_model_new_values_reuses_the_plan_and_loads_exact(tmp_path: Any) -> None:
    from dcp_datastates import DataStatesSavePlanner, DataStatesWriter

    planned = []

    class Counting(DataStatesSavePlanner):
        def _create_global_plan(self, all_plans: Any) -> Any:
            planned.append(1)
            return super()._create_global_plan(all_plans)

    DataStatesSavePlanner.clear_plan_cache()
    sd = {"model": {"w": torch.randn(8, 4), "b": torch.randn(4)}, "step": 1}
    saved = []
    with DataStatesWriter(str(tmp_path), host_cache_size="1MiB") as w:
        for i in range(3):
            sd["model"]["w"].add_(1.0)
            sd["step"] = i
            dcp.save(sd, storage_writer=w, checkpoint_id=f"{tmp_path}/s{i}", planner=Counting(),
                     no_dist=True)
            saved.append({"model": {k: v.clone() for k, v in sd["model"].items()}, "step": i})
    assert len(planned) == 1
    for i in range(3):
        assert _same(saved[i], _load_from_metadata(f"{tmp_path}/s{i}"))


def _key_of(sd: dict[str, Any], **kwargs: Any) -> bytes:
    from dcp_datastates import DataStatesSavePlanner

    p = DataStatesSavePlanner(**kwargs)
    p.set_up_planner(sd, None, True)
    plan = p.create_local_plan()
    return plan.planner_data.key  # type: ignore[no-any-return]


def test_structure_keys_follow_structure_not_values() -> None:
    from dcp_datastates.save import plan_cache

    plan_cache.clear()
    base = {"m": {"w": torch.zeros(4, 2), "b": torch.zeros(2)}, "step": 3}
    key = _key_of(base)
    assert _key_of({"m": {"w": torch.ones(4, 2), "b": torch.ones(2)}, "step": 4}) == key
    changed = [
        {"m": {"w": torch.zeros(4, 2, dtype=torch.bfloat16), "b": torch.zeros(2)}, "step": 3},
        {"m": {"w": torch.zeros(4, 3), "b": torch.zeros(2)}, "step": 3},
        {"m.w": torch.zeros(4, 2), "m.b": torch.zeros(2), "step": 3},  # same names, nesting
        {"m": {"b": torch.zeros(2), "w": torch.zeros(4, 2)}, "step": 3},  # order
        {"m": {"w": torch.zeros(4, 2), "b": torch.zeros(2)}},
    ]
    keys = {_key_of(sd) for sd in changed} | {_key_of(base, dedup_save_to_lowest_rank=True)}
    assert key not in keys and len(keys) == len(changed) + 1


def test_structure_keys_are_the_same_in_every_process() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch\n"
        "from test_plan_cache import _key_of\n"
        "print(_key_of({'m': {'w': torch.zeros(4, 2)}, 'names': ['a', 'b'], 'n': 1}).hex())\n"
    )
    outs = set()
    for seed in ("1", "2"):  # str hashes differ between these processes; keys must not
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True, cwd=Path(__file__).parent,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        outs.add(out.stdout.strip())
    assert len(outs) == 1, outs
