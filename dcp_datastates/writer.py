"""DataStatesWriter: the DCP StorageWriter (and AsyncStager) on the native host-cache engine.

Call order, per save, as torch.distributed.checkpoint drives it (who calls what on which rank):

==========================  ==============  ==================================================
call                        thread / ranks  what happens here
==========================  ==============  ==================================================
``stage(state_dict)``       caller, all     (async_save only) tensors registered with a new
                                            engine job, copies start; returns at once
``reset(checkpoint_id)``    save thread     a new per-thread save context for that path
``storage_meta()``          save thread     checkpoint id and a fresh save id
``set_up_storage_writer``   save thread     rank and role recorded; waits for earlier saves
``prepare_local_plan``      all             unchanged
``prepare_global_plan``     coordinator     path claimed; stale ``.metadata`` removed;
                                            in-progress marker written
``write_data(plan, pl.)``   all             the job is found (by staged-object identity) or
                                            created (dcp.save); items placed in files; the
                                            engine flushes as copies land; waits until durable;
                                            writes this rank's manifest
``finish(metadata, res.)``  coordinator     ``.metadata`` written atomically: the commit
==========================  ==============  ==================================================

``dcp.async_save`` runs everything after ``stage`` in a background thread; ``stage`` returns the
staged dict (not a future), so planning and flushing start while copies are still running. This is
what lets a host cache smaller than one checkpoint work: flushes free space for later copies.

The barrier (:mod:`dcp_datastates.barrier`): a process-wide optimizer step pre-hook makes every
optimizer's ``step()`` wait until the saves in flight holding lazy copies of *its* tensors have
them in the host cache, and verifies that none was modified meanwhile; nothing to call.
``protect(optimizer)`` adds the explicit form (waits for every save, raises their errors).
``should_synchronize_after_execute`` is False: async_save does not wait for anything.

Threads: stage/protect/wait_captured run in the training thread; the DCP protocol calls run in
whatever thread runs the save (one per async_save); several saves may be in flight on one writer
(their protocol state lives in a thread-local context). Native copy/flush threads never call Python.
Failures: a failed save raises CheckpointSaveError from write_data (hence on the save's future as
DCP's CheckpointException); nothing is committed for it and its cache space is returned. Each error
is reported once per channel: always on the save's future, then once at the next explicit barrier
(``wait_captured``, a ``protect()`` hook, ``synchronize_staging``) or ``wait()`` unless the caller
already read it from the future (``result()``/``exception()``) or from ``dcp.save``. The automatic
step barrier never raises (it logs), the next save logs it, ``close()`` logs it. A later save is
never refused because an earlier one failed.

Lifecycle of a staged job (it must never be left behind, or later saves, ``wait`` and ``close``
would wait on it forever):

* ``stage`` creates it and returns a :class:`_StagedStateDict`;
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
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import _core, barrier
from .capture import CapturedTensor, SaveJob, Stager, raise_if_modified
from .commit import METADATA_FILE, CheckpointDir, claim_and_prepare, manifest_name, release_path
from .config import CaptureMode, WriterConfig, parse_size
from .engine import Engine, engine_time_to_perf
from .errors import CheckpointSaveError
from .fsspec_sink import SinkItem, write_sequential
from .layout import FileLayout, TemplateCache, data_file_name
from .manifest import ItemRecord, RankManifest
from .stats import SaveStats

logger = logging.getLogger(__name__)

try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    CURRENT_DCP_VERSION = "1.0.0"  # type: ignore[misc]


@dataclass
class _Context:
    """Protocol state of one save in one thread (DCP drives a save from a single thread)."""

    path: str
    rank: int = 0
    coordinator: bool = True
    use_collectives: bool = True
    save_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    job: SaveJob | None = None  # the staged job this save thread carries (None: dcp.save)
    path_key: str | None = None  # set while this context holds the path claim
    meta_taken: bool = False  # storage_meta() ran: the next storage_meta() begins a new save
    finished: bool = False  # finish() ran (coordinator) or the context ended
    ended: bool = False


class _ContextHolder:
    """Lives in thread-local storage; its finalizer ends the context when the thread exits."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx


class _Binding:
    """Lives in a save thread's thread-local storage while that thread carries a staged job.

    Its finalizer (thread exit, or replacement by the next job bound to the same thread)
    releases the job: the thread's DCP protocol is over.
    """

    def __init__(self, job: SaveJob) -> None:
        self.job = job


