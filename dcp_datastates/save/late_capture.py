"""Late capture: the captured record of each planned tensor item, captured at placement if need be.

A staged save (``async_save`` through the writer's ``stage``) captured its tensors at the call:
:func:`lookup` finds a planned item's record by the identity of its object in the staged state
dict. ``dcp.save`` stages nothing, and a custom planner may plan items the staged state does not
know: those are captured when they are placed (:func:`capture_late_many`, one native call for a
whole ``dcp.save``; :func:`capture_late`), written from where they are (no copy into the cache).
An incremental save's tensor referenced at the call whose owner cannot be used at placement is
written from its source instead (:func:`write_instead`). :func:`check_planned_shape` checks a
record against its item's planned chunk.

Used by :class:`~dcp_datastates.save.placement.Placer` (and through it by the safetensors and
stream-transform writers), in the save thread of one save; stateless.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ..errors import CheckpointSaveError
from .capture import CapturedTensor, SaveJob, Stager
from .contexts import SaveContext
from .incremental import StageInfo

if TYPE_CHECKING:
    from ..config import WriterConfig
    from ..engine import Engine
    from ..format.layout import TemplateCache


class ItemPlacer(Protocol):
    """What the variants of placement (stream transforms, the safetensors format) use of the
    torch format's :class:`~dcp_datastates.save.placement.Placer`: its configuration, engine and
    archive templates, and its lookup or capture of each item's tensor."""

    config: WriterConfig
    _engine: Engine
    _templates: TemplateCache

    def captured_item(
        self, ctx: SaveContext, job: SaveJob, staged_sd: Any, item: WriteItem,
        planner: SavePlanner,
    ) -> tuple[CapturedTensor, bool]: ...

    def capture_late_many(
        self, job: SaveJob, items: list[WriteItem], planner: SavePlanner
    ) -> bool: ...

logger = logging.getLogger("dcp_datastates.save.writer")


def check_planned_shape(ctx: SaveContext, item: WriteItem, cap: CapturedTensor) -> None:
    """Raises if the planner's chunk of a tensor item differs from what was captured."""
    sizes = item.tensor_data.chunk.sizes  # type: ignore[union-attr]
    if sizes != cap.shape:  # torch.Size compares equal to the tuple of its ints
        raise CheckpointSaveError(
            f"save to {ctx.path}: '{item.index.fqn}' planned with shape {tuple(sizes)} but "
            f"captured with shape {cap.shape}"
        )


def lookup(job: SaveJob, staged_sd: Any, item: WriteItem) -> CapturedTensor | None:
    """The captured tensor of a tensor item: by the identity of its object in the staged
    state dict, else by the item (captured late); None if it was never captured."""
    if not isinstance(staged_sd, dict):
        return job.by_staged_id.get(id(item))
    obj = staged_sd.get(item.index.fqn)
    cap = job.lookup(obj) if obj is not None else None
    if cap is None:
        cap = job.by_staged_id.get(id(item))  # captured late, keyed by the item
    return cap


def write_instead(
    stager: Stager, job: SaveJob, item: WriteItem, info: StageInfo
) -> CapturedTensor:
    """Incremental saves: a tensor referenced at the call whose owner cannot be used now is
    written from its source (checked unchanged afterwards, ``Tracker.check_fallbacks``)."""
    info.fallback = True
    cap = stager.stage_tensor(job, info.name, info.source)
    job.rekey(cap, item)
    cap.incr = info
    return cap


def capture_late_many(
    stager: Stager, job: SaveJob, items: list[WriteItem], planner: SavePlanner
) -> bool:
    """:func:`capture_late` for every tensor item of a ``dcp.save`` (one native call); True if
    there was any."""
    tensor_items = [item for item in items if item.type != WriteItemType.BYTE_IO]
    sd = getattr(planner, "state_dict", None)
    if isinstance(sd, dict) and _resolves_by_default(planner):
        data = []
        for item in tensor_items:
            t = _plain_tensor(sd, item)
            data.append(t if t is not None else _resolved_tensor(item, planner))
    else:
        data = [_resolved_tensor(item, planner) for item in tensor_items]
    names = [item.index.fqn for item in tensor_items]
    return stager.stage_tensors(job, names, data, tensor_items) > 0


def capture_late(
    stager: Stager, job: SaveJob, item: WriteItem, planner: SavePlanner
) -> CapturedTensor:
    """Captures an item the staged state does not know (dcp.save, or custom planners)."""
    if not job.adhoc:
        logger.warning(
            "'%s' was not captured at save time (custom planner?); it is copied now, when "
            "its data is written",
            item.index.fqn,
        )
    cap = stager.stage_tensor(job, item.index.fqn, _resolved_tensor(item, planner))
    job.rekey(cap, item)
    return cap


def _resolves_by_default(planner: SavePlanner) -> bool:
    """Whether ``planner`` resolves items as DefaultSavePlanner does (none of its lookup
    methods overridden)."""
    cls = type(planner)
    return all(
        getattr(cls, m, None) is getattr(DefaultSavePlanner, m)
        for m in ("resolve_data", "lookup_object", "transform_object")
    )


def _plain_tensor(sd: dict[str, Any], item: WriteItem) -> torch.Tensor | None:
    """What DefaultSavePlanner.resolve_data gives for a whole plain tensor, found directly
    (100,000 items: a quarter of a second); None for anything else (DTensors, shards, tensor
    subclasses), which goes the planner's way."""
    obj = sd.get(item.index.fqn)
    if type(obj) is not torch.Tensor:
        return None
    off = item.index.offset
    if off is not None and (len(off) != obj.dim() or any(off)):
        return None
    return obj


def _resolved_tensor(item: WriteItem, planner: SavePlanner) -> torch.Tensor:
    """The tensor the planner resolves for a tensor item; raises naming the item otherwise."""
    data = planner.resolve_data(item)
    if not isinstance(data, torch.Tensor):
        raise CheckpointSaveError(f"'{item.index.fqn}': planner resolved a {type(data)!r}")
    return data


__all__ = ["capture_late", "capture_late_many", "check_planned_shape", "lookup", "write_instead"]
