"""The compact wire form of plans and write results (dcp_datastates.save.wire).

What DCP's collectives pickle must come back exactly as the default pickle would give it: the
same classes, the same attributes (the index hint too, which ``==`` ignores), fresh objects with
nothing shared that the default pickle would not share. Items of any other shape travel as they
are. Then a save through a one-rank gloo group (what pickles them) loads bit for bit with the
stock reader.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from dcp_datastates.save.planner import share_equal_values
from dcp_datastates.save.wire import CompactSavePlan, CompactWriteResults, compact_plan

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        **{f"w{i}": torch.randn(8, 4) for i in range(20)},
        "bf": torch.randn(3, 5).to(torch.bfloat16),
        "grad": torch.randn(4, requires_grad=True),
        "i64": torch.arange(6),
        "step": 7,
        "cfg": {"lr": 0.1, "name": "x"},
    }


def _local_plan(sd: dict[str, Any]) -> SavePlan:
    p = DefaultSavePlanner()
    p.set_up_planner(sd, None, True)
    return p.create_local_plan()


class _ItemSubclass(WriteItem):
    pass


def _odd_items() -> list[WriteItem]:
    """Items the encoder must pass through as they are, and plain ones with unusual values."""
    props = TensorProperties(dtype=torch.float16, memory_format=torch.channels_last,
                             pin_memory=True)
    chunk = ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([4, 8]))
    shard = WriteItem(  # a shard of a larger tensor, with an index hint
        index=MetadataIndex("sharded", torch.Size([4, 0]), index=3),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size([8, 8])),
    )
    sub = _ItemSubclass(index=MetadataIndex("sub", torch.Size([0])), type=WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
                            properties=TensorProperties(dtype=torch.float32),
                            size=torch.Size([2])))
    extra = WriteItem(index=MetadataIndex("extra", torch.Size([0])), type=WriteItemType.TENSOR,
                      tensor_data=TensorWriteData(
                          chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
                          properties=TensorProperties(dtype=torch.float32),
                          size=torch.Size([2])))
    object.__setattr__(extra, "note", "kept")  # an attribute the encoder does not know
    listy = WriteItem(index=MetadataIndex("listy"), type=WriteItemType.TENSOR,
                      tensor_data=TensorWriteData(
                          chunk=ChunkStorageMetadata([0], [3]),  # type: ignore[arg-type]
                          properties=TensorProperties(dtype=torch.int8), size=[3]))  # type: ignore[arg-type]
    raw = WriteItem(index=MetadataIndex("raw"), type=WriteItemType.BYTE_IO,
                    bytes_io_data=BytesIOWriteData(nbytes=12))
    return [shard, sub, extra, listy, raw]


def _same(a: Any, b: Any, path: str = "") -> None:
    """Deep comparison of class and every attribute (``==`` skips MetadataIndex.index)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif hasattr(a, "__dict__") and not isinstance(a, (torch.dtype, torch.layout)):
        _same(vars(a), vars(b), path)
    else:
        assert a == b, (path, a, b)


def _plan() -> SavePlan:
    plan = share_equal_values(_local_plan(_state()))
    plan.items.extend(_odd_items())
    return dataclasses.replace(plan, storage_data=_StoragePrefix("__7_"))


def test_a_plan_round_trips_as_the_default_pickle_gives_it() -> None:
    plan = _plan()
    default = pickle.loads(pickle.dumps(plan))
    compact = compact_plan(plan)
    assert type(compact) is CompactSavePlan and compact.items is plan.items
    blob = pickle.dumps(compact)
    back = pickle.loads(blob)
    assert type(back) is CompactSavePlan
    assert back == plan and plan == back and back == default
    _same(back.items, default.items)
    _same(back.storage_data, default.storage_data)
    _same(back.planner_data, default.planner_data)
    assert back.usable is True
    assert len(blob) < 0.6 * len(pickle.dumps(plan))
    # The encoder's shapes: odd items travel as themselves (subclass, extra attribute, lists).
    odd = {i.index.fqn: i for i in back.items[-5:]}
    assert type(odd["sub"]) is _ItemSubclass
    assert odd["extra"].__dict__["note"] == "kept"
    assert odd["sharded"].index.index == 3
    assert odd["sharded"].tensor_data.properties.memory_format is torch.channels_last
    assert odd["listy"].tensor_data.size == [3]


def test_decoded_items_share_no_mutable_object() -> None:
    back = pickle.loads(pickle.dumps(compact_plan(_plan())))
    props = [i.tensor_data.properties for i in back.items if i.tensor_data is not None]
    assert len({id(p) for p in props}) == len(props)  # one TensorProperties per item
    props[0].dtype = torch.float64  # a planner may change one item's properties...
    assert all(p.dtype != torch.float64 for p in props[1:])  # ...and only that one


def test_plan_semantics_are_savePlans() -> None:
    plan = _plan()
    compact = compact_plan(plan)
    assert dataclasses.replace(compact, usable=False).usable is False
    assert type(dataclasses.replace(compact, items=[])) is CompactSavePlan
    assert copy.deepcopy(compact) == plan
    assert compact != dataclasses.replace(plan, usable=False)
    assert compact != "a plan"
    with pytest.raises(TypeError):
        hash(compact)

    @dataclasses.dataclass(frozen=True)
    class PlannersOwn(SavePlan):
        extra: int = 0

    own = PlannersOwn(plan.items, extra=3)
    assert compact_plan(own) is own  # a planner's own class is left alone


def test_write_results_round_trip() -> None:
    items = _local_plan(_state()).items
    results: list[Any] = [
        WriteResult(index=it.index, size_in_bytes=64 * k,
                    storage_data=_StorageInfo("__0_0.distcp", 4096 * k, 64 * k))
        for k, it in enumerate(items)
    ]
    results.append(WriteResult(index=MetadataIndex("t", torch.Size([2]), index=1),
                               size_in_bytes=8,
                               storage_data=_StorageInfo("__0_1.distcp", 0, 8, ["zstd"])))
    results.append(WriteResult(index=MetadataIndex("other"), size_in_bytes=1,
                               storage_data={"custom": 1}))  # a storage_data of another kind
    default = pickle.loads(pickle.dumps(results))
    back = pickle.loads(pickle.dumps(CompactWriteResults(results)))
    assert type(back) is list
    _same(back, default)
    assert back[-2].storage_data.transform_descriptors == ["zstd"]
    assert "transform_descriptors" not in vars(back[0].storage_data)  # as __getstate__ leaves it
    assert back[-2].index.index == 1


def _save_and_load(rank: int, world: int, root: str) -> bool:
    from dcp_datastates import DataStatesWriter

    sd = _state()
    with DataStatesWriter(root, host_cache_size="4MiB") as w:
        for k in range(2):
            path = f"{root}/c{k}"
            dcp.async_save(sd, storage_writer=w, checkpoint_id=path).result(60)
            dcp.save(sd, storage_writer=w, checkpoint_id=path + "s")
    for path in (f"{root}/c1", f"{root}/c1s"):
        out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
               for k, v in sd.items()}
        out["cfg"] = {"lr": 0.0, "name": ""}
        dcp.load(out, checkpoint_id=path)
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(out[k], v), k
            else:
                assert out[k] == v, k
    return True


def test_save_through_a_one_rank_group_loads_bit_for_bit(tmp_path: Path) -> None:
    """DCP pickles the compact plans and results here (gather, scatter) even with one rank."""
    from dist_utils import run_ranks

    assert run_ranks(_save_and_load, str(tmp_path / "ck"), tmp_path=tmp_path, world_size=1,
                     timeout_s=120) == [True]
