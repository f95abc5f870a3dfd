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
Failures: a failed save raises CheckpointSaveError from write_data, or from finish where one
process's async_save handed its results over before its data was durable (hence on the save's
future as DCP's CheckpointException); nothing is committed for it and its cache space is returned.
Each error is reported once per channel: always on the save's future, then once at the next
explicit barrier (``wait_captured``, a ``protect()`` hook, ``synchronize_staging``) or ``wait()``
unless the caller already read it from the future (``result()``/``exception()``) or from
``dcp.save``. The automatic step barrier never raises (it logs), the next save logs it, ``close()``
logs it. A later save is never refused because an earlier one failed.

Lifecycle of a staged job (it must never be left behind, or later saves, ``wait`` and ``close``
would wait on it forever):

* ``stage`` creates it and returns a :class:`~dcp_datastates.save.jobs.StagedStateDict`;
* the first iteration of that dict in another thread (DCP's save thread) *binds* the job to that
  thread; the save's ``concurrent.futures.Future`` is found then (the executor's work item);
* the save's protocol is over when that future completes, or when the bound thread exits, or when
  another save binds the same thread; then the job is released: failed if its data was never
  written (any failure before ``write_data``: planner set-up, bad arguments, refusals, on any
  rank), and dropped;
* a staged dict collected without ever being bound (no save ran it) releases its job too.

Fork: a writer belongs to the process that created it. In a forked child (DataLoader workers)
finalizers do nothing, ``close()`` only marks it closed (nothing is joined or freed), and every
other use raises RuntimeError naming the owner process. ``AsyncCheckpointerType.PROCESS`` is
refused by ``stage`` (the host cache and threads cannot move to another process).

