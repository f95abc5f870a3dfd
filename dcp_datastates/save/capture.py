"""Capture: turning a state dict into a save job whose tensors are copied into the host cache.

``stage()`` runs in the training thread and must be fast. For every tensor it decides how the
snapshot is taken (docs/architecture.md, "Exactness"; docs/configuration.md, ``capture``):

* **at the call** - a host tensor is copied into the host cache by the calling thread (a native
  memcpy, GIL released). Exact by construction. State no optimizer owns (buffers, counters,
  anything a forward pass may change) is always taken this way, and every tensor with
  ``capture="eager"``; if the cache is full it *waits* for space freed by earlier saves (reported
  as ``stall_s``), it never clones.
* **lazy** - the tensor is registered as it is and copied in the background by the engine's copy
  threads (idle CPU priority on the host, the copy engine on CUDA); the step barrier
  (:mod:`dcp_datastates.save.barrier`) makes the owning optimizer's next ``step()`` wait for it.
  Under the default ``capture="auto"`` (the DataStates policy, also spelled ``"owned"``) this is how
  every tensor an optimizer owns (its parameters and state) is taken, on every device: measured
  on a 2-core host, it cost training less per checkpoint than copying everything at the call
  (docs/benchmarks.md, mlp-loop and GPT). With ``capture="lazy"`` every contiguous tensor is.
  Each lazy tensor's version counter and storage are recorded; if the tensor was modified in
  place, or its storage freed or resized, before the barrier verified the capture, the save
  fails with :class:`CaptureError` instead of being written torn (the copy threads read through
  the kernel, so a freed source is an error, not a crash). A tensor made under
  ``torch.inference_mode()`` has no version counter, so it is never captured lazily: it is taken
  at the call (host) or cloned on its device (CUDA) in every mode.
* **spill** - state that must be taken at the call but cannot fit even once earlier saves have
  drained (this save alone needs more than the whole cache) is written at the call to an
  anonymous temporary file (:mod:`dcp_datastates.save.spill`), later copied into the data file by
  the kernel. Memory stays bounded; the call takes as long as that write. Only if no spill file can
  be created is such a tensor captured lazily (with the checks above) and a warning logged.

CUDA tensors the optimizer does not own are cloned on their device (device memory, not host
memory) and the clone is copied lazily. Non-contiguous views and tensors with conjugate/negative
bits are compacted first (a transient copy of that tensor). Non-tensor values are deep-copied at
save time. The staged dict handed back to DCP holds an object per tensor leaf that is that leaf's
key in its job (``SaveJob.by_staged_id``; each save thread carries one job, so several saves in
flight never mix): a detached alias or the clone, or the tensor itself for a tensor without
autograd, captured lazily (an optimizer-owned plain tensor in a dict; any lazily captured
DTensor) and met first in the save: an alias per tensor was a third of the call with 20,000
plain tensors, and a new DTensor costs ~30 us. Such a tensor's metadata changed in place before
DCP plans fails the save (the planned shape, storage and version checks) instead of being
written with the call's.
"""

from __future__ import annotations

import copy
import itertools
import logging
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import Engine
from ..errors import CaptureError
from ..runtime.cpuload import CpuMeter
from ..runtime.gcpause import ProtocolPause
from .barrier import DTensor, _local, default_world_size
from .incremental import Owner, StageInfo, Tracker
from .spill import SpilledTensor, spill_tensor

logger = logging.getLogger(__name__)

_UNSUPPORTED_LAYOUT_HINT = "convert it to a dense strided tensor before saving"


@dataclass(slots=True)
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
    owner: int | None = None  # id() of the optimizer owning a lazy tensor (None: nobody)
    at_call: bool = False  # copied into the cache by the save call itself
    spill: SpilledTensor | None = None  # written to a spill file at the call (see spill.py)
    storage_ptr: int = 0  # the source's storage address and size at save time (lazy only)
    storage_nbytes: int = 0
    incr: StageInfo | None = None  # incremental saves: identity, and the reference if unchanged
    # A DTensor shard no other rank holds (sharded on every dimension of a mesh spanning the
    # world): DCP's deduplication never moves it, so it may be placed before the planning with
    # several ranks too (dcp_datastates.save.early).
    rank_unique: bool = False


