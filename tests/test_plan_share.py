"""Local plans share equal sizes (dcp_datastates.save.planner.share_equal_values).

DCP pickles plans through its collectives and the global metadata into ``.metadata``; items of one
shape sharing one ``torch.Size`` object are written once. Nothing else may change: the plan
compares equal, the checkpoint loads bit for bit with the stock reader, and values that are not
``torch.Size`` (a custom planner's tuples) are left alone.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_datastates import DataStatesWriter
from dcp_datastates.save.planner import share_equal_values

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(n: int = 50) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        **{f"w{i}": torch.randn(8, 4) for i in range(n)},
        "odd": torch.randn(3, 5),
        "bf": torch.randn(8, 4).to(torch.bfloat16),
        "step": 7,
    }


def _local_plan(sd: dict[str, Any]) -> Any:
    p = DefaultSavePlanner()
    p.set_up_planner(sd, None, True)
    return p.create_local_plan()


def test_shared_plan_is_equal_and_pickles_smaller() -> None:
    sd = _state()
    plan = _local_plan(sd)
    before = copy.deepcopy(plan)
    out = share_equal_values(plan)
    assert out is plan and plan == before
    sizes = {id(i.tensor_data.chunk.sizes) for i in plan.items if i.tensor_data is not None}
    assert len(sizes) == 2  # (8, 4) for 51 tensors (float32 and bf16 alike), (3, 5) once
    assert len(pickle.dumps(plan)) < 0.8 * len(pickle.dumps(before))
    assert pickle.loads(pickle.dumps(plan)) == before


def test_values_that_are_not_torch_size_are_left_alone() -> None:
    plan = _local_plan(_state(3))
    item = next(i for i in plan.items if i.tensor_data is not None)
    item.tensor_data.chunk.sizes = [8, 4]  # type: ignore[assignment]  # a custom planner's list
    share_equal_values(plan)
    assert item.tensor_data.chunk.sizes == [8, 4]


def test_metadata_shares_sizes_and_loads_bit_exact(tmp_path: Path) -> None:
    sd = _state()
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    with DataStatesWriter(ours, host_cache_size="16MiB") as w:
        dcp.save(sd, storage_writer=w, checkpoint_id=ours)
    dcp.save(sd, storage_writer=FileSystemWriter(stock), checkpoint_id=stock)

    def distinct_sizes(path: Path) -> int:
        md = FileSystemReader(path).read_metadata()
        return len({id(m.size) for m in md.state_dict_metadata.values() if hasattr(m, "size")})

    assert distinct_sizes(ours) == 2 and distinct_sizes(stock) == 52
    assert (ours / ".metadata").stat().st_size < (stock / ".metadata").stat().st_size
    back = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
    dcp.load(back, checkpoint_id=ours)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back[k], v) and back[k].dtype == v.dtype, k
        else:
            assert back[k] == v


def _metadata(tmp_path: Path, writer: Any) -> Any:
    dcp.save(_state(), storage_writer=writer, checkpoint_id=tmp_path)
    return FileSystemReader(tmp_path).read_metadata()


def test_final_metadata_shares_properties_and_offsets(tmp_path: Path) -> None:
    """share_metadata_values at finish(): equal TensorProperties and the storage_data keys'
    offsets are one object each in .metadata; every key still finds its storage entry, and the
    result equals (==) the stock writer's metadata apart from the storage details."""
    with DataStatesWriter(tmp_path / "ours", host_cache_size="16MiB") as w:
        ours = _metadata(tmp_path / "ours", w)
    stock = _metadata(tmp_path / "stock", FileSystemWriter(tmp_path / "stock"))
    tensors = [m for m in ours.state_dict_metadata.values() if hasattr(m, "properties")]
    assert len({id(m.properties) for m in tensors}) == 2  # float32 and bfloat16
    offsets = [k.offset for k in ours.storage_data if k.offset is not None]  # "step": None
    assert len(offsets) == 52 and len({id(o) for o in offsets}) == 1  # all (0, 0)
    for k in ours.storage_data:
        assert ours.storage_data[k] is ours.storage_data[copy.deepcopy(k)]  # hashes unchanged
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert set(ours.storage_data) == set(stock.storage_data)
    assert len(pickle.dumps(ours)) < len(pickle.dumps(stock))


def test_share_metadata_values_leaves_other_values_alone() -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dcp_datastates.save.planner import share_metadata_values

    class Props(TensorProperties):  # a subclass: not merged with the plain ones
        pass

    def tmd(props: TensorProperties, size: Any) -> TensorStorageMetadata:
        return TensorStorageMetadata(props, size, [ChunkStorageMetadata(torch.Size([0]), size)])

    a = tmd(TensorProperties(torch.float32), torch.Size([4]))
    b = tmd(TensorProperties(torch.float32), torch.Size([4]))
    c = tmd(Props(torch.float32), [4])  # a custom planner's list: left as it is
    keys = [MetadataIndex("a", torch.Size([0])), MetadataIndex("b", torch.Size([0])),
            MetadataIndex("bytes")]
    md = Metadata({"a": a, "b": b, "c": c, "bytes": "not a tensor"},  # type: ignore[dict-item]
                  storage_data={k: i for i, k in enumerate(keys)})
    before = copy.deepcopy(md)
    assert share_metadata_values(md) is md
    assert md.state_dict_metadata == before.state_dict_metadata
    assert a.properties is b.properties and a.size is b.size
    assert type(c.properties) is Props and c.size == [4]
    assert keys[0].offset is keys[1].offset and keys[2].offset is None
    assert [md.storage_data[k] for k in before.storage_data] == [0, 1, 2]
