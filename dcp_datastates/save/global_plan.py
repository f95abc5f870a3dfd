"""DCP's global save planning (``DefaultSavePlanner._create_global_plan``), linear in the items.

Why: the coordinator of every ``dcp.save`` turns all ranks' local plans into the global plans and
the checkpoint's ``Metadata`` while every other rank waits. DCP's version costs about 10 us per
item and grows faster than the items: its validation sweeps each tensor's chunks along the
tensor's *largest* dimension, and when the chunks are split along another one (FSDP's row shards
of a ``(1024, 8192)`` projection, or of an MLP down projection, a ``(8192, 28672)`` one) every
chunk is compared with every other, ``n_ranks ** 2 / 2`` box tests per tensor. 100 tensors per
rank: 0.7 s at 256 ranks, 9 s at 2,048; 2,000 items per rank at 4,096 ranks is hours.

What: :func:`create_global_plan` gives the same result as ``dedup_save_plans`` followed by
``create_default_global_save_plan``, the merge of the planners' data and
``_validate_global_plan`` (torch/distributed/checkpoint/): the same global plans (item for item,
index hints included), the same deduplication (a replicated item goes to the rank with the least
data planned so far, in DCP's order, ties broken as DCP's ``min`` over a set breaks them), the
same ``Metadata`` (the same entries in the same order, the same chunk objects) and the same
exceptions and error messages for invalid plans. How:

* deduplication hashes each item's ``(fqn, offset)`` once, and computes sizes only up to the last
  replicated item's first occurrence (usually within the first ranks);
* the plans and the metadata are built in one pass, and the new items (DCP gives every tensor
  item a new ``MetadataIndex`` carrying its index hint) are made without dataclass machinery;
* the validation is vectorized (torch, on CPU) over every tensor's chunks at once: bounds and
  coverage are integer arithmetic, and chunks are shown disjoint by sorting them along one
  dimension, where each chunk's range must either equal or not overlap its neighbour's, then
  along the next dimension within each group of equal ranges (row shards, column shards, TP x
  FSDP grids all pass in one or two linear steps). A tensor this cannot clear (an invalid one,
  or a disjoint layout that is not such a grid) is handed to DCP's own validation, alone, which
  gives DCP's messages for it in DCP's order.

Anything unusual (an item of another class, a duplicate item within one rank's plan, a plan DCP
would refuse with an exception rather than a validation error) takes DCP's own code for the
whole plan, so its behaviour there is DCP's by construction.

Threads: pure functions of their arguments; the input plans are not modified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from array import array
from collections import ChainMap
from collections.abc import Iterator, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any

import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import (
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

Key = tuple[str, Any]

#: A hint of an item a rank keeps without an index hint (bytes items), and of one it drops.
KEPT_AS_IS = -2
DROPPED = -1

_SHARD = WriteItemType.SHARD
_BYTE_IO = WriteItemType.BYTE_IO
_INDEX = attrgetter("index")
_OFFSETS_SIZES = attrgetter("offsets", "sizes")
_BIG = 1 << 62  # offsets, sizes and volumes above it are checked by DCP's code (no overflow)


@dataclasses.dataclass
class GlobalPlan:
    """The result: DCP's global plans and metadata, and what each rank got of its local plan.

    ``hints[r][i]`` is, for item ``i`` of rank ``r``'s local plan, the index hint of the item it
    became in the global plan, :data:`KEPT_AS_IS` (kept, no hint set) or :data:`DROPPED`
    (deduplicated onto another rank): the global plan of rank ``r`` is a function of its local
    plan and these, which is what the plan cache keys on (plan_cache.py).
    """

    plans: list[SavePlan]
    metadata: Metadata
    hints: list[array]


def create_global_plan(
    all_plans: Sequence[SavePlan], dedup_to_lowest: bool = False, flatten: bool = True
) -> GlobalPlan:
    """DCP's ``DefaultSavePlanner._create_global_plan`` for these arguments (its
    ``dedup_save_to_lowest_rank`` and ``flatten_state_dict``), raising what it raises."""
    keys = [[(ix.fqn, ix.offset) for ix in map(_INDEX, p.items)] for p in all_plans]
    dropped = _dedup(all_plans, keys, dedup_to_lowest)
    built = None if dropped is None else _build(all_plans, keys, dropped)
    if built is None:  # something DCP treats specially: its own code, for the same outcome
        return _stock(all_plans, dedup_to_lowest, flatten)
    plans, md, hints = built
    metadata = Metadata(md)
    if flatten:
        metadata = dataclasses.replace(metadata, planner_data=merge_planner_data(plans))
    _raise_invalid(plans, metadata)
    return GlobalPlan(plans, metadata, hints)


def _stock(all_plans: Sequence[SavePlan], dedup_to_lowest: bool, flatten: bool) -> GlobalPlan:
    """DCP's own code (DefaultSavePlanner._create_global_plan), step for step."""
    deduped = dedup_save_plans(list(all_plans), dedup_to_lowest)
    plans, metadata = create_default_global_save_plan(deduped)
    if flatten:
        merged = dict(ChainMap(*[p.planner_data for p in plans]))
        metadata = dataclasses.replace(metadata, planner_data=merged)
    _raise_invalid(plans, metadata)
    hints = [plan_hints(a, b) for a, b in zip(all_plans, plans, strict=True)]
    return GlobalPlan(plans, metadata, [h if h is not None else array("i") for h in hints])