def _end_context_cb(writer_ref: weakref.ref[DataStatesWriter], ctx: _Context, pid: int) -> None:
    """Finalizer of a _ContextHolder. Holds the writer weakly, so the writer can be collected."""
    if os.getpid() != pid:
        return  # a forked child: the context belongs to a parent thread
    w = writer_ref()
    if w is not None:
        w._end_context(ctx)
    elif ctx.path_key is not None:
        release_path(ctx.path_key)
        ctx.path_key = None


def _release_cb(
    writer_ref: weakref.ref[DataStatesWriter], job: SaveJob, pid: int, why: str,
    cause: BaseException | None = None,
) -> None:
    """Finalizer/callback that ends a staged job's protocol (never in a forked child)."""
    if os.getpid() != pid:
        return
    w = writer_ref()
    if w is not None:
        w._release_job(job, why, cause)


def _future_exception(fut: concurrent.futures.Future[Any]) -> BaseException | None:
    """The exception of a done future, read without marking it seen."""
    if fut.cancelled():
        return concurrent.futures.CancelledError("the save was cancelled")
    return concurrent.futures.Future.exception(fut, timeout=0)


class _SeenTrackingFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The class a save's executor future is switched to: it notes ``exception()`` reads.

    An error returned by ``exception()`` is not raised again at the next barrier. (An error
    raised by ``result()`` is recognised from its traceback instead, see _raised_by_result, as
    ``result()`` may already be waiting when the switch happens.) Otherwise the base class.
    """

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = super().exception(timeout)
        if exc is not None:
            cb = self.__dict__.get("_dcpds_on_seen")
            if cb is not None:
                cb()
        return exc


_FUTURES_BASE = os.path.join("concurrent", "futures", "_base.py")


def _raised_by_result(exc: BaseException | None) -> bool:
    """True if ``exc`` was raised to a caller by ``concurrent.futures.Future.result()``.

    Raising an exception again prepends the raising frames to its traceback, so a future's
    exception that went through ``result()`` carries that frame; one never read does not.
    """
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in ("result", "__get_result") and code.co_filename.endswith(_FUTURES_BASE):
            return True
        tb = tb.tb_next
    return False


def _current_executor_future() -> concurrent.futures.Future[Any] | None:
    """The future of the ``concurrent.futures`` work item running in this thread, if any.

    DCP's thread executor runs each save as a work item whose frame (``_WorkItem.run``) holds
    the future that ``async_save`` returned. None when the save runs any other way.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "run":
            fut = getattr(frame.f_locals.get("self"), "future", None)
            if isinstance(fut, concurrent.futures.Future):
                return fut
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _async_save_uses_process_executor() -> bool:
    """True when stage() is being called by ``dcp.async_save(..., PROCESS)``."""
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError:  # pragma: no cover - older torch
        return False
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        if frame.f_code.co_name == "async_save":
            kind = frame.f_locals.get("async_checkpointer_type")
            return bool(kind == AsyncCheckpointerType.PROCESS)
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _staged_collected(
    writer_ref: weakref.ref[DataStatesWriter], job: SaveJob, pid: int
) -> None:
    """Finalizer of a _StagedStateDict: a job no save thread ever bound is released."""
    if os.getpid() != pid or job.thread is not None:
        return
    w = writer_ref()
    if w is not None:
        logger.warning(
            "a staged state dict was discarded before any save used it; its copies are dropped"
        )
        w._release_job(job, "its staged state dict was discarded before any save used it",
                       quiet=True)


