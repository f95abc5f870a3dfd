"""Repeated saves by reference: write results and ``.metadata`` that cross no collective twice.

Why: after the planning (which plan caching makes free when the structure repeats,
:mod:`.plan_cache`), every DCP save still gathers every rank's write results on the coordinator
(one object per item of every rank), merges them into the checkpoint's ``Metadata``, pickles
that into ``.metadata`` and broadcasts it back to every rank. All of it grows with ranks x items:
measured by ``benchmarks/scale_sim.py`` for a 70B layout at 256 ranks, about 17 s of the
coordinator's time per repeated save, and it is the same every time, since a save of the same
structure to the same writer places every item at the same file, offset and length.

What: a rank whose write results are those of its last committed save (the same digest, a
BLAKE2b of their wire form, :meth:`~.wire.CompactWriteResults.digest`) sends a reference
(their digest) instead of them; the coordinator, which kept every rank's results of its last
:data:`CAPACITY` commits by digest, resolves it. When every rank's digest and the planned
``Metadata`` are those of the last commit, the coordinator does not merge nor pickle anything:
``.metadata`` is the last commit's bytes, wrapped so that it unpickles with this save's
``storage_meta`` (:func:`restamped`). A rank whose results changed (a bytes item of another
size, another structure) sends them in full, alone.

Contract:

* a rank refers to results only after a save of them ended without error on that rank (its
  coordinator committed them then); any failed save empties the rank's references, so the next
  save sends its results in full. A coordinator asked for results it does not hold (a rank
  saving through process groups with different coordinators) fails that save naming the rank;
  the next one sends them in full (as :mod:`.plan_cache`, whose limits apply);
* what is cached: on each rank, the digests of its last :data:`CAPACITY` committed results; on
  the coordinator, per rank position, the storage entries of the last :data:`CAPACITY` results
  (the objects the committed ``Metadata`` holds: a dictionary more, not a copy), and the last
  commit's ``.metadata`` bytes. :func:`clear` empties every cache (call it on every rank);
* ``.metadata`` stays a pickle the stock reader loads with ``pickle.load``: the reused form is
  ``pickle.loads(<the last commit's bytes>)`` followed by setting ``storage_meta``, both
  standard pickle operations (``tests/test_result_cache.py`` loads one with the stock reader);
* threads: every cache is guarded by one lock; fork: a child inherits the caches and should
  :func:`clear` them before it saves through another process group.
"""

from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CheckpointSaveError
from .wire import CompactWriteResults

#: How many committed results each cache keeps per rank position (a model and its EMA copy).
CAPACITY = 2

_lock = threading.Lock()


class RankReferences:
    """A rank's digests of results a committed save carried (module docstring)."""

    def __init__(self) -> None:
        self._digests: OrderedDict[bytes, None] = OrderedDict()

    def held(self, digest: bytes | None) -> bool:
        """True when results of this digest were committed: the rank may send the digest."""
        with _lock:
            return digest is not None and digest in self._digests

    def confirm(self, digest: bytes | None) -> None:
        """A save that carried results of this digest ended without error on this rank."""
        if digest is None:
            return
        with _lock:
            self._digests[digest] = None
            self._digests.move_to_end(digest)
            while len(self._digests) > CAPACITY:
                self._digests.popitem(last=False)

    def clear(self) -> None:
        """A save failed: the next one sends its results in full."""
        with _lock:
            self._digests.clear()


@dataclass
class _Commit:
    """The coordinator's last commit: what a save of the same results can reuse."""

    digests: tuple[bytes | None, ...]
    state_dict_metadata: Any
    planner_data: Any
    storage_data: dict[Any, Any]
    blob: bytes


@dataclass
class Resolved:
    """Every rank's storage entries for one save, in rank order, and their digests."""

    storage: list[dict[Any, Any]]
    digests: tuple[bytes | None, ...]