def _raise_invalid(plans: list[SavePlan], metadata: Metadata) -> None:
    """DefaultSavePlanner._create_global_plan's refusal of an invalid plan, in its words."""
    errors = validation_errors(len(plans), metadata)
    if errors is True or errors == []:
        return
    if errors is False:  # older torch: a bool, the details in DCP's warnings
        raise ValueError("Failed to validate global plan")
    error_summary = "; ".join(errors)
    if len(error_summary) > 500:
        error_summary = error_summary[:500] + "... (truncated)"
    raise ValueError(f"Failed to validate global plan: {error_summary}")


def plan_hints(local: SavePlan, planned: SavePlan) -> array | None:
    """What ``planned`` (a rank's global plan) kept of ``local`` (its local plan), as in
    :attr:`GlobalPlan.hints`; None when ``planned``'s items are not some of ``local``'s, in
    their order."""
    out = array("i", [DROPPED]) * len(local.items)
    j, n = 0, len(local.items)
    keys = [(ix.fqn, ix.offset) for ix in map(_INDEX, local.items)]
    for ix in map(_INDEX, planned.items):
        key = (ix.fqn, ix.offset)
        while j < n and keys[j] != key:
            j += 1
        if j == n:
            return None
        out[j] = KEPT_AS_IS if ix.index is None else ix.index
        j += 1
    return out


# --- deduplication ---------------------------------------------------------------------------


def _dedup(
    all_plans: Sequence[SavePlan], keys: list[list[Key]], dedup_to_lowest: bool
) -> dict[int, list[int]] | None:
    """DCP's ``dedup_save_plans``: the positions of the items each plan drops (a replicated
    item is kept by one plan), in order; None when a plan holds an item twice (DCP's code
    handles that)."""
    owner: dict[Key, int] = {}  # the first plan holding each item
    first = owner.setdefault
    later = [[j for j, k in enumerate(ks) if first(k, p) != p] for p, ks in enumerate(keys)]
    repeats = sum(map(len, later))
    if len(owner) + repeats != sum(map(len, keys)):
        return None  # twice in the plan holding it first
    if not repeats:
        return {}
    # The set of plans holding each replicated item, built as DCP builds it (a set's iteration
    # order breaks ties in its min()), and the last of its items (whose size DCP counts).
    sets: dict[Key, set[int]] = {}
    last: dict[Key, WriteItem] = {}
    for p, js in enumerate(later):
        ks, items = keys[p], all_plans[p].items
        for j in js:
            k = ks[j]
            s = sets.get(k)
            if s is None:
                s = sets[k] = set()
                s.add(owner[k])
            n = len(s)
            s.add(p)
            if len(s) == n:
                return None  # twice in plan p
            last[k] = items[j]
    if dedup_to_lowest:  # min(plans) is the first: every later occurrence is dropped
        return {p: js for p, js in enumerate(later) if js}
    selected, dropped = _least_loaded(all_plans, keys, owner, sets, last)
    for p, js in enumerate(later):
        ks = keys[p]
        gone = [j for j in js if selected[ks[j]] != p]
        if gone:
            dropped[p] = sorted(dropped.get(p, []) + gone)
    return dropped


