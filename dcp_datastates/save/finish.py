"""Completing a save: this rank's data durable and its manifest written, then the commit.

:class:`WriteCompletion` (a base of :class:`~dcp_datastates.DataStatesWriter`) holds what follows
the placement of a save's items in ``write_data`` and what ``finish`` does:

* ``write_data`` hands its write results over (:meth:`WriteCompletion._hand_over`): a plain
  ``dcp.save``, and the ranks of an ``async_save`` without a store to report through, wait there
  until their data is durable; the coordinator of an ``async_save`` hands the pending write to
  ``finish``, which waits for it while the ``.metadata`` is pickled; another rank of an
  ``async_save`` completes in a thread of its own (``dcp_datastates-complete``) and reports to the
  coordinator through the process group's store (:mod:`dcp_datastates.save.rank_commit`);
* ``finish`` (the coordinator; :meth:`WriteCompletion._commit`) waits for its own data and for
  every rank that handed its results over early, then writes ``.metadata`` atomically (the
  commit), records the commit time, and queues the copy to the persistent tier;
* results unchanged since a committed save travel by reference, and a repeated save writes the
  last commit's ``.metadata`` bytes again (:mod:`dcp_datastates.save.result_cache`); after a
  multi-rank ``async_save``, DCP broadcasts its result as a reference
  (:mod:`dcp_datastates.save.lazy_metadata`).

Threads: the save thread, and the completion thread of a non-coordinator, whose lifetime is the
job's: the job's release joins it (aborting the job first if the save failed elsewhere), so the
job never ends while the thread may still use it. Native threads never call any of this.

Failures: a failed save raises CheckpointSaveError from ``write_data``, or from ``finish`` where
one process's ``async_save`` handed its results over before its data was durable (hence on the
save's future as DCP's CheckpointException); nothing is committed for it and its cache space is
returned; its path claim is released, so a later save to the path does not find it busy. Each
error is reported once per channel: always on the save's future, then once at the next explicit
barrier (``wait_captured``, a ``protect()`` hook, ``synchronize_staging``) or ``wait()`` unless
the caller already read it from the future (``result()``/``exception()``) or from ``dcp.save``.
The automatic step barrier never raises (it logs), the next save logs it, ``close()`` logs it. A
later save is never refused because an earlier one failed (:mod:`dcp_datastates.save.jobs`). A
failed copy to the persistent tier never fails the save: the refusal to queue it is logged.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import Any, NoReturn

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ..config import WriterConfig
from ..errors import CheckpointSaveError, reraisable
from ..lifecycle.replicas import ReplicaRequest
from ..lifecycle.tiers import Promoter
from ..runtime.gcpause import gc_paused
from . import rank_commit, result_cache
from .capture import SaveJob
from .contexts import SaveContext, release_claim
from .jobs import JobTable
from .lazy_metadata import broadcast_as_reference
from .placement import PendingWrite
from .planner import share_metadata_values
from .release import DeferredRelease
from .wire import CompactWriteResults

# Messages keep the writer's logger name (this code was part of dcp_datastates.save.writer).
logger = logging.getLogger("dcp_datastates.save.writer")

try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    CURRENT_DCP_VERSION = "1.0.0"  # type: ignore[misc]


class WriteCompletion:
    """Completes a save's writes and commits it (module docstring).

    A base of DataStatesWriter; the writer provides the attributes annotated here.
    """

    config: WriterConfig
    _table: JobTable
    _promoter: Promoter | None
    _released: DeferredRelease

    def _hand_over(
        self, ctx: SaveContext, job: SaveJob, plan: SavePlan, results: list[WriteResult],
        pending: PendingWrite,
    ) -> CompactWriteResults:
        """The end of ``write_data`` once its items are placed: completes the write here, or
        arranges for it to complete later; returns the results DCP gathers."""
        out = CompactWriteResults(results)  # DCP gathers them (wire.py)
        out.with_digest = True  # the coordinator keeps committed results by it (result_cache)
        job.results_digest = out.wire_digest()
        if not ctx.coordinator and result_cache.RANK.held(job.results_digest):
            out.by_reference = True  # those of a committed save: the coordinator holds them
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
            ticket = rank_commit.Ticket(ctx.rank, ctx.save_id, rank_commit.group_of(ctx.path))
            job.reporter = rank_commit.Reporter(kv, ticket, self.config.rank_liveness_s)
            self._complete_in_background(ctx, job, pending, job.reporter)
            out.awaited = ticket
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
        return out

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
        if self.config.replicas and not ctx.coordinator:
            job.replica = ReplicaRequest(ctx.path, ctx.rank, None, self.config.replicas)
        if self._promoter is not None and not ctx.coordinator:
            # This rank's files are durable; the coordinator's promotion commits the copy.
            self._submit_promotion(ctx, 0)

    def _complete_in_background(
        self, ctx: SaveContext, job: SaveJob, pending: PendingWrite,
        reporter: rank_commit.Reporter,
    ) -> None:
        """Completes a non-coordinator's write in a thread (``dcp_datastates-complete``).

        The thread waits for the data, writes the manifest, finishes the job and reports to the
        coordinator through ``reporter``; on any failure it fails the job and reports the
        error (rank_commit.py). The job's release joins it (aborting the job first if the save
        failed elsewhere), so the job never ends while the thread may still use it.
        """
        def run() -> None:
            try:
                self._write_completed(ctx, job, pending)
            except BaseException as e:  # noqa: BLE001 - reported through the job and the store
                err = save_error(ctx, e)
                if not isinstance(job.error, CheckpointSaveError):
                    self._table.fail_job(job, err)
                reporter.report(str(job.error or err))
                return
            reporter.report(None)

        t = threading.Thread(target=run, name="dcp_datastates-complete", daemon=True)
        job.completer = t
        t.start()

    def _raise_write_failure(self, ctx: SaveContext, job: SaveJob, e: BaseException) -> NoReturn:
        """Fails ``job`` for ``e`` (unless it failed elsewhere first) and raises the error."""
        ctx.end_gc_pause()
        if isinstance(job.error, CheckpointSaveError):
            # Failed elsewhere first (a barrier found a changed tensor, an abort): that is
            # the cause; what this thread hit afterwards is only a consequence.
            release_claim(ctx)
            raise reraisable(job.error) from e
        err = save_error(ctx, e)
        self._table.fail_job(job, err)
        release_claim(ctx)  # a later save to this path must not find it busy
        if err is e:
            raise
        raise err from e

    def _commit(
        self, ctx: SaveContext, metadata: Metadata, results: list[list[WriteResult]]
    ) -> None:
        """``finish``: waits for this rank's data and for the ranks that handed their results
        over early, then writes ``.metadata`` (the commit); the save's context is over after."""
        try:
            resolved, blob, kept = self._metadata_bytes(ctx, metadata, results)
            job = ctx.job
            pending = job.pending_write if job is not None else None
            if pending is not None:
                assert job is not None
                job.pending_write = None
                ctx.end_gc_pause()  # training runs while this thread waits for the data
                self._complete_write(ctx, job, pending)
                others = rank_commit.awaited_tickets(results)
                if others:  # ranks that sent their results before their data was durable
                    kv = rank_commit.store()
                    if kv is None:
                        raise CheckpointSaveError(
                            f"save to {ctx.path}: ranks {sorted(t.rank for t in others)} "
                            "report through the process group's store, which this rank "
                            "cannot reach"
                        )
                    rank_commit.wait_for_ranks(
                        kv, others, ctx.path, self.config.rank_timeout_s,
                        self.config.rank_liveness_s,
                    )
                ctx.begin_gc_pause()  # the commit and DCP's broadcast of the result
            ctx.directory().commit(metadata, self.config.durable, blob=blob)
            self._table.mark_committed(ctx.path, time.perf_counter())
            result_cache.COORDINATOR.committed(metadata, resolved, kept)
            if self.config.replicas and ctx.job is not None:
                ctx.job.replica = ReplicaRequest(ctx.path, ctx.rank, ctx.save_id,
                                                 self.config.replicas)
            if ctx.job is not None and not ctx.job.adhoc:
                self._released.hold(metadata)  # async_save's result: see release.py
                if len(results) > 1:  # DCP broadcasts it: as a reference (lazy_metadata.py)
                    broadcast_as_reference(metadata, ctx.path, ctx.storage_options)
            if self._promoter is not None:
                self._submit_promotion(ctx, len(results))
        finally:
            # after DCP's broadcast of the result and its frames let go of the plan (gcpause.py)
            ctx.end_gc_pause_after_save(len(metadata.storage_data or ()))
            ctx.finished = True
            release_claim(ctx)

    @staticmethod
    def _metadata_bytes(
        ctx: SaveContext, metadata: Metadata, results: list[list[WriteResult]]
    ) -> tuple[result_cache.Resolved, bytes, bytes]:
        """Completes ``metadata`` with every rank's storage entries (results sent by reference
        resolved) and returns them, the ``.metadata`` bytes and the bytes to keep for a later
        save of the same results: the last commit's, restamped, when they are the same
        (result_cache.py), else a fresh pickle (while the data may still be flushing)."""
        metadata.version = CURRENT_DCP_VERSION
        resolved = result_cache.COORDINATOR.resolve(results, ctx.path)
        reuse = result_cache.COORDINATOR.reusable(metadata, resolved)
        metadata.storage_meta = StorageMeta(checkpoint_id=ctx.path, save_id=ctx.save_id)
        if reuse is not None:
            metadata.storage_data = reuse.storage_data
            return resolved, result_cache.restamped(reuse.blob, metadata.storage_meta), reuse.blob
        storage_md: dict[Any, Any] = {}
        for entries in resolved.storage:
            storage_md.update(entries)
        metadata.storage_data = storage_md
        share_metadata_values(metadata)  # pickled into .metadata and by the broadcast
        with gc_paused():  # an object per item (see dcp_datastates.runtime.gcpause)
            blob = pickle.dumps(metadata)
        return resolved, blob, blob

    def _submit_promotion(self, ctx: SaveContext, world_size: int) -> None:
        """Queues the copy of this rank's part to the persistent tier; never fails the save (the
        fast checkpoint is committed or durable already): a refusal is logged."""
        assert self._promoter is not None
        try:
            self._promoter.submit(ctx.path, ctx.rank, world_size, coordinator=ctx.coordinator)
        except (RuntimeError, ValueError) as e:
            logger.error("%s is not copied to the persistent tier: %s", ctx.path, str(e))


def save_error(ctx: SaveContext, e: BaseException) -> CheckpointSaveError:
    """``e`` as the error of this save on this rank (itself if it is one already)."""
    if isinstance(e, CheckpointSaveError):
        return e
    return CheckpointSaveError(
        f"save to {ctx.path} failed on rank {ctx.rank}: {type(e).__name__}: {e}"
    )


__all__ = ["CURRENT_DCP_VERSION", "WriteCompletion", "save_error"]
