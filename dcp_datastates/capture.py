"""Capture: turning a state dict into a save job whose tensors are copied into the host cache.

``stage()`` runs in the training thread and must be fast. For every tensor it decides how the
snapshot is taken (docs/architecture.md, "Exactness"):

* **lazy** - the tensor is registered with the engine as it is; its copy into the host cache runs
  in the background. Used for tensors only ``optimizer.step()`` modifies (parameters and state of
  optimizers passed to ``writer.protect``), or for every tensor with ``capture="lazy"``. The
  barrier (``wait_captured``, called by the step pre-hook) makes the step wait for these copies.
  Each lazy tensor's version counter is recorded; if it changed before the barrier verified the
  capture, the tensor was modified in place and the save fails with :class:`CaptureError`
  instead of being written torn.
* **eager** - the tensor is snapshotted at save time (buffers such as BatchNorm running
  statistics, step counters, anything not protected): a contiguous host tensor is copied straight
  into the host cache by this thread when the cache has room without waiting; otherwise it is
  cloned on its device (a host clone is then flushed from where it is, a CUDA clone copied like a
  lazy tensor). Non-contiguous views and tensors with conjugate/negative bits are always
  compacted eagerly.

Non-tensor values are deep-copied at save time. The staged dict handed back to DCP holds a new
object for every tensor leaf (a detached alias or the clone), so the writer can tell which save
job a DCP write belongs to by object identity, even when several saves are in flight.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .engine import Engine
from .errors import CaptureError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

_UNSUPPORTED_LAYOUT_HINT = "convert it to a dense strided tensor before saving"


@dataclass
class CapturedTensor:
    """One tensor (or DTensor local shard) of a save job."""

    name: str
    staged: Any  # the object placed in the staged dict (identity key)
    source: torch.Tensor  # contiguous tensor the engine copies from (kept alive until captured)
    entry: int  # engine entry index
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    lazy: bool
    version: int  # source._version at save time (lazy only)
    direct: bool = False  # flushed from `source` itself (kept alive until the job is done)


@dataclass
class SaveJob:
    """A staged save: its engine job, its tensors and its bookkeeping (one per save call)."""

    engine_job: int
    seq: int
    tensors: list[CapturedTensor] = field(default_factory=list)
    by_staged_id: dict[int, CapturedTensor] = field(default_factory=dict)
    keepalive: list[Any] = field(default_factory=list)  # CUDA events etc. until captured
    t_stage: float = 0.0  # perf_counter at the start of stage()
    stage_s: float = 0.0
    blocked_s: float = 0.0  # time the training thread spent in barriers for this job
    captured_before_barrier: bool | None = None
    verified: bool = False  # lazy capture checked against version counters
    adhoc: bool = False  # created by write_data for a synchronous dcp.save
    bound: bool = False  # write_data has placed its items
    error: BaseException | None = None
    error_reported: bool = False
    checkpoint_id: str | None = None
    rank: int = -1
    thread: int | None = None  # ident of the DCP save thread carrying this job
    finished: bool = False  # written or failed; its engine job is forgotten
    protocol_done: bool = False  # the save thread's DCP protocol ended (after the commit)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def lookup(self, staged_obj: Any) -> CapturedTensor | None:
        return self.by_staged_id.get(id(staged_obj))

    def release_sources(self, done: bool = False) -> None:
        """Drops the references to sources the engine no longer reads.

        After capture that is every copied source; direct sources are read until the job is done.
        """
        for t in self.tensors:
            if done or not t.direct:
                t.source = _RELEASED
        if done:
            self.keepalive.clear()

    def modified_tensors(self) -> list[str]:
        """Names of lazy tensors whose version counter moved since the save call."""
        return [
            t.name
            for t in self.tensors
            if t.lazy and t.source is not _RELEASED and t.source._version != t.version
        ]


_RELEASED = torch.empty(0)
_SEQ = itertools.count(1)


def protected_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storage addresses of everything the given optimizers own (params and state tensors)."""
    ptrs: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = _local(t)
            if local.device.type != "meta" and local.numel() > 0:
                ptrs.add(local.untyped_storage().data_ptr())

    for opt in optimizers:
        for o in (opt, getattr(opt, "optim", None)):  # ZeroRedundancyOptimizer wraps `optim`
            if o is None:
                continue
            for group in getattr(o, "param_groups", ()):
                for p in group.get("params", ()):
                    add(p)
            for st in getattr(o, "state", {}).values():
                if isinstance(st, Mapping):
                    for v in st.values():
                        add(v)
    return ptrs


