"""Save contexts: the DCP protocol state of one save, kept per save thread.

DCP drives one save from one thread (``reset`` .. ``finish``), and several saves may be in flight
on one writer (one background thread per ``async_save``), so a writer keeps each save's state in a
thread-local :class:`SaveContext`. This module holds that state, the holder whose finalizer ends a
context when its thread exits, and the path claim a context takes for its save.

Threads and lifetimes: a context is created, read and ended by its own save thread, except that
its holder's finalizer may run in whatever thread drops the last reference (thread exit). The
finalizer holds the writer weakly, so an idle thread-local never keeps a writer (its host cache and
threads) alive; with the writer gone it still releases the path claim. In a forked child the
finalizer does nothing (the context belongs to a thread of the parent).

:class:`SaveContexts` is the writer's side of it (a base of
:class:`~dcp_datastates.DataStatesWriter`): a context begins at ``reset`` (or at the first call
of a save without one), is found by every later protocol call of that thread, and ends when it is
replaced, when its thread exits, or after ``finish``. Ending a context undoes what its save left
open (a collector pause, a pending write, the path claim) and fails a plain ``dcp.save``'s job
that never wrote its data; a staged job is released by its binding instead
(:mod:`dcp_datastates.save.binding`). The path claim is taken by the coordinator in
``prepare_global_plan`` (by ``write_data`` with no global plan step) after every rank checked
that the save can replace what is there (``prepare_local_plan``); it is released after the commit
or the failure, never held by a context that ended.
"""

from __future__ import annotations

import os
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import WriterConfig
from ..errors import CheckpointExistsError, CheckpointSaveError
from ..format.commit import METADATA_FILE, CheckpointDir, claim_and_prepare, release_path
from ..runtime.gcpause import ProtocolPause
from .capture import SaveJob
from .jobs import JobTable, current_executor_future

# How long a collector pause held until an async_save's release may last if that never comes.
AFTER_SAVE_BACKSTOP_S = 10.0


@dataclass
class SaveContext:
    """Protocol state of one save in one thread (DCP drives a save from a single thread)."""

    path: str
    rank: int = 0
    coordinator: bool = True
    use_collectives: bool = True
    save_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    job: SaveJob | None = None  # the staged job this save thread carries (None: dcp.save)
    path_key: str | None = None  # set while this context holds the path claim
    # The claim left the overwritten checkpoint in place: the save removes it once its own data
    # is durable (placement, early placement with one rank); True until it has.
    removal_deferred: bool = False
    meta_taken: bool = False  # storage_meta() ran: the next storage_meta() begins a new save
    finished: bool = False  # finish() ran (coordinator) or the context ended
    ended: bool = False
    storage_options: dict[str, Any] | None = None  # fsspec options of non-local URLs
    gc_pause: ProtocolPause | None = None  # collector off during DCP's planning (gcpause.py)

    def end_gc_pause(self) -> None:
        """Ends the collector pause this save holds, if any (idempotent)."""
        pause, self.gc_pause = self.gc_pause, None
        if pause is not None:
            pause.end()

    def end_gc_pause_after_save(self, items: int) -> None:
        """Ends the collector pause once this save's protocol is over, not in ``finish()``.

        After ``finish()`` DCP pickles the metadata once more (its broadcast of the result, even
        on one rank) while its frames still hold the plans: a collection then would scan all of
        it (with 22,924 tensors and 16 GB resident, the broadcast took 1.5 s instead of 0.1 s).
        An ``async_save``'s pause ends when its future completes (the job's release; a timer
        ends it after ``AFTER_SAVE_BACKSTOP_S`` should that never come); a ``dcp.save``'s, which
        has no such event, 0.1 s + 50 us per item after ``finish()`` (a timer).
        """
        pause, self.gc_pause = self.gc_pause, None
        if pause is None:
            return
        if self.job is not None and not self.job.adhoc and self.job.hold_gc_pause_until_release(
            pause
        ):
            pause.end_soon(AFTER_SAVE_BACKSTOP_S)  # should the release never come
        else:
            pause.end_soon(0.1 + 50e-6 * items)

    def begin_gc_pause(self) -> None:
        """Pauses the collector until :meth:`end_gc_pause` (or the pause's own time limit);
        a pause this save holds already goes on."""
        if self.gc_pause is None or self.gc_pause.ended:
            self.gc_pause = ProtocolPause()

    def directory(self) -> CheckpointDir:
        """The checkpoint directory of this save (with the writer's storage options)."""
        return CheckpointDir(self.path, self.storage_options)


