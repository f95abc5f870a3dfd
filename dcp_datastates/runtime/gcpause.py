"""Pausing Python's cyclic garbage collector around per-item bookkeeping.

Staging or placing tens of thousands of tensors allocates a few objects per tensor; every 700
allocations CPython runs a collection, and now and then a full one that walks every object of
the process (the model, the optimizer state, the previous saves' records). With 20,000 tensors
that was up to 0.2 s of a 0.4 s ``async_save`` call, and 3.4 s of a 15.6 s ``dcp.save`` of
100,000 tensors. The bookkeeping creates no reference cycles, so nothing is lost by collecting
once afterwards, at the next allocation, instead of dozens of times during it.

Contract:

* :func:`gc_paused` is used only around loops that never wait (no I/O, no lock held by another
  thread, no engine wait), so the pause lasts as long as the Python work itself;
* it is process-wide (CPython has one collector), re-entrant and thread-safe: the collector is
  re-enabled when the last pause ends, and only if it was enabled when the first one began (a
  program that disabled it keeps it disabled);
* fork: a child forked while another thread of the parent is inside a pause (a DataLoader
  worker started during a save) would inherit a disabled collector that no thread of its own
  ever re-enables. The child therefore starts with no pause in progress and the collector
  restored; a pause that was entered before the fork ends in the child without effect.

:class:`ProtocolPause` covers code that is not ours, or spans threads: the ``stage()`` walk's
pause, which the save thread takes over and keeps through DCP's planning (no collection in
the caller's ``async_save`` call), and DCP's planning between two calls of the
storage-writer protocol (100,000 items: 3.3 s of collections in a 9.8 s ``dcp.save``). DCP may
stop between those calls (a planner error, a failed collective) without calling the writer
again, so such a pause also ends by itself after ``max_s`` seconds (a timer thread), and the
writer ends it when the save's context ends (the next save in that thread, or the thread's exit).
At worst the collector is off for ``max_s`` seconds after a failure: nothing is lost, cyclic
garbage is only collected later. Collective waits happen inside it (bounded by ``max_s``). A
save's pause ends after the save's last protocol call, once DCP's frames have dropped the plan's
objects, which then die by reference counting and are never scanned: when an ``async_save``'s
future completes, a ``dcp.save``'s 0.1 s + 50 us per item after ``finish()``
(``SaveContext.end_gc_pause_after_save``). The collector's switch is global: a program that calls
``gc.disable()`` *while* a save is planning, or right after it, finds the collector enabled
again when that pause ends (one that disabled it before the save keeps it disabled).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_reenable = False
_generation = 0  # bumped in a forked child: pauses entered before the fork end without effect


def _reset_in_child() -> None:
    global _lock, _depth, _reenable, _generation
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _depth > 0 and _reenable:
        gc.enable()
    _depth, _reenable = 0, False
    _generation += 1


os.register_at_fork(after_in_child=_reset_in_child)


def _enter() -> int:
    """Begins a pause; returns the fork generation it belongs to."""
    global _depth, _reenable
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            if _reenable:
                gc.disable()
        _depth += 1
        return _generation


def _exit(generation: int) -> None:
    """Ends a pause begun in ``generation`` (one begun before a fork ends without effect)."""
    global _depth, _reenable
    with _lock:
        if generation == _generation:
            _depth -= 1
            if _depth == 0 and _reenable:
                _reenable = False
                gc.enable()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Runs the body with the cyclic garbage collector disabled (see the module docstring)."""
    generation = _enter()
    try:
        yield
    finally:
        _exit(generation)


PROTOCOL_PAUSE_MAX_S = 60.0  # a ProtocolPause nobody ends lasts this long


class ProtocolPause:
    """A pause across calls that may never come back: ended by :meth:`end` (idempotent, any
    thread) or, failing that, by a timer after ``max_s`` seconds (default
    :data:`PROTOCOL_PAUSE_MAX_S`)."""

    def __init__(self, max_s: float | None = None) -> None:
        if max_s is None:
            max_s = PROTOCOL_PAUSE_MAX_S
        self._end_lock = threading.Lock()
        self._ended = False
        self._generation = _enter()
        self._timer = threading.Timer(max_s, self.end)
        self._timer.daemon = True
        self._timer.name = "dcp_datastates-gc-pause"
        self._timer.start()

    @property
    def ended(self) -> bool:
        return self._ended

    def end_soon(self, delay_s: float) -> None:
        """Ends the pause ``delay_s`` seconds from now (on the timer thread), not now.

        For the end of a save: the caller's frames still hold the plan's objects, which all die
        by reference counting as the save returns; a collection started now would scan them.
        """
        with self._end_lock:
            if self._ended:
                return
            self._timer.cancel()
            self._timer = threading.Timer(delay_s, self.end)
            self._timer.daemon = True
            self._timer.name = "dcp_datastates-gc-pause"
            self._timer.start()

    def end(self) -> None:
        """Ends the pause (the collector runs again when no other pause is left)."""
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
        if threading.current_thread() is not self._timer:
            self._timer.cancel()
        _exit(self._generation)


__all__ = ["ProtocolPause", "gc_paused"]