def _local(t: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor
    return t


def _validate(name: str, t: torch.Tensor) -> None:
    local = _local(t)
    if local.layout != torch.strided:
        raise TypeError(
            f"cannot save '{name}': {local.layout} tensors are not supported; "
            + _UNSUPPORTED_LAYOUT_HINT
        )
    if local.is_nested:
        raise TypeError(f"cannot save '{name}': nested tensors are not supported")
    if local.is_quantized:
        raise TypeError(
            f"cannot save '{name}': quantized tensors are not supported; dequantize it first"
        )
    if local.device.type == "meta":
        raise TypeError(f"cannot save '{name}': it is a meta tensor and holds no data")
    if local.device.type not in ("cpu", "cuda"):
        raise TypeError(f"cannot save '{name}': device {local.device} is not supported")


class Stager:
    """Builds save jobs from state dicts for one engine (used by DataStatesWriter.stage)."""

    def __init__(self, engine: Engine, capture_mode: str) -> None:
        self._engine = engine
        self._mode = capture_mode

    def stage(
        self, state_dict: Mapping[str, Any], protected: set[int]
    ) -> tuple[dict[str, Any], SaveJob]:
        """Registers every tensor of ``state_dict`` with a new engine job and starts its copies.

        Returns the staged dict (same structure; new objects for tensor leaves, deep copies of
        other values) and the job. Raises TypeError naming the key for unsupported values; in that
        case nothing was started.
        """
        t0 = time.perf_counter()
        seq = next(_SEQ)
        job = SaveJob(engine_job=self._engine.create_job(f"save-{seq}"), seq=seq, t_stage=t0)
        try:
            staged = self._walk(state_dict, "", job, protected)
            self._engine.start_copies(job.engine_job)
        except BaseException:
            self._engine.forget(job.engine_job)
            raise
        job.stage_s = time.perf_counter() - t0
        return staged, job

    def stage_tensor(self, job: SaveJob, name: str, tensor: torch.Tensor) -> CapturedTensor:
        """Registers one tensor for a synchronous save (the caller waits until it is written).

        No clone: contiguous tensors are copied from where they are; others are compacted.
        """
        _validate(name, tensor)
        source = tensor.detach().resolve_conj().resolve_neg().contiguous()
        return self._register(job, name, source, source, lazy=False, direct=True)

    # -- internals -------------------------------------------------------------------------
    def _walk(self, obj: Any, path: str, job: SaveJob, protected: set[int]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._stage_tensor(obj, path or "<root>", job, protected)
        if isinstance(obj, Mapping):
            items = [(k, self._walk(v, _join(path, k), job, protected)) for k, v in obj.items()]
            if type(obj) is dict:
                return dict(items)
            try:
                return type(obj)(items)  # type: ignore[call-arg]  # OrderedDict and friends
            except TypeError:
                return dict(items)
        if isinstance(obj, list):
            return [self._walk(v, _join(path, i), job, protected) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._walk(v, _join(path, i), job, protected) for i, v in enumerate(obj))
        try:
            return copy.deepcopy(obj)
        except Exception as e:
            raise TypeError(f"cannot save '{path}': value of type {type(obj).__name__} "
                            f"cannot be copied at save time ({e})") from e

    def _stage_tensor(
        self, t: torch.Tensor, name: str, job: SaveJob, protected: set[int]
    ) -> torch.Tensor:
        _validate(name, t)
        local = _local(t).detach()
        is_dtensor = local is not t and DTensor is not None and isinstance(t, DTensor)
        simple = local.is_contiguous() and not local.is_conj() and not local.is_neg()
        if self._mode == "lazy":
            lazy = simple
        elif self._mode == "eager":
            lazy = False
        else:
            lazy = (
                simple
                and local.numel() > 0
                and local.untyped_storage().data_ptr() in protected
            )
        snapshot_now = False
        if lazy:
            source = local
        else:
            source = local.resolve_conj().resolve_neg().contiguous()
            if source.numel() > 0 and source.data_ptr() == local.data_ptr():
                # Already contiguous: snapshot it straight into the host cache if there is room
                # (no allocation); else fall back to a clone below.
                snapshot_now = source.device.type == "cpu"
                if not snapshot_now:
                    source = source.clone()
        # A fresh object per save (the detached alias or the clone): the identity key.
        staged: torch.Tensor = local if lazy or snapshot_now else source
        if is_dtensor:
            staged = DTensor.from_local(
                staged,
                t.device_mesh,  # type: ignore[attr-defined]
                t.placements,  # type: ignore[attr-defined]
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        if snapshot_now:
            cap = self._register(job, name, staged, source, lazy=False)
            if not self._engine.capture_now(job.engine_job, cap.entry):
                clone = source.clone()
                self._engine.retarget(job.engine_job, cap.entry, clone.data_ptr(), direct=True)
                cap.source, cap.direct = clone, True
            return staged
        # A clone is private to this save: flush it from where it is, no copy into the cache.
        self._register(job, name, staged, source, lazy, direct=not lazy and source is not local)
        return staged

    def _register(
        self,
        job: SaveJob,
        name: str,
        staged: Any,
        source: torch.Tensor,
        lazy: bool,
        direct: bool = False,
    ) -> CapturedTensor:
        nbytes = source.numel() * source.element_size()
        device = -1
        event = 0
        direct = direct and source.device.type == "cpu"
        if source.device.type == "cuda":
            self._engine.enable_cuda()
            device = source.device.index if source.device.index is not None else 0
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(source.device))
            job.keepalive.append(ev)
            event = int(ev.cuda_event)
        entry = self._engine.add_entry(
            job.engine_job, name, source.data_ptr() if nbytes else 0, nbytes, device, event, direct
        )
        cap = CapturedTensor(
            name=name,
            staged=staged,
            source=source,
            entry=entry,
            nbytes=nbytes,
            dtype=source.dtype,
            shape=tuple(source.shape),
            lazy=lazy,
            version=source._version,
            direct=direct,
        )
        job.tensors.append(cap)
        job.by_staged_id[id(staged)] = cap
        return cap


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def raise_if_modified(job: SaveJob, checkpoint: str) -> None:
    """Raises CaptureError if a lazily captured tensor changed before its capture was verified."""
    changed = job.modified_tensors()
    if changed:
        shown = ", ".join(f"'{n}'" for n in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        raise CaptureError(
            f"save to {checkpoint} failed: tensor {shown}{more} was modified in place before its "
            "lazy copy into the host cache was confirmed; the save was not committed. Call "
            "writer.wait_captured() (or writer.protect(optimizer)) before modifying saved tensors, "
            "or use capture='eager'."
        )
