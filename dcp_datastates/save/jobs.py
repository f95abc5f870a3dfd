"""A writer's save jobs: which save thread carries which job, their order, how each ends, and
where each failure is reported.

A save job (:class:`dcp_datastates.save.capture.SaveJob`) is created by ``stage()`` (or by
``write_data`` for a plain ``dcp.save``). This module holds what follows it:

* how DCP's save thread finds its staged job: :class:`StagedStateDict` (what ``stage()`` returns)
  binds the job to the first other thread that iterates it; the writer
  (:mod:`dcp_datastates.save.binding`) then keeps a :class:`Binding` in that thread's
  thread-local storage and finds the save's
  ``concurrent.futures.Future`` on the call stack (:func:`current_executor_future`); the job is
  released when that future completes, when the thread exits or binds another job, or when the
  staged dict is collected unbound (:func:`release_cb`, :func:`staged_collected`);
* :class:`JobTable`: the jobs in flight in save-call order (a save's protocol waits for earlier
  ones, :meth:`JobTable.wait_turn`), their completion, failure, release and barrier, and the
  per-save telemetry;
* errors reported once per channel: always on the save's future; once at the next explicit
  barrier or ``wait()`` unless the caller read it from the future already
  (:class:`SeenTrackingFuture` notes ``exception()`` reads, :func:`raised_by_result` recognises
  ``result()`` raises). Every failure counts, whatever failed: the capture, the writes, or,
  after the data was durable, the commit or another rank (:meth:`JobTable.release_job` learns
  of those from the future).

Threads and locks: the table's ``lock`` (re-entrant; the writer shares it) guards the job lists,
the thread map and the error queue; ``idle`` (a condition on it) is notified whenever a job is
dropped. A job's own ``lock`` serialises its completion, failure and barrier; the engine job is
aborted *before* taking it, since a barrier may hold it while waiting for that job. Callbacks and
finalizers hold the writer weakly (it can be collected with saves bound), through
:class:`JobOwner` (this module never imports the writer), and do nothing in a forked child.
Native engine threads never call any of this.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ..engine import Engine, engine_time_to_perf
from ..errors import CheckpointSaveError
from ..lifecycle import replicas
from . import result_cache
from .capture import SaveJob, raise_if_modified
from .stats import SaveStats

# Messages keep the writer's logger name (this code was part of dcp_datastates.save.writer).
logger = logging.getLogger("dcp_datastates.save.writer")


class JobOwner(Protocol):
    """What this module's callbacks and finalizers call on the writer that owns the jobs (held
    weakly; implemented by :class:`dcp_datastates.save.binding.JobBinding`)."""

    _pid: int  # the owner process: callbacks do nothing in a forked child

    def _bind_thread(self, ident: int, job: SaveJob) -> None: ...

    def _error_seen(self, job: SaveJob) -> None: ...

    def _release_job(
        self, job: SaveJob, why: str, cause: BaseException | None = None, quiet: bool = False
    ) -> None: ...


class Binding:
    """Lives in a save thread's thread-local storage while that thread carries a staged job.

    Its finalizer (thread exit, or replacement by the next job bound to the same thread)
    releases the job: the thread's DCP protocol is over.
    """

    def __init__(self, job: SaveJob) -> None:
        self.job = job


def release_cb(
    writer_ref: weakref.ref[JobOwner], job: SaveJob, pid: int, why: str,
    cause: BaseException | None = None,
) -> None:
    """Finalizer/callback that ends a staged job's protocol (never in a forked child)."""
    if os.getpid() != pid:
        return
    w = writer_ref()
    if w is not None:
        w._release_job(job, why, cause)


def future_exception(fut: concurrent.futures.Future[Any]) -> BaseException | None:
    """The exception of a done future, read without marking it seen."""
    if fut.cancelled():
        return concurrent.futures.CancelledError("the save was cancelled")
    return concurrent.futures.Future.exception(fut, timeout=0)


class SeenTrackingFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The class a save's executor future is switched to: it notes ``exception()`` reads.

    An error returned by ``exception()`` is not raised again at the next barrier. (An error
    raised by ``result()`` is recognised from its traceback instead, see raised_by_result, as
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


def raised_by_result(exc: BaseException | None) -> bool:
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


def current_executor_future() -> concurrent.futures.Future[Any] | None:
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


def async_save_uses_process_executor() -> bool:
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


def staged_collected(
    writer_ref: weakref.ref[JobOwner], job_ref: weakref.ref[SaveJob], pid: int
) -> None:
    """Finalizer of a StagedStateDict: a job no save thread ever bound is released.

    It holds the job weakly: a failed save's error refers, through its traceback's frames, to
    the staged dict, so a strong reference from the finalizer registry would keep the job, its
    error, the staged dict and the user's tensors alive forever. A job collected first needs no
    release (the table holds every job in flight).
    """
    job = job_ref()
    if os.getpid() != pid or job is None or job.thread is not None:
        return
    w = writer_ref()
    if w is not None:
        logger.warning(
            "a staged state dict was discarded before any save used it; its copies are dropped"
        )
        w._release_job(job, "its staged state dict was discarded before any save used it",
                       quiet=True)


def describe_cause(cause: BaseException) -> str:
    """One line naming an exception; for DCP's CheckpointException, the first rank's failure."""
    failures = getattr(cause, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException):
            return f"rank {rank}: {describe_cause(inner)}"
        return str(inner)
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


class StagedStateDict(dict):  # type: ignore[type-arg]
    """The staged dict ``stage()`` returns: it tells the writer which thread saves which job.

    ``dcp.async_save`` hands it to a background thread whose first use of it, before any
    storage-writer call that needs to know, is ``dcp.save``'s ``_stateful_to_state_dict``
    iterating ``items()``. That first iteration in a thread other than the staging one binds
    that thread to this save job, so consecutive saves can be ordered identically on every rank.
    If it is collected without ever being bound, its job is released (failed and dropped).
    It cannot be pickled (``AsyncCheckpointerType.PROCESS`` is not supported).
    """

    def __init__(self, data: dict[str, Any], writer: JobOwner, job: SaveJob) -> None:
        super().__init__(data)
        self._writer_ref = weakref.ref(writer)
        self._job = job
        self._stage_thread = threading.get_ident()
        weakref.finalize(self, staged_collected, self._writer_ref, weakref.ref(job), writer._pid)

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


def track_future(
    fut: concurrent.futures.Future[Any],
    writer_ref: weakref.ref[JobOwner],
    job: SaveJob,
    pid: int,
) -> None:
    """Follows the save's executor future: reading its error counts as seen (``exception()``);
    its completion releases the job with the save's error as the cause."""

    def on_seen() -> None:
        w = writer_ref()
        if w is not None:
            w._error_seen(job)

    try:
        fut._dcpds_on_seen = on_seen  # type: ignore[attr-defined]
        if type(fut) is concurrent.futures.Future:
            fut.__class__ = SeenTrackingFuture
    except (AttributeError, TypeError):  # pragma: no cover - an exotic future
        pass

    def settled(f: concurrent.futures.Future[Any]) -> None:
        if os.getpid() != pid:
            return
        if future_exception(f) is None and job.error is None:
            result_cache.RANK.confirm(job.results_digest)  # committed: may go by reference
            rep = replicas.current()
            if job.replica is not None and rep is not None:
                rep.submit(job.replica)  # lifecycle/replicas.py
        else:
            result_cache.RANK.clear()  # the next save sends its results in full

    # before the release: a job released (wait_idle) has had its round queued
    fut.add_done_callback(settled)
    fut.add_done_callback(
        lambda f: release_cb(writer_ref, job, pid, "its save ended", future_exception(f))
    )


class JobTable:
    """The save jobs in flight on one writer, oldest first, and the errors not yet reported.

    Owned by one writer and living as long as it (it holds the writer's engine, not the writer).
    Thread-safe: used by the training thread (stage, barriers, wait), save threads (the DCP
    protocol) and finalizers; see the module docstring for the locks.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)
        self._jobs: list[SaveJob] = []  # staged or running jobs, oldest first
        self._thread_jobs: dict[int, SaveJob] = {}  # save thread -> the staged job it carries
        self._unreported: collections.deque[SaveJob] = collections.deque()
        self._future_errors: dict[int, BaseException] = {}  # id(job in _unreported) -> its error
        self.stats: collections.deque[SaveStats] = collections.deque(maxlen=1000)

    def add_staged(self, job: SaveJob) -> None:
        """Registers a job ``stage()`` created (it is ordered after every earlier one)."""
        with self.lock:
            self._jobs.append(job)

    def add_adhoc(self, job: SaveJob) -> None:
        """Registers the job ``write_data`` created for a plain ``dcp.save``."""
        with self.lock:
            self._jobs.append(job)

    def unverified(self) -> list[SaveJob]:
        """The jobs whose capture has not been verified yet (what a barrier waits for)."""
        with self.lock:
            return [j for j in self._jobs if not j.verified]

    def waiting_for(self, owner_ids: set[int]) -> list[SaveJob]:
        """Unfinished, unverified jobs holding lazy copies of tensors of these owners."""
        with self.lock:
            return [
                j for j in self._jobs
                if not j.verified and not j.finished and j.waits_for(owner_ids)
            ]

    def wait_idle(self, timeout: float | None) -> bool:
        """Blocks until no job is in flight; False if ``timeout`` (seconds) expired."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.idle:
            while self._jobs:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.idle.wait(left)
        return True

    def wait_turn(
        self, job: SaveJob | None, before_waiting: Callable[[], None] | None = None
    ) -> None:
        """Blocks until every staged save earlier than ``job`` (every one, for None) has ended
        its protocol: one save's protocol (with its collectives) at a time, in the order of the
        save calls, identically on every rank. ``before_waiting`` runs first (without the
        table's lock) if the call is going to wait."""
        limit = job.seq if job is not None else None

        def earlier_running() -> bool:
            return any(
                not j.protocol_done and not j.adhoc and (limit is None or j.seq < limit)
                for j in self._jobs
            )

        if before_waiting is not None:
            with self.lock:
                waits = earlier_running()
            if waits:
                before_waiting()
        with self.idle:
            while earlier_running():
                self.idle.wait()

    def job_of_thread(self, ident: int) -> SaveJob | None:
        """The staged job bound to save thread ``ident``, if any."""
        with self.lock:
            return self._thread_jobs.get(ident)

    def claim_thread(self, ident: int, job: SaveJob) -> bool:
        """Binds ``job`` to save thread ``ident``; False if it is bound or released.

        A job that already failed (a barrier found a changed tensor before its save thread
        started) is still bound: that thread must own it, so that it is ordered by its own job
        (not behind it, see :meth:`wait_turn`) and ends it by raising its error.
        """
        with self.lock:
            if job.thread is not None or job.protocol_done:
                return False
            job.thread = ident
            self._thread_jobs[ident] = job
            return True

    def error_seen(self, job: SaveJob) -> None:
        """The caller read this job's error from its future: the barrier will not raise it."""
        with self.lock:
            job.error_reported = True
            self._future_errors.pop(id(job), None)
            if job in self._unreported:
                self._unreported.remove(job)

    def release_job(
        self, job: SaveJob, why: str, cause: BaseException | None = None, quiet: bool = False,
        path: str = "",
    ) -> None:
        """Ends a staged job's protocol: fails it if its data was never written, drops it.

        ``cause``: the save's error as its future holds it. A job whose data was written but whose
        save failed afterwards (the commit, another rank) gets it as its error, queued for the next
        barrier or ``wait()`` unless the caller has read it from the future.
        ``quiet``: nobody is waiting for that save's outcome; the barrier does not raise it.
        ``path``: the writer's default path, named when the job has no checkpoint id yet.
        """
        with self.lock:
            if job.protocol_done:
                return
            if quiet:
                job.error_reported = True
            job.protocol_done = True  # its DCP protocol (collectives included) is over
            if job.thread is not None and self._thread_jobs.get(job.thread) is job:
                del self._thread_jobs[job.thread]
        if not job.finished:
            msg = (
                f"save to {job.checkpoint_id or path or '<no path>'} failed on rank "
                f"{max(job.rank, 0)} before its data was written ({why})"
            )
            if cause is not None:
                msg += f": {describe_cause(cause)}"
            self.fail_job(job, CheckpointSaveError(msg))
        if cause is not None:
            with self.lock:
                if job in self._unreported:  # the barrier checks whether result() raised it
                    self._future_errors[id(job)] = cause
                elif job.error is None and not job.error_reported:
                    # Its data was durable, then the save failed (the commit, another rank, DCP
                    # after write_data): unseen, it is reported like any other failure.
                    err = CheckpointSaveError(
                        f"save to {job.checkpoint_id or path or '<no path>'} failed on rank "
                        f"{max(job.rank, 0)} after its data was written: {describe_cause(cause)}"
                    )
                    job.error = err
                    self._unreported.append(job)
                    self._future_errors[id(job)] = cause
                    for s in reversed(self.stats):  # its stats were recorded as a success
                        if s.checkpoint_id == (job.checkpoint_id or "") and s.error is None:
                            s.error = str(err)
                            break
        self.drop_job(job)
        job.discard_payload()

    def finish_job(self, job: SaveJob, rank: int) -> None:
        """Marks a job whose data is durable finished: forgets its engine job, records stats."""
        st = self._engine.stats(job.engine_job)
        with job.lock:
            job.finished = True
            self._engine.forget(job.engine_job)
            job.release_sources(done=True)
        self.record_stats(job, rank, st)
        if job.adhoc:
            self.drop_job(job)  # dcp.save: its caller is the only one waiting
            job.discard_payload()  # its records are not needed for the commit (memory peak)

    def fail_job(self, job: SaveJob, err: CheckpointSaveError) -> None:
        """Fails a job (once): aborts its engine job, returns its cache space, queues its error
        for the next barrier or ``wait()`` unless its caller has it already."""
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
        self.record_stats(job, job.rank, st)
        with self.lock:
            if job.adhoc:
                job.error_reported = True  # dcp.save raised it to its caller
            if not job.error_reported:
                self._unreported.append(job)
        if job.adhoc:
            self.drop_job(job)
            job.discard_payload()  # the save context may outlive it; the records are not needed

    def drop_job(self, job: SaveJob) -> None:
        """Removes a job from the table; wakes whoever waits for the table to change."""
        job.end_gc_pause()  # a save thread that never started (capture.py)
        with self.idle:
            if job in self._jobs:
                self._jobs.remove(job)
            self.idle.notify_all()

    def barrier_one(
        self, job: SaveJob, timeout: float | None, report: bool = True, path: str = ""
    ) -> bool:
        """Waits until ``job`` is in the host cache and verifies its lazy tensors are unchanged.

        False if ``timeout`` expired. A changed tensor fails the job; with ``report`` its error is
        raised here (and counts as seen), else logged. ``path`` names the save when the job has
        no checkpoint id.
        """
        t0 = time.perf_counter()
        try:
            with job.lock:
                if job.finished or job.verified:
                    return True
                was_captured = self._engine.is_captured(job.engine_job)
                # The caller (training thread) is blocked anyway: it copies while it waits, so
                # the barrier cannot starve behind idle-priority copy threads.
                if not self._engine.help_until_captured(job.engine_job, timeout):
                    return False  # the time waited is added in `finally`
                if job.captured_before_barrier is None:
                    job.captured_before_barrier = was_captured
                raise_if_modified(job, job.checkpoint_id or path or "<checkpoint>")
                job.verified = True
                job.release_sources()
        except CheckpointSaveError as e:
            self.fail_job(job, e)
            if not report:
                logger.warning("%s", str(e))
                return True
            self.error_seen(job)  # raised here, at the barrier
            raise
        finally:
            job.blocked_s += time.perf_counter() - t0
        return True

    def log_unseen_failures(self) -> None:
        """Logs (once each) failed saves nobody has seen yet; the new save is not affected."""
        with self.lock:
            jobs = [j for j in self._unreported if not j.error_logged]
            for j in jobs:
                j.error_logged = True
        for j in jobs:
            if not raised_by_result(self._future_errors.get(id(j))):
                logger.error("an earlier save failed (raised by its future and writer.wait()): "
                             "%s", j.error)

    def raise_unreported(self) -> None:
        """Raises the error of the oldest failed save its caller has not seen yet (if any)."""
        with self.lock:
            while self._unreported:
                job = self._unreported.popleft()
                job.error_reported = True
                if raised_by_result(self._future_errors.pop(id(job), None)):
                    continue  # the caller got it from the save's future already
                assert job.error is not None
                raise job.error

    def record_stats(self, job: SaveJob, rank: int, st: dict[str, Any]) -> None:
        """Appends the telemetry of a finished or failed job (engine stats ``st``)."""
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
            busy_bytes=job.busy_bytes,
            early_tensors=len(job.early.placed) if job.early is not None else 0,
            flush_busy_s=float(st["flush_busy_s"]),
            flush_writes=int(st.get("flush_writes", 0)),
            error=str(job.error) if job.error is not None else None,
        )
        with self.lock:
            self.stats.append(s)

    def mark_committed(self, checkpoint_id: str, t: float) -> None:
        """Records the commit time ``t`` (perf_counter) in the latest stats of that save."""
        with self.lock:
            for s in reversed(self.stats):
                if s.checkpoint_id == checkpoint_id and math.isnan(s.t_committed):
                    s.t_committed = t
                    s.committed_s = t - s.t_stage
                    return


__all__ = [
    "Binding",
    "JobOwner",
    "JobTable",
    "StagedStateDict",
    "async_save_uses_process_executor",
    "current_executor_future",
    "describe_cause",
    "raised_by_result",
    "release_cb",
    "track_future",
]