def _least_loaded(
    all_plans: Sequence[SavePlan],
    keys: list[list[Key]],
    owner: dict[Key, int],
    sets: dict[Key, set[int]],
    last: dict[Key, WriteItem],
) -> tuple[dict[Key, int], dict[int, list[int]]]:
    """DCP's choice for each replicated item: the plan with the least storage planned so far,
    items taken in the order of their first occurrence; and the positions of first occurrences
    given to another plan.

    An item's first occurrence is in the lowest plan holding it, so when DCP decides, every
    other plan it could choose comes later: their sizes so far are the replicated items given
    to them, none of their own yet. Only the plans where replicated items first occur are
    read, each up to its last such item.
    """
    planned = [0] * len(all_plans)
    load = planned.__getitem__
    selected: dict[Key, int] = {}
    dropped: dict[int, list[int]] = {}
    pending: dict[int, int] = {}  # plan -> replicated items first occurring in it
    for k in sets:
        pending[owner[k]] = pending.get(owner[k], 0) + 1
    for p in sorted(pending):
        items = all_plans[p].items
        left = pending[p]
        for j, k in enumerate(keys[p]):
            if owner[k] != p:
                continue  # decided at its first occurrence
            s = sets.get(k)
            if s is None:
                planned[p] += _storage_size(items[j])
                continue
            pick = min(s, key=load)
            planned[pick] += _storage_size(last[k])
            selected[k] = pick
            if pick != p:
                dropped.setdefault(p, []).append(j)
            left -= 1
            if not left:
                break
    return selected, dropped


_ELEMENT_SIZES: dict[torch.dtype, int] = {}


def _storage_size(item: WriteItem) -> int:
    """``item.tensor_storage_size() or 1``, as DCP's deduplication counts it."""
    td = item.tensor_data
    if td is None:
        return 1
    dtype = td.properties.dtype
    size = _ELEMENT_SIZES.get(dtype)
    if size is None:
        size = _ELEMENT_SIZES[dtype] = torch._utils._element_size(dtype)
    return math.prod(td.size) * size or 1


# --- plans and metadata ----------------------------------------------------------------------


def _build(
    all_plans: Sequence[SavePlan], keys: list[list[Key]], dropped: dict[int, list[int]]
) -> tuple[list[SavePlan], dict[str, Any], list[array]] | None:
    """The global plans, the metadata entries and the hints, in one pass, without the items at
    ``dropped`` positions; None where DCP's ``create_default_global_save_plan`` raises (its
    code then raises it)."""
    md: dict[str, Any] = {}
    plans: list[SavePlan] = []
    all_hints: list[array] = []
    for p, plan in enumerate(all_plans):
        items = _global_items(plan.items, keys[p], dropped.get(p, ()), md, hints := array("i"))
        if items is None:
            return None
        plans.append(dataclasses.replace(plan, items=items))
        all_hints.append(hints)
    return plans, md, all_hints


def _global_items(
    local: list[WriteItem], keys: list[Key], drop: Sequence[int], md: dict[str, Any],
    hints: array,
) -> list[WriteItem] | None:
    """One plan's global items (a new item with its index hint for each tensor item, as
    ``create_default_global_save_plan`` makes them), its chunks added to ``md``."""
    items: list[WriteItem] = []
    keep, hint, get = items.append, hints.append, md.get
    new, setf = object.__new__, object.__setattr__
    start = 0
    for stop in (*drop, len(local)):  # the runs of items between dropped ones
        for item, k in zip(local[start:stop], keys[start:stop], strict=True):
            fqn = k[0]
            cur = get(fqn)
            typ = item.type
            if typ is _BYTE_IO:
                if cur is not None:
                    return None
                md[fqn] = BytesStorageMetadata()
                keep(item)
                ix = item.index
                hint(KEPT_AS_IS if ix.index is None else ix.index)
                continue
            td = item.tensor_data
            if td is None or (cur is not None and typ is not _SHARD) or td.chunk is None:
                return None
            if cur is None:
                cur = md[fqn] = TensorStorageMetadata(
                    properties=td.properties, size=td.size, chunks=[]
                )
            elif type(cur) is not TensorStorageMetadata:
                return None
            chunks = cur.chunks
            h = len(chunks)
            ix = item.index
            if type(item) is WriteItem and type(ix) is MetadataIndex:
                off = k[1]  # MetadataIndex(...) makes a torch.Size of it, as DCP's does
                if off is not None and type(off) is not torch.Size:
                    off = torch.Size(off)
                # Fields set as the dataclasses' own __init__ sets them (no dict per object)
                nix = new(MetadataIndex)
                setf(nix, "fqn", fqn)
                setf(nix, "offset", off)
                setf(nix, "index", h)
                old = item
                item = new(WriteItem)
                setf(item, "index", nix)
                setf(item, "type", typ)
                setf(item, "bytes_io_data", old.bytes_io_data)
                setf(item, "tensor_data", td)
            else:
                item = dataclasses.replace(item, index=dataclasses.replace(ix, index=h))
            keep(item)
            hint(h)
            chunks.append(td.chunk)
        if stop < len(local):
            hint(DROPPED)
        start = stop + 1
    return items


