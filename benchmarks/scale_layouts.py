"""Synthetic layouts for the scale simulator: any rank's DCP ``SavePlan`` without its tensors.

A *layout* is a model shape (:data:`MODELS`: a Llama-like stack with AdamW state) spread over a
world of ranks by one parallelism (:data:`LAYOUTS`):

* ``fsdp``: FSDP2, every parameter and its AdamW moments a DTensor ``Shard(0)`` over all ranks;
* ``hsdp``: FSDP2 on a (replicas x shards) mesh, ``(Replicate(), Shard(0))``: every shard is held
  by each replica group and DCP's deduplication keeps one copy;
* ``tp-fsdp``: tensor parallel inside FSDP2 on a (dp x tp) mesh, with torchtitan's Llama plan
  (column-wise ``wq wk wv w1 w3 output``, row-wise ``wo w2``, embedding rows, norms replicated
  over tp); FSDP2 shards dim 0 over dp, as ``_StridedShard`` where tp shards dim 0 too;
* ``zero1``: ZeRO-1 style: the model replicated on every rank (plain bf16 tensors, which DCP
  deduplicates), the fp32 master weights and both AdamW moments each one flat 1-D buffer evenly
  partitioned over all ranks (a 1-D DTensor ``Shard(0)``).

The state dict is the one ``torch.distributed.checkpoint.state_dict.get_state_dict`` returns,
saved as ``{"model": ..., "optim": ...}``: AdamW state per parameter (``step`` a 0-d float32
tensor, replicated, as AdamW keeps it; ``exp_avg``, ``exp_avg_sq`` sharded as the parameter)
and one parameter group of plain values (each a bytes item). 70b: 723 parameters, 2,904 items
per rank (2,169 tensors sharded, 723 ``step`` tensors, 12 bytes items).

:class:`PlanBuilder` makes the plan DCP's ``DefaultSavePlanner.create_local_plan`` would make on
any rank from plain ints: each shard's size and offset come from torch's own DTensor function
(``_compute_local_shape_and_global_offset``), and the items are built field by field as DCP's
``_create_write_items`` builds them (fresh objects per item, as DCP makes them, so that pickled
sizes match). :meth:`PlanBuilder.state_dict` builds the same state as real DTensors (their local
tensors zero-byte expanded views) under a fake process group (:func:`fake_world`, torch's
``fake`` backend: one process plays any rank of any world), on which DCP's own planners run.
tests/test_scale_sim.py checks both against real FSDP2 (+TP) modules with a stepped AdamW.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
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
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

T = TypeVar("T")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-like decoder: ``layers`` blocks of attention (grouped-query: ``kv`` = kv heads x
    head dim) and a SwiGLU MLP, token embedding and output head of ``vocab`` rows."""

    name: str
    layers: int
    hidden: int
    ffn: int
    vocab: int
    kv: int


MODELS = {
    "70b": ModelShape("70b", layers=80, hidden=8192, ffn=28672, vocab=128256, kv=1024),
    "8b": ModelShape("8b", layers=32, hidden=4096, ffn=14336, vocab=128256, kv=1024),
    "tiny": ModelShape("tiny", layers=2, hidden=64, ffn=160, vocab=256, kv=16),
}
LAYOUTS = ("fsdp", "hsdp", "tp-fsdp", "zero1")

# tp styles: "col" (tp shards dim 0), "row" (tp shards dim 1), "rep" (tp replicates)
_BLOCK = (
    ("attention.wq.weight", "hh", "col"),
    ("attention.wk.weight", "kh", "col"),
    ("attention.wv.weight", "kh", "col"),
    ("attention.wo.weight", "hh", "row"),
    ("feed_forward.w1.weight", "fh", "col"),
    ("feed_forward.w2.weight", "hf", "row"),
    ("feed_forward.w3.weight", "fh", "col"),
    ("attention_norm.weight", "h", "rep"),
    ("ffn_norm.weight", "h", "rep"),
)


