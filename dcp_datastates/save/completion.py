"""Completion: the second half of a torch-format write, once every item of it is placed.

:meth:`Placer.write_deferred <dcp_datastates.save.placement.Placer.write_deferred>` returns a
save's WriteResults as soon as its items are placed, with a :class:`PendingWrite`. For the torch
format that write's ``complete()`` is :meth:`PlacedWrite.complete`, in steps: wait until every
item is captured (checking that no lazily captured tensor changed) and durable; give the data
files their names when the removal of the checkpoint being replaced was deferred until then, or
copy the early files that could not be linked (:mod:`dcp_datastates.save.early`); check the
incremental fallbacks; write the rank's manifest from the chunk records (:func:`chunk_map`,
:func:`manifest_items`); hand the incremental tracker its records.

Threads and lifetimes: a :class:`PlacedWrite` is made by the placement of one save (in its save
thread) and lives until its PendingWrite is completed or abandoned; it holds what the completion
needs and nothing the placement alone used. It raises on any failure, like the placement.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem

from ..config import WriterConfig
from ..engine import Engine
from ..format.commit import CheckpointDir, check_claim, manifest_name
from ..format.layout import TemplateCache, data_file_name
from ..format.manifest import ItemRecord, encode_manifest
from ..runtime.gcpause import gc_paused
from .capture import CapturedTensor, SaveJob, wait_written
from .contexts import SaveContext
from .early import EarlyPlacement
from .incremental import StageInfo, Tracker

# (item, its record, file, archive offset, payload offset): a tensor item this save writes
Placed = tuple[WriteItem, CapturedTensor, int, int, int]
# (item, file, offset, bytes, CRC-32C): a bytes item
PlacedBytes = tuple[WriteItem, int, int, int, int]
# (entry, chunk, file, file offset, bytes, CRC-32C): a chunk not written by the flush threads
ChunkRecord = tuple[int, int, int, int, int, int]


class PendingWrite:
    """The second half of :meth:`Placer.write_deferred`: the wait until one rank's data is
    captured and durable, and its manifest. ``complete()`` runs once, in the save thread;
    ``abandon()`` instead (any thread, idempotent) only releases what the save holds (its
    callbacks from :meth:`on_end`)."""

    def __init__(self, complete: Callable[[], None] | None) -> None:
        self._complete = complete
        self._on_end: list[Callable[[], None]] = []
        self._ended = False
        self._lock = threading.Lock()  # abandon() may come from a finalizer's thread

    @property
    def writes_manifest(self) -> bool:
        """Whether ``complete()`` has work to do: wait for the data, write the manifest (the
        safetensors format writes at placement and has neither)."""
        return self._complete is not None

    def on_end(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` once this write is completed (or failed completing) or abandoned."""
        self._on_end.append(fn)

    def complete(self) -> None:
        """Waits for the data and writes the manifest; raises on any failure."""
        with self._lock:
            complete, self._complete = self._complete, None
            if self._ended:
                raise RuntimeError("this write was completed or abandoned already")
        try:
            if complete is not None:
                complete()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Lets go of what the write holds, without completing it (idempotent)."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self._complete = None
            fns, self._on_end = self._on_end, []
        for fn in fns:
            fn()