_PAUSE_SWAP = threading.Lock()  # SaveJob.take_gc_pause


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
    stall_s: float = 0.0  # time stage() waited for host cache space
    lazy_bytes: int = 0  # bytes left to the background copies (0: all taken at the call)
    busy_bytes: int = 0  # lazy by policy, copied at the call: the machine was busy (cpuload.py)
    lazy_owners: set[int | None] = field(default_factory=set)  # owners of its lazy tensors
    captured_before_barrier: bool | None = None
    verified: bool = False  # lazy capture checked against version counters
    adhoc: bool = False  # created by write_data for a synchronous dcp.save
    bound: bool = False  # write_data has placed its items
    error: BaseException | None = None
    error_reported: bool = False
    error_logged: bool = False
    checkpoint_id: str | None = None
    rank: int = -1
    thread: int | None = None  # ident of the DCP save thread carrying this job
    finished: bool = False  # written or failed; its engine job is forgotten
    protocol_done: bool = False  # the save thread's DCP protocol ended (after the commit)
    early: Any = None  # its EarlyPlacement (dcp_datastates.save.early), placed before DCP planned
    no_room: Any = None  # room.NoRoom: early placement found no room beside the old checkpoint
    # The coordinator's async_save: write_data returned its results before the data was durable;
    # finish() completes this completion.PendingWrite before the commit. None otherwise.
    pending_write: Any = None
    # Several ranks, a non-coordinator's async_save: the thread completing its write after
    # write_data returned (writer._complete_in_background); its release joins it.
    completer: threading.Thread | None = None
    # ... and its heartbeat and report to the coordinator (rank_commit.Reporter); closed by the
    # release, once the save ended.
    reporter: Any = None
    # The digest of the write results it handed over (result_cache.py): a save that ends
    # without error on this rank confirms them, so the next save may send them by reference.
    results_digest: bytes | None = None
    # Replicas on (lifecycle/replicas.py): this rank's part of the save, set once its files are
    # durable (the coordinator's: once committed); queued when the save's future succeeds.
    replica: Any = None
    gc_pause: ProtocolPause | None = None  # from stage() until its save thread takes it
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def lookup(self, staged_obj: Any) -> CapturedTensor | None:
        return self.by_staged_id.get(id(staged_obj))

    def rekey(self, cap: CapturedTensor, key: Any) -> None:
        """Makes ``key`` (a plan's WriteItem) the identity under which ``cap`` is found."""
        self.by_staged_id.pop(id(cap.staged), None)
        self.by_staged_id[id(key)] = cap
        cap.staged = key

    def release_sources(self, done: bool = False) -> None:
        """Drops the references to sources the engine no longer reads.

        After capture that is every copied source; direct sources are read until the job is done.
        """
        for t in self.tensors:
            if done or not t.direct:
                t.source = _RELEASED
            if done and t.spill is not None:
                t.spill.close()
        if done:
            self.keepalive.clear()
            if self.early is not None:
                self.early.close()  # its unnamed files, if never linked, vanish with the engine's

    def end_gc_pause(self) -> None:
        """Ends the collector pause stage() began, unless taken (idempotent; any thread)."""
        pause = self.take_gc_pause()
        if pause is not None:
            pause.end()

    def hold_gc_pause_until_release(self, pause: ProtocolPause) -> bool:
        """Keeps ``pause`` until this job's protocol is released (its future completed, see
        JobTable.release_job). False if the job was released already (or holds another
        pause): the caller then ends it another way."""
        with _PAUSE_SWAP:
            if self.protocol_done or self.gc_pause is not None:
                return False
            self.gc_pause = pause
            return True

    def take_gc_pause(self) -> ProtocolPause | None:
        """Hands the collector pause stage() began to the save thread (None if gone).

        Not under ``self.lock``: the training thread may hold that lock while it waits for this
        job's copies, which may need this save thread's flushes to free cache space.
        """
        with _PAUSE_SWAP:  # held for the swap only
            pause, self.gc_pause = self.gc_pause, None
        return pause

    def discard_payload(self) -> None:
        """Drops the per-tensor records of a finished job whose DCP protocol is over.

        The job object may outlive its save by long (the save's future refers to it until the
        caller drops the future, typically at the next ``async_save``): keeping its records would
        keep one Python object per tensor alive, slow every full garbage collection and make
        freeing them land inside the next save call.
        """
        with self.lock:
            if not self.finished:
                return
            self.tensors = []
            self.by_staged_id = {}
            self.keepalive.clear()
            if self.early is not None:  # its per-tensor places, like the records
                self.early.close()
                self.early = None

    def waits_for(self, owners: set[int]) -> bool:
        """Whether a step of an optimizer with one of these ids must wait for this job."""
        return None in self.lazy_owners or not self.lazy_owners.isdisjoint(owners)

    def modified_tensors(self) -> list[str]:
        """Lazy tensors changed since the save call: "'name' (why)" for each."""
        out = []
        for t in self.tensors:
            if not t.lazy or t.source is _RELEASED:
                continue
            st = t.source.untyped_storage()
            if st.data_ptr() != t.storage_ptr or st.nbytes() < t.storage_nbytes:
                out.append(f"'{t.name}' (its storage was freed or resized)")
            elif _version(t.source) != t.version:
                out.append(f"'{t.name}' (modified in place)")
        return out