class ContextHolder:
    """Lives in thread-local storage; its finalizer ends the context when the thread exits."""

    def __init__(self, ctx: SaveContext) -> None:
        self.ctx = ctx


def end_context_cb(writer_ref: weakref.ref[SaveContexts], ctx: SaveContext, pid: int) -> None:
    """Finalizer of a ContextHolder. Holds the writer weakly, so the writer can be collected."""
    if os.getpid() != pid:
        return  # a forked child: the context belongs to a parent thread
    w = writer_ref()
    if w is not None:
        w._end_context(ctx)
    elif ctx.path_key is not None:
        release_path(ctx.path_key, ctx.directory() if ctx.removal_deferred else None)
        ctx.path_key = None


def claim_path(
    ctx: SaveContext,
    durable: bool,
    before_prepare: Callable[[], None] | None = None,
    defer_removal: bool = False,
) -> None:
    """Claims the context's path for its save and clears what an overwritten checkpoint left.

    In-process and cross-process (marker flock) claim, then ``before_prepare`` (which may refuse
    the save: nothing is removed then), then the overwritten checkpoint's files go, unless
    ``defer_removal`` (the save removes them itself, once its data is durable: see
    ``SaveContext.removal_deferred``); on failure the claim is released inside
    (commit.claim_and_prepare) and the error raised.
    """
    fut = current_executor_future()  # async_save: its future tells when its caller was told
    ctx.path_key = claim_and_prepare(
        ctx.directory(), durable, before_prepare, remove_old=not defer_removal,
        ended=fut.done if fut is not None else None,
    )
    ctx.removal_deferred = defer_removal


def release_claim(ctx: SaveContext) -> None:
    """Releases the context's path claim, if it holds one (idempotent)."""
    if ctx.path_key is not None:
        release_path(ctx.path_key, ctx.directory() if ctx.removal_deferred else None)
        ctx.path_key = None
        ctx.removal_deferred = False


class ReplaceChecks(Protocol):
    """What the path claim asks of a writer's placer (:class:`~.placement.Placer`)."""

    def check_replace(self, ctx: SaveContext, job: SaveJob | None) -> None: ...

    def defers_removal(self, ctx: SaveContext, job: SaveJob | None) -> bool: ...


class SaveContexts:
    """A writer's save contexts, one per save thread, and their path claims (module docstring).

    A base of DataStatesWriter; the writer provides the attributes annotated here.
    """

    path: str
    overwrite: bool
    storage_options: dict[str, Any]
    config: WriterConfig
    _pid: int
    _tls: threading.local  # .holder: this thread's ContextHolder
    _table: JobTable
    _placer: ReplaceChecks

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
        ctx: SaveContext = holder.ctx
        return ctx

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

    def _check_before_claim(self) -> None:
        """``prepare_local_plan``'s checks, on every rank before the coordinator's claim.

        ``overwrite=False``: refuses a save to a committed checkpoint. Otherwise: nothing of the
        checkpoint being replaced is removed for a save that has failed or cannot fit
        (dcp_datastates.storage.room). Either refusal ends the save's collector pause.
        """
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
            ctx = holder.ctx
            try:
                self._placer.check_replace(ctx, ctx.job)
            except BaseException:
                ctx.end_gc_pause()
                raise

    def _claim_and_prepare(self, ctx: SaveContext) -> None:
        claim_path(
            ctx,
            self.config.durable,
            lambda: self._placer.check_replace(ctx, ctx.job),
            defer_removal=self._placer.defers_removal(ctx, ctx.job),
        )

    def _release_claim(self, ctx: SaveContext) -> None:
        release_claim(ctx)


__all__ = [
    "ContextHolder",
    "ReplaceChecks",
    "SaveContext",
    "SaveContexts",
    "claim_path",
    "end_context_cb",
    "release_claim",
]