@dataclass(kw_only=True)
class PlacedWrite:
    """One save's placed items and what its completion needs (see the module docstring)."""

    engine: Engine
    templates: TemplateCache
    config: WriterConfig
    incremental: Tracker | None  # incremental saves: the tracker this save's records go to
    ctx: SaveContext
    job: SaveJob
    d: CheckpointDir
    tag: str  # the tag in this save's data file names (Placer._file_tag)
    early: EarlyPlacement | None  # its tensors placed before DCP planned (save.early)
    # One rank, placed early: the checkpoint being replaced stays until this save's data is
    # durable; every file of this save is unnamed until then (complete() names them).
    deferred: bool
    copy_early: bool  # the early files could not be linked: copied after the flush
    infos: list[StageInfo] | None  # incremental saves: the stage info of every tensor
    placed: list[Placed] = field(default_factory=list)
    bytes_crcs: list[PlacedBytes] = field(default_factory=list)
    referenced: list[tuple[StageInfo, ItemRecord]] = field(default_factory=list)  # incremental
    ext_records: list[ChunkRecord] = field(default_factory=list)  # spilled, streamed

    def complete(self) -> None:
        """Waits until the data is captured and durable, names the files, writes the manifest;
        raises on any failure."""
        ctx = self.ctx
        wait_written(self.engine, self.job, f"{ctx.path} (rank {ctx.rank})")
        self._name_files()
        if self.infos:
            Tracker.check_fallbacks(self.infos, f"{ctx.path} (rank {ctx.rank})")
        self._write_manifest()

    def _name_files(self) -> None:
        """Gives the early files their names now if the removal was deferred, or copies the
        ones that could not be linked (nothing to do otherwise)."""
        early, d, ctx = self.early, self.d, self.ctx
        copy_now = self.copy_early
        if self.deferred:
            # This save's data is durable: only now does the checkpoint it replaces go
            # (.metadata first), and its files get their names.
            assert early is not None and ctx.path_key is not None
            check_claim(ctx.path_key, d)  # removed meanwhile: not recreated here
            d.prepare(self.config.durable)
            ctx.removal_deferred = False
            copy_now = not early.link_named(d)
        if copy_now:
            assert early is not None
            early.copy_into(d, self.config.durable)

    def _write_manifest(self) -> None:
        """Writes the rank's manifest; incremental saves then hand their records to the
        tracker (the next save compares with them)."""
        ctx, d = self.ctx, self.d
        with gc_paused():
            chunks = chunk_map(self.engine, self.job, self.ext_records)
        recs = manifest_items(
            self.templates, ctx.rank, self.tag, self.placed, self.bytes_crcs, chunks
        )
        records: list[ItemRecord] | None = None
        if self.incremental is not None:  # the records are kept for the tracker
            with gc_paused():
                records = list(recs) + [rec for _, rec in self.referenced]
        # Without references the records and their text are made while they are written.
        text = encode_manifest(ctx.rank, self.config.checksums, ctx.save_id,
                               records if records is not None else recs)
        d.write_atomic(manifest_name(ctx.rank), text, self.config.durable)
        if self.incremental is not None:
            assert records is not None
            if d.local:
                written = [
                    (cap.incr, rec)
                    for (_i, cap, *_r), rec in zip(self.placed, records, strict=False)
                    if cap.incr is not None
                ]
                self.incremental.record(d.path, ctx.rank, ctx.save_id, written, self.referenced)
            else:
                self.incremental.forget()


def chunk_map(engine: Engine, job: SaveJob, ext_records: list[ChunkRecord]) -> dict[int, Any]:
    """Entry -> its chunk record ``(file offset, bytes, crc)``, or a list of them when it has
    several (most entries have one: no list per entry)."""
    by_entry: dict[int, Any] = {}
    recs = engine.chunk_records(job.engine_job)
    flat = ((e, off, n, crc) for e, _c, _file, off, _eo, n, crc in recs)
    ext = ((e, off, n, crc) for e, _c, _f, off, n, crc in ext_records)
    for e, off, n, crc in itertools.chain(flat, ext):
        prev = by_entry.get(e)
        if prev is None:
            by_entry[e] = (off, n, crc)  # the file is implied by the item's placement
        elif isinstance(prev, tuple):
            by_entry[e] = [prev, (off, n, crc)]
        else:
            prev.append((off, n, crc))
    return by_entry


def manifest_items(
    templates: TemplateCache,
    rank: int,
    tag: str,
    placed: list[Placed],
    bytes_crcs: list[PlacedBytes],
    chunks: dict[int, Any],
) -> Iterator[ItemRecord]:
    """This rank's manifest records, one at a time: every placed item with its chunk records
    (offsets, CRCs), then the bytes items."""
    for item, cap, f, start, payload in placed:
        tmpl = templates.get(cap.dtype, cap.shape)
        got = chunks.get(cap.entry)
        yield ItemRecord(
            fqn=item.index.fqn,
            offset=list(item.index.offset) if item.index.offset is not None else None,
            file=data_file_name(rank, f, tag),
            archive_offset=start,
            archive_length=tmpl.total_bytes,
            payload_offset=payload,
            payload_bytes=cap.nbytes,
            dtype=str(cap.dtype).replace("torch.", ""),
            shape=list(cap.shape),
            chunks=[] if got is None else [got] if isinstance(got, tuple) else sorted(got),
        )
    for item, f, off, n, crc in bytes_crcs:
        yield ItemRecord(
            fqn=item.index.fqn,
            offset=None,
            file=data_file_name(rank, f, tag),
            archive_offset=off,
            archive_length=n,
            payload_offset=off,
            payload_bytes=n,
            dtype="bytes",
            shape=[],
            chunks=[(off, n, crc)],
        )


__all__ = ["PendingWrite", "PlacedWrite", "chunk_map", "manifest_items"]
