"""Several ranks: the coordinator commits only once every rank's data is durable.

With several ranks an ``async_save``'s ranks hand their write results to DCP as soon as every item
is placed (where each item's bytes go is known then), not once their data is durable: DCP's
gather of the results, the coordinator's global metadata and its pickle then run while the data
still flushes. What the coordinator must not do is commit before every rank's data is durable.

So a rank that hands its results over early reports, once its data is durable and its manifest
written, through the process group's key-value store (the c10d store every ``torch.distributed``
job has, reachable from every node: no shared file system is assumed, node-local checkpoint
directories work): :func:`report` sets the key ``dcp_datastates/durable/<the rank's save id>``
to ``{"rank": r, "error": null}``, or to the error if its flush failed. The coordinator, in
``finish()``, looks at those keys (:func:`wait_for_ranks`) and only then writes ``.metadata``;
a rank's error fails the save naming that rank, nothing is committed, and DCP carries the error to
every rank's future. A rank that dies (or cannot reach the store) is named by the wait's timeout
(:data:`RANK_WAIT_TIMEOUT_S`, DCP's default collective timeout). The coordinator deletes the
keys it read.

Which ranks handed their results over early travels with the results themselves
(:class:`AwaitedResults`, built from ``wire.CompactWriteResults.awaited``), so the coordinator
never waits for a rank that did not (a ``dcp.save``, the safetensors format, a job whose store
cannot be reached: those ranks return their results once their data is durable, as before).

The wait looks at the keys with ``Store.check`` (every 0.5 ms at first, backing off to 20 ms; a
round trip per look and per report that arrived) rather than blocking in ``Store.wait``: a
TCPStore client serves one request at a time, and a blocking wait would hold up every other use
of the store in the coordinator's process (a new process group, a barrier) for as long as the
flush takes.

Threads: :func:`wait_for_ranks` runs in the coordinator's save thread (the GIL is released while
it sleeps); :func:`report` in the reporting rank's completion thread.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointSaveError

logger = logging.getLogger(__name__)

#: How long the coordinator waits for the other ranks' data (seconds): the 30 minutes of
#: DCP's default collective timeout, which the same wait had when it happened inside DCP's gather.
RANK_WAIT_TIMEOUT_S = 1800.0

_KEY_PREFIX = "dcp_datastates/durable/"
_POLL_FIRST_S = 0.0005
_POLL_MAX_S = 0.02


def store() -> Any | None:
    """The default process group's key-value store, or None (no process group, no store)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _key(save_id: str) -> str:
    return _KEY_PREFIX + save_id


class AwaitedResults(list):  # type: ignore[type-arg]
    """A rank's write results that reached the coordinator before that rank's data was durable.

    ``rank`` and ``save_id`` name the report the coordinator waits for before it commits.
    Otherwise a plain list of ``WriteResult``.
    """

    def __init__(self, results: Iterable[Any], rank: int, save_id: str) -> None:
        super().__init__(results)
        self.rank = rank
        self.save_id = save_id


def awaited_ranks(results: Iterable[Any]) -> dict[int, str]:
    """The ranks among ``results`` (DCP's gathered write results) whose data may still flush,
    with each one's save id (the key of its report)."""
    return {r.rank: r.save_id for r in results if isinstance(r, AwaitedResults)}


def report(kv: Any, rank: int, save_id: str, error: str | None) -> None:
    """Tells the coordinator that ``rank``'s data of save ``save_id`` is durable (``error`` is
    None) or never will be. Never raises: should the store be unreachable, the coordinator's
    wait times out naming the rank."""
    try:
        kv.set(_key(save_id), json.dumps({"rank": rank, "error": error}))
    except Exception as e:  # noqa: BLE001 - any store failure ends in the coordinator's timeout
        logger.error("rank %d cannot report its save %s to the coordinator: %s", rank, save_id, e)


def wait_for_ranks(
    kv: Any, ranks: dict[int, str], where: str, timeout_s: float | None = None
) -> None:
    """Returns once every rank in ``ranks`` (rank -> its save id) reported its data durable.

    Raises :class:`CheckpointSaveError` naming the rank and its error if one reported a failure,
    or naming the ranks that never reported after ``timeout_s`` (default
    :data:`RANK_WAIT_TIMEOUT_S`). ``where`` (the checkpoint) is named in the errors. Deletes
    the keys it read.
    """
    timeout = RANK_WAIT_TIMEOUT_S if timeout_s is None else timeout_s
    missing = {_key(ranks[rank]): rank for rank in sorted(ranks)}
    deadline = time.monotonic() + timeout
    delay = _POLL_FIRST_S
    failures: list[str] = []
    while missing:
        keys = list(missing)
        if kv.check(keys):
            arrived = keys
        else:  # take those that arrived in rank order, up to the first missing one: each poll
            arrived = []  # costs a round trip per new report and one more, not one per rank
            for k in keys:
                if not kv.check([k]):
                    break
                arrived.append(k)
        for k in arrived:
            rank = missing.pop(k)
            try:
                raw = kv.get(k)
                kv.delete_key(k)
            except Exception as e:  # noqa: BLE001 - a store that lost the key: say which rank
                failures.append(f"rank {rank}: its report could not be read ({e})")
                continue
            try:
                err = json.loads(raw).get("error")
            except (ValueError, AttributeError):
                err = f"unreadable report {raw[:80]!r}"
            if err is not None:
                failures.append(f"rank {rank}: {err}")
        if failures:
            _forget(kv, missing)
            raise CheckpointSaveError(
                f"save to {where} failed, nothing was committed: " + "; ".join(failures)
            )
        if not missing:
            return
        if time.monotonic() >= deadline:
            late = sorted(missing.values())
            _forget(kv, missing)
            raise CheckpointSaveError(
                f"save to {where} failed, nothing was committed: rank(s) {late} did not report "
                f"their data durable within {timeout:g} s (a rank that died or hangs?)"
            )
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


def _forget(kv: Any, missing: dict[str, int]) -> None:
    # Reports that arrive after the coordinator gave up stay in the store (a few bytes each).
    for k in missing:
        try:
            kv.delete_key(k)
        except Exception:  # noqa: BLE001, S110 - nothing to clean is fine
            pass


__all__ = ["RANK_WAIT_TIMEOUT_S", "AwaitedResults", "awaited_ranks", "report", "store",
           "wait_for_ranks"]