def _describe_cause(cause: BaseException) -> str:
    """One line naming an exception; for DCP's CheckpointException, the first rank's failure."""
    failures = getattr(cause, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            return f"rank {rank}: {_describe_cause(inner)}"
        return str(inner)
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


def _close_engine(engine: Engine, pid: int) -> None:
    """Finalizer of a DataStatesWriter: stops its threads and frees its cache (leaks in a child)."""
    if os.getpid() == pid:
        engine.close()


class _StagedStateDict(dict):  # type: ignore[type-arg]
    """The staged dict ``stage()`` returns: it tells the writer which thread saves which job.

    ``dcp.async_save`` hands it to a background thread whose first use of it, before any
    storage-writer call that needs to know, is ``dcp.save``'s ``_stateful_to_state_dict``
    iterating ``items()``. That first iteration in a thread other than the staging one binds
    that thread to this save job, so consecutive saves can be ordered identically on every rank.
    If it is collected without ever being bound, its job is released (failed and dropped).
    It cannot be pickled (``AsyncCheckpointerType.PROCESS`` is not supported).
    """

    def __init__(self, data: dict[str, Any], writer: DataStatesWriter, job: SaveJob) -> None:
        super().__init__(data)
        self._writer_ref = weakref.ref(writer)
        self._job = job
        self._stage_thread = threading.get_ident()
        weakref.finalize(self, _staged_collected, self._writer_ref, job, writer._pid)

    def items(self):  # type: ignore[no-untyped-def,override]
        ident = threading.get_ident()
        if ident != self._stage_thread:
            w = self._writer_ref()
            if w is not None:
                w._bind_thread(ident, self._job)
        return super().items()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a DataStatesWriter staged state dict cannot be pickled: its data lives in this "
            "process's host cache. Use dcp.async_save with the default thread executor, not "
            "AsyncCheckpointerType.PROCESS."
        )


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
        capture: "auto" (default), "owned", "lazy" or "eager"; see docs/configuration.md.
        checksums: CRC-32C per chunk, recorded in the manifest (see ``verify_checkpoint``).
        durable: fdatasync data files and fsync directories before the commit.
        prefault: touch the cache's pages up front (default: off; pages are faulted in by the
            first saves, and only as many as the saves in flight need).
        flush_nice: niceness added to flush threads, so copies win the CPU.
        idle_priority: run the engine's threads under SCHED_IDLE (default: on), so background
            copies and flushes only use CPU time training leaves idle.
        step_barrier: take part in the automatic step barrier (default: on). Off: no tensor is
            captured lazily unless its optimizer was passed to :meth:`protect`.
        pin_memory: page-lock the cache with the CUDA runtime at construction (default: when
            CUDA is available; otherwise it happens on the first save of a CUDA tensor).
        overwrite: replace an existing checkpoint at the save's path (default, as
            FileSystemWriter); False refuses the save on every rank (FileExistsError naming the
            path) when ``.metadata`` is already there.

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
        capture: CaptureMode = "auto",
        checksums: bool = True,
        durable: bool = True,
        prefault: bool = False,
        flush_nice: int = 5,
        idle_priority: bool = True,
        step_barrier: bool = True,
        pin_memory: bool | None = None,
        overwrite: bool = True,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.overwrite = bool(overwrite)
        self._pid = os.getpid()
        self.config = WriterConfig(
            cache_bytes=parse_size(host_cache_size, what="host_cache_size"),
            chunk_bytes=parse_size(chunk_size, default_unit=1, what="chunk_size"),
            copy_threads=copy_threads,
            flush_threads=flush_threads,
            files_per_rank=files_per_rank if files_per_rank is not None else flush_threads,
            o_direct=o_direct,
            capture=capture,
            checksums=checksums,
            durable=durable,
            prefault=prefault,
            flush_nice=flush_nice,
            idle_priority=idle_priority,
            step_barrier=step_barrier,
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
        self._stager = Stager(self._engine, self.config.capture, _spill_dirs(self.path))
        self._templates = TemplateCache()
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._jobs: list[SaveJob] = []  # staged or running jobs, oldest first
        self._by_staged: dict[int, SaveJob] = {}
        self._thread_jobs: dict[int, SaveJob] = {}  # save thread -> the staged job it carries
        self._protects: list[ProtectHandle] = []
        self._unreported: collections.deque[SaveJob] = collections.deque()
        self._future_errors: dict[int, BaseException] = {}  # id(job in _unreported) -> its error
        self._stats: collections.deque[SaveStats] = collections.deque(maxlen=1000)
        self._tls = threading.local()
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
        with self._lock:
            jobs = [j for j in self._jobs if not j.verified]
        for job in jobs:
            remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not self._barrier_one(job, remaining):
                return False
        self._raise_unreported()
        return True

    def _step_barrier(self, optimizer: torch.optim.Optimizer) -> None:
        """The automatic barrier (runs before ``optimizer.step()``; see dcp_datastates.barrier).

        Waits for the saves in flight holding lazy copies of this optimizer's tensors. A save
        that fails here (a tensor changed) is failed and logged, not raised: its future and the
        next save report it.
        """
        if self._closed or not self.config.step_barrier:
            return
        ids = barrier.owner_ids(optimizer)
        with self._lock:
            jobs = [j for j in self._jobs if not j.verified and not j.finished and j.waits_for(ids)]
        for job in jobs:
            try:
                self._barrier_one(job, None, report=False)
            except CheckpointSaveError as e:  # pragma: no cover - report=False does not raise
                logger.warning("%s", e)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every save in flight is durable (or failed). False on timeout.

        Then raises the error of a failed save that nobody has seen yet (not read from its
        future, not raised by a barrier or an earlier ``wait``), once: a loop that never looks
        at the futures of the plain call still learns of a failed save here.
        """
        if not self._wait_idle(timeout):
            return False
        self._raise_unreported()
        return True

    def _wait_idle(self, timeout: float | None) -> bool:
        self._check_owner()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def save_stats(self) -> list[dict[str, Any]]:
        """Telemetry of the recent saves on this rank (oldest first), as dicts (see SaveStats)."""
        self._check_owner()
        with self._lock:
            return [s.as_dict() for s in self._stats]

    def engine_counters(self) -> dict[str, int]:
        """Host cache use, live jobs, open files and queue lengths (for monitoring and tests)."""
        return self._engine.counters()

    @property
    def engine(self) -> Engine:
        """The native engine (test hooks: pause_copies, set_delays)."""
        return self._engine

    def close(self) -> None:
        """Waits for saves in flight, then stops the engine and frees the host cache.

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
            self._raise_unreported()
        except CheckpointSaveError as e:  # close() never raises for a save: it says so
            logger.error("a save failed and its error was never read: %s", e)
        with self._lock:
            for h in list(self._protects):
                h._hook.remove()
            self._protects.clear()
            self._closed = True
        barrier.unregister_writer(self)
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
        self._log_unseen_failures()
        owners: dict[int, int] = {}
        if self.config.capture in ("auto", "owned"):
            with self._lock:
                opts = [o for o in (h.optimizer for h in self._protects) if o is not None]
            if self.config.step_barrier:
                opts += barrier.known_optimizers()
            owners = barrier.owned_storages(opts)
        staged, job = self._stager.stage(state_dict, owners)
        with self._lock:
            self._jobs.append(job)
            for key in job.by_staged_id:
                self._by_staged[key] = job
        return _StagedStateDict(staged, self, job)

    def _refuse_process_executor(self) -> None:
        if _async_save_uses_process_executor():
            raise ValueError(
                "DataStatesWriter does not support dcp.async_save(async_checkpointer_type="
                "AsyncCheckpointerType.PROCESS): its host cache and native threads live in this "
                "process. Use the default AsyncCheckpointerType.THREAD."
            )

    def _bind_thread(self, ident: int, job: SaveJob) -> None:
        """Binds a staged job to the save thread that iterates its staged dict (see the module
        docstring); arranges for the job to be released when that save ends, whatever happens."""
        with self._lock:
            if job.thread is not None or job.finished or job.protocol_done:
                return
            job.thread = ident
            self._thread_jobs[ident] = job
            holder = getattr(self._tls, "holder", None)
            if job.checkpoint_id is None:
                ctx = holder.ctx if holder is not None and not holder.ctx.finished else None
                job.checkpoint_id = ctx.path if ctx is not None else (self.path or None)
            if job.rank < 0:
                job.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        wref = weakref.ref(self)
        binding = _Binding(job)
        weakref.finalize(binding, _release_cb, wref, job, self._pid, "its save thread ended")
        self._tls.binding = binding  # replaces (and so releases) a previous job of this thread
        fut = _current_executor_future()
        if fut is None:
            return

        def on_seen() -> None:
            w = wref()
            if w is not None:
                w._error_seen(job)

        try:
            fut._dcpds_on_seen = on_seen  # type: ignore[attr-defined]
            if type(fut) is concurrent.futures.Future:
                fut.__class__ = _SeenTrackingFuture
        except (AttributeError, TypeError):  # pragma: no cover - an exotic future
            pass
        pid = self._pid
        fut.add_done_callback(
            lambda f: _release_cb(wref, job, pid, "its save ended", _future_exception(f))
        )

    def _error_seen(self, job: SaveJob) -> None:
        """The caller read this job's error from its future: the barrier will not raise it."""
        with self._lock:
            job.error_reported = True
            self._future_errors.pop(id(job), None)
            if job in self._unreported:
                self._unreported.remove(job)

    def _release_job(
        self, job: SaveJob, why: str, cause: BaseException | None = None, quiet: bool = False
    ) -> None:
        """Ends a staged job's protocol: fails it if its data was never written, drops it.

        ``quiet``: nobody is waiting for that save's outcome; the barrier does not raise it.
        """
        with self._lock:
            if job.protocol_done:
                return
            if quiet:
                job.error_reported = True
            job.protocol_done = True  # its DCP protocol (collectives included) is over
            if job.thread is not None and self._thread_jobs.get(job.thread) is job:
                del self._thread_jobs[job.thread]
        if not job.finished:
            msg = (
                f"save to {job.checkpoint_id or self.path or '<no path>'} failed on rank "
                f"{max(job.rank, 0)} before its data was written ({why})"
            )
            if cause is not None:
                msg += f": {_describe_cause(cause)}"
            self._fail_job(job, CheckpointSaveError(msg))
        if cause is not None:
            with self._lock:
                if job in self._unreported:  # the barrier checks whether result() raised it
                    self._future_errors[id(job)] = cause
        self._drop_job(job)

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
        with self._lock:
            # Adopt the staged job first, so that a refusal below still ends it (the binding
            # releases it when this save ends).
            ctx.job = self._thread_jobs.get(threading.get_ident())
        ctx.coordinator = is_coordinator
        ctx.rank = int(kwargs.get("rank", args[0] if args else 0) or 0)
        ctx.use_collectives = bool(kwargs.get("use_collectives", True))
        if not ctx.use_collectives and dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                raise ValueError(
                    "DataStatesWriter does not support use_collectives=False with several ranks "
                    "(one .metadata per rank); save with the default use_collectives=True"
                )
        if not ctx.path:
            raise ValueError("DataStatesWriter has no path: pass one or a checkpoint_id")
        with self._idle:
            # One save's protocol (with its collectives) at a time, in the order of the save
            # calls, identically on every rank: wait for every earlier staged save to end.
            limit = ctx.job.seq if ctx.job is not None else None
            while any(
                not j.protocol_done and not j.adhoc and (limit is None or j.seq < limit)
                for j in self._jobs
            ):
                self._idle.wait()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.overwrite:
            ctx = self._context()
            d = CheckpointDir(ctx.path)
            if d.fs.exists(d.join(METADATA_FILE)):
                raise FileExistsError(
                    f"checkpoint {ctx.path} already exists and this DataStatesWriter has "
                    f"overwrite=False (rank {ctx.rank}); save to another checkpoint_id"
                )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        ctx = self._context()
        self._claim_and_prepare(ctx)
        return plans

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        ctx = self._context()
        if not ctx.use_collectives and ctx.path_key is None:
            self._claim_and_prepare(ctx)  # no global plan step (single rank): prepare here
        job = self._bind_job(ctx, plan, planner)
        try:
            results = self._write(ctx, job, plan, planner)
        except BaseException as e:
            if isinstance(job.error, CheckpointSaveError):
                # Failed elsewhere first (a barrier found a changed tensor, an abort): that is
                # the cause; what this thread hit afterwards is only a consequence.
                self._release_claim(ctx)
                raise job.error from e
            err = e if isinstance(e, CheckpointSaveError) else CheckpointSaveError(
                f"save to {ctx.path} failed on rank {ctx.rank}: {type(e).__name__}: {e}"
            )
            self._fail_job(job, err)
            self._release_claim(ctx)  # a later save to this path must not find it busy
            if err is e:
                raise
            raise err from e
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        ctx = self._context()
        try:
            metadata.version = CURRENT_DCP_VERSION
            storage_md = {}
            for wr_list in results:
                storage_md.update({wr.index: wr.storage_data for wr in wr_list})
            metadata.storage_data = storage_md
            metadata.storage_meta = StorageMeta(checkpoint_id=ctx.path, save_id=ctx.save_id)
            CheckpointDir(ctx.path).commit(metadata, self.config.durable)
            self._mark_committed(ctx.path, time.perf_counter())
        finally:
            ctx.finished = True
            self._release_claim(ctx)

    def _mark_committed(self, checkpoint_id: str, t: float) -> None:
        with self._lock:
            for s in reversed(self._stats):
                if s.checkpoint_id == checkpoint_id and math.isnan(s.t_committed):
                    s.t_committed = t
                    s.committed_s = t - s.t_stage
                    return

    # ------------------------------------------------------------------------------------------
    # Save contexts (one per save, per thread)
    def _begin_context(self, path: str) -> _Context:
        old = getattr(self._tls, "holder", None)
        if old is not None:
            self._end_context(old.ctx)
        ctx = _Context(path=path)
        holder = _ContextHolder(ctx)
        # The finalizer holds the writer weakly: a strong reference (a bound method) would keep
        # every writer used from a long-lived thread alive forever, cache and threads included.
        weakref.finalize(holder, _end_context_cb, weakref.ref(self), ctx, self._pid)
        self._tls.holder = holder
        return ctx

    def _context(self) -> _Context:
        holder = getattr(self._tls, "holder", None)
        if holder is None or holder.ctx.finished:
            return self._begin_context(self.path)
        return holder.ctx

    def _end_context(self, ctx: _Context) -> None:
        """Runs when a save context is replaced or its thread exits: undoes what it left open.

        A staged job is released by its binding (see _bind_thread), not here; a dcp.save job
        is finished or failed by write_data.
        """
        if ctx.ended:
            return
        ctx.ended = True
        self._release_claim(ctx)
        job = ctx.job
        if job is not None and job.adhoc and not job.finished:
            self._fail_job(
                job,
                CheckpointSaveError(
                    f"save to {ctx.path} failed on rank {ctx.rank} before its data was written"
                ),
            )
        ctx.finished = True

    def _claim_and_prepare(self, ctx: _Context) -> None:
        # In-process and cross-process (marker flock) claim, then the overwritten checkpoint's
        # files go; on failure the claim is released inside (commit.claim_and_prepare).
        ctx.path_key = claim_and_prepare(CheckpointDir(ctx.path), self.config.durable)

    def _release_claim(self, ctx: _Context) -> None:
        if ctx.path_key is not None:
            release_path(ctx.path_key)
            ctx.path_key = None

    # ------------------------------------------------------------------------------------------
    # Binding a DCP plan to a save job
    def _bind_job(self, ctx: _Context, plan: SavePlan, planner: SavePlanner) -> SaveJob:
        job = ctx.job
        if job is None:
            # dcp.save (no stage): a job whose tensors are captured as their items are placed.
            job = SaveJob(engine_job=self._engine.create_job("sync-save"), seq=0, adhoc=True)
            job.t_stage = time.perf_counter()
            ctx.job = job
            with self._lock:
                self._jobs.append(job)
        elif job.bound:
            raise CheckpointSaveError(f"save to {ctx.path}: the staged state was written twice")
        job.bound = True
        job.checkpoint_id = ctx.path
        job.rank = ctx.rank
        return job

    def _write(
        self, ctx: _Context, job: SaveJob, plan: SavePlan, planner: SavePlanner
    ) -> list[WriteResult]:
        d = CheckpointDir(ctx.path)
        d.ensure_exists()
        eng = self._engine
        nfiles = self.config.files_per_rank if d.local else 1
        layout = FileLayout(nfiles, 4096 if self.config.o_direct else 64)
        staged_sd = getattr(planner, "state_dict", None)
        file_ids: dict[int, int] = {}
        sink: dict[int, list[SinkItem]] = collections.defaultdict(list)
        placed: list[tuple[WriteItem, CapturedTensor, int, int, int]] = []
        results: list[WriteResult] = []
        bytes_crcs: list[tuple[WriteItem, int, int, int, int]] = []
        spilled: list[tuple[CapturedTensor, int, int, int, Any]] = []
        added_late = False

        def fid(f: int) -> int:
            if f not in file_ids:
                file_ids[f] = eng.open_file(job.engine_job, d.join(data_file_name(ctx.rank, f)))
            return file_ids[f]

        # Tensor items in the order their bytes land: those copied at the save call first (they
        # are in the cache already), then the background copies in queue (entry) order; bytes
        # items last. A sequential consumer (the fsspec path) must never wait for a chunk that
        # cannot land because the cache is full of chunks it will only read later.
        def order(item: WriteItem) -> tuple[int, int, int]:
            if item.type == WriteItemType.BYTE_IO:
                return (2, 0, 0)
            cap = self._lookup(job, staged_sd, item)
            if cap is None:
                return (1, 1, 0)
            return (0, 0 if cap.at_call else 1, cap.entry)

        for item in sorted(plan.items, key=order):
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
                f, off = layout.place_bytes(len(raw))
                if d.local:
                    eng.write_bytes(job.engine_job, fid(f), off, raw)
                else:
                    sink[f].append(SinkItem(offset=off, data=raw))
                bytes_crcs.append((item, f, off, len(raw), _core.crc32c(raw)))
                results.append(_result(item, data_file_name(ctx.rank, f), off, len(raw)))
                continue
            cap = self._lookup(job, staged_sd, item)
            if cap is None:
                cap = self._capture_late(job, item, planner)
                added_late = True
            chunk_sizes = tuple(int(s) for s in item.tensor_data.chunk.sizes)  # type: ignore[union-attr]
            if chunk_sizes != cap.shape:
                raise CheckpointSaveError(
                    f"save to {ctx.path}: '{item.index.fqn}' planned with shape {chunk_sizes} but "
                    f"captured with shape {cap.shape}"
                )
            tmpl = self._templates.get(cap.dtype, cap.shape)
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
            results.append(_result(item, data_file_name(ctx.rank, f), start, tmpl.total_bytes))
        if added_late:
            eng.start_copies(job.engine_job)
        ext_records: list[tuple[int, int, int, int, int, int]] = []
        for cap, f, start, payload, tmpl in spilled:  # before seal: finalize syncs them too
            fd = os.open(
                d.join(data_file_name(ctx.rank, f)), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
            try:
                os.pwrite(fd, tmpl.prefix, start)
                assert cap.spill is not None
                cap.spill.copy_to(fd, payload)
                os.pwrite(fd, tmpl.suffix, payload + cap.nbytes)
            finally:
                os.close(fd)
            ext_records.append((cap.entry, 0, f, payload, cap.nbytes, cap.spill.crc))
        eng.seal(job.engine_job)

        for f, items in sink.items():
            for e, c, off, n, crc in write_sequential(
                eng, job.engine_job, d.fs, d.join(data_file_name(ctx.rank, f)), items
            ):
                ext_records.append((e, c, f, off, n, crc))

        # Capture: all copies landed; then the exactness check (unless a barrier did it).
        eng.wait_captured(job.engine_job)
        with job.lock:
            if not job.verified:
                raise_if_modified(job, f"{ctx.path} (rank {ctx.rank})")
                job.verified = True
            job.release_sources()
        eng.wait_done(job.engine_job)

        manifest = self._manifest(ctx, job, placed, bytes_crcs, ext_records)
        d.write_atomic(manifest_name(ctx.rank), manifest.to_json().encode(), self.config.durable)
        self._finish_job(job, ctx)
        return results

    def _lookup(
        self, job: SaveJob, staged_sd: Any, item: WriteItem
    ) -> CapturedTensor | None:
        if not isinstance(staged_sd, dict):
            return job.by_staged_id.get(id(item))
        obj = staged_sd.get(item.index.fqn)
        cap = job.lookup(obj) if obj is not None else None
        if cap is None:
            cap = job.by_staged_id.get(id(item))  # captured late, keyed by the item
        return cap

    def _capture_late(self, job: SaveJob, item: WriteItem, planner: SavePlanner) -> CapturedTensor:
        """Captures an item the staged state does not know (dcp.save, or custom planners)."""
        if not job.adhoc:
            logger.warning(
                "'%s' was not captured at save time (custom planner?); it is copied now, when "
                "its data is written",
                item.index.fqn,
            )
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise CheckpointSaveError(f"'{item.index.fqn}': planner resolved a {type(data)!r}")
        cap = self._stager.stage_tensor(job, item.index.fqn, data)
        job.by_staged_id.pop(id(cap.staged), None)
        job.by_staged_id[id(item)] = cap
        cap.staged = item
        return cap

    def _manifest(
        self,
        ctx: _Context,
        job: SaveJob,
        placed: list[tuple[WriteItem, CapturedTensor, int, int, int]],
        bytes_crcs: list[tuple[WriteItem, int, int, int, int]],
        ext_records: list[tuple[int, int, int, int, int, int]],
    ) -> RankManifest:
        by_entry: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
        for e, _c, _file, off, _entry_off, n, crc in self._engine.chunk_records(job.engine_job):
            by_entry[e].append((off, n, crc))  # the file is implied by the item's placement
        for e, _c, _f, off, n, crc in ext_records:
            by_entry[e].append((off, n, crc))
        items: list[ItemRecord] = []
        for item, cap, f, start, payload in placed:
            tmpl = self._templates.get(cap.dtype, cap.shape)
            items.append(
                ItemRecord(
                    fqn=item.index.fqn,
                    offset=list(item.index.offset) if item.index.offset is not None else None,
                    file=data_file_name(ctx.rank, f),
                    archive_offset=start,
                    archive_length=tmpl.total_bytes,
                    payload_offset=payload,
                    payload_bytes=cap.nbytes,
                    dtype=str(cap.dtype).replace("torch.", ""),
                    shape=list(cap.shape),
                    chunks=sorted(by_entry.get(cap.entry, [])),
                )
            )
        for item, f, off, n, crc in bytes_crcs:
            items.append(
                ItemRecord(
                    fqn=item.index.fqn,
                    offset=None,
                    file=data_file_name(ctx.rank, f),
                    archive_offset=off,
                    archive_length=n,
                    payload_offset=off,
                    payload_bytes=n,
                    dtype="bytes",
                    shape=[],
                    chunks=[(off, n, crc)],
                )
            )
        return RankManifest(
            rank=ctx.rank,
            checksums=self.config.checksums,
            save_id=ctx.save_id,
            items=items,
        )

    # ------------------------------------------------------------------------------------------
    # Job completion, failure, barrier
    def _finish_job(self, job: SaveJob, ctx: _Context) -> None:
        st = self._engine.stats(job.engine_job)
        with job.lock:
            job.finished = True
            self._engine.forget(job.engine_job)
            job.release_sources(done=True)
        self._record_stats(job, ctx.rank, st)
        if job.adhoc:
            self._drop_job(job)  # dcp.save: its caller is the only one waiting

    def _fail_job(self, job: SaveJob, err: CheckpointSaveError) -> None:
        # Abort first, without job.lock: a barrier may hold it while waiting for this job.
        if not job.finished:
            self._engine.abort(job.engine_job, str(err))
        with job.lock:
            if job.finished:
                return
            job.error = err
            self._engine.abort(job.engine_job, str(err))
            st = self._engine.stats(job.engine_job)
            self._engine.forget(job.engine_job)  # waits until no native thread holds its chunks
            job.finished = True
            job.release_sources(done=True)
        self._record_stats(job, job.rank, st)
        with self._lock:
            if job.adhoc:
                job.error_reported = True  # dcp.save raised it to its caller
            if not job.error_reported:
                self._unreported.append(job)
        if job.adhoc:
            self._drop_job(job)

    def _drop_job(self, job: SaveJob) -> None:
        with self._idle:
            if job in self._jobs:
                self._jobs.remove(job)
            for key in list(job.by_staged_id):
                if self._by_staged.get(key) is job:
                    del self._by_staged[key]
            self._idle.notify_all()

    def _barrier_one(self, job: SaveJob, timeout: float | None, report: bool = True) -> bool:
        t0 = time.perf_counter()
        try:
            with job.lock:
                if job.finished or job.verified:
                    return True
                was_captured = self._engine.is_captured(job.engine_job)
                if not self._engine.wait_captured(job.engine_job, timeout):
                    return False  # the time waited is added in `finally`
                if job.captured_before_barrier is None:
                    job.captured_before_barrier = was_captured
                raise_if_modified(job, job.checkpoint_id or self.path or "<checkpoint>")
                job.verified = True
                job.release_sources()
        except CheckpointSaveError as e:
            self._fail_job(job, e)
            if not report:
                logger.warning("%s", e)
                return True
            self._error_seen(job)  # raised here, at the barrier
            raise
        finally:
            job.blocked_s += time.perf_counter() - t0
        return True

    def _log_unseen_failures(self) -> None:
        """Logs (once each) failed saves nobody has seen yet; the new save is not affected."""
        with self._lock:
            jobs = [j for j in self._unreported if not j.error_logged]
            for j in jobs:
                j.error_logged = True
        for j in jobs:
            if not _raised_by_result(self._future_errors.get(id(j))):
                logger.error("an earlier save failed (raised by its future and writer.wait()): "
                             "%s", j.error)

    def _raise_unreported(self) -> None:
        """Raises the error of the oldest failed save its caller has not seen yet (if any)."""
        with self._lock:
            while self._unreported:
                job = self._unreported.popleft()
                job.error_reported = True
                if _raised_by_result(self._future_errors.pop(id(job), None)):
                    continue  # the caller got it from the save's future already
                assert job.error is not None
                raise job.error

    def _record_stats(self, job: SaveJob, rank: int, st: dict[str, Any]) -> None:
        t_cap = engine_time_to_perf(st["captured_s"]) if st["captured_s"] >= 0 else math.nan
        t_done = engine_time_to_perf(st["done_s"]) if st["done_s"] >= 0 else math.nan
        dur = t_done - job.t_stage
        s = SaveStats(
            checkpoint_id=job.checkpoint_id or "",
            rank=rank,
            bytes=int(st["bytes_total"]),
            stage_s=job.stage_s,
            blocked_s=job.stage_s + job.blocked_s,
            captured_before_barrier=job.captured_before_barrier,
            captured_s=t_cap - job.t_stage,
            done_s=dur,
            t_stage=job.t_stage,
            t_captured=t_cap,
            t_done=t_done,
            flush_gbps=(st["bytes_written"] / dur / 1e9) if dur > 0 else math.nan,
            copy_busy_s=float(st["copy_busy_s"]),
            stall_s=job.stall_s,
            lazy_bytes=job.lazy_bytes,
            flush_busy_s=float(st["flush_busy_s"]),
            error=str(job.error) if job.error is not None else None,
        )
        with self._lock:
            self._stats.append(s)

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


def _spill_dirs(path: str) -> list[str]:
    """Where at-call snapshots larger than the cache are spilled: beside the checkpoints (same
    file system, so the copy into the data file can be a reflink), else the temp directory."""
    dirs: list[str] = []
    if path and "://" not in path:
        base = os.path.abspath(path)
        dirs += [base, os.path.dirname(base)]
    dirs.append(tempfile.gettempdir())
    return dirs


def _result(item: WriteItem, relative_path: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=relative_path, offset=offset, length=length),
    )


__all__ = ["DataStatesWriter", "ProtectHandle"]