This module is the protocol: each call above delegates to one concept, in its own module:
:mod:`dcp_datastates.save.contexts` (per-thread save contexts and the path claim),
:mod:`dcp_datastates.save.jobs` (binding staged jobs to save threads, save order, job completion and
failure, errors once per channel, telemetry), :mod:`dcp_datastates.save.placement` (placing one
save's items in the data files, writing them, the manifest), :mod:`dcp_datastates.save.capture`
(``stage``).
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..config import CaptureMode, CheckpointFormat, WriterConfig, parse_size
from ..engine import Engine
from ..errors import CheckpointExistsError, CheckpointSaveError, reraisable
from ..format.commit import METADATA_FILE, CheckpointDir
from ..format.layout import TemplateCache
from ..lifecycle.checkpoints import RetentionPolicy
from ..lifecycle.tiers import Promoter, attach_persist_stats
from ..runtime.cpuload import CpuMeter
from ..runtime.dcplog import skip_unheard_debug_events
from ..runtime.gcpause import gc_paused
from . import barrier, forksafe, rank_commit
from .barrier import default_world_size
from .capture import SaveJob, Stager
from .contexts import ContextHolder, SaveContext, claim_path, end_context_cb, release_claim
from .extensions import check_extensions
from .incremental import IncrementalMode, Tracker, parse_mode
from .jobs import (
    Binding,
    JobTable,
    StagedStateDict,
    async_save_uses_process_executor,
    current_executor_future,
    describe_cause,
    release_cb,
    track_future,
)
from .placement import PendingWrite, Placer
from .planner import share_equal_values, share_metadata_values
from .release import DeferredRelease
from .wire import CompactWriteResults, compact_plan

logger = logging.getLogger(__name__)

try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    CURRENT_DCP_VERSION = "1.0.0"  # type: ignore[misc]


def _close_engine(engine: Engine, pid: int) -> None:
    """Finalizer of a DataStatesWriter: stops its threads and frees its cache (leaks in a child)."""
    if os.getpid() == pid:
        engine.close()


class ProtectHandle:
    """Returned by :meth:`DataStatesWriter.protect`; ``remove()`` undoes it."""

    def __init__(self, writer: DataStatesWriter, optimizer: torch.optim.Optimizer) -> None:
        self._writer = weakref.ref(writer)
        self._opt = weakref.ref(optimizer)
        self._hook = optimizer.register_step_pre_hook(self._pre_step)

    def _pre_step(self, *_: Any) -> None:
        w = self._writer()
        if w is not None and not w.closed and w._pid == os.getpid():
            w.wait_captured()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._opt()

    def remove(self) -> None:
        self._hook.remove()
        w = self._writer()
        if w is not None:
            w._unprotect(self)


class DataStatesWriter(StorageWriter):
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
        _extensions: stream transforms applied to every item, as ``FileSystemWriter``'s keyword
            of the same name (experimental in DCP): e.g. ``[ZStandard()]``; the stock reader
            undoes them. Transformed items are written by the save thread from the host cache
            (:mod:`dcp_datastates.save.extensions`); the torch format only, not incremental.

    Lifetime: the engine (host cache and threads) is freed by :meth:`close`, or when the writer
    is garbage-collected. A forked child cannot use a parent's writer (see the module docstring).
    """

    _synchronize_after_execute: bool = False

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
        incremental: IncrementalMode = False,
        persist_to: str | os.PathLike[str] | None = None,
        persist_storage_options: dict[str, Any] | None = None,
        persist_timeout: float = 600.0,
        persist_retention: RetentionPolicy | int | None = None,
        fast_retention: RetentionPolicy | int | None = None,
        _extensions: Sequence[StreamTransformExtension] | None = None,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.overwrite = bool(overwrite)
        self._pid = os.getpid()
        skip_unheard_debug_events()  # DCP's per-key DEBUG records nobody receives (dcplog.py)
        forksafe.warm_up()  # native statics a background save would create (forksafe.py)
        self.config = WriterConfig(
            cache_bytes=parse_size(host_cache_size, what="host_cache_size"),
            chunk_bytes=parse_size(chunk_size, default_unit=1, what="chunk_size"),
            copy_threads=copy_threads,
            flush_threads=flush_threads,
            files_per_rank=files_per_rank if files_per_rank is not None else flush_threads,
            o_direct=o_direct,
            early_flush=early_flush,
            capture=capture,
            checksums=checksums,
            durable=durable,
            prefault=prefault,
            flush_nice=flush_nice,
            idle_priority=idle_priority,
            adapt_to_load=adapt_to_load,
            flush_idle=flush_idle,
            step_barrier=step_barrier,
            format=format,
            part_bytes=parse_size(upload_part_size, default_unit=1, what="upload_part_size"),
            upload_concurrency=upload_concurrency,
        )
        self.storage_options = dict(storage_options or {})
        mode = parse_mode(incremental)  # before the engine: a bad value allocates nothing
        if mode != "off" and self.config.format != "torch":
            raise ValueError(
                f"incremental={incremental!r} needs format='torch': a {self.config.format} file "
                "cannot point at another checkpoint's bytes"
            )
        self._incremental = Tracker(mode, self.config.checksums) if mode != "off" else None
        self._extensions = check_extensions(_extensions)  # dcp_datastates.save.extensions
        if self._extensions and (self.config.format != "torch" or mode != "off"):
            raise ValueError(
                "_extensions needs format='torch' and incremental=False: a transformed item can "
                "be neither a safetensors tensor nor referenced by a later incremental save"
            )
        self._promoter: Promoter | None = None
        if persist_to is not None:  # multi-level flush (dcp_datastates.lifecycle.tiers)
            if mode != "off":
                raise ValueError(
                    "persist_to cannot be combined with incremental saves: an incremental "
                    "checkpoint points at earlier checkpoints' files, which the persistent tier "
                    "would have to hold under the same names (save fully, or persist separately)"
                )
            self._promoter = Promoter(
                self.path, os.fspath(persist_to), persist_storage_options, persist_timeout,
                durable=self.config.durable, fast_retention=fast_retention,
                persist_retention=persist_retention,
            )
        elif persist_retention is not None or fast_retention is not None:
            raise ValueError(
                "persist_retention and fast_retention need persist_to (without a persistent "
                "tier, prune with dcp_datastates.lifecycle.checkpoints.prune)"
            )
        self._engine = Engine(self.config)
        if pin_memory or (pin_memory is None and torch.cuda.is_available()):
            # Page-lock the cache now rather than on the first CUDA save (cudaHostRegister of a
            # large cache takes time). Without a CUDA runtime in the process this raises.
            try:
                self._engine.enable_cuda()
            except CheckpointSaveError:
                self._engine.close()
                raise
        meter = CpuMeter() if self.config.adapt_to_load and self.config.idle_priority else None
        self._stager = Stager(
            self._engine, self.config.capture, _spill_dirs(self.path), self._incremental, meter
        )
        self._templates = TemplateCache()
        self._placer = Placer(
            self._engine, self._templates, self._stager, self.config, self._incremental,
            self._extensions,
        )
        self._table = JobTable(self._engine)  # jobs in flight, their order, failures, stats
        # async_save results (Metadata) freed on a save thread, not the caller's (release.py)
        self._released = DeferredRelease()
        self._lock = self._table.lock  # also guards _protects
        self._protects: list[ProtectHandle] = []
        self._tls = threading.local()  # per save thread: its context holder and job binding
        self._closed = False
        weakref.finalize(self, _close_engine, self._engine, self._pid)
        barrier.register_writer(self)

    # ------------------------------------------------------------------------------------------
    # Public API beyond DCP
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owner_pid(self) -> int:
        """The process that created this writer; a forked child cannot use it."""
        return self._pid

    def protect(self, optimizer: torch.optim.Optimizer) -> ProtectHandle:
        """Makes ``optimizer.step()`` wait until every save in flight is in the host cache.

        The automatic step barrier already makes each optimizer wait for the copies of its own
        tensors, without raising; this explicit form waits for every save in flight and raises
        their errors (CaptureError, CheckpointSaveError) from ``step()``. It also marks the
        optimizer as an owner before its first step, and keeps working with
        ``step_barrier=False``. Returns a handle whose ``remove()`` undoes it.
        """
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(f"protect() needs a torch.optim.Optimizer, got {type(optimizer)!r}")
        barrier.remember_optimizer(optimizer)
        handle = ProtectHandle(self, optimizer)
        with self._lock:
            self._protects.append(handle)
        return handle

    def _unprotect(self, handle: ProtectHandle) -> None:
        with self._lock:
            if handle in self._protects:
                self._protects.remove(handle)

    def wait_captured(self, timeout: float | None = None) -> bool:
        """The barrier: blocks until every save in flight has all its tensors in the host cache.

        Verifies that no lazily captured tensor was modified in place meanwhile; raises
        CaptureError (that save fails, nothing torn is written) or the CheckpointSaveError of a
        save that failed since the last barrier. Returns False if ``timeout`` (seconds) expired.
        Safe to call at any time, from the training thread; releases the GIL while waiting.
        """
        self._check_owner()
        deadline = None if timeout is None else time.perf_counter() + timeout
        for job in self._table.unverified():
            remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not self._table.barrier_one(job, remaining, path=self.path):
                return False
        self._table.raise_unreported()
        return True

    def _step_barrier(self, optimizer: torch.optim.Optimizer) -> None:
        """The automatic barrier (runs before ``optimizer.step()``; see
        dcp_datastates.save.barrier).

        Waits for the saves in flight holding lazy copies of this optimizer's tensors. A save
        that fails here (a tensor changed) is failed and logged, not raised: its future and the
        next save report it.
        """
        if self._closed or not self.config.step_barrier:
            return
        ids = barrier.owner_ids(optimizer)
        for job in self._table.waiting_for(ids):
            try:
                self._table.barrier_one(job, None, report=False, path=self.path)
            except CheckpointSaveError as e:  # pragma: no cover - report=False does not raise
                logger.warning("%s", str(e))

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every save in flight has ended: committed, or failed. False on timeout
        (nothing raised then).

        Then raises the :class:`CheckpointSaveError` of a failed save whose error the caller has
        not seen yet: not read from its future (``result()`` that raised, or ``exception()``),
        not raised by a barrier or an earlier ``wait``. One per call, oldest first, each once;
        whatever failed (the capture, the writes, the commit, another rank). So a loop that
        never looks at the futures of the plain call still learns of a failed save here, and
        one that reads them is not told twice. The future always carries its save's error,
        whether or not ``wait`` raised it. (An ``exception()`` call already waiting when the
        save's thread started is not noticed: ``wait`` may raise that error once more.)

        With ``persist_to`` it does not wait for the copies to the persistent tier (those never
        delay training): :meth:`wait_persisted` does, and raises their failures.
        """
        if not self._wait_idle(timeout):
            return False
        self._table.raise_unreported()
        return True

    def _wait_idle(self, timeout: float | None) -> bool:
        self._check_owner()
        return self._table.wait_idle(timeout)

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """With ``persist_to``: blocks until every checkpoint committed so far on this rank was
        copied to the persistent tier (or failed). False on timeout. Then raises
        :class:`~dcp_datastates.lifecycle.tiers.PersistError` for failed copies not reported yet
        (once). Without ``persist_to`` it returns True at once."""
        self._check_owner()
        if self._promoter is None:
            return True
        return self._promoter.wait(timeout)

    def persist_stats(self) -> list[dict[str, Any]]:
        """With ``persist_to``: this rank's recent promotions, oldest first (``source``,
        ``target``, ``persist_s``, ``bytes``, ``error``); ``[]`` without it."""
        return [] if self._promoter is None else self._promoter.records()

    def unpersisted(self) -> list[str]:
        """With ``persist_to``: fast-tier checkpoints not (yet) on the persistent tier: in flight
        or failed. Pass them as ``exclude=`` when pruning the fast tier."""
        return [] if self._promoter is None else self._promoter.unpersisted()

    def save_stats(self) -> list[dict[str, Any]]:
        """Telemetry of the recent saves on this rank (oldest first), as dicts (see SaveStats).

        With ``persist_to`` each dict also has ``persist_state`` ("pending", "done", "failed",
        or None when the save was not promoted), ``persist_s`` (submit to end of the copy,
        NaN until then) and ``persist_error``, from :meth:`persist_stats`."""
        self._check_owner()
        with self._lock:
            out = [s.as_dict() for s in self._table.stats]
        if self._promoter is not None:
            attach_persist_stats(out, self._promoter.records())
        return out

    def engine_counters(self) -> dict[str, int]:
        """Host cache use, live jobs, open files and queue lengths (for monitoring and tests)."""
        return self._engine.counters()

    @property
    def engine(self) -> Engine:
        """The native engine (test hooks: pause_copies, set_delays)."""
        return self._engine

    def close(self) -> None:
        """Waits for saves in flight, then stops the engine and frees the host cache.

        With ``persist_to`` it also waits for every copy to the persistent tier already queued,
        within ``persist_timeout`` in all (copies not done by then fail; failures are logged,
        not raised; call :meth:`wait_persisted` first to get them).

        Idempotent. In a forked child it only marks this process's view of the writer closed:
        the engine belongs to the parent and is neither waited for, joined nor freed here.
        """
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True  # no lock: a parent thread may have held it at the fork
            self._engine.close()  # the binding leaks the native engine in a child
            return
        self._wait_idle(None)
        try:
            self._table.raise_unreported()
        except CheckpointSaveError as e:  # close() never raises for a save: it says so
            logger.error("a save failed and its error was never read: %s", str(e))
        if self._promoter is not None:
            self._promoter.close()  # waits for the copies in flight; logs failures
        with self._lock:
            for h in list(self._protects):
                h._hook.remove()
            self._protects.clear()
            self._closed = True
        barrier.unregister_writer(self)
        self._released.clear()
        self._engine.close()

    def __enter__(self) -> DataStatesWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "DataStatesWriter cannot be pickled: its host cache and native threads live in this "
            "process. Use dcp.async_save with the default thread executor, not "
            "AsyncCheckpointerType.PROCESS."
        )

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
        owners: dict[int, int] = {}
        # (incremental saves never reference optimizer-owned tensors: owners are needed then too)
        if self.config.capture in ("auto", "owned") or self._incremental is not None:
            with self._lock:
                opts = [o for o in (h.optimizer for h in self._protects) if o is not None]
            if self.config.step_barrier:
                opts += barrier.known_optimizers()
            owners = barrier.owned_storages(opts)
        staged, job = self._stager.stage(state_dict, owners)
        self._table.add_staged(job)
        return StagedStateDict(staged, self, job)

    def _refuse_process_executor(self) -> None:
        if async_save_uses_process_executor():
            raise ValueError(
                "DataStatesWriter does not support dcp.async_save(async_checkpointer_type="
                "AsyncCheckpointerType.PROCESS): its host cache and native threads live in this "
                "process. Use the default AsyncCheckpointerType.THREAD."
            )

    def _bind_thread(self, ident: int, job: SaveJob) -> None:
        """Binds a staged job to the save thread that iterates its staged dict (see the module
        docstring); arranges for the job to be released when that save ends, whatever happens."""
        with self._lock:
            if not self._table.claim_thread(ident, job):
                return
            holder = getattr(self._tls, "holder", None)
            if job.checkpoint_id is None:
                ctx = holder.ctx if holder is not None and not holder.ctx.finished else None
                job.checkpoint_id = ctx.path if ctx is not None else (self.path or None)
            if job.rank < 0:
                job.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        wref = weakref.ref(self)
        binding = Binding(job)
        weakref.finalize(binding, release_cb, wref, job, self._pid, "its save thread ended")
        self._tls.binding = binding  # replaces (and so releases) a previous job of this thread
        fut = current_executor_future()
        if fut is not None:
            track_future(fut, wref, job, self._pid)
        self._start_early(job)

    def _start_early(self, job: SaveJob) -> None:
        """Places a just-bound job early, at the start of DCP's ``save`` in its thread.

        The path is known here (``reset`` ran), and DCP has yet to turn every top-level value of
        the staged dict into its own dict and to set its planner up (``_stateful_to_state_dict``,
        ``set_up_planner``: 0.1 s for 5,700 top-level tensors) before it calls
        ``set_up_storage_writer``: the flush starts that much sooner. Only with one rank (with
        several, the save's rank in its process group is known only in
        ``set_up_storage_writer``, which places their unique shards early), where early placement
        applies at all (dcp_datastates.save.early) and only for the context this save runs in; best
        effort: anything unexpected leaves the placement to ``set_up_storage_writer``, which
        checks the save first (its checks raise there).
        """
        holder = getattr(self._tls, "holder", None)
        ctx = holder.ctx if holder is not None else None
        if (
            ctx is None
            or ctx.finished
            or not ctx.path
            or job.checkpoint_id != ctx.path
            or default_world_size() > 1
            or not self._placer.early_applies(job)
        ):
            return
        try:
            # Its turn first, as in set_up_storage_writer (no collector pause spans the wait).
            self._table.wait_turn(job, before_waiting=job.end_gc_pause)
            if job.early is None:
                self._placer.place_early(ctx, job)  # checks again: the job may have failed
        except Exception as e:  # noqa: BLE001 - set_up_storage_writer places (and raises)
            logger.debug("early placement at bind time skipped for %s: %s", ctx.path, str(e))

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
            self._set_up(ctx, is_coordinator, *args, **kwargs)
        except BaseException:
            ctx.end_gc_pause()
            raise
        # DCP plans next (an object or more per item): no collections until write_data.
        ctx.begin_gc_pause()

    def _set_up(self, ctx: SaveContext, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """set_up_storage_writer's checks, its turn and its early placement."""
        ctx.coordinator = is_coordinator
        rank = kwargs.get("rank", args[0] if args else None)
        if rank is None:
            # DCP passes rank= only to a set_up_storage_writer whose signature names **kwargs (a
            # wrapper with **kw hides it): every rank would write rank 0's files. Its rank in
            # the default group names this rank's files uniquely.
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        ctx.rank = int(rank)
        ctx.use_collectives = bool(kwargs.get("use_collectives", True))
        if not ctx.use_collectives and default_world_size() > 1:
            raise ValueError(
                "DataStatesWriter does not support use_collectives=False with several ranks "
                "(one .metadata per rank); save with the default use_collectives=True"
            )
        if not ctx.path:
            raise ValueError("DataStatesWriter has no path: pass one or a checkpoint_id")
        if self._promoter is not None:
            self._promoter.relative(ctx.path)  # refuses a checkpoint outside the fast tier
        # One save's protocol (with its collectives) at a time, in the order of the save
        # calls, identically on every rank: wait for every earlier staged save to end.
        self._table.wait_turn(ctx.job, before_waiting=ctx.end_gc_pause)  # no pause spans it
        if self._promoter is not None:  # the newest save of a name wins: its old copy stops
            self._promoter.supersede(ctx.path)
        if ctx.job is not None and ctx.job.error is not None:
            raise ctx.job.error  # failed before its save began (e.g. by a step barrier)
        if ctx.job is not None and ctx.job.early is None:  # placed at bind time already?
            self._placer.place_early(ctx, ctx.job)  # flushes while DCP plans (early.py)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.overwrite:
            ctx = self._context()
            d = ctx.directory()
            if d.fs.exists(d.join(METADATA_FILE)):
                ctx.end_gc_pause()
                raise CheckpointExistsError(  # torch's words first (FileSystemWriter's refusal)
                    f"Checkpoint already exists and overwrite=False: {ctx.path} holds a "
                    f"committed checkpoint (rank {ctx.rank}); save to another checkpoint_id or "
                    "use a DataStatesWriter with overwrite=True"
                )
        elif (holder := getattr(self._tls, "holder", None)) is not None and not holder.ctx.finished:
            # Nothing of the checkpoint being replaced is removed for a save that has failed or
            # cannot fit (dcp_datastates.storage.room): every rank checks before the claim.
            ctx = holder.ctx
            try:
                self._placer.check_replace(ctx, ctx.job)
            except BaseException:
                ctx.end_gc_pause()
                raise
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
        results = CompactWriteResults(results)  # DCP gathers them (wire.py)
        if job.adhoc:
            # dcp.save: nothing would end a job left pending here until the caller's thread
            # saved again, so its results mean that its data is durable.
            self._complete_write(ctx, job, pending)
        elif ctx.coordinator:
            # async_save: the results go to finish() while the data still flushes; finish()
            # waits for it (and pickles the .metadata meanwhile), and for every rank that
            # handed its results over early, before it commits. Should DCP stop before
            # finish(), the job's release (its future completing) fails it and abandons the
            # pending write.
            job.pending_write = pending
        elif pending.writes_manifest and (kv := rank_commit.store()) is not None:
            # Another rank, async_save: a thread of its own waits for the data, writes the
            # manifest and reports to the coordinator, whose finish() waits for that report
            # (rank_commit.py); the results say so.
            self._complete_in_background(ctx, job, pending, kv)
            results.awaited = (ctx.rank, ctx.save_id)
        else:
            # Other ranks of safetensors saves (or without a store): results once durable.
            self._complete_write(ctx, job, pending)
        ctx.begin_gc_pause()  # DCP gathers every rank's results (for finish() on the coordinator)
        if not ctx.coordinator:
            # No finish() here, but DCP's protocol goes on: it receives the coordinator's
            # metadata and unpickles it (an object per item of every rank). A collection then
            # would scan the whole process: 2 ranks x 2,000 tensors, 0.18 s added to every
            # other save. So the pause ends as the coordinator's does, when the save ends.
            ctx.end_gc_pause_after_save(len(plan.items))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _complete_write(self, ctx: SaveContext, job: SaveJob, pending: PendingWrite) -> None:
        """Waits until this rank's data is durable and its manifest written; finishes the job.
        Raises (failing the job) on any failure."""
        try:
            self._write_completed(ctx, job, pending)
        except BaseException as e:
            self._raise_write_failure(ctx, job, e)

    def _write_completed(self, ctx: SaveContext, job: SaveJob, pending: PendingWrite) -> None:
        """Waits for the data, writes the manifest, finishes the job, queues the promotion of
        another rank's files; raises on any failure (the caller fails the job)."""
        pending.complete()
        self._table.finish_job(job, ctx.rank)
        if self._promoter is not None and not ctx.coordinator:
            # This rank's files are durable; the coordinator's promotion commits the copy.
            self._submit_promotion(ctx, 0)

    def _complete_in_background(
        self, ctx: SaveContext, job: SaveJob, pending: PendingWrite, kv: Any
    ) -> None:
        """Completes a non-coordinator's write in a thread (``dcp_datastates-complete``).

        The thread waits for the data, writes the manifest, finishes the job and reports to the
        coordinator through the store ``kv``; on any failure it fails the job and reports the
        error (rank_commit.py). The job's release joins it (aborting the job first if the save
        failed elsewhere), so the job never ends while the thread may still use it.
        """
        def run() -> None:
            try:
                self._write_completed(ctx, job, pending)
            except BaseException as e:  # noqa: BLE001 - reported through the job and the store
                err = _save_error(ctx, e)
                if not isinstance(job.error, CheckpointSaveError):
                    self._table.fail_job(job, err)
                rank_commit.report(kv, ctx.rank, ctx.save_id, str(job.error or err))
                return
            rank_commit.report(kv, ctx.rank, ctx.save_id, None)

        t = threading.Thread(target=run, name="dcp_datastates-complete", daemon=True)
        job.completer = t
        t.start()

    def _raise_write_failure(self, ctx: SaveContext, job: SaveJob, e: BaseException) -> NoReturn:
        """Fails ``job`` for ``e`` (unless it failed elsewhere first) and raises the error."""
        ctx.end_gc_pause()
        if isinstance(job.error, CheckpointSaveError):
            # Failed elsewhere first (a barrier found a changed tensor, an abort): that is
            # the cause; what this thread hit afterwards is only a consequence.
            self._release_claim(ctx)
            raise reraisable(job.error) from e
        err = _save_error(ctx, e)
        self._table.fail_job(job, err)
        self._release_claim(ctx)  # a later save to this path must not find it busy
        if err is e:
            raise
        raise err from e

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        ctx = self._context()
        try:
            metadata.version = CURRENT_DCP_VERSION
            storage_md = {}
            for wr_list in results:
                storage_md.update({wr.index: wr.storage_data for wr in wr_list})
            metadata.storage_data = storage_md
            metadata.storage_meta = StorageMeta(checkpoint_id=ctx.path, save_id=ctx.save_id)
            share_metadata_values(metadata)  # pickled into .metadata and by DCP's broadcast
            blob: bytes | None = None
            job = ctx.job
            pending = job.pending_write if job is not None else None
            if pending is not None:
                assert job is not None
                job.pending_write = None
                with gc_paused():  # an object per item (see dcp_datastates.runtime.gcpause)
                    blob = pickle.dumps(metadata)  # while the data is still flushing
                ctx.end_gc_pause()  # training runs while this thread waits for the data
                self._complete_write(ctx, job, pending)
                others = rank_commit.awaited_ranks(results)
                if others:  # ranks that sent their results before their data was durable
                    kv = rank_commit.store()
                    if kv is None:
                        raise CheckpointSaveError(
                            f"save to {ctx.path}: ranks {sorted(others)} report through the "
                            "process group's store, which this rank cannot reach"
                        )
                    rank_commit.wait_for_ranks(kv, others, ctx.path)
                ctx.begin_gc_pause()  # the commit and DCP's broadcast of the result
            ctx.directory().commit(metadata, self.config.durable, blob=blob)
            self._table.mark_committed(ctx.path, time.perf_counter())
            if ctx.job is not None and not ctx.job.adhoc:
                self._released.hold(metadata)  # async_save's result: see release.py
            if self._promoter is not None:
                self._submit_promotion(ctx, len(results))
        finally:
            # after DCP's broadcast of the result and its frames let go of the plan (gcpause.py)
            ctx.end_gc_pause_after_save(len(metadata.storage_data or ()))
            ctx.finished = True
            self._release_claim(ctx)

    # ------------------------------------------------------------------------------------------
    # Save contexts (one per save, per thread)
    def _begin_context(self, path: str) -> SaveContext:
        old = getattr(self._tls, "holder", None)
        if old is not None:
            self._end_context(old.ctx)
        ctx = SaveContext(path=path, storage_options=self.storage_options or None)
        holder = ContextHolder(ctx)
        # The finalizer holds the writer weakly: a strong reference (a bound method) would keep
        # every writer used from a long-lived thread alive forever, cache and threads included.
        weakref.finalize(holder, end_context_cb, weakref.ref(self), ctx, self._pid)
        self._tls.holder = holder
        return ctx

    def _context(self) -> SaveContext:
        holder = getattr(self._tls, "holder", None)
        if holder is None or holder.ctx.finished:
            return self._begin_context(self.path)
        return holder.ctx

    def _end_context(self, ctx: SaveContext) -> None:
        """Runs when a save context is replaced or its thread exits: undoes what it left open.

        A staged job is released by its binding (see _bind_thread), not here; a dcp.save job
        is finished or failed by write_data.
        """
        if ctx.ended:
            return
        ctx.ended = True
        ctx.end_gc_pause()  # DCP stopped between two calls (a planner error, a collective)
        job = ctx.job
        pending = job.pending_write if job is not None else None
        if pending is not None:
            # Between write_data and finish(): nothing was committed; the job fails by its
            # binding's release (async_save), which abandons the pending write too.
            pending.abandon()
        self._release_claim(ctx)
        if job is not None and job.adhoc and not job.finished:
            self._table.fail_job(
                job,
                CheckpointSaveError(
                    f"save to {ctx.path} failed on rank {ctx.rank} before its data was written"
                ),
            )
        ctx.finished = True

    def _submit_promotion(self, ctx: SaveContext, world_size: int) -> None:
        """Queues the copy of this rank's part to the persistent tier; never fails the save (the
        fast checkpoint is committed or durable already): a refusal is logged."""
        assert self._promoter is not None
        try:
            self._promoter.submit(ctx.path, ctx.rank, world_size, coordinator=ctx.coordinator)
        except (RuntimeError, ValueError) as e:
            logger.error("%s is not copied to the persistent tier: %s", ctx.path, str(e))

    def _claim_and_prepare(self, ctx: SaveContext) -> None:
        claim_path(
            ctx,
            self.config.durable,
            lambda: self._placer.check_replace(ctx, ctx.job),
            defer_removal=self._placer.defers_removal(ctx, ctx.job),
        )

    def _release_claim(self, ctx: SaveContext) -> None:
        release_claim(ctx)

    # ------------------------------------------------------------------------------------------
    # Binding a DCP plan to a save job
    def _bind_job(self, ctx: SaveContext, plan: SavePlan, planner: SavePlanner) -> SaveJob:
        job = ctx.job
        if job is None:
            # dcp.save (no stage): a job whose tensors are captured as their items are placed.
            job = SaveJob(engine_job=self._engine.create_job("sync-save"), seq=0, adhoc=True)
            job.t_stage = time.perf_counter()
            ctx.job = job
            self._table.add_adhoc(job)
        elif job.bound:
            raise CheckpointSaveError(f"save to {ctx.path}: the staged state was written twice")
        job.bound = True
        job.checkpoint_id = ctx.path
        job.rank = ctx.rank
        return job

    # ------------------------------------------------------------------------------------------
    # Callbacks of the job table's finalizers and futures (they hold the writer weakly)
    def _error_seen(self, job: SaveJob) -> None:
        """The caller read this job's error from its future: the barrier will not raise it."""
        self._table.error_seen(job)

    def _release_job(
        self, job: SaveJob, why: str, cause: BaseException | None = None, quiet: bool = False
    ) -> None:
        """Ends a staged job's protocol: fails it if its data was never written, drops it."""
        completer, job.completer = job.completer, None
        if completer is not None and completer is not threading.current_thread():
            if cause is not None:
                # The save failed elsewhere (another rank, the coordinator): stop waiting for
                # this rank's flush. Only an abort here: the completion thread fails the job
                # itself, since forgetting the engine job under its wait is not allowed.
                where = job.checkpoint_id or self.path
                why_abort = f"save to {where} failed: {describe_cause(cause)}"
                self._engine.abort(job.engine_job, why_abort)
            completer.join()
        self._table.release_job(job, why, cause, quiet, path=self.path)
        pending, job.pending_write = job.pending_write, None
        if pending is not None:  # DCP stopped between write_data and finish()
            pending.abandon()

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this DataStatesWriter belongs to process {self._pid}; a forked child (process "
                f"{os.getpid()}) cannot use it: create a new writer in the child"
            )

    def _check_open(self) -> None:
        self._check_owner()
        if self._closed:
            raise RuntimeError("this DataStatesWriter is closed")


def _save_error(ctx: SaveContext, e: BaseException) -> CheckpointSaveError:
    """``e`` as the error of this save on this rank (itself if it is one already)."""
    if isinstance(e, CheckpointSaveError):
        return e
    return CheckpointSaveError(
        f"save to {ctx.path} failed on rank {ctx.rank}: {type(e).__name__}: {e}"
    )


def _spill_dirs(path: str) -> list[str]:
    """Where at-call snapshots larger than the cache are spilled: beside the checkpoints (same
    file system, so the copy into the data file can be a reflink), else the temp directory."""
    dirs: list[str] = []
    if path and "://" not in path:
        base = os.path.abspath(path)
        dirs += [base, os.path.dirname(base)]
    dirs.append(tempfile.gettempdir())
    return dirs


__all__ = ["DataStatesWriter", "ProtectHandle"]
