"""Deferred release: a save's large result is freed off the training thread, in slices.

``dcp.async_save`` returns a future whose result is the checkpoint's global ``Metadata``: one
entry per item, several objects each (20,000 tensors: about 100,000 objects). Whoever drops the
last reference to it frees them all in one deallocation cascade that holds the GIL throughout;
in a training loop that is the training thread, as it rebinds ``fut = dcp.async_save(...)`` at the
next save: 25-30 ms of the next save call with 20,000 tensors, on the machine of
docs/benchmarks.md.

:class:`DeferredRelease` keeps a reference to such a result (the coordinator's ``finish`` hands
it the ``Metadata`` of each ``async_save``), so the caller's drop frees nothing. A later save's
thread calls :meth:`DeferredRelease.collect`: every held object that nothing else references any
more is taken apart there, a slice of its dictionaries' entries at a time, releasing the GIL
between slices, so the training thread runs in between instead of waiting for the whole cascade.

Contract:

* what "nothing else references" means: the object's reference count is what our own references
  account for (measured on a control object held the same way, so it holds on any CPython), and
  no weak reference to it exists; a dictionary attribute is emptied only under the same test
  (a caller may keep ``md.state_dict_metadata`` and drop ``md``). An object still referenced is
  left alone and kept, up to ``keep`` objects; beyond that the oldest is simply dropped (its
  last holder frees it, as without this module).
* threads: any thread may call :meth:`hold`, :meth:`collect` and :meth:`clear` (a lock guards the
  list; the taking apart runs without it, on objects no other thread can reach).
* failures: taking apart never raises (an object that cannot be taken apart is just dropped).
* fork: a child inherits the held objects and frees them with the process, or by :meth:`clear`.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Any

SLICE_ITEMS = 1000  # dictionary entries freed between two releases of the GIL


class _Probe:
    """A control object held exactly like the objects we hold (see ``_probe_refcounts``)."""

    def __init__(self) -> None:
        self.d: dict[Any, Any] = {}


class DeferredRelease:
    """Holds results whose freeing should not fall on the caller's thread (module docstring)."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._held: list[Any] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(self, obj: Any) -> None:
        """Keeps a reference to ``obj`` until a :meth:`collect` finds it unreferenced."""
        with self._lock:
            self._held.append(obj)
            dropped = self._held[: max(0, len(self._held) - self._keep)]
            del self._held[: len(dropped)]
        del dropped  # still referenced elsewhere, most likely: dropping is cheap

    def collect(self) -> int:
        """Takes apart, in slices, every held object nothing else references; returns how many.

        Runs on the calling thread (a save thread), releasing the GIL between slices.
        """
        with self._lock:
            held, self._held = self._held, []
        expected, expected_attr = _probe_refcounts()
        keep: list[Any] = []
        freed = 0
        while held:
            obj = held.pop(0)
            if not _weakly_referenced(obj) and _refcount(obj) <= expected:
                _take_apart(obj, expected_attr)
                freed += 1
            else:
                keep.append(obj)
            del obj
        with self._lock:
            self._held[:0] = keep
        return freed

    def clear(self) -> None:
        """Drops every held reference now (on the calling thread)."""
        with self._lock:
            held, self._held = self._held, []
        del held


def _probe_refcounts() -> tuple[int, int]:
    """The counts :func:`_refcount` and :func:`_attr_refcount` show for an object, and its dict
    attribute, that nothing else references, seen from the same frames as in ``collect``."""
    held = [_Probe()]
    obj = held.pop(0)
    return _refcount(obj), _attr_refcount(obj, "d")


def _refcount(obj: Any) -> int:
    return sys.getrefcount(obj)


def _attr_refcount(obj: Any, name: str) -> int:
    value = obj.__dict__[name]
    return sys.getrefcount(value)


def _weakly_referenced(obj: Any) -> bool:
    try:
        return weakref.getweakrefcount(obj) > 0
    except TypeError:
        return False


def _take_apart(obj: Any, expected_attr: int) -> None:
    """Empties ``obj``'s dictionary attributes a slice at a time (GIL released in between)."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return
    for name in list(attrs):
        if type(attrs.get(name)) is not dict or _attr_refcount(obj, name) > expected_attr:
            continue
        d = attrs[name]
        try:
            while d:
                for _ in range(min(SLICE_ITEMS, len(d))):
                    d.popitem()
                time.sleep(0)  # lets the training thread run between slices
        except Exception:  # noqa: BLE001 - a dict changing under us: leave the rest to decref
            pass
        del d


__all__ = ["DeferredRelease", "SLICE_ITEMS"]
