"""The linear global planning gives DCP's result, on valid plans and on invalid ones.

``DataStatesSavePlanner._create_global_plan`` (dcp_datastates/save/global_plan.py) against
``DefaultSavePlanner._create_global_plan`` on the same local plans: the same global plans (item
for item, index hints included, same plan classes), the same deduplication, the same metadata
(entries, chunks and planner data, in the same order, the chunks the same objects) and, for
invalid plans, the same exception with the same message. Layouts are drawn at random: FSDP row
shards (uneven, empty last shards), shards along other dimensions, HSDP replicas, replicated
DTensors and plain tensors (DDP), TP x FSDP grids, strided (permuted) shards, ZeRO-like flat
partitions, layouts that tile without being a grid, scalars, bytes items replicated or per rank,
mixed dtypes, and per-rank item orders.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcp_datastates import DataStatesSavePlanner
from dcp_datastates.save.global_plan import create_global_plan, merge_planner_data, plan_hints

Chunk = tuple[list[int], list[int]]  # offsets, sizes
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


@pytest.fixture(autouse=True)
def _quiet_dcp_warnings() -> Any:
    logger = logging.getLogger("torch.distributed.checkpoint.default_planner")
    level = logger.level
    logger.setLevel(logging.ERROR)  # DCP logs every validation error it finds
    yield
    logger.setLevel(level)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's split of n into parts (offset, size), empty parts at the end."""
    cs = -(-n // parts) if n else 1
    out = []
    for i in range(parts):
        start = min(i * cs, n)
        out.append((start, max(0, min(n, start + cs) - start)))
    return out


def _item(fqn: str, off: list[int], sz: list[int], shape: list[int], dtype: torch.dtype,
          typ: WriteItemType = WriteItemType.SHARD) -> WriteItem:
    o, s = torch.Size(off), torch.Size(sz)
    return WriteItem(
        index=MetadataIndex(fqn, o), type=typ,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(o, s), properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape)),
    )