def merge_planner_data(plans: Sequence[SavePlan]) -> dict[Any, Any]:
    """``dict(ChainMap(*[p.planner_data for p in plans]))`` (the same keys, values and order:
    the last plan's keys first, each value from the first plan that has it) in one pass."""
    maps = [p.planner_data for p in plans]
    if not all(type(m) is dict for m in maps):
        return dict(ChainMap(*maps))
    out: dict[Any, Any] = {}
    for m in reversed(maps):
        out.update(m)
    return out


# --- validation ------------------------------------------------------------------------------


def validation_errors(n_plans: int, metadata: Metadata) -> Any:
    """``_validate_global_plan``'s result (its messages in its order, or in older torch
    whether the plan is valid; its warnings logged): the tensors that might be invalid are found
    vectorized, and only those go through DCP's code (an empty list when there are none)."""
    groups: dict[int, list[tuple[str, TensorStorageMetadata]]] = {}
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata):
            continue
        if type(value) is not TensorStorageMetadata:
            return _validate_global_plan([SavePlan([])] * n_plans, metadata)
        if len(value.size):
            groups.setdefault(len(value.size), []).append((key, value))
    suspects: set[str] = set()
    with _one_thread():  # coverage checked whatever the plan count (older torch did)
        for ndim, entries in groups.items():
            suspects.update(entries[i][0] for i in _suspects(ndim, entries, True))
    if not suspects:
        return []
    sub = {k: v for k, v in metadata.state_dict_metadata.items() if k in suspects}
    return _validate_global_plan([SavePlan([])] * n_plans, Metadata(sub))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads off, for this thread only: these operations take milliseconds,
    and threads sharing busy cores made them 25 times slower (2 cores, another process busy).
    ``torch.set_num_threads`` sets the calling thread's OpenMP count (and the default of threads
    that start meanwhile); a training thread's own stays as it is."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _suspects(
    ndim: int, entries: list[tuple[str, TensorStorageMetadata]], check_fill: bool
) -> set[int]:
    """Which of these tensors (all of ``ndim`` dimensions) DCP's validation might find invalid:
    a superset of those it does."""
    chunk_lists = [v.chunks for _, v in entries]
    rows = sum(map(len, chunk_lists))
    pairs = list(map(_OFFSETS_SIZES, chain.from_iterable(chunk_lists)))  # one read per chunk
    try:
        if set(map(len, chain.from_iterable(pairs))) != {ndim}:
            raise ValueError("chunks of another rank than their tensor's")
        both = _int64(chain.from_iterable(chain.from_iterable(pairs)), rows, 2 * ndim)
        o, s = both[:, :ndim], both[:, ndim:]
        t = _int64(chain.from_iterable(v.size for _, v in entries), len(entries), ndim)
    except (OverflowError, TypeError, ValueError):
        if len(entries) == 1:
            return {0}  # DCP's code checks it (and raises what it raises)
        return {i for i, e in enumerate(entries) if _suspects(ndim, [e], check_fill)}
    counts = torch.tensor(list(map(len, chunk_lists)))
    seg = torch.repeat_interleave(torch.arange(len(entries)), counts)
    return _check(o, s, t, seg, check_fill)


def _int64(values: Any, rows: int, ndim: int) -> torch.Tensor:
    buf = array("q", values)
    if len(buf) != rows * ndim:
        raise ValueError("ragged")
    if not buf:
        return torch.zeros((rows, ndim), dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int64).view(rows, ndim)


