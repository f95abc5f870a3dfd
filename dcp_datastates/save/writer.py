"""DataStatesWriter: the DCP StorageWriter (and AsyncStager) on the native host-cache engine.

Call order, per save, as torch.distributed.checkpoint drives it (who calls what on which rank):

==========================  ==============  ==================================================
call                        thread / ranks  what happens here
==========================  ==============  ==================================================
``stage(state_dict)``       caller, all     (async_save only) tensors registered with a new
                                            engine job, copies start; returns at once
``reset(checkpoint_id)``    save thread     a new per-thread save context for that path
``storage_meta()``          save thread     checkpoint id and a fresh save id
``set_up_storage_writer``   save thread     rank and role recorded; waits for earlier saves;
                                            one rank, local path: the staged tensors are
                                            placed in unnamed files and flush from here on
``prepare_local_plan``      all             refuses a save that failed or cannot fit
                                            (nothing of the old checkpoint removed yet)
``prepare_global_plan``     coordinator     path claimed; stale ``.metadata`` removed (one
                                            rank placed early: once its data is durable);
                                            in-progress marker written
``write_data(plan, pl.)``   all             the job is found (by staged-object identity) or
                                            created (dcp.save); items placed in files; the
                                            engine flushes as copies land; waits until durable;
                                            writes this rank's manifest (one process,
                                            async_save: returns once placed, finish waits)
``finish(metadata, res.)``  coordinator     ``.metadata`` written atomically: the commit
==========================  ==============  ==================================================

``dcp.async_save`` runs everything after ``stage`` in a background thread; ``stage`` returns the
staged dict (not a future), so planning and flushing start while copies are still running. This is
what lets a host cache smaller than one checkpoint work: flushes free space for later copies.

The barrier (:mod:`dcp_datastates.save.barrier`): a process-wide optimizer step pre-hook makes every
optimizer's ``step()`` wait until the saves in flight holding lazy copies of *its* tensors have
them in the host cache, and verifies that none was modified meanwhile; nothing to call.
``protect(optimizer)`` adds the explicit form (waits for every save, raises their errors).
``should_synchronize_after_execute`` is False: async_save does not wait for anything.

Threads: stage/protect/wait_captured run in the training thread; the DCP protocol calls run in
whatever thread runs the save (one per async_save); several saves may be in flight on one writer
(their protocol state lives in a thread-local context). Native copy/flush threads never call Python.

This module is the protocol: each call above delegates to one concept, in its own module, whose
docstring states its threads, lifetimes and failure contract:
:mod:`~dcp_datastates.save.parts` (the writer's options checked, its parts built),
:mod:`~dcp_datastates.save.controls` (the public API beyond DCP: ``protect``, ``wait_captured``,
``wait``, stats, ``close``; fork behaviour), :mod:`~dcp_datastates.save.barrier` (the automatic
step barrier), :mod:`~dcp_datastates.save.capture` (``stage``),
:mod:`~dcp_datastates.save.contexts` (per-thread save contexts and the path claim),
:mod:`~dcp_datastates.save.binding` and :mod:`~dcp_datastates.save.jobs` (staged jobs bound to
save threads and released, save order, errors once per channel, telemetry),
:mod:`~dcp_datastates.save.placement` (placing one save's items in the data files, writing them,
the manifest), :mod:`~dcp_datastates.save.finish` (write completion across ranks, failures,
the commit).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..config import CaptureMode, CheckpointFormat
from ..format.commit import CheckpointDir
from ..lifecycle.checkpoints import RetentionPolicy
from .binding import JobBinding
from .contexts import SaveContexts
from .controls import ProtectHandle, WriterControls
from .finish import WriteCompletion
from .incremental import IncrementalMode
from .jobs import StagedStateDict
from .parts import build_parts
from .placement import Placer
from .planner import share_equal_values
from .wire import compact_plan


class DataStatesWriter(WriterControls, WriteCompletion, JobBinding, SaveContexts, StorageWriter):
    """A DCP StorageWriter that snapshots state into a host cache and flushes it in the background.

    Create it once and reuse it for every save (the host cache is allocated once)::

        writer = DataStatesWriter("ckpt", host_cache_size=16)   # GiB
        dcp.async_save(state, storage_writer=writer, checkpoint_id=f"ckpt/step-{step}")
        ...
        dcp.load(state, checkpoint_id=f"ckpt/step-{step}")      # stock reader

    Args:
        path: default checkpoint directory (or fsspec URL) when a save passes no checkpoint_id.
        host_cache_size: GiB as a number (DataStates' ``host_cache_size``), or a string with units
            ("512MiB"). Checkpoints larger than the cache stream through it.
        chunk_size: largest single copy/write (default "64MiB").
        copy_threads, flush_threads: native worker threads.
        files_per_rank: data files per rank (default: flush_threads); 1 for non-local URLs.
        o_direct: write payloads with O_DIRECT where the file system allows it (default: on; no
            kernel copy, no page-cache pollution; file systems that refuse it get buffered I/O).
        early_flush: with ``async_save`` to a local directory, place the staged
            tensors (with several ranks: the DTensor shards no other rank holds) in (still
            unnamed) data files as soon as the save thread begins, so they flush while DCP
            plans (default: on; :mod:`dcp_datastates.save.early`).
        capture: "auto" (default), "owned", "lazy" or "eager"; see docs/configuration.md.
        checksums: CRC-32C per chunk, recorded in the manifest (see ``verify_checkpoint``).
        durable: fdatasync data files and fsync directories before the commit.
        prefault: touch the cache's pages up front (default: off; pages are faulted in by the
            first saves, and only as many as the saves in flight need).
        flush_nice: niceness (0..19) of flush threads (default 5) when they are not idle.
        idle_priority: run the engine's copy threads under SCHED_IDLE (default: on), so
            background copies only use CPU time training leaves idle.
        adapt_to_load: where a step barrier cannot raise the idle-priority copy threads to
            normal priority (the OS refuses: no CAP_SYS_NICE), copy a save's lazy state at the
            call instead (native threads at normal priority) when, since the previous save,
            other processes kept every core busy, so the copies would starve and land at the
            optimizer step (default: on; ``dcp_datastates.runtime.cpuload``). Off: the capture
            policy alone decides.
        flush_idle: run flush threads under SCHED_IDLE too (default: off). Flushes mostly wait
            for the disk (O_DIRECT writes, checksums taken during the copy), so at a normal
            priority they keep the disk busy while training runs; turn on where writes cost CPU
            (a file system that refuses O_DIRECT, fsspec targets) and training must not lose it.
        step_barrier: take part in the automatic step barrier (default: on). Off: no tensor is
            captured lazily unless its optimizer was passed to :meth:`protect`.
        pin_memory: page-lock the cache with the CUDA runtime at construction (default: when
            CUDA is available; otherwise it happens on the first save of a CUDA tensor).
        overwrite: replace an existing checkpoint at the save's path (default, as
            FileSystemWriter); False refuses the save on every rank (:class:`CheckpointExistsError`,
            a ``RuntimeError`` and ``FileExistsError`` saying "Checkpoint already exists" as
            FileSystemWriter does, naming the path and rank) when ``.metadata`` is already there.
        format: "torch" (default: torch.save archives, the stock ``dcp.load`` reads them) or
            "safetensors": each rank's tensors go into ``.safetensors`` files that
            ``safetensors.safe_open`` and torch's ``HuggingFaceStorageReader`` load; load the
            whole checkpoint (non-tensor values included) with ``dcp_datastates.load``
            (docs/format.md, "safetensors format").
        storage_options: fsspec options for non-local URLs (``s3://``: ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``, ``config_kwargs``...), passed to the file system of
            every save's path; the same dict loads it (``FsspecReader(url, **storage_options)``).
        upload_part_size: object stores (``s3://``): size of each multipart-upload part but the
            last (default "16MiB"; 5 MiB .. 5 GiB). A file smaller than one part is one PUT.
        upload_concurrency: object stores (``s3://``): parts of one file uploading at once
            (default 4). Memory beyond the host cache: ``(upload_concurrency + 1) *
            upload_part_size`` per save in flight.
        incremental: False (default), True or "verify": a tensor unchanged since this writer's
            previous save (same storage and version counter; "verify" also compares its
            CRC-32C) and owned by no optimizer (frozen weights) is not written again; the new
            ``.metadata`` points at the earlier checkpoint's bytes. Local directories only; see
            docs/configuration.md, "Incremental saves".
        rank_timeout: several ranks, ``async_save``: seconds the coordinator waits for the other
            ranks' data to be durable before it fails the save naming the ranks still missing
            (DCP's default collective timeout; :mod:`dcp_datastates.save.rank_commit`).
        rank_liveness: several ranks: seconds a rank whose data still flushes may go without a
            heartbeat before the coordinator names it dead and fails the save (a slow rank
            keeps beating and is waited for up to ``rank_timeout``).
        persist_to: multi-level flush: a second, persistent tier (a local path or an fsspec URL
            such as ``s3://bucket/run``). Saves go to ``path`` (the fast tier) as usual; each
            committed checkpoint is then copied in the background to the same relative name under
            ``persist_to``, ``.metadata`` last, and ``latest`` is updated on both tiers
            (:mod:`dcp_datastates.lifecycle.tiers`; docs/configuration.md, "Multi-level flush").
        persist_storage_options: fsspec options of ``persist_to``.
        persist_timeout: seconds one rank's copy of one checkpoint to the persistent tier may
            take (on the coordinator, its wait for the other ranks' files and the commit
            included); past it the copy fails, its upload aborted. ``close()`` waits for the
            copies within it in all (docs/configuration.md, "Multi-level flush").
        persist_retention: retention of the persistent tier, applied by rank 0 after each
            checkpoint committed there: an int (``keep_last``) or a ``RetentionPolicy``
            (``prune`` semantics); None (default) keeps everything.
        fast_retention: retention of the fast tier, applied by every rank to ``path`` after
            each promotion: an int or a ``RetentionPolicy``; a checkpoint is deleted only once
            it is on the persistent tier (never one in flight or whose copy failed); None
            (default) keeps everything. Both need ``persist_to``.
        persist_agent: True (default): the copies run in the fast root's *persistence agent*, a
            process of its own that outlives the trainer (started here unless one runs; a
            SIGKILL of the trainer loses nothing committed on the fast tier;
            :mod:`dcp_datastates.lifecycle.persist_agent`; docs/configuration.md, "Recovery");
            ``persist_storage_options`` must then be JSON-serializable. False: in a thread of
            this process (where subprocesses are not allowed; the copies die with it).
        replicas: node-local fast tiers on several nodes: after each committed ``async_save``,
            each node's files of the checkpoint are copied to the fast tier (the same root) of
            ``replicas`` other nodes, in a ring, in the background, over a gloo group of this
            job's ranks (created here: with replicas, every rank creates its writers in the same
            order, after ``init_process_group``). After a node is lost,
            :func:`~dcp_datastates.recover_from_replicas` rebuilds the newest checkpoint on
            every node of the restarted job. 0 (default): none
            (:mod:`dcp_datastates.lifecycle.replicas`; docs/configuration.md, "Recovery").
        replica_timeout: seconds a replication round waits for a peer; past it replication is
            off for the rest of the process (logged).
        _extensions: stream transforms applied to every item, as ``FileSystemWriter``'s keyword
            of the same name (experimental in DCP): e.g. ``[ZStandard()]``; the stock reader
            undoes them. Transformed items are written by the save thread from the host cache
            (:mod:`dcp_datastates.save.extensions`); the torch format only, not incremental.

    Lifetime: the engine (host cache and threads) is freed by :meth:`close`, or when the writer
    is garbage-collected. A forked child cannot use a parent's writer
    (:mod:`dcp_datastates.save.controls`).
    """

    _synchronize_after_execute: bool = False
    _placer: Placer  # SaveContexts declares less of it (contexts.ReplaceChecks)

    def __init__(
        self,
        path: str | os.PathLike[str] = "",
        host_cache_size: int | float | str = 4,
        *,
        chunk_size: int | str = "64MiB",
        copy_threads: int = 2,
        flush_threads: int = 2,
        files_per_rank: int | None = None,
        o_direct: bool = True,
        early_flush: bool = True,
        capture: CaptureMode = "auto",
        checksums: bool = True,
        durable: bool = True,
        prefault: bool = False,
        flush_nice: int = 5,
        idle_priority: bool = True,
        adapt_to_load: bool = True,
        flush_idle: bool = False,
        step_barrier: bool = True,
        pin_memory: bool | None = None,
        overwrite: bool = True,
        format: CheckpointFormat = "torch",  # noqa: A002 - the option's documented name
        storage_options: dict[str, Any] | None = None,
        upload_part_size: int | str = "16MiB",
        upload_concurrency: int = 4,
        rank_timeout: float = 1800.0,
        rank_liveness: float = 60.0,
        incremental: IncrementalMode = False,
        persist_to: str | os.PathLike[str] | None = None,
        persist_storage_options: dict[str, Any] | None = None,
        persist_timeout: float = 600.0,
        persist_retention: RetentionPolicy | int | None = None,
        fast_retention: RetentionPolicy | int | None = None,
        persist_agent: bool = True,
        replicas: int = 0,
        replica_timeout: float = 600.0,
        _extensions: Sequence[StreamTransformExtension] | None = None,
    ) -> None:
        parts = build_parts(
            path, host_cache_size, chunk_size=chunk_size, copy_threads=copy_threads,
            flush_threads=flush_threads, files_per_rank=files_per_rank, o_direct=o_direct,
            early_flush=early_flush, capture=capture, checksums=checksums, durable=durable,
            prefault=prefault, flush_nice=flush_nice, idle_priority=idle_priority,
            adapt_to_load=adapt_to_load, flush_idle=flush_idle, step_barrier=step_barrier,
            pin_memory=pin_memory, overwrite=overwrite, format=format,
            storage_options=storage_options, upload_part_size=upload_part_size,
            upload_concurrency=upload_concurrency, rank_timeout=rank_timeout,
            rank_liveness=rank_liveness, incremental=incremental,
            persist_to=persist_to, persist_storage_options=persist_storage_options,
            persist_timeout=persist_timeout, persist_retention=persist_retention,
            fast_retention=fast_retention, persist_agent=persist_agent, replicas=replicas,
            replica_timeout=replica_timeout, _extensions=_extensions,
        )
        super().__init__(parts)  # WriterControls: the parts become this writer's attributes

    # ------------------------------------------------------------------------------------------
    # AsyncStager protocol
    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Registers the state with a new save job and starts the copies; returns at once.

        Returns the staged dict that dcp.async_save hands to its background save.
        """
        self._check_open()
        self._refuse_process_executor()
        self._table.log_unseen_failures()
        staged, job = self._stager.stage(state_dict, self._optimizer_owners())
        self._table.add_staged(job)
        return StagedStateDict(staged, self, job)

    def synchronize_staging(self) -> None:
        """Same as :meth:`wait_captured` (for code written against the AsyncStager protocol)."""
        self.wait_captured()

    # ------------------------------------------------------------------------------------------
    # StorageWriter protocol
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._check_owner()
        self._begin_context(os.fspath(checkpoint_id) if checkpoint_id is not None else self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            CheckpointDir(os.fspath(checkpoint_id))
        except Exception:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        self._check_owner()
        ctx = self._context()
        if ctx.meta_taken:
            # DCP calls storage_meta() once per save, first: a save without reset() (no
            # checkpoint_id) must not inherit the previous save's context in this thread.
            ctx = self._begin_context(self.path)
        ctx.meta_taken = True
        return StorageMeta(checkpoint_id=ctx.path, save_id=ctx.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._check_open()
        ctx = self._context()
        # Adopt the staged job first, so that a refusal below still ends it (the binding
        # releases it when this save ends).
        ctx.job = self._table.job_of_thread(threading.get_ident())
        if ctx.job is not None:
            # The collector pause stage() began goes on through DCP's planning (capture.py).
            ctx.gc_pause = ctx.job.take_gc_pause()
        try:
            self._set_up(ctx, is_coordinator, *args, **kwargs)  # checks, turn, early placement
        except BaseException:
            ctx.end_gc_pause()
            raise
        # DCP plans next (an object or more per item): no collections until write_data.
        ctx.begin_gc_pause()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._check_before_claim()  # overwrite=False; a save that failed or cannot fit
        # DCP pickles it (collectives, .metadata): planner.py, wire.py
        return compact_plan(share_equal_values(plan))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        ctx = self._context()
        try:
            self._claim_and_prepare(ctx)
        except BaseException:
            ctx.end_gc_pause()
            raise
        # The global step rebuilt every item's index (MetadataIndex makes a new torch.Size of its
        # offset): shared again before DCP scatters the plans and gathers the write results.
        return [compact_plan(share_equal_values(p)) for p in plans]

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        ctx = self._context()
        if ctx.job is not None:
            # async_save: the planning is over, and this thread now waits for the flush while
            # training runs. dcp.save keeps the pause to the end of finish(): the plan's objects
            # all die with the save, so a collection in between would only scan them.
            ctx.end_gc_pause()
            # Results of earlier saves their caller dropped are freed here, not in the caller.
            self._released.collect()
        if not ctx.use_collectives and ctx.path_key is None:
            self._claim_and_prepare(ctx)  # no global plan step (single rank): prepare here
        job = self._bind_job(ctx, plan, planner)
        try:
            results, pending = self._placer.write_deferred(ctx, job, plan, planner)
        except BaseException as e:
            self._raise_write_failure(ctx, job, e)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(self._hand_over(ctx, job, plan, results, pending))  # finish.py
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._commit(self._context(), metadata, results)  # finish.py


__all__ = ["DataStatesWriter", "ProtectHandle"]