def _bytes(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _along(shape: list[int], dim: int, off: int, size: int) -> Chunk:
    o, s = [0] * len(shape), list(shape)
    o[dim], s[dim] = off, size
    return o, s


def _grid(shape: list[int], splits: list[int]) -> list[Chunk]:
    """The chunks of a grid: dimension d split ``splits[d]`` ways, row-major."""
    out: list[Chunk] = [([], [])]
    for n, parts in zip(shape, splits, strict=True):
        out = [(o + [a], s + [b]) for o, s in out for a, b in _split(n, parts)]
    return out


def _layout(rng: random.Random, kind: str, world: int, shape: list[int]) -> list[list[Chunk]]:
    """Per rank, the chunks it holds of one tensor."""
    ndim = len(shape)
    if kind == "fsdp":
        return [[_along(shape, 0, a, b)] for a, b in _split(shape[0], world)]
    if kind == "fsdp_dim":
        d = rng.randrange(ndim)
        return [[_along(shape, d, a, b)] for a, b in _split(shape[d], world)]
    if kind == "hsdp":
        reps = rng.choice([r for r in (1, 2, 4) if world % r == 0])
        parts = _split(shape[0], world // reps)
        return [[_along(shape, 0, *parts[r % (world // reps)])] for r in range(world)]
    if kind == "replicated":
        return [[([0] * ndim, list(shape))] for _ in range(world)]
    if kind == "tp_fsdp":
        tp = rng.choice([t for t in (1, 2, 4) if world % t == 0])
        return [[c] for c in _grid(shape, [world // tp, tp] + [1] * (ndim - 2))]
    if kind == "strided":
        parts = [_along(shape, 0, a, b) for a, b in _split(shape[0], world)]
        rng.shuffle(parts)
        return [[p] for p in parts]
    if kind == "zero_flat":
        n = shape[0]
        cuts = sorted([0, n] + [rng.randint(0, n) for _ in range(world - 1)])
        # an empty part at the end: DCP keys items by offset, and would keep one of several
        # items at one offset (an empty one, perhaps) and drop the others
        return [[([cuts[r] if cuts[r + 1] > cuts[r] else n], [cuts[r + 1] - cuts[r]])]
                for r in range(world)]
    if kind == "brick":  # rows halved, each half split at its own column: not a grid
        h, w = shape[0], shape[1]
        c1, c2 = rng.randint(1, w - 1), rng.randint(1, w - 1)
        pieces = [([0, 0], [h // 2, c1]), ([0, c1], [h // 2, w - c1]),
                  ([h // 2, 0], [h - h // 2, c2]), ([h // 2, c2], [h - h // 2, w - c2])]
        return [[p for i, p in enumerate(pieces) if i % world == r] for r in range(world)]
    if kind == "pinwheel":  # five rectangles tiling a square, a grid in no order
        k = shape[0] // 3
        cells = [((0, 0), (1, 2)), ((0, 2), (2, 1)), ((2, 1), (1, 2)), ((1, 0), (2, 1)),
                 ((1, 1), (1, 1))]
        pieces = [([a * k, b * k], [c * k, d * k]) for (a, b), (c, d) in cells]
        return [[p for i, p in enumerate(pieces) if i % world == r] for r in range(world)]
    raise AssertionError(kind)


KINDS_BY_NDIM = {
    1: ["fsdp", "hsdp", "replicated", "strided", "zero_flat"],
    2: ["fsdp", "fsdp_dim", "hsdp", "replicated", "tp_fsdp", "strided", "brick", "pinwheel"],
    3: ["fsdp", "fsdp_dim", "hsdp", "tp_fsdp", "strided"],
}


def _random_plans(rng: random.Random, world: int) -> list[SavePlan]:
    per_rank: list[list[WriteItem]] = [[] for _ in range(world)]
    for t in range(rng.randint(1, 12)):
        ndim = rng.choice([0, 1, 2, 2, 3])
        dtype = rng.choice(DTYPES)
        fqn = f"m.t{t}"
        if ndim == 0 or rng.random() < 0.1:  # a plain tensor: on every rank, or on one
            shape = [rng.randint(1, 6) for _ in range(ndim)]
            holders = range(world) if rng.random() < 0.7 else [rng.randrange(world)]
            for r in holders:
                per_rank[r].append(_item(fqn, [0] * ndim, shape, shape, dtype,
                                         WriteItemType.TENSOR))
            continue
        kind = rng.choice(KINDS_BY_NDIM[ndim])
        lo = 3 if kind == "pinwheel" else 2
        shape = [rng.choice([1, lo, 3, 5, 8, 13, world, 2 * world + 1]) for _ in range(ndim)]
        shape = [max(lo, n) if kind in ("brick", "pinwheel") else n for n in shape]
        if kind == "pinwheel":
            shape = [3 * rng.randint(1, 3)] * 2
        for r, chunks in enumerate(_layout(rng, kind, world, shape)):
            for off, sz in chunks:
                per_rank[r].append(_item(fqn, off, sz, shape, dtype))
    for b in range(rng.randint(0, 3)):
        mode = rng.choice(["all", "rank0", "unique"])
        for r in range(world):
            if mode == "all" or (mode == "rank0" and r == 0):
                per_rank[r].append(_bytes(f"extra.b{b}"))
            elif mode == "unique":
                per_rank[r].append(_bytes(f"extra.b{b}.r{r}"))
    plans = []
    for r, items in enumerate(per_rank):
        if rng.random() < 0.2:
            rng.shuffle(items)
        mappings = {i.index.fqn: tuple(i.index.fqn.split(".")) for i in items}
        if rng.random() < 0.3:
            mappings[f"only.r{r}"] = ("only", f"r{r}")
        plans.append(SavePlan(items, planner_data=mappings))
    return plans


def _outcome(planner: DefaultSavePlanner, plans: list[SavePlan]) -> Any:
    try:
        return planner._create_global_plan(plans)
    except Exception as e:  # noqa: BLE001 - compared with the other planner's
        return e


def _assert_same(plans: list[SavePlan], **kwargs: Any) -> Any:
    before = copy.deepcopy(plans)
    stock = _outcome(DefaultSavePlanner(**kwargs), plans)
    ours_planner = DataStatesSavePlanner(enable_plan_caching=False, **kwargs)
    ours = _outcome(ours_planner, plans)
    assert plans == before  # the local plans are left as they were
    if isinstance(stock, Exception):
        assert type(ours) is type(stock) and str(ours) == str(stock), (ours, stock)
        return stock
    assert not isinstance(ours, Exception), ours
    (gs, ms), (go, mo) = stock, ours
    assert go == gs and [type(p) for p in go] == [type(p) for p in gs]
    index_hints = [[i.index.index for i in p.items] for p in gs]
    assert [[i.index.index for i in p.items] for p in go] == index_hints
    assert mo == ms
    assert list(mo.state_dict_metadata) == list(ms.state_dict_metadata)
    if ms.planner_data is not None:
        assert list(mo.planner_data) == list(ms.planner_data)
    for k, v in ms.state_dict_metadata.items():
        if hasattr(v, "chunks"):  # the local plans' chunk objects, in DCP's order
            assert [id(c) for c in mo.state_dict_metadata[k].chunks] == [id(c) for c in v.chunks]
            assert mo.state_dict_metadata[k].properties is v.properties
    hints = create_global_plan(plans, kwargs.get("dedup_save_to_lowest_rank", False),
                               kwargs.get("flatten_state_dict", True)).hints
    for local, planned, h in zip(plans, go, hints, strict=True):
        assert plan_hints(local, planned) == h  # what the plan cache keys each rank's plan by
    return stock


@pytest.mark.parametrize("seed", range(120))
def test_random_valid_layouts_match_dcp(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 6, 8, 16])
    plans = _random_plans(rng, world)
    kwargs = {"dedup_save_to_lowest_rank": rng.random() < 0.3,
              "flatten_state_dict": rng.random() < 0.8}
    out = _assert_same(plans, **kwargs)
    assert not isinstance(out, Exception), out  # the generator makes valid layouts


def _tensor_items(plans: list[SavePlan]) -> list[tuple[int, int]]:
    return [(r, i) for r, p in enumerate(plans) for i, it in enumerate(p.items)
            if it.tensor_data is not None and len(it.tensor_data.size)]


def _replace_chunk(plans: list[SavePlan], r: int, i: int, off: list[int], sz: list[int]) -> None:
    it = plans[r].items[i]
    assert it.tensor_data is not None
    plans[r].items[i] = _item(it.index.fqn, off, sz, list(it.tensor_data.size),
                              it.tensor_data.properties.dtype, it.type)


def _corrupt(rng: random.Random, plans: list[SavePlan], how: str) -> bool:
    """Breaks one item of ``plans`` in the way ``how`` says; False when there is none to."""
    cands = _tensor_items(plans)
    if not cands:
        return False
    r, i = rng.choice(cands)
    it = plans[r].items[i]
    td = it.tensor_data
    assert td is not None
    off, sz, shape = list(td.chunk.offsets), list(td.chunk.sizes), list(td.size)
    d = rng.randrange(len(shape))
    if how == "grow":  # overlaps a neighbour, or leaves the tensor
        sz[d] += rng.randint(1, 3)
    elif how == "shift":
        off[d] += rng.choice([-1, 1])
    elif how == "out_of_bounds":
        off[d] = shape[d] + rng.randint(0, 2)
        sz[d] = max(sz[d], 1)
    elif how == "negative_size":
        sz[d] = -1
    elif how == "missing":
        del plans[r].items[i]
        return True
    elif how == "shrink":
        if sz[d] == 0:
            return False
        sz[d] -= 1
    elif how == "empty_inside":
        if shape[d] < 3:
            return False
        off = [0] * len(shape)
        sz = list(shape)
        off[d], sz[d] = rng.randint(1, shape[d] - 1), 0
        plans[r].items.append(_item(it.index.fqn, off, sz, shape, td.properties.dtype))
        return True
    elif how == "ragged":
        off, sz = off + [0], sz + [1]
    elif how == "short":
        off, sz = off[:-1], sz[:-1]
    elif how == "no_tensor_data":
        plans[r].items[i] = WriteItem(index=it.index, type=it.type)
        return True
    elif how == "no_chunk":
        plans[r].items[i] = WriteItem(index=it.index, type=it.type, tensor_data=TensorWriteData(
            chunk=None, properties=td.properties, size=td.size))  # type: ignore[arg-type]
        return True
    elif how == "bytes_clash":
        plans[rng.randrange(len(plans))].items.append(_bytes(it.index.fqn))
        return True
    elif how == "twice_in_plan":
        plans[r].items.insert(rng.randrange(len(plans[r].items) + 1), it)
        return True
    elif how == "tensor_twice":
        plans[rng.randrange(len(plans))].items.append(
            _item(it.index.fqn + "x", [0] * len(shape), shape, shape, td.properties.dtype,
                  WriteItemType.TENSOR))
        plans[rng.randrange(len(plans))].items.append(
            _item(it.index.fqn + "x", [1] + [0] * (len(shape) - 1), shape, shape,
                  td.properties.dtype, WriteItemType.TENSOR))
        return True
    else:
        raise AssertionError(how)
    _replace_chunk(plans, r, i, off, sz)
    return True


CORRUPTIONS = ["grow", "shift", "out_of_bounds", "negative_size", "missing", "shrink",
               "empty_inside", "ragged", "short", "no_tensor_data", "no_chunk", "bytes_clash",
               "twice_in_plan", "tensor_twice"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_invalid_plans_fail_as_dcp_fails(how: str) -> None:
    failures = 0
    for seed in range(12):
        rng = random.Random(1000 + seed)
        plans = _random_plans(rng, rng.choice([1, 2, 3, 4, 8]))
        if not _corrupt(rng, plans, how):
            continue
        out = _assert_same(plans, dedup_save_to_lowest_rank=rng.random() < 0.3)
        failures += isinstance(out, Exception)
    if how not in ("twice_in_plan", "shift", "shrink", "missing"):
        assert failures, "no draw was invalid"


def test_each_validation_error_kind_is_dcp_s() -> None:
    shape = [8, 4]

    def rows(*chunks: tuple[int, int]) -> list[SavePlan]:
        return [SavePlan([_item("w", [o, 0], [s, 4], shape, torch.float32)], planner_data={})
                for o, s in chunks]

    cases: dict[str, list[SavePlan]] = {
        "overlapping chunks": rows((0, 5), (4, 4)),
        "out of bounds chunk": rows((0, 4), (4, 5)),
        "invalid fill": rows((0, 4), (5, 3)),
    }
    for words, plans in cases.items():
        err = _assert_same(plans)
        assert isinstance(err, ValueError) and words in str(err), err
    whole = SavePlan([_item("w", [0, 0], [8, 4], shape, torch.float32)], planner_data={})
    wide = [whole, *rows((2, 0))]
    assert isinstance(_assert_same(wide), ValueError)  # an empty chunk inside another
    overlapping = [SavePlan([_item(f"w{t}", [o, 0], [s, 4], shape, torch.float32)
                             for t in range(40)], planner_data={}) for o, s in ((0, 5), (4, 4))]
    assert "(truncated)" in str(_assert_same(overlapping))  # 120 messages: DCP's truncation


def test_fsdp_at_scale_matches_dcp() -> None:
    """Row shards at 256 ranks of wide and narrow tensors (DCP's quadratic case), bytes items
    on every rank."""
    world = 256
    shapes = [[1024, 64], [64, 1024], [300, 7], [7], [4096], [5, 5, 5]]
    plans = []
    for r in range(world):
        items = []
        for t, shape in enumerate(shapes):
            for state in ("p", "m", "v"):
                a, b = _split(shape[0], world)[r]
                items.append(_item(f"{state}.t{t}", *_along(shape, 0, a, b), shape,
                                   torch.float32))
        items.append(_bytes("param_groups"))
        items.append(_item("step", [], [], [], torch.float32, WriteItemType.TENSOR))
        plans.append(SavePlan(items, planner_data={i.index.fqn: (i.index.fqn,) for i in items}))
    _assert_same(plans)


def test_merged_planner_data_is_chainmap_s() -> None:
    from collections import ChainMap

    maps: list[Any] = [{"a": 1, "b": 2}, {"c": 3, "a": 9}, {"d": 4, "b": 7}]
    plans = [SavePlan([], planner_data=m) for m in maps]
    want = dict(ChainMap(*maps))
    got = merge_planner_data(plans)
    assert got == want and list(got) == list(want)
    with pytest.raises(TypeError):
        merge_planner_data([SavePlan([], planner_data=None)] * 2)


def test_subclass_dedup_hook_is_honoured() -> None:
    calls: list[int] = []

    class Custom(DataStatesSavePlanner):
        def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
            calls.append(len(all_plans))
            return super()._dedup_save_plans(all_plans)

    plans = _random_plans(random.Random(5), 4)
    want: Callable[..., Any] = DefaultSavePlanner()._create_global_plan
    assert Custom(enable_plan_caching=False)._create_global_plan(plans) == want(plans)
    assert calls == [4]


def test_ties_are_broken_as_dcp_s_set_order_breaks_them() -> None:
    """An item on ranks 5 and 8, both with nothing planned: DCP's ``min`` over the set {5, 8}
    meets 8 first (its hash slot comes first), and so saves it on rank 8."""
    plans = [SavePlan([], planner_data={}) for _ in range(9)]
    for r in (5, 8):
        plans[r] = SavePlan([_item("x", [0], [4], [4], torch.float32, WriteItemType.TENSOR)],
                            planner_data={})
    gs, _ = _assert_same(plans)
    assert [len(p.items) for p in gs] == [0] * 8 + [1]


def test_older_torch_validation_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Older torch: ``_validate_global_plan`` returns a bool, and DCP raises without the
    details (they were logged)."""
    from dcp_datastates.save import global_plan

    seen: list[list[str]] = []

    def old_style(global_plan: Any, metadata: Any) -> bool:
        seen.append(list(metadata.state_dict_metadata))
        return False

    plans = [SavePlan([_item("w", [o, 0], [4, 4], [8, 4], torch.float32)], planner_data={})
             for o in (0, 3)]
    plans[0].items.append(_item("ok", [0], [3], [3], torch.float32, WriteItemType.TENSOR))
    monkeypatch.setattr(global_plan, "_validate_global_plan", old_style)
    with pytest.raises(ValueError, match=r"^Failed to validate global plan$"):
        global_plan.create_global_plan(plans)
    assert seen == [["w"]]  # only the tensor that may be invalid went to DCP's code


def test_benchmark_runs_and_checks_equality(tmp_path: Any) -> None:
    """benchmarks/global_plan.py at a small size: DCP's and ours agree, every column filled."""
    import json

    from benchmarks import global_plan as bench

    out = tmp_path / "gp.json"
    assert bench.main(["--layout", "small", "--ranks", "8", "--stock-ranks", "8", "--repeat",
                       "1", "--in-process", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["equal"] is True and row["items"] == 800
    for k in ("stock_first_s", "ours_first_s", "stock_cached_s", "ours_cached_s", "rank_key_ms"):
        assert row[k] > 0, k
    assert "| small | 8 |" in bench.table([row])