def _check(
    o: torch.Tensor, s: torch.Tensor, t: torch.Tensor, seg: torch.Tensor, check_fill: bool
) -> set[int]:
    """Bounds, coverage and overlap of chunks (offsets ``o``, sizes ``s``, rows of tensor
    ``seg``) of tensors of sizes ``t``: the indices of the tensors that might fail one."""
    ts = t[seg]
    bad = torch.zeros(len(t), dtype=torch.bool)
    huge = (o.abs() > _BIG).any(1) | (s.abs() > _BIG).any(1) | (ts > _BIG).any(1)
    out_of_bounds = (o < 0).any(1) | (s < 0).any(1) | (o + s > ts).any(1)
    bad[seg[huge | out_of_bounds]] = True
    empty = (s == 0).any(1)
    # An empty chunk overlaps another only strictly inside it: never at a tensor's edge
    edge = ((s == 0) & ((o <= 0) | (o >= ts))).any(1)
    bad[seg[empty & ~edge]] = True
    if check_fill:
        volumes = [math.prod(x) for x in t.tolist()]
        big = torch.tensor([v > _BIG for v in volumes], dtype=torch.bool)
        filled = torch.zeros(len(t), dtype=torch.int64)
        filled.index_add_(0, seg, torch.where(bad[seg], 0, s.prod(1)))
        bad |= big | (filled != torch.tensor([min(v, _BIG) for v in volumes]))
    rows = torch.nonzero(~empty & ~bad[seg]).flatten()
    dims = list(range(o.shape[1]))
    unproven = _not_disjoint(o, s, seg, rows, dims)
    if unproven and len(dims) > 1:  # another grid order (brick-like layouts)
        retry = rows[torch.isin(seg[rows], torch.tensor(sorted(unproven)))]
        unproven = _not_disjoint(o, s, seg, retry, dims[::-1])
    bad[torch.tensor(sorted(unproven), dtype=torch.int64)] = True
    return set(torch.nonzero(bad).flatten().tolist())


def _not_disjoint(
    o: torch.Tensor, s: torch.Tensor, seg: torch.Tensor, rows: torch.Tensor, dims: list[int]
) -> set[int]:
    """The tensors whose non-empty chunks ``rows`` this cannot show pairwise disjoint.

    Along each dimension in turn, within groups of chunks equal in the dimensions before, each
    chunk's range sorted by start must equal its predecessor's or start at or after its end;
    then chunks of one range are one group for the next dimension. Passing every dimension with
    no group of two left proves the chunks disjoint (each range either equals or misses every
    other range of its group), so every tensor a violation or a leftover group touches is
    returned, and no other.
    """
    out: set[int] = set()
    gid = seg[rows]
    for k in dims:
        if not len(rows):
            return out
        start = o[rows, k]
        end = start + s[rows, k]
        order = _sorted_order(gid, start)
        if order is not None:
            rows, gid, start, end = rows[order], gid[order], start[order], end[order]
        same = gid[1:] == gid[:-1]
        equal = same & (start[1:] == start[:-1]) & (end[1:] == end[:-1])
        clash = same & ~equal & (start[1:] < end[:-1])
        out.update(seg[rows[1:][clash]].tolist())
        # Groups for the next dimension: runs of equal ranges, two or more long
        run = torch.cat([torch.ones(1, dtype=torch.int64), (~equal).long()]).cumsum(0)
        counts = torch.bincount(run)
        keep = counts[run] > 1
        if out:
            keep &= ~torch.isin(seg[rows], torch.tensor(sorted(out)))
        rows, gid = rows[keep], run[keep]
    out.update(seg[rows].tolist())  # equal non-empty boxes: they overlap
    return out


def _sorted_order(gid: torch.Tensor, start: torch.Tensor) -> torch.Tensor | None:
    """A stable order by (group, start); None when the rows are in it already."""
    if len(gid) < 2:
        return None
    g1, g0, s1, s0 = gid[1:], gid[:-1], start[1:], start[:-1]
    if bool(((g1 > g0) | ((g1 == g0) & (s1 >= s0))).all()):
        return None
    order = torch.sort(start, stable=True).indices
    return order[torch.sort(gid[order], stable=True).indices]
