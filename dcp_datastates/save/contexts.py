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
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..format.commit import CheckpointDir, claim_and_prepare, release_path
from ..runtime.gcpause import ProtocolPause
from .capture import SaveJob

if TYPE_CHECKING:
    from .writer import DataStatesWriter


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


def end_context_cb(
    writer_ref: weakref.ref[DataStatesWriter], ctx: SaveContext, pid: int
) -> None:
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
    ctx.path_key = claim_and_prepare(
        ctx.directory(), durable, before_prepare, remove_old=not defer_removal
    )
    ctx.removal_deferred = defer_removal


def release_claim(ctx: SaveContext) -> None:
    """Releases the context's path claim, if it holds one (idempotent)."""
    if ctx.path_key is not None:
        release_path(ctx.path_key, ctx.directory() if ctx.removal_deferred else None)
        ctx.path_key = None
        ctx.removal_deferred = False


__all__ = ["ContextHolder", "SaveContext", "claim_path", "end_context_cb", "release_claim"]
