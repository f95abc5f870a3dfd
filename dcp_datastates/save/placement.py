"""Placement: where one save's items go in this rank's data files, and writing them there.

:class:`Placer` turns a DCP ``SavePlan`` into placed items: each tensor item becomes a
``torch.save`` archive (template prefix + payload + suffix, :mod:`dcp_datastates.format.layout`) at
an aligned offset of one of the rank's data files, each bytes item a raw range. Local directories
are written by the engine's flush threads as copies land (``place``); spilled snapshots are copied
in by this thread; other fsspec URLs are streamed by one sequential consumer
(:mod:`dcp_datastates.storage.fsspec_sink`). Then it waits until everything is captured (checking
that no lazily captured tensor changed) and durable, and writes the rank's manifest.

``Placer._write`` runs these as named steps over one ``_Placement`` (the state of that save's
placement): begin (the files, the layout), order the items, place the tensors, place the bytes
items, write the spilled snapshots and seal, stream the non-local files. The wait and the manifest
are the completion's (:mod:`dcp_datastates.save.completion`, which also holds
:class:`PendingWrite`); items the staged state does not know are captured at placement
(:mod:`dcp_datastates.save.late_capture`). The safetensors format and stream transforms have
writers of their own (:mod:`.safetensors_writer`, :mod:`.extensions`).

Threads and lifetimes: a Placer belongs to one writer and lives as long as it; it holds that
writer's engine, template cache, stager and configuration, and no state of its own between saves.
``write`` runs in the save thread of one save; several saves may run it at once for different
jobs (the engine, the template cache and the stager are thread-safe). It raises on any failure;
the writer then fails the job, which aborts its engine job and returns its cache space.
"""

from __future__ import annotations

import collections
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .. import _core
from ..config import WriterConfig
from ..engine import Engine
from ..errors import CheckpointSaveError, reraisable
from ..format.commit import is_owned_name
from ..format.layout import ArchiveTemplate, FileLayout, TemplateCache, data_file_name, save_tag
from ..format.manifest import ItemRecord
from ..runtime.gcpause import gc_paused
from ..storage import room
from ..storage.fsspec_sink import SinkItem, write_sequential
from . import late_capture
from .barrier import default_world_size
from .capture import CapturedTensor, SaveJob, Stager
from .completion import (
    ChunkRecord,
    PendingWrite,
    Placed,
    PlacedBytes,
    PlacedWrite,
    chunk_map,
    manifest_items,
)
from .contexts import SaveContext
from .early import EarlyPlacement, place_early
from .extensions import write_transformed
from .incremental import StageInfo, Tracker
from .safetensors_writer import write_safetensors


@dataclass(kw_only=True)
class _Placement(PlacedWrite):
    """One save's placement while :meth:`Placer._write` runs its steps: the
    :class:`~dcp_datastates.save.completion.PlacedWrite` its completion keeps, built up by the
    steps, and what only the placement uses (freed with it: :meth:`written`)."""

    layout: FileLayout  # the early placement's, continued, or a fresh one
    file_ids: dict[int, int]  # layout file -> engine file id (opened on first use)
    early_at: dict[int, tuple[int, int, int]]  # entry -> (file, start, payload), placed early
    caps: dict[int, CapturedTensor | None] = field(default_factory=dict)  # id(item) -> record
    sink: dict[int, list[SinkItem]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )  # non-local files: what the sequential consumer writes, by layout file
    spilled: list[tuple[CapturedTensor, int, int, int, ArchiveTemplate]] = field(
        default_factory=list
    )  # spilled snapshots in local files: (record, file, start, payload, template)
    results: list[WriteResult] = field(default_factory=list)
    added_late: bool = False  # tensors registered only now: their copies are still to start

    def written(self) -> PlacedWrite:
        """What the completion keeps of this placement (the same lists, not these extras)."""
        return PlacedWrite(**{f.name: getattr(self, f.name) for f in fields(PlacedWrite)})


