"""Placement: where one save's items go in this rank's data files, and writing them there.

:class:`Placer` turns a DCP ``SavePlan`` into placed items: each tensor item becomes a
``torch.save`` archive (template prefix + payload + suffix, :mod:`dcp_datastates.format.layout`) at
an aligned offset of one of the rank's data files, each bytes item a raw range. Local directories
are written by the engine's flush threads as copies land (``place``); spilled snapshots are copied
in by this thread; other fsspec URLs are streamed by one sequential consumer
(:mod:`dcp_datastates.storage.fsspec_sink`). Then it waits until everything is captured (checking
that no lazily captured tensor changed) and durable, and writes the rank's manifest.

Threads and lifetimes: a Placer belongs to one writer and lives as long as it; it holds that
writer's engine, template cache, stager and configuration, and no state of its own between saves.
``write`` runs in the save thread of one save; several saves may run it at once for different
jobs (the engine, the template cache and the stager are thread-safe). It raises on any failure;
the writer then fails the job, which aborts its engine job and returns its cache space.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .. import _core
from ..config import WriterConfig
from ..engine import Engine
from ..errors import CheckpointSaveError, reraisable
from ..format.commit import check_claim, is_owned_name, manifest_name
from ..format.layout import FileLayout, TemplateCache, data_file_name, save_tag
from ..format.manifest import ItemRecord, encode_manifest
from ..runtime.gcpause import gc_paused
from ..storage import room
from ..storage.fsspec_sink import SinkItem, write_sequential
from .barrier import default_world_size
from .capture import CapturedTensor, SaveJob, Stager, wait_written
from .contexts import SaveContext
from .early import EarlyPlacement, place_early
from .extensions import write_transformed
from .incremental import StageInfo, Tracker
from .safetensors_writer import write_safetensors

logger = logging.getLogger("dcp_datastates.save.writer")


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
        d = ctx.directory()
        d.ensure_exists()
        tag = self._file_tag(ctx)
        rank = ctx.rank
        eng = self._engine
        early: EarlyPlacement | None = job.early
        copy_early = False  # the early files could not be linked: copied after the flush
        # One rank, placed early: the checkpoint being replaced stays until this save's data is
        # durable; every file of this save is unnamed until then (complete() names them).
        deferred = early is not None and ctx.removal_deferred
        if early is not None:
            if early.rank != ctx.rank:  # set_up_storage_writer placed them for this context
                raise CheckpointSaveError(
                    f"save to {ctx.path}: its data was placed early for rank {early.rank}, "
                    f"not {ctx.rank}"
                )
            if not deferred:
                # Under the claim, the overwritten checkpoint's files are gone: name ours.
                copy_early = not early.matches(d) or not early.link(eng, job)
            layout = early.layout
            file_ids: dict[int, int] = dict(early.file_ids)
            early_at = early.placed
        else:
            nfiles = self.config.files_per_rank if d.local else 1
            layout = FileLayout(nfiles, _core.DIRECT_ALIGN if self.config.o_direct else 64,
                                direct_min=_core.DIRECT_MIN_BYTES)
            file_ids = {}
            early_at = {}
        staged_sd = getattr(planner, "state_dict", None)
        sink: dict[int, list[SinkItem]] = collections.defaultdict(list)
        placed: list[tuple[WriteItem, CapturedTensor, int, int, int]] = []
        results: list[WriteResult] = []
        bytes_crcs: list[tuple[WriteItem, int, int, int, int]] = []
        spilled: list[tuple[CapturedTensor, int, int, int, Any]] = []
        added_late = False
        referenced: list[tuple[StageInfo, ItemRecord]] = []  # incremental saves

        def fid(f: int) -> int:
            if f not in file_ids:
                name = d.join(data_file_name(rank, f, tag))
                if deferred:  # unnamed too, beside the early ones (named in complete())
                    assert early is not None
                    file_ids[f] = eng.open_file(job.engine_job, name, early.anon_dir)
                    early.adopt_fd(f, eng.dup_fd(job.engine_job, file_ids[f]))
                else:
                    file_ids[f] = eng.open_file(job.engine_job, name)
            return file_ids[f]

        # Tensor items in the order their bytes land: those copied at the save call first (they
        # are in the cache already), then the background copies in queue (entry) order; bytes
        # items last. A sequential consumer (the fsspec path) must never wait for a chunk that
        # cannot land because the cache is full of chunks it will only read later.
        caps: dict[int, CapturedTensor | None] = {}  # id(item) -> its record, looked up once

        def order(item: WriteItem) -> tuple[int, int, int]:
            if item.type == WriteItemType.BYTE_IO:
                return (2, 0, 0)
            cap = self.lookup(job, staged_sd, item)
            caps[id(item)] = cap
            if cap is None:
                return (1, 1, 0)
            return (0, 0 if cap.at_call else 1, cap.entry)

        with gc_paused():  # per-item bookkeeping only, no waits (runtime/gcpause.py)
            if job.adhoc:  # dcp.save: nothing was staged; register every tensor in one batch
                added_late = self.capture_late_many(job, plan.items, planner)
                # Registered in plan order, all direct: that is the order; bytes items last.
                keyed = job.by_staged_id
                tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
                caps.update((id(i), keyed.get(id(i))) for i in tensors)
                ordered = tensors + [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
            else:
                ordered = sorted(plan.items, key=order)
            for item in ordered:
                if item.type == WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item)
                    raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
                    f, off = layout.place_bytes(len(raw))
                    if d.local:
                        eng.write_bytes(job.engine_job, fid(f), off, raw, item.index.fqn)
                    else:
                        sink[f].append(SinkItem(offset=off, data=raw))
                    bytes_crcs.append((item, f, off, len(raw), _core.crc32c(raw)))
                    results.append(write_result(item, data_file_name(rank, f, tag), off, len(raw)))
                    continue
                cap = caps[id(item)]
                if cap is not None and cap.incr is not None and cap.incr.ref is not None:
                    assert self._incremental is not None
                    hit = self._incremental.reference(ctx.rank, item, cap.incr)
                    if hit is not None:  # unchanged: .metadata points at the owner's bytes
                        rel, off, length, rec = hit
                        referenced.append((cap.incr, rec))
                        results.append(write_result(item, rel, off, length))
                        continue
                    cap = self.write_instead(job, item, cap.incr)  # owner unusable: write it
                    added_late = True
                if cap is None:
                    cap = self.capture_late(job, item, planner)
                    added_late = True
                self.check_planned_shape(ctx, item, cap)
                tmpl = self._templates.get(cap.dtype, cap.shape)
                pre = early_at.get(cap.entry) if early_at else None
                if pre is not None:  # placed (and flushing) since set_up_storage_writer
                    f, start, payload = pre
                    placed.append((item, cap, f, start, payload))
                    results.append(
                        write_result(item, data_file_name(rank, f, tag), start, tmpl.total_bytes)
                    )
                    continue
                f, start, payload = layout.place_tensor(tmpl)
                if cap.spill is not None and d.local:
                    fid(f)  # the engine creates (and later syncs) the data file
                    spilled.append((cap, f, start, payload, tmpl))
                elif cap.spill is not None:
                    sink[f].append(
                        SinkItem(offset=start, entry=cap.entry, prefix=tmpl.prefix,
                                 suffix=tmpl.suffix, spill=cap.spill)
                    )
                elif d.local:
                    eng.place(job.engine_job, cap.entry, fid(f), payload, tmpl.prefix, tmpl.suffix)
                else:
                    eng.place_external(job.engine_job, cap.entry)
                    sink[f].append(
                        SinkItem(
                            offset=start,
                            entry=cap.entry,
                            prefix=tmpl.prefix,
                            suffix=tmpl.suffix,
                        )
                    )
                placed.append((item, cap, f, start, payload))
                results.append(
                    write_result(item, data_file_name(ctx.rank, f, tag), start, tmpl.total_bytes)
                )
        if added_late:
            eng.start_copies(job.engine_job)
        ext_records: list[tuple[int, int, int, int, int, int]] = []
        unlinked_fds = early.fds if (copy_early or deferred) and early is not None else {}
        for cap, f, start, payload, tmpl in spilled:  # before seal: finalize syncs them too
            # Not linked (copied later): write into the unnamed file, through its descriptor.
            unnamed = unlinked_fds.get(f)
            fd = unnamed if unnamed is not None else os.open(
                d.join(data_file_name(ctx.rank, f, tag)), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
            try:
                os.pwrite(fd, tmpl.prefix, start)
                assert cap.spill is not None
                cap.spill.copy_to(fd, payload)
                os.pwrite(fd, tmpl.suffix, payload + cap.nbytes)
            finally:
                if unnamed is None:  # an unnamed file's descriptor is the early placement's
                    os.close(fd)
            ext_records.append((cap.entry, 0, f, payload, cap.nbytes, cap.spill.crc))
        eng.seal(job.engine_job)

        for f, items in sink.items():
            for e, c, off, n, crc in write_sequential(
                eng, job.engine_job, d.fs, d.join(data_file_name(ctx.rank, f, tag)), items,
                part_bytes=self.config.part_bytes, concurrency=self.config.upload_concurrency,
            ):
                ext_records.append((e, c, f, off, n, crc))

        def complete() -> None:
            wait_written(eng, job, f"{ctx.path} (rank {ctx.rank})")
            copy_now = copy_early
            if deferred:
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
            if infos:
                Tracker.check_fallbacks(infos, f"{ctx.path} (rank {ctx.rank})")

            with gc_paused():
                chunks = self.chunk_map(job, ext_records)
            recs = self.manifest_items(ctx, placed, bytes_crcs, chunks)
            records: list[ItemRecord] | None = None
            if self._incremental is not None:  # the records are kept for the tracker
                with gc_paused():
                    records = list(recs) + [rec for _, rec in referenced]
            # Without references the records and their text are made while they are written.
            text = encode_manifest(ctx.rank, self.config.checksums, ctx.save_id,
                                   records if records is not None else recs)
            d.write_atomic(manifest_name(ctx.rank), text, self.config.durable)
            if self._incremental is not None:
                assert records is not None
                if d.local:
                    written = [
                        (cap.incr, rec)
                        for (_i, cap, *_r), rec in zip(placed, records, strict=False)
                        if cap.incr is not None
                    ]
                    self._incremental.record(d.path, ctx.rank, ctx.save_id, written, referenced)
                else:
                    self._incremental.forget()

        return results, PendingWrite(complete)

    @staticmethod
    def check_planned_shape(ctx: SaveContext, item: WriteItem, cap: CapturedTensor) -> None:
        """Raises if the planner's chunk of a tensor item differs from what was captured."""
        sizes = item.tensor_data.chunk.sizes  # type: ignore[union-attr]
        if sizes != cap.shape:  # torch.Size compares equal to the tuple of its ints
            raise CheckpointSaveError(
                f"save to {ctx.path}: '{item.index.fqn}' planned with shape {tuple(sizes)} but "
                f"captured with shape {cap.shape}"
            )

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

    def lookup(
        self, job: SaveJob, staged_sd: Any, item: WriteItem
    ) -> CapturedTensor | None:
        """The captured tensor of a tensor item: by the identity of its object in the staged
        state dict, else by the item (captured late); None if it was never captured."""
        if not isinstance(staged_sd, dict):
            return job.by_staged_id.get(id(item))
        obj = staged_sd.get(item.index.fqn)
        cap = job.lookup(obj) if obj is not None else None
        if cap is None:
            cap = job.by_staged_id.get(id(item))  # captured late, keyed by the item
        return cap

    def write_instead(self, job: SaveJob, item: WriteItem, info: StageInfo) -> CapturedTensor:
        """Incremental saves: a tensor referenced at the call whose owner cannot be used now is
        written from its source (checked unchanged afterwards, ``Tracker.check_fallbacks``)."""
        info.fallback = True
        cap = self._stager.stage_tensor(job, info.name, info.source)
        job.rekey(cap, item)
        cap.incr = info
        return cap

    def capture_late_many(
        self, job: SaveJob, items: list[WriteItem], planner: SavePlanner
    ) -> bool:
        """:meth:`capture_late` for every tensor item of a ``dcp.save`` (one native call);
        True if there was any."""
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
        return self._stager.stage_tensors(job, names, data, tensor_items) > 0

    def capture_late(self, job: SaveJob, item: WriteItem, planner: SavePlanner) -> CapturedTensor:
        """Captures an item the staged state does not know (dcp.save, or custom planners)."""
        if not job.adhoc:
            logger.warning(
                "'%s' was not captured at save time (custom planner?); it is copied now, when "
                "its data is written",
                item.index.fqn,
            )
        cap = self._stager.stage_tensor(job, item.index.fqn, _resolved_tensor(item, planner))
        job.rekey(cap, item)
        return cap

    def chunk_map(
        self, job: SaveJob, ext_records: list[tuple[int, int, int, int, int, int]]
    ) -> dict[int, Any]:
        """Entry -> its chunk record ``(file offset, bytes, crc)``, or a list of them when it has
        several (most entries have one: no list per entry)."""
        by_entry: dict[int, Any] = {}
        recs = self._engine.chunk_records(job.engine_job)
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
        self,
        ctx: SaveContext,
        placed: list[tuple[WriteItem, CapturedTensor, int, int, int]],
        bytes_crcs: list[tuple[WriteItem, int, int, int, int]],
        chunks: dict[int, Any],
    ) -> Iterator[ItemRecord]:
        """This rank's manifest records, one at a time: every placed item with its chunk records
        (offsets, CRCs), then the bytes items."""
        tag = self._file_tag(ctx)
        for item, cap, f, start, payload in placed:
            tmpl = self._templates.get(cap.dtype, cap.shape)
            got = chunks.get(cap.entry)
            yield ItemRecord(
                fqn=item.index.fqn,
                offset=list(item.index.offset) if item.index.offset is not None else None,
                file=data_file_name(ctx.rank, f, tag),
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
                file=data_file_name(ctx.rank, f, tag),
                archive_offset=off,
                archive_length=n,
                payload_offset=off,
                payload_bytes=n,
                dtype="bytes",
                shape=[],
                chunks=[(off, n, crc)],
            )


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


def write_result(item: WriteItem, relative_path: str, offset: int, length: int) -> WriteResult:
    """DCP's WriteResult of an item stored at [offset, offset+length) of relative_path."""
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=relative_path, offset=offset, length=length),
    )


__all__ = ["Placer", "write_result"]
