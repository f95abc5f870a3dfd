"""A writer's side of its save jobs: binding a staged job to its save thread, its turn, its release.

:class:`JobBinding` (a base of :class:`~dcp_datastates.DataStatesWriter`) holds the calls the
job table's callbacks make on the writer (:mod:`dcp_datastates.save.jobs`, through weak
references): ``_bind_thread``, ``_release_job``, ``_error_seen``; and what a save thread does
with its job: wait for its turn and place it early (``_set_up``, ``_start_early``), or, for a
plain ``dcp.save``, create it (``_bind_job``).

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

Threads: ``_bind_thread`` runs in the save thread (inside DCP's first iteration of the staged
dict), ``_release_job`` and ``_error_seen`` in whatever thread completes the save's future, reads
its error or drops the binding (thread exit, a finalizer); never in native threads. Saves run their
protocol one at a time, in the order of the save calls, identically on every rank
(:meth:`~dcp_datastates.save.jobs.JobTable.wait_turn`).
Failures: a job released before its data was written is failed with a CheckpointSaveError naming
why (its cache space returned); a save that failed elsewhere aborts this rank's flush first.
Lifetime and fork: the callbacks hold the writer weakly and do nothing once it is collected or in
a forked child.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ..engine import Engine
from ..errors import CheckpointSaveError
from ..lifecycle.tiers import Promoter
from .barrier import default_world_size
from .capture import SaveJob
from .contexts import SaveContext
from .jobs import (
    Binding,
    JobOwner,
    JobTable,
    current_executor_future,
    describe_cause,
    release_cb,
    track_future,
)
from .placement import Placer

# Messages keep the writer's logger name (this code was part of dcp_datastates.save.writer).
logger = logging.getLogger("dcp_datastates.save.writer")


class JobBinding:
    """Binds staged jobs to save threads and releases them (module docstring).

    A base of DataStatesWriter; the writer provides the attributes annotated here.
    """

    path: str
    _pid: int
    _lock: threading.RLock
    _tls: threading.local  # .holder: the thread's save context; .binding: its Binding
    _engine: Engine
    _table: JobTable
    _placer: Placer
    _promoter: Promoter | None

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
        wref: weakref.ref[JobOwner] = weakref.ref(self)
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
                "(one .metadata per rank: no resharding, no deduplication, no global commit); "
                "save with the default use_collectives=True: with dcp_datastates.planner(), "
                "a repeated save sends no plans nor results and commits after one round "
                "through the store (docs/scale.md)"
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

    def _bind_job(self, ctx: SaveContext, plan: SavePlan, planner: SavePlanner) -> SaveJob:
        """``write_data``'s job: the staged one this thread carries, or, for a plain
        ``dcp.save``, a new one whose tensors are captured as their items are placed."""
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
        reporter, job.reporter = job.reporter, None
        if reporter is not None:
            reporter.close()  # the save ended: no more heartbeats (rank_commit.py)
        self._table.release_job(job, why, cause, quiet, path=self.path)
        pending, job.pending_write = job.pending_write, None
        if pending is not None:  # DCP stopped between write_data and finish()
            pending.abandon()


__all__ = ["JobBinding"]
