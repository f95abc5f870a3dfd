"""Incremental saves: tensors unchanged since the writer's last save are referenced, not written.

With ``DataStatesWriter(..., incremental=True)`` (or ``"verify"``) a save does not copy or write a
tensor that provably did not change since the previous save of the same writer on this rank (the
frozen base weights of a LoRA fine-tune). Its ``.metadata`` entry points at the bytes of the
checkpoint that *owns* them: ``_StorageInfo("../step-100/__0_1.distcp", offset, length)``, which
the stock ``FileSystemReader`` opens as ``<checkpoint>/../step-100/__0_1.distcp``. So the stock
``dcp.load`` loads an incremental checkpoint bit-exactly, with no plugin (docs/format.md,
"Incremental saves").

When a tensor is referenced (all must hold; otherwise it is written as usual):

* incremental saves are on for the writer, and the tensor is not owned by a known optimizer (its
  parameters and state change at every ``step()``: frozen weights and buffers are candidates);
* it is a contiguous CPU tensor (or, with ``incremental=True``, a contiguous CUDA tensor) without
  conjugate/negative bits, not empty, and not an inference tensor (made under
  ``torch.inference_mode()``: it has no version counter, so both modes write it in full at every
  save rather than trust an identity that cannot see its in-place changes);
* the previous save of this writer on this rank saved it under the same name, and since that
  save's call it has the *same storage* (the same live storage object, data pointer and size),
  the *same version counter value*, dtype, shape, strides and storage offset;
* with ``incremental="verify"``: the CRC-32C of its bytes now, taken at the save call, equals the
  CRC-32C recorded for the referenced bytes (this also catches writes the version counter does
  not see: ``p.data.add_()``, numpy/DLPack views, raw pointers);
* the owner checkpoint is committed (``.metadata`` present), its manifest for this rank is the one
  that save wrote (same save id), its ``.metadata`` was committed by that save (not rewritten by
  another writer since, :mod:`dcp_datastates.format.refcheck`), its data file is there and large
  enough, and it is a sibling directory of the new checkpoint (same parent); the target is a local
  directory. The manifest records the owner's save id with each reference (``ref_save_id``), so
  a reader can check the reference before trusting it.

What ``incremental=True`` does not detect: writes that bypass the version counter and keep the
storage (``.data`` writes, numpy or DLPack aliases, custom kernels or other processes writing
the memory), and a state dict whose tensors carry a *fresh* version counter each time (built
with ``p.data`` instead of ``p.detach()``/``state_dict()``: ``.data`` has its own counter). Use
``incremental="verify"`` where such writes may happen: it reads the tensor once at memory speed
(about 10 GB/s) instead of writing it at disk speed.

References point straight at the bytes' owner: a save referencing a checkpoint that itself
references an older one records the older one (no chains of hops). Each rank decides for its own
items; DCP merges the metadata as usual.

Every save of an incremental writer names its data files after the save
(``__<rank>_<i>.<tag>.distcp``, :func:`dcp_datastates.format.layout.save_tag`): no other save writes
those names, so another writer saving into an owner's directory (the stock ``FileSystemWriter``
rewrites ``__<rank>_<i>.distcp`` in place) does not change what a reference reads, whichever
reader follows it. Readers of this package check each reference before they trust it
(:mod:`dcp_datastates.format.refcheck`).

Retention and overwrite (:func:`referrers`, used by :mod:`dcp_datastates.lifecycle.checkpoints` and
:mod:`dcp_datastates.format.commit`): a checkpoint that another checkpoint of the same root
references (complete or partial, through its manifests) is never pruned, cleaned up or overwritten;
prune logs and keeps it, an overwrite is refused with :class:`CheckpointReferencedError` naming the
referrers. Races with a concurrent prune or overwrite are closed by the owner's marker lock: a
saving rank holds a *shared* ``flock`` on each owner's ``.datastates.incomplete`` from the moment
it validates the owner until its manifest (which records the references) is durable; prune and
overwrite hold the *exclusive* lock while they look for referrers and delete. An owner that
vanished before the saving rank locked it makes the tensor be written in full, from the source,
with its version counter and storage checked after the write (a change fails the save with
CaptureError, never a torn write).

Threads: :class:`Tracker` methods are called from the training thread (``stage``) and the save
threads (placement); its record table is guarded by a lock. Records hold storages weakly.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _core
from ..errors import CaptureError
from ..format.manifest import ItemRecord
from ..format.refcheck import OwnerChecks
from ..format.refs import lock_shared, relative_path, stat_key, unlock

logger = logging.getLogger(__name__)

IncrementalMode = bool | Literal["verify"]

_METADATA = ".metadata"


def parse_mode(value: object) -> str:
    """``False`` -> "off", ``True`` -> "trust", ``"verify"`` -> "verify"; else ValueError."""
    if value is False or value is None:
        return "off"
    if value is True:
        return "trust"
    if value == "verify":
        return "verify"
    raise ValueError(f"incremental must be False, True or 'verify', got {value!r}")


# ------------------------------------------------------------------------------------------------
# Where bytes live, and how a tensor is recognised as unchanged
@dataclass(frozen=True)
class Owner:
    """The checkpoint (and the rank's manifest in it) that holds some bytes."""

    dir: str  # realpath of the checkpoint directory
    rank: int  # the rank whose manifest records the bytes
    save_id: str  # that manifest's save id (a later save to the directory has another)

    @property
    def name(self) -> str:
        return os.path.basename(self.dir)


@dataclass(frozen=True)
class Location:
    """One tensor item's bytes in its owner checkpoint (a copy of the owner's manifest record)."""

    owner: Owner
    file: str
    archive_offset: int
    archive_length: int
    payload_offset: int
    payload_bytes: int
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[int, int, int], ...]
    index_offset: tuple[int, ...] | None  # the DCP chunk offset it was saved under

    @property
    def end(self) -> int:
        return self.archive_offset + self.archive_length