class CoordinatorResults:
    """The coordinator's cache of its ranks' committed results (module docstring)."""

    def __init__(self) -> None:
        self._by_rank: dict[int, OrderedDict[bytes, dict[Any, Any]]] = {}
        self._last: _Commit | None = None

    def resolve(self, results: Sequence[Any], where: str) -> Resolved:
        """Each rank's storage entries: from its results, or from the cache for a rank that
        sent a reference. Raises :class:`CheckpointSaveError` naming the ranks whose
        referenced results this coordinator does not hold (and forgets every reference)."""
        storage: list[dict[Any, Any]] = []
        missing: list[int] = []
        with _lock:
            for position, res in enumerate(results):
                digest = _digest_of(res)
                if getattr(res, "by_reference", False) and not isinstance(
                    res, CompactWriteResults
                ):  # a reference that crossed the gather (a local object holds its items)
                    held = self._by_rank.get(position)
                    cached = None if held is None or digest is None else held.get(digest)
                    if cached is None:
                        missing.append(position)
                        continue
                    storage.append(cached)
                else:
                    storage.append({wr.index: wr.storage_data for wr in res})
            if missing:
                self._by_rank.clear()
                self._last = None
        if missing:
            raise CheckpointSaveError(
                f"save to {where} failed, nothing was committed: rank(s) {missing} sent their "
                "write results by reference, and this coordinator does not hold them (ranks "
                "saving through process groups with different coordinators?); the next save "
                "sends them in full"
            )
        return Resolved(storage, tuple(_digest_of(r) for r in results))

    def reusable(self, metadata: Metadata, resolved: Resolved) -> _Commit | None:
        """The last commit, when this save's planned metadata and every rank's results are
        the same: its ``.metadata`` bytes and storage entries stand for this save's."""
        with _lock:
            last = self._last
        if (
            last is None
            or None in resolved.digests
            or last.digests != resolved.digests
            or last.state_dict_metadata is not metadata.state_dict_metadata
            or last.planner_data is not metadata.planner_data
        ):
            return None
        return last

    def committed(self, metadata: Metadata, resolved: Resolved, blob: bytes | None) -> None:
        """Keeps what a committed save carried (``blob``: its ``.metadata`` bytes, if known)."""
        with _lock:
            for position, (digest, entries) in enumerate(
                zip(resolved.digests, resolved.storage, strict=True)
            ):
                if digest is None:
                    continue
                held = self._by_rank.setdefault(position, OrderedDict())
                held[digest] = entries
                held.move_to_end(digest)
                while len(held) > CAPACITY:
                    held.popitem(last=False)
            if blob is None or metadata.storage_data is None:
                self._last = None
                return
            self._last = _Commit(resolved.digests, metadata.state_dict_metadata,
                                 metadata.planner_data, metadata.storage_data, blob)

    def clear(self) -> None:
        with _lock:
            self._by_rank.clear()
            self._last = None


def _digest_of(results: Any) -> bytes | None:
    """The digest a rank's results came with; results that never crossed a collective (one
    process, no process group) are this process's own ``CompactWriteResults``."""
    if isinstance(results, CompactWriteResults):
        return results.wire_digest() if results.with_digest else None
    return getattr(results, "digest", None)


class _Restamped:
    """Pickles as ``pickle.loads(blob)`` with ``storage_meta`` then set on the result."""

    def __init__(self, blob: bytes, storage_meta: StorageMeta) -> None:
        self.blob = blob
        self.storage_meta = storage_meta

    def __reduce__(self) -> tuple[Any, ...]:
        return (pickle.loads, (self.blob,), {"storage_meta": self.storage_meta})


def restamped(blob: bytes, storage_meta: StorageMeta) -> bytes:
    """``.metadata`` bytes: the pickled ``Metadata`` ``blob`` of an earlier commit, which loads
    with this save's ``storage_meta`` (its checkpoint id and save id). The cost is a copy of
    ``blob``; nothing is pickled again."""
    return pickle.dumps(_Restamped(blob, storage_meta), protocol=pickle.HIGHEST_PROTOCOL)


RANK = RankReferences()
COORDINATOR = CoordinatorResults()


def clear() -> None:
    """Empties this process's caches of results (call it on every rank)."""
    RANK.clear()
    COORDINATOR.clear()


__all__ = ["CAPACITY", "COORDINATOR", "RANK", "CoordinatorResults", "RankReferences",
           "Resolved", "clear", "restamped"]