def parameters(m: ModelShape) -> list[tuple[str, tuple[int, ...], str]]:
    """(fqn, shape, tp style) of every parameter, in ``named_parameters()`` order."""
    dims = {"h": m.hidden, "k": m.kv, "f": m.ffn}
    out = [("tok_embeddings.weight", (m.vocab, m.hidden), "col")]
    for i in range(m.layers):
        for name, shape, style in _BLOCK:
            out.append((f"layers.{i}.{name}", tuple(dims[c] for c in shape), style))
    out += [("norm.weight", (m.hidden,), "rep"), ("output.weight", (m.vocab, m.hidden), "col")]
    return out


@functools.lru_cache(maxsize=1)
def adamw_template() -> tuple[tuple[str, ...], torch.dtype, tuple[tuple[str, Any], ...]]:
    """What torch's AdamW keeps, from a real one that stepped once: its per-parameter state keys
    in order, the dtype of its ``step`` tensor, and its parameter group's (key, value) pairs
    (``params`` last, as ``Optimizer.state_dict`` orders them)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.zeros(2)
    opt.step()
    sd = opt.state_dict()
    state = sd["state"][0]
    step = state["step"]
    assert isinstance(step, torch.Tensor) and step.dim() == 0
    group = tuple((k, v) for k, v in sd["param_groups"][0].items())
    return tuple(state), step.dtype, group


def local_shard(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local sizes, global offsets) of a tensor of ``shape`` placed by ``placements`` on the
    mesh coordinate ``coordinate``: what DTensor's ``compute_local_shape_and_global_offset``
    returns (DCP's source of a shard's chunk).

    With ``_StridedShard`` it is torch's function itself. With ``Shard`` and ``Replicate`` only,
    the same arithmetic on ints (torch's ``Shard.local_shard_size_and_offset`` per mesh dim):
    torch's function materialises ``arange(offset, offset + size)`` per shard to track offsets,
    an index of 8 bytes per element of the shard (a 70B flat buffer over 8 ranks: 70 GB);
    tests/test_scale_sim.py checks that both agree.
    """
    if any(isinstance(p, _StridedShard) for p in placements):
        return _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coordinate), placements
        )
    local = list(shape)
    first: dict[int, int] = {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        d = p.dim
        size, off = Shard.local_shard_size_and_offset(
            local[d], mesh_shape[mesh_dim], coordinate[mesh_dim]
        )
        # torch: an empty shard's offset is the dimension's size; otherwise the offsets are a
        # contiguous range, so the first one adds up across mesh dims sharding the same dim
        first[d] = shape[d] if size == 0 else first.get(d, 0) + int(off)
        local[d] = int(size)
    return tuple(local), tuple(first.get(d, 0) for d in range(len(shape)))


@dataclass(frozen=True)
class Layout:
    """A parallelism over ``world`` ranks: its device mesh and each tensor's placements."""

    kind: str
    world: int
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate in the (row-major) device mesh."""
        out = []
        for size in reversed(self.mesh_shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def placements(self, style: str) -> tuple[Placement, ...] | None:
        """Placements of a parameter of tp ``style`` (and of its AdamW moments); None: a plain
        tensor, the same on every rank."""
        if self.kind == "fsdp":
            return (Shard(0),)
        if self.kind == "hsdp":
            return (Replicate(), Shard(0))
        if self.kind == "tp-fsdp":
            tp = self.mesh_shape[1]
            if style == "col":
                return (_StridedShard(0, split_factor=tp) if tp > 1 else Shard(0), Shard(0))
            if style == "row":
                return (Shard(0), Shard(1))
            return (Shard(0), Replicate())
        if self.kind == "zero1":
            return None if style != "flat" else (Shard(0),)
        raise ValueError(f"unknown layout {self.kind!r}")


def make_layout(kind: str, world: int, *, tp: int = 8, shard_group: int = 8) -> Layout:
    """``kind`` over ``world`` ranks; ``tp`` (tp-fsdp) and ``shard_group`` (hsdp: ranks per
    replica) shrink to ``world`` when it is smaller, and must divide it."""
    if world < 1:
        raise ValueError("world must be >= 1")
    if kind in ("fsdp", "zero1"):
        return Layout(kind, world, (world,), ("dp",))
    inner = min(tp if kind == "tp-fsdp" else shard_group, world)
    if world % inner:
        raise ValueError(f"{kind}: {inner} does not divide {world} ranks")
    names = ("dp", "tp") if kind == "tp-fsdp" else ("replicate", "shard")
    if kind not in ("hsdp", "tp-fsdp"):
        raise ValueError(f"unknown layout {kind!r}; choose from {', '.join(LAYOUTS)}")
    return Layout(kind, world, (world // inner, inner), names)


@dataclass(frozen=True)
class Entry:
    """One leaf of the flattened state dict: its flat key, its path (DCP's mapping), what it is
    (``dtensor``, ``tensor`` or ``bytes``), global shape, tp style and dtype."""

    fqn: str
    path: tuple[Any, ...]
    kind: str
    shape: tuple[int, ...] = ()
    style: str = ""
    dtype: torch.dtype = torch.float32


def _entries(m: ModelShape, layout: Layout) -> list[Entry]:
    """The flattened state dict's leaves, in DCP's order (``flatten_state_dict``)."""
    state_keys, step_dtype, group = adamw_template()
    params = parameters(m)
    out: list[Entry] = []

    def leaf(path: tuple[Any, ...], kind: str, **kw: Any) -> None:
        # DCP's flatten joins the path into a fresh string: one object per key, shared by the
        # item's index and the mapping (as in a real plan, so pickled sizes match)
        out.append(Entry(".".join(map(str, path)), path, kind, **kw))

    zero1 = layout.kind == "zero1"
    for fqn, shape, style in params:
        kind = "tensor" if zero1 else "dtensor"
        leaf(("model", fqn), kind, shape=shape, style=style,
             dtype=torch.bfloat16 if zero1 else torch.float32)
    if zero1:
        flat = (sum(math.prod(s) for _, s, _ in params),)
        owners = [("flat_group0", flat, "flat")]
    else:
        # get_optimizer_state_dict's keys are built apart from the model's (fresh strings)
        owners = [("".join(fqn), shape, style) for fqn, shape, style in params]
    for owner, shape, style in owners:
        for key in state_keys:
            if key == "step":
                leaf(("optim", "state", owner, key), "tensor", shape=(), dtype=step_dtype)
            else:
                leaf(("optim", "state", owner, key), "dtensor", shape=shape, style=style)
        if zero1:
            leaf(("optim", "state", owner, "fp32_master"), "dtensor", shape=shape, style=style)
    for key, _ in group:
        leaf(("optim", "param_groups", 0, key), "bytes")
    return out


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


class PlanBuilder:
    """Builds any rank's local save plan (and, under :func:`fake_world`, its state dict)."""

    def __init__(self, model: ModelShape, layout: Layout) -> None:
        self.model = model
        self.layout = layout
        self.entries = _entries(model, layout)
        self._placements = {
            e.style: layout.placements(e.style) for e in self.entries if e.kind == "dtensor"
        }

    @property
    def items_per_rank(self) -> int:
        return len(self.entries)

    def shard(self, e: Entry, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(local sizes, global offsets) of ``e``'s shard on ``rank``: :func:`local_shard`."""
        return local_shard(
            e.shape, self.layout.mesh_shape, self.layout.coordinate(rank),
            self._placements[e.style],
        )

    def mappings(self) -> dict[str, tuple[Any, ...]]:
        """DCP's flatten mapping (the plan's ``planner_data``)."""
        return {e.fqn: e.path for e in self.entries}

    def local_plan(self, rank: int, mappings: dict[str, Any] | None = None) -> SavePlan:
        """The ``SavePlan`` DefaultSavePlanner.create_local_plan makes on ``rank``, built from
        ints (see the module docstring). ``mappings``: the planner data to attach (default: a
        new :meth:`mappings` dict, as each rank's planner has its own).

        Objects are made as unpickling makes them (``object.__new__``, then their attributes in
        the order their own ``__init__`` sets them): equal, and pickled to the same bytes, as
        the ones DCP's ``_create_write_items`` makes, three times faster to build.
        """
        shards: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        items: list[WriteItem] = []
        append = items.append
        new, size_of = object.__new__, torch.Size
        strided, contiguous = torch.strided, torch.contiguous_format
        tensor_type, shard_type = WriteItemType.TENSOR, WriteItemType.SHARD
        for e in self.entries:
            if e.kind == "bytes":  # planner_helpers._create_write_item_for_bytesio
                append(WriteItem(index=MetadataIndex(e.fqn), type=WriteItemType.BYTE_IO))
                continue
            if e.kind == "tensor":  # planner_helpers._create_write_item_for_tensor
                typ = tensor_type
                offsets = size_of([0] * len(e.shape))
                sizes = size_of(e.shape)
            else:  # planner_helpers._create_write_items_for_dtensor
                typ = shard_type
                key = (e.shape, e.style)
                local = shards.get(key)
                if local is None:
                    local = shards[key] = self.shard(e, rank)
                sizes, offsets = size_of(local[0]), size_of(local[1])
            props = new(TensorProperties)
            props.__dict__.update(dtype=e.dtype, layout=strided, requires_grad=False,
                                  memory_format=contiguous, pin_memory=False)
            chunk = new(ChunkStorageMetadata)
            chunk.__dict__.update(offsets=offsets, sizes=sizes)
            td = new(TensorWriteData)
            td.__dict__.update(chunk=chunk, properties=props, size=size_of(e.shape))
            index = new(MetadataIndex)  # its __init__ copies the offset into a new Size
            index.__dict__.update(fqn=e.fqn, index=None, offset=size_of(offsets))
            item = new(WriteItem)
            item.__dict__.update(index=index, type=typ, bytes_io_data=None, tensor_data=td)
            append(item)
        return SavePlan(items, planner_data=self.mappings() if mappings is None else mappings)

    def nbytes(self, item: WriteItem) -> int:
        """Bytes an item's data takes in a data file (a bytes item: a small torch.save)."""
        td = item.tensor_data
        if td is None:
            return 1_000
        return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize

    def state_dict(self, mesh: Any) -> dict[str, Any]:
        """The nested state dict this layout gives the rank that ``mesh`` (a DeviceMesh under
        :func:`fake_world`) belongs to: DTensors whose local tensors are zero-byte expanded views
        of the shard's shape, plain tensors likewise, the parameter group's real values."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        zero = {dt: torch.empty((), dtype=dt) for dt in (torch.float32, torch.bfloat16)}
        _, _, group = adamw_template()
        root: dict[str, Any] = {}
        for e in self.entries:
            if e.kind == "bytes":
                value: Any = dict(group)[e.path[-1]]
                if e.path[-1] == "params":
                    value = [o for o in self._owner_names()]
            elif e.kind == "tensor":
                value = zero[e.dtype].expand(e.shape) if e.shape else zero[e.dtype].clone()
            else:
                pl = self._placements[e.style]
                local, _ = compute_local_shape_and_global_offset(e.shape, mesh, pl)
                value = DTensor.from_local(
                    zero[e.dtype].expand(local), mesh, pl, run_check=False,
                    shape=torch.Size(e.shape), stride=_contiguous_stride(e.shape),
                )
            _set_path(root, e.path, value)
        return root

    def _owner_names(self) -> list[str]:
        return list(dict.fromkeys(
            e.path[2] for e in self.entries if e.path[:2] == ("optim", "state")
        ))


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for i, key in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            while len(node) <= key:
                node.append({})
            node = node[key]
            continue
        node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    node[path[-1]] = value


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """A process group of torch's ``fake`` backend in which this process is ``rank`` of
    ``world`` (no communication: collectives return without data). Destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group exists already")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def in_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a new thread; returns its result or raises its error.

    DTensor caches sharding decisions per thread, keyed by device meshes that compare equal
    across ranks of the same shape: a second fake world in the same thread would get the first
    rank's shards back. A mesh made in another thread never compares equal to it.
    """
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out.append((False, e))

    t = threading.Thread(target=run, name="scale-sim-fake-rank")
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def device_mesh(layout: Layout) -> Any:
    """The layout's DeviceMesh (CPU) in the current (fake) process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=layout.mesh_dim_names)


__all__ = ["LAYOUTS", "MODELS", "Layout", "ModelShape", "PlanBuilder", "adamw_template",
           "device_mesh", "fake_world", "in_fresh_thread", "local_shard", "make_layout",
           "parameters"]