_RELEASED = torch.empty(0)
_SEQ = itertools.count(1)


def _validate(name: str, t: torch.Tensor) -> None:
    local = _local(t)
    if local.is_cpu or local.is_cuda:  # the common case: cheap checks only (once per tensor)
        if local.layout == torch.strided and not local.is_nested and not local.is_quantized:
            return
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


class _Batch:
    """The tensor leaves one ``stage()`` call registers, in registration order, already laid out
    as the engine's one native call takes them (so that no second pass over 20,000 tensors is
    needed). Each leaf is taken at the call (``must``), copied in the background (``lazy``) or,
    for incremental saves, referenced and never copied (``ref``); ``cap.entry`` is its index here
    (the engine numbers a fresh job's entries from 0)."""

    __slots__ = ("caps", "names", "srcs", "sizes", "cuda", "by_id", "must", "lazy", "ref")

    def __init__(self) -> None:
        self.caps: list[CapturedTensor] = []
        self.names: list[str] = []
        self.srcs: list[int] = []  # source addresses (0 for an empty tensor)
        self.sizes: list[int] = []
        self.cuda: list[tuple[int, torch.Tensor]] = []  # (index, source) of CUDA sources
        self.by_id: dict[int, CapturedTensor] = {}  # id(staged object) -> record
        self.must: list[CapturedTensor] = []
        self.lazy: list[CapturedTensor] = []
        self.ref: list[CapturedTensor] = []

    def add(self, cap: CapturedTensor, at_call: str) -> None:
        """Adds one leaf (``at_call``: "must", "no" or "ref")."""
        source = cap.source
        cap.entry = len(self.caps)
        self.caps.append(cap)
        self.names.append(cap.name)
        self.srcs.append(source.data_ptr() if cap.nbytes else 0)
        self.sizes.append(cap.nbytes)
        if source.is_cuda:
            self.cuda.append((cap.entry, source))
        self.by_id[id(cap.staged)] = cap
        (self.must if at_call == "must" else self.lazy if at_call == "no" else self.ref).append(cap)