@dataclass
class Identity:
    """What must be equal for a tensor to count as unchanged (see the module docstring)."""

    storage: StorageWeakRef  # weak: a record never keeps a tensor alive
    cdata: int
    ptr: int
    nbytes: int
    version: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> Identity:
        st = t.untyped_storage()
        return cls(
            storage=StorageWeakRef(st),
            cdata=st._cdata,
            ptr=st.data_ptr(),
            nbytes=st.nbytes(),
            version=t._version,
            dtype=t.dtype,
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            storage_offset=int(t.storage_offset()),
            device=t.device,
        )

    def matches(self, now: Identity) -> bool:
        """True if ``now`` (taken at this save) is the same, unmodified tensor."""
        return (
            not self.storage.expired()  # alive, so its address was not reused by another storage
            and self.cdata == now.cdata
            and self.ptr == now.ptr
            and self.nbytes == now.nbytes
            and self.version == now.version
            and self.dtype == now.dtype
            and self.shape == now.shape
            and self.stride == now.stride
            and self.storage_offset == now.storage_offset
            and self.device == now.device
        )


@dataclass
class Record:
    identity: Identity
    location: Location


@dataclass
class StageInfo:
    """Attached to a captured tensor that incremental saves considered (``CapturedTensor.incr``).

    ``ref`` is set when the tensor is referenced instead of written; ``source`` is the tensor as
    the caller held it (kept until the job ends: a reference that cannot be used at placement is
    written from it).
    """

    name: str
    identity: Identity
    source: torch.Tensor
    ref: Location | None = None
    fallback: bool = False  # referenced at the call, written from the source at placement