class Placer:
    """Places and writes the items of one save job (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        templates: TemplateCache,
        stager: Stager,
        config: WriterConfig,
        incremental: Tracker | None = None,
        extensions: tuple[StreamTransformExtension, ...] = (),
    ) -> None:
        self._engine = engine
        self._templates = templates
        self._stager = stager
        self.config = config
        self._incremental = incremental  # incremental saves (dcp_datastates.save.incremental)
        self._extensions = extensions  # stream transforms (dcp_datastates.save.extensions)

    def _file_tag(self, ctx: SaveContext) -> str:
        """The tag in this save's data file names (``data_file_name``). An incremental writer's
        files carry the save's tag (``__<rank>_<i>.<tag>.distcp``): later checkpoints reference
        them, and no other save (the stock ``FileSystemWriter`` saving to the same directory
        rewrites ``__<rank>_<i>.distcp`` in place) writes that name. Others: none."""
        return save_tag(ctx.save_id) if self._incremental is not None else ""

    def early_applies(self, job: SaveJob) -> bool:
        """Whether :meth:`place_early` would place ``job`` (the conditions of
        :mod:`dcp_datastates.save.early`, apart from the file system's)."""
        return not (
            not self.config.early_flush
            or job.adhoc
            or job.error is not None
            or job.no_room is not None  # tried already: no room beside the old checkpoint
            or self.config.format != "torch"
            or self._incremental is not None
            or bool(self._extensions)
        )

    def place_early(self, ctx: SaveContext, job: SaveJob) -> None:
        """Places a staged job's tensors before DCP plans, so they flush during the planning
        (:mod:`dcp_datastates.save.early`: local directories, the torch format, not incremental;
        with several ranks only the shards no other rank holds). Runs in the save thread, before any
        collective; never raises for a file system that cannot do it (the job is then placed in
        :meth:`write`)."""
        if not self.early_applies(job):
            return
        try:
            job.early = place_early(
                self._engine, self._templates, self.config, job, ctx.directory(), ctx.rank,
                rank_unique_only=default_world_size() > 1,
            )
        except CheckpointSaveError:
            if isinstance(job.error, CheckpointSaveError):
                # Failed elsewhere meanwhile (a barrier found a changed tensor, an abort): that
                # is the cause; what placing hit afterwards is only a consequence.
                raise reraisable(job.error) from None
            raise

    def defers_removal(self, ctx: SaveContext, job: SaveJob | None) -> bool:
        """Whether the save keeps the checkpoint it replaces until its own data is durable (one
        rank, its tensors placed early in unnamed files for this directory): then any failure
        before that, a crash included, leaves the old checkpoint whole. With several ranks the
        coordinator removes it at the claim, before the others name their files."""
        return (
            job is not None
            and job.early is not None
            and default_world_size() == 1
            and job.early.matches(ctx.directory())
        )

    def check_replace(self, ctx: SaveContext, job: SaveJob | None) -> None:
        """Runs before anything of the checkpoint at the save's path is removed (on every rank
        before the plans are gathered, and by the coordinator under the claim): raises if the
        save has failed already (its early flush hit ``ENOSPC``, ``EIO``...) or cannot fit even
        once the old checkpoint's files are gone
        (:func:`dcp_datastates.storage.room.check_replace`), so that the old checkpoint is left as
        it was. Removes nothing."""
        if job is None:
            return
        if isinstance(job.error, CheckpointSaveError):
            raise reraisable(job.error)
        if not job.finished:  # its engine job is still there (its early flush may have failed)
            try:
                st = self._engine.stats(job.engine_job)
            except RuntimeError:  # forgotten meanwhile: the job's end reports its outcome
                st = {}
            if st.get("failed"):
                raise CheckpointSaveError(
                    f"save to {ctx.path} failed on rank {ctx.rank} before it replaced anything: "
                    f"{st.get('error')}"
                )
        d = ctx.directory()
        if not d.local:
            return
        if job.no_room is not None:
            room.check_replace(d.path, job.no_room, is_owned_name)
        elif (
            job.early is None
            and not job.adhoc
            and self._incremental is None  # (referenced bytes are not written again)
            and default_world_size() == 1  # (with several ranks, DCP decides who writes what)
        ):
            self._check_room_late(d.path, job)

    def _check_room_late(self, directory: str, job: SaveJob) -> None:
        """:meth:`check_replace` for a staged job placed in ``write_data`` (after the removal),
        from lower bounds of what its files need: every tensor's bytes, the largest tensor (or
        an equal share of all, ``files_per_rank``) in one file."""
        sizes = [t.nbytes for t in job.tensors]
        if not sizes:
            return
        needed = sum(sizes)
        biggest = max(max(sizes), needed // max(1, self.config.files_per_rank))
        limit = room.file_size_limit()
        free = room.free_bytes(directory)
        if limit is not None and biggest > limit:
            why = OSError(errno.EFBIG, f"a data file needs at least {biggest} bytes, over this "
                          f"process's file size limit (RLIMIT_FSIZE) of {limit}", directory)
        elif free is not None and free < needed:
            why = OSError(errno.ENOSPC, f"{needed} bytes to write, {free} free", directory)
        else:
            return
        room.check_replace(directory, room.NoRoom(why, needed), is_owned_name)

    def write(
        self, ctx: SaveContext, job: SaveJob, plan: SavePlan, planner: SavePlanner
    ) -> list[WriteResult]:
        """Places every item of ``plan`` in this rank's data files and writes them; returns
        their WriteResults once the data is durable and the rank's manifest is written.

        Runs in the save thread. Raises on any failure (the caller fails the job); the job is
        finished by the caller.
        """
        results, pending = self.write_deferred(ctx, job, plan, planner)
        pending.complete()
        return results

    def write_deferred(
        self, ctx: SaveContext, job: SaveJob, plan: SavePlan, planner: SavePlanner
    ) -> tuple[list[WriteResult], PendingWrite]:
        """:meth:`write` in two steps: places every item and returns their WriteResults (final:
        where each item's bytes will be) while the data is still being copied and flushed, with
        the :class:`PendingWrite` whose ``complete()`` waits until it is captured (checking
        that no lazily captured tensor changed) and durable and writes the rank's manifest.

        The caller must call exactly one of ``complete()`` (in the save thread) or ``abandon()``
        (which only lets go of what the save holds, from any thread: the writer fails the job).
        """
        if self._extensions:  # written through the stream transforms (their own module)
            results, complete = write_transformed(self, ctx, job, plan, planner, self._extensions)
            return results, PendingWrite(complete)
        if self.config.format == "safetensors":  # the safetensors layout (its own module)
            return write_safetensors(self, ctx, job, plan, planner), PendingWrite(None)
        if self._incremental is None:
            return self._write(ctx, job, plan, planner, None)
        # Incremental saves: the owners of referenced bytes stay locked (shared) and validated
        # until this rank's manifest, which names them, is durable (dcp_datastates.format.refs).
        d = ctx.directory()
        infos = [t.incr for t in job.tensors if t.incr is not None]
        locks = self._incremental.acquire(d.path, d.local, infos)
        try:
            results, pending = self._write(ctx, job, plan, planner, infos)
        except BaseException:
            locks.release()
            raise
        pending.on_end(locks.release)
        return results, pending

    def _write(
        self,
        ctx: SaveContext,
        job: SaveJob,
        plan: SavePlan,
        planner: SavePlanner,
        infos: list[StageInfo] | None,
    ) -> tuple[list[WriteResult], PendingWrite]:
        """:meth:`write_deferred` of the torch format, step by step: begin the placement (its
        files, its layout), order the items, place the tensors, then the bytes items, start
        the copies of tensors registered only now, write the spilled snapshots and seal the
        engine job, stream the non-local files; the PendingWrite completes what was placed
        (:meth:`PlacedWrite.complete <dcp_datastates.save.completion.PlacedWrite.complete>`)."""
        p = self._begin(ctx, job, infos)
        with gc_paused():  # per-item bookkeeping only, no waits (runtime/gcpause.py)
            tensors, byte_items = self._order(p, plan, planner)
            self._place_tensors(p, tensors, planner)
            self._place_bytes(p, byte_items, planner)
        if p.added_late:
            self._engine.start_copies(job.engine_job)
        self._write_spilled(p)  # before seal: finalize syncs them too
        self._engine.seal(job.engine_job)
        self._stream(p)
        return p.results, PendingWrite(p.written().complete)

    def _begin(self, ctx: SaveContext, job: SaveJob, infos: list[StageInfo] | None) -> _Placement:
        """The placement of one save, before any item: its directory (created), and the early
        placement's layout and files continued (named now, under the claim, unless the removal
        of the checkpoint being replaced is deferred), or a fresh layout."""
        d = ctx.directory()
        d.ensure_exists()
        early: EarlyPlacement | None = job.early
        copy_early = False
        deferred = early is not None and ctx.removal_deferred
        if early is not None:
            if early.rank != ctx.rank:  # set_up_storage_writer placed them for this context
                raise CheckpointSaveError(
                    f"save to {ctx.path}: its data was placed early for rank {early.rank}, "
                    f"not {ctx.rank}"
                )
            if not deferred:
                # Under the claim, the overwritten checkpoint's files are gone: name ours.
                copy_early = not early.matches(d) or not early.link(self._engine, job)
            layout = early.layout
            file_ids: dict[int, int] = dict(early.file_ids)
            early_at = early.placed
        else:
            nfiles = self.config.files_per_rank if d.local else 1
            layout = FileLayout(nfiles, _core.DIRECT_ALIGN if self.config.o_direct else 64,
                                direct_min=_core.DIRECT_MIN_BYTES)
            file_ids = {}
            early_at = {}
        return _Placement(
            engine=self._engine, templates=self._templates, config=self.config,
            incremental=self._incremental, ctx=ctx, job=job, d=d, tag=self._file_tag(ctx),
            early=early, deferred=deferred, copy_early=copy_early, infos=infos,
            layout=layout, file_ids=file_ids, early_at=early_at,
        )

    def _order(
        self, p: _Placement, plan: SavePlan, planner: SavePlanner
    ) -> tuple[list[WriteItem], list[WriteItem]]:
        """The tensor items in the order they are placed, each one's captured record looked up
        (or, for ``dcp.save``, registered now) into ``p.caps``; and the bytes items, placed
        after them (in plan order)."""
        # Tensor items in the order their bytes land: those copied at the save call first (they
        # are in the cache already), then the background copies in queue (entry) order; bytes
        # items last. A sequential consumer (the fsspec path) must never wait for a chunk that
        # cannot land because the cache is full of chunks it will only read later.
        job, caps = p.job, p.caps
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        byte_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        if job.adhoc:  # dcp.save: nothing was staged; register every tensor in one batch
            p.added_late = self.capture_late_many(job, plan.items, planner)
            # Registered in plan order, all direct: that is the order.
            keyed = job.by_staged_id
            caps.update((id(i), keyed.get(id(i))) for i in tensors)
            return tensors, byte_items
        staged_sd = getattr(planner, "state_dict", None)

        def order(item: WriteItem) -> tuple[int, int, int]:
            cap = self.lookup(job, staged_sd, item)
            caps[id(item)] = cap  # looked up once
            if cap is None:
                return (1, 1, 0)
            return (0, 0 if cap.at_call else 1, cap.entry)

        return sorted(tensors, key=order), byte_items

    def _place_tensors(
        self, p: _Placement, items: list[WriteItem], planner: SavePlanner
    ) -> None:
        """Places the tensor items, in order: a referenced one (incremental saves) stays where
        it is (:meth:`_reference`); the others, captured now if the save had not, go where the
        early placement put them, else at the next place of the layout, and are handed to what
        writes them (:meth:`_send`)."""
        caps, early_at, layout, rank, tag = p.caps, p.early_at, p.layout, p.ctx.rank, p.tag
        for item in items:
            cap = caps[id(item)]
            if cap is not None and cap.incr is not None and cap.incr.ref is not None:
                cap = self._reference(p, item, cap.incr)
                if cap is None:  # unchanged: .metadata points at the owner's bytes
                    continue
            if cap is None:
                cap = self.capture_late(p.job, item, planner)
                p.added_late = True
            self.check_planned_shape(p.ctx, item, cap)
            tmpl = self._templates.get(cap.dtype, cap.shape)
            pre = early_at.get(cap.entry) if early_at else None
            if pre is not None:  # placed (and flushing) since set_up_storage_writer
                f, start, payload = pre
            else:
                f, start, payload = layout.place_tensor(tmpl)
                self._send(p, cap, tmpl, f, start, payload)
            p.placed.append((item, cap, f, start, payload))
            p.results.append(
                write_result(item, data_file_name(rank, f, tag), start, tmpl.total_bytes)
            )

    def _reference(
        self, p: _Placement, item: WriteItem, info: StageInfo
    ) -> CapturedTensor | None:
        """Incremental saves, a tensor referenced at the call: None if it is referenced (its
        result points at the owner's bytes), else its record to write it from its source (the
        owner cannot be used now)."""
        assert self._incremental is not None
        hit = self._incremental.reference(p.ctx.rank, item, info)
        if hit is not None:  # unchanged: .metadata points at the owner's bytes
            rel, off, length, rec = hit
            p.referenced.append((info, rec))
            p.results.append(write_result(item, rel, off, length))
            return None
        cap = self.write_instead(p.job, item, info)  # owner unusable: write it
        p.added_late = True
        return cap

    def _send(
        self, p: _Placement, cap: CapturedTensor, tmpl: ArchiveTemplate, f: int, start: int,
        payload: int,
    ) -> None:
        """Hands a tensor placed in file ``f`` to what writes it: the engine's flush threads
        (local files), this thread after the placement (a spilled snapshot in a local file,
        :meth:`_write_spilled`), or the sequential consumer of a non-local file
        (:meth:`_stream`)."""
        eng, job = self._engine, p.job
        if cap.spill is not None and p.d.local:
            self._file_id(p, f)  # the engine creates (and later syncs) the data file
            p.spilled.append((cap, f, start, payload, tmpl))
        elif cap.spill is not None:
            p.sink[f].append(
                SinkItem(offset=start, entry=cap.entry, prefix=tmpl.prefix,
                         suffix=tmpl.suffix, spill=cap.spill)
            )
        elif p.d.local:
            eng.place(job.engine_job, cap.entry, self._file_id(p, f), payload, tmpl.prefix,
                      tmpl.suffix)
        else:
            eng.place_external(job.engine_job, cap.entry)
            p.sink[f].append(
                SinkItem(
                    offset=start,
                    entry=cap.entry,
                    prefix=tmpl.prefix,
                    suffix=tmpl.suffix,
                )
            )

    def _place_bytes(
        self, p: _Placement, items: list[WriteItem], planner: SavePlanner
    ) -> None:
        """Places the bytes items after the tensors and writes them (the engine, for a local
        file; the sequential consumer otherwise), each with its CRC-32C for the manifest."""
        for item in items:
            data = planner.resolve_data(item)
            raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
            f, off = p.layout.place_bytes(len(raw))
            if p.d.local:
                self._engine.write_bytes(
                    p.job.engine_job, self._file_id(p, f), off, raw, item.index.fqn
                )
            else:
                p.sink[f].append(SinkItem(offset=off, data=raw))
            p.bytes_crcs.append((item, f, off, len(raw), _core.crc32c(raw)))
            p.results.append(
                write_result(item, data_file_name(p.ctx.rank, f, p.tag), off, len(raw))
            )

    def _file_id(self, p: _Placement, f: int) -> int:
        """The engine's id of data file ``f`` of this save, opened on first use."""
        if f not in p.file_ids:
            eng, job = self._engine, p.job
            name = p.d.join(data_file_name(p.ctx.rank, f, p.tag))
            if p.deferred:  # unnamed too, beside the early ones (named in complete())
                assert p.early is not None
                p.file_ids[f] = eng.open_file(job.engine_job, name, p.early.anon_dir)
                p.early.adopt_fd(f, eng.dup_fd(job.engine_job, p.file_ids[f]))
            else:
                p.file_ids[f] = eng.open_file(job.engine_job, name)
        return p.file_ids[f]

    def _write_spilled(self, p: _Placement) -> None:
        """Writes the spilled snapshots placed in local files (archive prefix, payload from the
        spill file, suffix), recording their chunks."""
        early = p.early
        unlinked_fds = early.fds if (p.copy_early or p.deferred) and early is not None else {}
        for cap, f, start, payload, tmpl in p.spilled:
            # Not linked (copied later): write into the unnamed file, through its descriptor.
            unnamed = unlinked_fds.get(f)
            fd = unnamed if unnamed is not None else os.open(
                p.d.join(data_file_name(p.ctx.rank, f, p.tag)),
                os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
            )
            try:
                os.pwrite(fd, tmpl.prefix, start)
                assert cap.spill is not None
                cap.spill.copy_to(fd, payload)
                os.pwrite(fd, tmpl.suffix, payload + cap.nbytes)
            finally:
                if unnamed is None:  # an unnamed file's descriptor is the early placement's
                    os.close(fd)
            p.ext_records.append((cap.entry, 0, f, payload, cap.nbytes, cap.spill.crc))

    def _stream(self, p: _Placement) -> None:
        """Writes each non-local data file front to back through one sequential consumer
        (:mod:`dcp_datastates.storage.fsspec_sink`), recording its chunks."""
        for f, items in p.sink.items():
            for e, c, off, n, crc in write_sequential(
                self._engine, p.job.engine_job, p.d.fs,
                p.d.join(data_file_name(p.ctx.rank, f, p.tag)), items,
                part_bytes=self.config.part_bytes, concurrency=self.config.upload_concurrency,
            ):
                p.ext_records.append((e, c, f, off, n, crc))

    # The captured records of planned items, captured at placement if need be (late_capture).
    check_planned_shape = staticmethod(late_capture.check_planned_shape)
    lookup = staticmethod(late_capture.lookup)

    def captured_item(
        self, ctx: SaveContext, job: SaveJob, staged_sd: Any, item: WriteItem,
        planner: SavePlanner,
    ) -> tuple[CapturedTensor, bool]:
        """The captured tensor of a planned tensor item, its planned shape checked, and whether
        it was registered only now (the save had not staged it: the caller starts its copy)."""
        cap = self.lookup(job, staged_sd, item)
        late = cap is None
        if cap is None:
            cap = self.capture_late(job, item, planner)
        self.check_planned_shape(ctx, item, cap)
        return cap, late

    def write_instead(self, job: SaveJob, item: WriteItem, info: StageInfo) -> CapturedTensor:
        """Writes a referenced tensor from its source after all (:mod:`.late_capture`)."""
        return late_capture.write_instead(self._stager, job, item, info)

    def capture_late_many(
        self, job: SaveJob, items: list[WriteItem], planner: SavePlanner
    ) -> bool:
        """Captures every tensor item of a ``dcp.save`` (:mod:`.late_capture`)."""
        return late_capture.capture_late_many(self._stager, job, items, planner)

    def capture_late(self, job: SaveJob, item: WriteItem, planner: SavePlanner) -> CapturedTensor:
        """Captures an item the staged state does not know (:mod:`.late_capture`)."""
        return late_capture.capture_late(self._stager, job, item, planner)

    def chunk_map(self, job: SaveJob, ext_records: list[ChunkRecord]) -> dict[int, Any]:
        """Entry -> its chunk record ``(file offset, bytes, crc)``, or a list of them
        (:func:`dcp_datastates.save.completion.chunk_map`)."""
        return chunk_map(self._engine, job, ext_records)

    def manifest_items(
        self,
        ctx: SaveContext,
        placed: list[Placed],
        bytes_crcs: list[PlacedBytes],
        chunks: dict[int, Any],
    ) -> Iterator[ItemRecord]:
        """This rank's manifest records, one at a time
        (:func:`dcp_datastates.save.completion.manifest_items`)."""
        return manifest_items(
            self._templates, ctx.rank, self._file_tag(ctx), placed, bytes_crcs, chunks
        )


def write_result(item: WriteItem, relative_path: str, offset: int, length: int) -> WriteResult:
    """DCP's WriteResult of an item stored at [offset, offset+length) of relative_path."""
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=relative_path, offset=offset, length=length),
    )


__all__ = ["PendingWrite", "Placer", "write_result"]