class Stager:
    """Builds save jobs from state dicts for one engine (used by DataStatesWriter.stage).

    Thread-safety: one ``stage()`` at a time per writer (the training thread); the engine calls
    it makes are thread-safe.
    """

    def __init__(
        self,
        engine: Engine,
        capture_mode: str,
        spill_dirs: list[str] | None = None,
        incremental: Tracker | None = None,
        meter: CpuMeter | None = None,
    ) -> None:
        self._engine = engine
        self._meter = meter  # machine load: lazy copies or copies at the call (cpuload.py)
        self._mode = capture_mode
        self._spill_dirs = spill_dirs if spill_dirs is not None else [tempfile.gettempdir()]
        self._warned_overflow = False
        self._warned_device_oom = False
        self._incremental = incremental  # incremental saves (dcp_datastates.save.incremental)
        self._owners_valid: dict[Owner, bool] = {}  # owner checks of the current stage() call

    def stage(
        self, state_dict: Mapping[str, Any], owners: Mapping[int, int]
    ) -> tuple[dict[str, Any], SaveJob]:
        """Registers every tensor of ``state_dict`` with a new engine job and captures it.

        ``owners`` maps storage addresses to the id of the optimizer owning them (see
        :func:`dcp_datastates.save.barrier.owned_storages`); only owned tensors may be lazy (except
        with ``capture="lazy"``). Returns the staged dict (same structure; new objects for tensor
        leaves, deep copies of other values) and the job, whose at-call copies are done and
        whose lazy copies are running. Raises TypeError naming the key for unsupported values;
        in that case nothing was started.
        """
        t0 = time.perf_counter()
        seq = next(_SEQ)
        job = SaveJob(engine_job=self._engine.create_job(f"save-{seq}"), seq=seq, t_stage=t0)
        self._owners_valid = {}
        batch = _Batch()
        # Per-tensor bookkeeping with the collector paused, and the pause handed over to the save
        # thread, which keeps it through DCP's planning (writer.set_up_storage_writer): no
        # collection in the caller's save call (one that started on the save thread while the
        # caller was still returning would hold the GIL for all of it), none of the walk's
        # objects scanned while they live. It ends with the job if no save thread takes it.
        job.gc_pause = ProtocolPause()
        try:
            staged = self._walk(state_dict, "", job, owners, batch)
            self._register_batch(job, batch)
            self._capture(job, batch)
            self._engine.start_copies(job.engine_job)
        except BaseException:
            job.end_gc_pause()
            self._engine.forget(job.engine_job)
            raise
        job.stage_s = time.perf_counter() - t0
        return staged, job

    def stage_tensor(self, job: SaveJob, name: str, tensor: torch.Tensor) -> CapturedTensor:
        """Registers one tensor for a synchronous save (the caller waits until it is written).

        No copy into the cache: contiguous tensors are written from where they are; others are
        compacted first.
        """
        _validate(name, tensor)
        source = _direct_source(tensor)
        return self._register(job, name, source, source, lazy=False, direct=True)

    def stage_tensors(
        self, job: SaveJob, names: list[str], tensors: list[torch.Tensor], keys: list[Any]
    ) -> int:
        """:meth:`stage_tensor` for many tensors, host ones registered in one native call
        (``dcp.save`` of 100,000 tensors); record i is found by (and staged as) ``keys[i]``.
        Returns how many were registered."""
        batch: list[int] = []
        sources: list[torch.Tensor] = []
        for i, (name, t) in enumerate(zip(names, tensors, strict=True)):
            _validate(name, t)
            if not _local(t).is_cpu:
                job.rekey(self.stage_tensor(job, name, t), keys[i])
                continue
            source = _direct_source(t)
            batch.append(i)
            sources.append(source)
        if batch:
            n = len(batch)
            sizes = [src.nbytes for src in sources]
            first = self._engine.add_entries(
                job.engine_job,
                [names[i] for i in batch],
                [src.data_ptr() if size else 0 for src, size in zip(sources, sizes, strict=True)],
                sizes, [-1] * n, [0] * n, [1] * n,
            )
            for k, (i, src) in enumerate(zip(batch, sources, strict=True)):
                cap = CapturedTensor(
                    name=names[i], staged=keys[i], source=src, entry=first + k,
                    nbytes=sizes[k], dtype=src.dtype, shape=tuple(src.shape), lazy=False,
                    version=0, direct=True,  # (lazy only; an inference tensor has none)
                )
                job.tensors.append(cap)
                job.by_staged_id[id(keys[i])] = cap
        return len(tensors)

    # -- internals -------------------------------------------------------------------------
    def _walk(
        self, obj: Any, path: str, job: SaveJob, owners: Mapping[int, int], out: _Batch
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._stage_tensor(obj, path or "<root>", owners, out)
        kind = type(obj)
        if kind is dict or kind is OrderedDict:  # the common cases, without the ABC check below
            if self._incremental is None and self._mode != "lazy":
                staged = self._walk_dict_fast(obj, path, job, owners, out)
            else:
                staged = {k: self._walk(v, _join(path, k), job, owners, out)
                          for k, v in obj.items()}
            return staged if kind is dict else OrderedDict(staged)  # (a module's state_dict)
        if isinstance(obj, Mapping):
            items = [(k, self._walk(v, _join(path, k), job, owners, out)) for k, v in obj.items()]
            if type(obj) is dict:
                return dict(items)
            try:
                return type(obj)(items)  # type: ignore[call-arg]  # OrderedDict and friends
            except TypeError:
                return dict(items)
        if isinstance(obj, list):
            return [self._walk(v, _join(path, i), job, owners, out) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(
                self._walk(v, _join(path, i), job, owners, out) for i, v in enumerate(obj)
            )
        try:
            return copy.deepcopy(obj)
        except Exception as e:
            raise TypeError(f"cannot save '{path}': value of type {type(obj).__name__} "
                            f"cannot be copied at save time ({e})") from e

    def _walk_dict_fast(
        self, obj: dict[Any, Any], path: str, job: SaveJob, owners: Mapping[int, int],
        out: _Batch,
    ) -> dict[Any, Any]:
        """``_walk`` of a plain dict, with the two common leaves staged inline: a plain,
        contiguous tensor an optimizer owns (CPU or CUDA) is left to the background copies, and
        one on the CPU nobody owns is taken at the call. The same decisions
        :meth:`_stage_tensor` makes for them, without its per-tensor calls (20,000 small
        tensors: about half the time). Not for incremental saves nor ``capture="lazy"``."""
        staged: dict[Any, Any] = {}
        prefix = f"{path}." if path else ""
        strided = torch.strided
        caps, names, srcs, sizes, must = out.caps, out.names, out.srcs, out.sizes, out.must
        by_id, cuda = out.by_id, out.cuda
        may_lazy = self._mode != "eager"
        lazy_owners = job.lazy_owners
        lazy_bytes = 0
        for k, v in obj.items():
            if (
                type(v) is not torch.Tensor
                or v.layout is not strided
                or v.is_nested
                or v.is_quantized
                or not v.is_contiguous()
                or v.is_conj()
                or v.is_neg()
            ):
                staged[k] = self._walk(v, _join(path, k), job, owners, out)
                continue
            on_cpu = v.is_cpu
            owner = None
            if owners and (on_cpu or v.is_cuda) and v.numel() > 0:
                storage = v.untyped_storage()
                owner = owners.get(storage.data_ptr())
            # owned: copied later, its step() waits; never an inference tensor (see _stage_tensor)
            lazy = owner is not None and may_lazy and not v.is_inference()
            at_call = on_cpu and owner is None  # nobody owns it: taken at the call
            if not (lazy or at_call):
                staged[k] = self._walk(v, _join(path, k), job, owners, out)
                continue
            # What _Batch.add (and, for a lazy leaf, _make_lazy) does, inline. The leaf's key
            # in its job: a fresh detached alias, or an owned tensor without autograd met first
            # in this save itself (see the module docstring).
            local = v if lazy and not v.requires_grad and id(v) not in by_id else v.detach()
            nbytes = local.nbytes
            name = f"{prefix}{k}"
            entry = len(caps)
            # Positional: CapturedTensor(name, staged, source, entry, nbytes, dtype, shape, lazy,
            # version).
            if lazy:
                cap = CapturedTensor(
                    name, local, local, entry, nbytes, local.dtype, tuple(local.shape),
                    True, local._version, owner=owner,
                    storage_ptr=storage.data_ptr(), storage_nbytes=storage.nbytes(),
                )
                if not on_cpu:
                    cuda.append((entry, local))
                lazy_owners.add(owner)
                lazy_bytes += nbytes
            else:
                cap = CapturedTensor(
                    name, local, local, entry, nbytes, local.dtype, tuple(local.shape),
                    False, 0,
                )
                must.append(cap)
            caps.append(cap)
            names.append(name)
            srcs.append(local.data_ptr() if nbytes else 0)
            sizes.append(nbytes)
            by_id[id(local)] = cap
            staged[k] = local
        job.lazy_bytes += lazy_bytes
        return staged

    def _stage_tensor(
        self,
        t: torch.Tensor,
        name: str,
        owners: Mapping[int, int],
        out: _Batch,
    ) -> torch.Tensor:
        """Decides how one tensor leaf is captured; it is registered later, with the batch."""
        _validate(name, t)
        local = _local(t).detach()
        is_dtensor = local is not t and DTensor is not None and isinstance(t, DTensor)
        simple = local.is_contiguous() and not local.is_conj() and not local.is_neg()
        owner = (
            owners.get(local.untyped_storage().data_ptr())
            if owners and local.numel() > 0
            else None
        )
        lazy_ok = self._may_be_lazy(local, simple, owner)
        on_cpu = local.is_cpu
        # Incremental saves: a tensor unchanged since the previous save is referenced, never
        # copied nor written (dcp_datastates.save.incremental decides).
        info = None
        if self._incremental is not None:
            info = self._incremental.check(
                name, local, owner is not None, simple, self._owners_valid
            )
        referenced = info is not None and info.ref is not None
        at_call = "must" if on_cpu and not (lazy_ok or referenced) else "no"
        if on_cpu:
            # Non-contiguous views (and conj/neg bits) are compacted: a transient copy.
            source = local if simple else local.resolve_conj().resolve_neg().contiguous()
        elif lazy_ok:
            source = local
        else:
            source = self._device_snapshot(local, name)
        # The leaf's key in its job: a fresh object (the detached alias or the clone), except
        # for a DTensor captured lazily (with its storage and version checks) without autograd
        # and met first in this save, which keys itself: a new DTensor costs ~30 us (FSDP2's
        # state is thousands of them). See the module docstring.
        staged: torch.Tensor = local if (on_cpu or lazy_ok) else source
        if is_dtensor:
            keys_itself = (
                lazy_ok
                and at_call == "no"
                and not referenced
                and not t.requires_grad
                and id(t) not in out.by_id
            )
            staged = t if keys_itself else _dtensor_around(t, staged)
        cap = CapturedTensor(
            name=name,
            staged=staged,
            source=source,
            entry=-1,
            nbytes=source.nbytes,
            dtype=source.dtype,
            shape=tuple(source.shape),
            # a CUDA tensor that may not be lazy is a private clone: exact already, not lazy
            lazy=at_call != "must" and lazy_ok,
            version=0,  # taken by _make_lazy for the tensors that stay lazy
            owner=owner if lazy_ok and self._mode != "lazy" else None,
            incr=info,
            rank_unique=is_dtensor and _rank_unique(t),
        )
        if referenced:
            at_call, cap.lazy, cap.owner = "ref", False, None
        out.add(cap, at_call)
        return staged

    def _may_be_lazy(self, local: torch.Tensor, simple: bool, owner: int | None) -> bool:
        """Whether a tensor leaf may be copied in the background (the capture mode; ``simple``:
        contiguous, without conj/neg bits; ``owner``: the optimizer owning its storage)."""
        mode = self._mode
        if mode == "lazy":
            lazy_ok = simple
        elif mode == "eager":
            lazy_ok = False
        else:  # auto, owned
            lazy_ok = simple and owner is not None
        if local.is_inference():
            # No version counter: an in-place change under inference_mode before the copy
            # could not be detected, so an inference tensor is always taken at the call.
            lazy_ok = False
        return lazy_ok

    def _device_snapshot(self, local: torch.Tensor, name: str) -> torch.Tensor:
        """A private copy of a device tensor that may not be copied lazily: a clone on its
        device, or, when the device has no memory left for it, a synchronous copy into host
        memory (exact too, slower; warned once per writer): the save goes on either way."""
        try:
            return _clone_on_device(local)
        except torch.OutOfMemoryError:
            if not self._warned_device_oom:
                self._warned_device_oom = True
                logger.warning(
                    "no device memory left to snapshot '%s' (%s, %d bytes) on its device at the "
                    "save call: copied to host memory instead (synchronous). Tensors no optimizer "
                    "owns are snapshotted at the call; see docs/architecture.md, 'Capture "
                    "policy'.", name, local.device, local.nbytes,
                )
            # one synchronous copy, compacted on the way (copy_ applies conj/neg bits itself)
            return torch.empty(local.shape, dtype=local.dtype).copy_(local)

    def _register_batch(self, job: SaveJob, batch: _Batch) -> None:
        """Registers every tensor of the batch with the engine in one native call."""
        n = len(batch.caps)
        devices: list[int] = [-1] * n
        events: list[int] = [0] * n
        # One ready event per device for the whole walk: every source on a device is ordered
        # after the same point of its current stream (nothing is queued between the records of a
        # per-tensor event), and recording thousands of events cost ~10 us each.
        per_device: dict[torch.device, tuple[int, int]] = {}
        for i, source in batch.cuda:
            got = per_device.get(source.device)
            if got is None:
                got = per_device[source.device] = self._cuda_source(job, source)
            devices[i], events[i] = got
        first = self._engine.add_entries(job.engine_job, batch.names, batch.srcs, batch.sizes,
                                         devices, events, [0] * n)
        if first:  # a fresh job numbers from 0; kept correct should that ever change
            for cap in batch.caps:
                cap.entry += first
        job.tensors.extend(batch.caps)
        job.by_staged_id.update(batch.by_id)

    def _cuda_source(self, job: SaveJob, source: torch.Tensor) -> tuple[int, int]:
        """(device ordinal, ready event) of a CUDA source: an event recorded now on its stream."""
        self._engine.enable_cuda()
        device = source.device.index if source.device.index is not None else 0
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(source.device))
        job.keepalive.append(ev)
        return device, int(ev.cuda_event)

    def _capture(self, job: SaveJob, batch: _Batch) -> None:
        """Takes the at-call snapshots, then leaves the rest to the background copies."""
        eng = self._engine
        for cap in batch.ref:  # incremental: referenced, neither copied nor written
            eng.skip(job.engine_job, cap.entry)
            cap.at_call = True
            cap.source = _RELEASED  # cap.incr keeps the tensor for a fallback write
        overflow = self._capture_must(job, batch.must)
        # Then what may be lazy: the background copies take it, unless the machine's other work
        # would starve them (cpuload.py) and no barrier could raise them to normal priority
        # (Engine.can_boost): host state is then copied now, what fits right away.
        if self._meter is not None and (batch.lazy or job.lazy_bytes):
            load = self._meter.sample()
            if load is not None and load.starves_idle_threads and not self._engine.can_boost():
                self._capture_now_busy(job, batch)
        for cap in batch.lazy:
            if not cap.at_call:
                self._make_lazy(job, cap)
        if overflow and not self._warned_overflow:
            self._warned_overflow = True
            logger.warning(
                "host_cache_size (%d MiB) is smaller than the state this save must snapshot at the "
                "call and spilling failed (%s%s): those tensors are copied lazily and the save "
                "fails with CaptureError if they change before the next optimizer step. Raise "
                "host_cache_size.",
                eng.cache_bytes >> 20,
                ", ".join(overflow[:3]),
                " ..." if len(overflow) > 3 else "",
            )

    def _capture_must(self, job: SaveJob, must: list[CapturedTensor]) -> list[str]:
        """Takes the tensors that must be taken at the call: into the cache, else spilled, else
        (neither possible) left to the background copies. Returns the host tensors whose spill
        failed, each named with why, for the warning of :meth:`_capture`."""
        eng = self._engine
        cache = eng.cache_bytes
        chunk = eng.chunk_bytes
        reserved = 0  # cache bytes this job holds (they drain only after its placement)

        def footprint(c: CapturedTensor) -> int:
            nchunks = max(1, -(-c.nbytes // chunk))
            return c.nbytes + nchunks * 4096

        overflow: list[str] = []
        # State that must be taken now first: one native call copies all that fits right now
        # (GIL released), then what did not fit may wait for space, or spill.
        taken_now = eng.capture_now_many(job.engine_job, [cap.entry for cap in must])
        left: list[CapturedTensor] = []
        released = _RELEASED
        for cap, taken in zip(must, taken_now, strict=True):
            if taken:
                cap.lazy = False
                cap.at_call = True
                cap.source = released  # the cache holds it; the caller may change it now
            else:
                left.append(cap)
        if left:  # what the taken ones hold of the cache (they drain only after placement)
            reserved = sum(
                footprint(cap) for cap, taken in zip(must, taken_now, strict=True) if taken
            )
        for cap in left:
            need = footprint(cap)
            may_wait = reserved + need + chunk <= cache
            t0 = time.perf_counter()
            taken = eng.capture_now(job.engine_job, cap.entry, wait=False)
            if not taken and may_wait:
                taken = eng.capture_now(job.engine_job, cap.entry, wait=True)
                job.stall_s += time.perf_counter() - t0
            if taken:
                reserved += need
                cap.lazy = False
                cap.at_call = True
                cap.source = _RELEASED  # the cache holds it; the caller may change it now
                continue
            if cap.source.device.type == "cpu":
                # This save alone needs more than the cache for what it must take now: spill.
                try:
                    cap.spill = spill_tensor(cap.source, self._spill_dirs)
                except OSError as e:
                    overflow.append(f"{cap.name} (spill failed: {e})")
                else:
                    job.stall_s += time.perf_counter() - t0
                    eng.skip(job.engine_job, cap.entry)  # never copied by the engine
                    cap.lazy = False
                    cap.at_call = True
                    cap.source = _RELEASED
                    continue
            self._make_lazy(job, cap)
        return overflow

    def _capture_now_busy(self, job: SaveJob, batch: _Batch) -> None:
        """Copies the host tensors left to the background copies at the call instead, as far
        as the cache has room now (waiting for space would block the call behind earlier saves'
        flushes); device tensors and what does not fit stay lazy."""
        pending = {id(cap) for cap in batch.lazy}
        host = [
            cap for cap in batch.caps
            if cap.nbytes and not cap.at_call and (cap.lazy or id(cap) in pending)
            and cap.source.device.type == "cpu"
        ]
        if not host:
            return
        taken = self._engine.capture_now_many(job.engine_job, [cap.entry for cap in host])
        for cap, ok in zip(host, taken, strict=True):
            if not ok:
                continue
            if cap.lazy:  # counted as lazy by the walk (_walk_dict_fast) or by _make_lazy
                job.lazy_bytes -= cap.nbytes
            cap.lazy = False
            cap.at_call = True
            cap.source = _RELEASED  # the cache holds it; the caller may change it now
            job.busy_bytes += cap.nbytes
        # Only owners with a tensor still lazy make their step() wait for this save.
        job.lazy_owners = {cap.owner for cap in batch.caps if cap.lazy}

    def _make_lazy(self, job: SaveJob, cap: CapturedTensor) -> None:
        if cap.nbytes == 0:
            cap.lazy = False
            return
        if cap.source.device.type == "cpu" or cap.lazy:
            cap.lazy = True
            st = cap.source.untyped_storage()
            cap.storage_ptr, cap.storage_nbytes = st.data_ptr(), st.nbytes()
            cap.version = _version(cap.source)
            job.lazy_owners.add(cap.owner)
        job.lazy_bytes += cap.nbytes

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
            device, event = self._cuda_source(job, source)
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
            version=_version(source) if lazy else 0,  # (an inference tensor has none)
            direct=direct,
        )
        job.tensors.append(cap)
        job.by_staged_id[id(staged)] = cap
        return cap


def _rank_unique(t: Any) -> bool:
    """Whether DTensor ``t``'s local shard is held by this rank alone: sharded (``Shard``,
    strided shards included) on every dimension of a mesh that spans the whole default group.
    Anything replicated or partial on some mesh dimension, or a mesh over part of the world
    (another group may hold the same shard), is not."""
    try:
        if not all(p.is_shard() for p in t.placements):
            return False
        return int(t.device_mesh.size()) == default_world_size()
    except Exception:  # noqa: BLE001 - an unusual mesh or placement: not known to be unique
        return False


def _dtensor_around(t: Any, local: torch.Tensor) -> Any:
    """A new DTensor like ``t`` (its mesh, placements, global shape and stride) around the
    tensor ``local``: the staged object of a DTensor leaf that does not key itself."""
    return DTensor.from_local(
        local,
        t.device_mesh,
        t.placements,
        run_check=False,
        shape=t.shape,
        stride=t.stride(),
    )


def _clone_on_device(t: torch.Tensor) -> torch.Tensor:
    """A contiguous clone of ``t`` on its device, without conj/neg bits (a kernel queued on its
    current stream: ordered after what was queued there before the save call)."""
    return t.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)


def _direct_source(t: torch.Tensor) -> torch.Tensor:
    """What a synchronous save writes a tensor from: the tensor itself when it is plain and
    contiguous (no alias: with 100k tiny tensors one more object each is 40 MB), else a compact
    copy without the conj/neg bits."""
    if (
        type(t) is torch.Tensor
        and not t.requires_grad
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    ):
        return t
    return t.detach().resolve_conj().resolve_neg().contiguous()


def _version(t: torch.Tensor) -> int:
    """``t._version``, or 0 for an inference tensor, which has no version counter (reading it
    raises outside inference_mode). Such a tensor is never captured lazily on purpose: only a
    lazy copy left over when spilling failed relies on this value, and it cannot see an in-place
    change made under inference_mode (the storage checks still apply)."""
    return 0 if t.is_inference() else t._version


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def raise_if_modified(job: SaveJob, checkpoint: str) -> None:
    """Raises CaptureError if a lazily captured tensor changed before its capture was verified."""
    changed = job.modified_tensors()
    if changed:
        shown = ", ".join(changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        raise CaptureError(
            f"save to {checkpoint} failed: tensor {shown}{more} changed before its lazy copy into "
            "the host cache was confirmed; the save was not committed. Tensors captured lazily "
            "may change only in their optimizer's step() (which waits for the copy); call "
            "writer.wait_captured() before changing them elsewhere, or use capture='eager'."
        )


def wait_written(engine: Engine, job: SaveJob, checkpoint: str) -> None:
    """Waits until every copy of ``job`` landed, checks (unless a barrier did) that no lazily
    captured tensor changed before that (:func:`raise_if_modified`), drops the sources the
    engine no longer reads, then waits until the job's data is durable. Raises on any failure."""
    engine.wait_captured(job.engine_job)
    with job.lock:
        if not job.verified:
            raise_if_modified(job, checkpoint)
            job.verified = True
        job.release_sources()
    engine.wait_done(job.engine_job)