# ------------------------------------------------------------------------------------------------
# Owner checks and locks (local directories only)
class _ManifestCache:
    """save_id of a manifest file, re-read only when the file changed (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, tuple[tuple[int, int, int, int], str | None]] = {}

    def save_id(self, path: str) -> str | None:
        key = stat_key(path)
        if key is None:
            return None
        with self._lock:
            hit = self._ids.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            with open(path, "rb") as f:
                raw = json.loads(f.read())
            sid = raw.get("save_id") if isinstance(raw, dict) else None
        except (OSError, ValueError):
            sid = None
        sid = sid if isinstance(sid, str) else None
        with self._lock:
            self._ids[path] = (key, sid)
        return sid


def owner_problem(
    owner: Owner,
    manifests: _ManifestCache,
    files: Iterable[Location] = (),
    checks: OwnerChecks | None = None,
) -> str | None:
    """Why ``owner`` cannot be referenced now (None: it can): committed, same save, files there;
    with ``checks``, also its ``.metadata`` committed by that save, not rewritten by another
    writer since (reads the owner's ``.metadata`` once while it is unchanged: the save thread's
    check in :meth:`Tracker.acquire`, not the save call's)."""
    if not os.path.isfile(os.path.join(owner.dir, _METADATA)):
        return f"{owner.dir} is not a committed checkpoint (no {_METADATA})"
    man = os.path.join(owner.dir, f"__datastates_manifest_{owner.rank}.json")
    if manifests.save_id(man) != owner.save_id:
        return f"{owner.dir} was overwritten or its manifest of rank {owner.rank} is gone"
    if checks is not None:
        why = checks.commit_problem(owner.dir)
        if why is not None:
            return why
    for loc in files:
        p = os.path.join(owner.dir, loc.file)
        key = stat_key(p)
        if key is None:
            return f"{p} is missing"
        if key[2] < loc.end:
            return f"{p} is truncated ({key[2]} bytes, an item ends at {loc.end})"
    return None


# ------------------------------------------------------------------------------------------------
class Tracker:
    """Per-writer incremental-save state: what each rank's previous save held, and where.

    ``check`` runs in the training thread at the save call; ``acquire``/``reference``/
    ``record``/``check_fallbacks`` in the save thread of one save (saves of one writer are
    serialized). The records are replaced, under a lock, by each save that finished on this rank.
    """

    def __init__(self, mode: str, checksums: bool) -> None:
        if mode == "verify" and not checksums:
            raise ValueError("incremental='verify' needs checksums=True (it compares CRC-32C)")
        self.mode = mode
        self._lock = threading.Lock()
        self._records: dict[str, Record] = {}
        self._manifests = _ManifestCache()
        self._owner_checks = OwnerChecks()
        self._warned_remote = False
        self.last_referenced_bytes = 0  # this rank's referenced payload bytes in the last save
        self.last_referenced_items = 0

    # -- at the save call ----------------------------------------------------------------------
    def check(
        self,
        name: str,
        local: torch.Tensor,
        owned: bool,
        simple: bool,
        valid: dict[Owner, bool],
    ) -> StageInfo | None:
        """Decides at the save call; None if the tensor is not a candidate at all.

        ``valid`` caches owner checks for one save call. The returned info has ``ref`` set if
        the tensor may be referenced instead of copied and written.
        """
        if owned or not simple or local.numel() == 0 or local.is_inference():
            return None  # (an inference tensor has no version counter: always written)
        dev = local.device.type
        if dev != "cpu" and not (dev == "cuda" and self.mode == "trust"):
            return None
        ident = Identity.of(local)
        info = StageInfo(name=name, identity=ident, source=local)
        with self._lock:
            rec = self._records.get(name)
        if rec is None or not rec.identity.matches(ident):
            return info
        loc = rec.location
        ok = valid.get(loc.owner)
        if ok is None:
            ok = valid[loc.owner] = owner_problem(loc.owner, self._manifests) is None
        if not ok:
            return info
        if self.mode == "verify" and not self._same_bytes(local, loc):
            return info
        info.ref = loc
        return info

    @staticmethod
    def _same_bytes(t: torch.Tensor, loc: Location) -> bool:
        """CRC-32C of the tensor's bytes now against the owner's recorded chunk CRCs."""
        if t.numel() * t.element_size() != loc.payload_bytes or not loc.chunks:
            return False
        base = t.data_ptr()
        for off, n, crc in loc.chunks:
            rel = off - loc.payload_offset
            if rel < 0 or rel + n > loc.payload_bytes:
                return False
            if _core.crc32c_address(base + rel, n) != crc:
                return False
        return True

    # -- at placement ----------------------------------------------------------------------------
    def acquire(self, target_dir: str, local: bool, infos: Iterable[StageInfo]) -> OwnerLocks:
        """Locks (shared) and re-validates the owners this save references; returns the locks.

        References that cannot be used (owner gone or not a sibling, non-local target) are
        turned into fallbacks (``info.fallback``): the caller writes them from their source.
        """
        locks = OwnerLocks()
        refs = [i for i in infos if i.ref is not None]
        if not refs:
            return locks
        if not local:
            if not self._warned_remote:
                self._warned_remote = True
                logger.warning(
                    "incremental saves need a local checkpoint directory (the stock reader must "
                    "open '../<owner>/<file>'); %s is written in full", target_dir
                )
            for i in refs:
                i.fallback = True
            return locks
        parent = os.path.dirname(os.path.realpath(target_dir))
        by_owner: dict[Owner, list[StageInfo]] = {}
        for i in refs:
            assert i.ref is not None
            by_owner.setdefault(i.ref.owner, []).append(i)
        try:
            for owner, items in by_owner.items():
                why = None
                if os.path.dirname(owner.dir) != parent:
                    why = "it is not in the same directory as the new checkpoint"
                elif owner.dir == os.path.realpath(target_dir):
                    why = "it is the checkpoint being overwritten"
                else:
                    fd = lock_shared(owner.dir)
                    if fd is None:
                        why = "it is gone, or being deleted or overwritten"
                    else:
                        locks.fds.append(fd)
                        why = owner_problem(
                            owner, self._manifests, [i.ref for i in items if i.ref is not None],
                            self._owner_checks,
                        )
                if why is not None:
                    logger.info(
                        "incremental save to %s: %d tensor(s) written in full instead of "
                        "referencing %s (%s)", target_dir, len(items), owner.dir, why,
                    )
                    for i in items:
                        i.fallback = True
        except BaseException:
            locks.release()
            raise
        return locks

    def reference(
        self, rank: int, item: Any, info: StageInfo
    ) -> tuple[str, int, int, ItemRecord] | None:
        """(relative path, offset, length, manifest record) of a referenced item; None when the
        item must be written after all (a fallback, or planned under another chunk offset)."""
        loc = info.ref
        if loc is None or info.fallback:
            return None
        offset = tuple(int(o) for o in item.index.offset) if item.index.offset is not None else None
        td = getattr(item, "tensor_data", None)
        sizes = tuple(int(x) for x in td.chunk.sizes) if td is not None else None
        if offset != loc.index_offset or sizes != loc.shape:
            info.fallback = True
            return None
        rec = ItemRecord(
            fqn=item.index.fqn,
            offset=list(offset) if offset is not None else None,
            file=loc.file,
            archive_offset=loc.archive_offset,
            archive_length=loc.archive_length,
            payload_offset=loc.payload_offset,
            payload_bytes=loc.payload_bytes,
            dtype=loc.dtype,
            shape=list(loc.shape),
            chunks=list(loc.chunks),
            ref=loc.owner.name,
            ref_save_id=loc.owner.save_id,
        )
        return relative_path(rec), loc.archive_offset, loc.archive_length, rec

    @staticmethod
    def check_fallbacks(infos: Iterable[StageInfo], checkpoint: str) -> None:
        """After a fallback write: raises CaptureError if a fallback tensor changed since the
        save call (it was written from where it is, after the call)."""
        changed = [
            i.name
            for i in infos
            if i.fallback and not i.identity.matches(Identity.of(i.source))
        ]
        if changed:
            raise CaptureError(
                f"save to {checkpoint} failed: tensor(s) {', '.join(changed[:5])} were to be "
                "referenced from an earlier checkpoint that vanished during the save, and changed "
                "before they could be written from their source; the save was not committed"
            )

    def record(
        self,
        target_dir: str,
        rank: int,
        save_id: str,
        written: list[tuple[StageInfo, ItemRecord]],
        referenced: list[tuple[StageInfo, ItemRecord]],
    ) -> None:
        """After this rank's manifest is durable: the records the next save compares with."""
        owner = Owner(dir=os.path.realpath(target_dir), rank=rank, save_id=save_id)
        new: dict[str, Record] = {}
        for info, it in written:
            new[info.name] = Record(info.identity, _location(owner, it))
        nbytes = 0
        for info, it in referenced:
            assert info.ref is not None
            new[info.name] = Record(info.identity, info.ref)
            nbytes += it.payload_bytes
        with self._lock:
            self._records = new
            self.last_referenced_bytes = nbytes
            self.last_referenced_items = len(referenced)

    def forget(self) -> None:
        """Drops every record (the next save writes everything)."""
        with self._lock:
            self._records = {}


def _location(owner: Owner, it: ItemRecord) -> Location:
    return Location(
        owner=owner,
        file=it.file,
        archive_offset=it.archive_offset,
        archive_length=it.archive_length,
        payload_offset=it.payload_offset,
        payload_bytes=it.payload_bytes,
        dtype=it.dtype,
        shape=tuple(it.shape),
        chunks=tuple(tuple(c) for c in it.chunks),  # type: ignore[misc]
        index_offset=tuple(it.offset) if it.offset is not None else None,
    )


@dataclass
class OwnerLocks:
    """Shared locks on the owners one save references; held until its manifest is durable."""

    fds: list[int] = field(default_factory=list)

    def release(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            unlock(fd)


__all__ = [
    "IncrementalMode",
    "StageInfo",
    "Tracker",
    "parse_mode",
]
