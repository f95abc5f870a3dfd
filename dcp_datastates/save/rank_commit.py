"""Several ranks: the coordinator commits only once every rank's data is durable.

With several ranks an ``async_save``'s ranks hand their write results to DCP as soon as every item
is placed (where each item's bytes go is known then), not once their data is durable: DCP's
gather of the results, the coordinator's global metadata and its pickle then run while the data
still flushes. What the coordinator must not do is commit before every rank's data is durable.

So a rank that hands its results over early reports, once its data is durable and its manifest
written, through the process group's key-value store (the c10d store every ``torch.distributed``
job has, reachable from every node: no shared file system is assumed, node-local checkpoint
directories work). Its :class:`Ticket` travels with its results (``wire.CompactWriteResults``),
so the coordinator waits exactly for the ranks that handed over early, and never for a rank that
did not (a ``dcp.save``, the safetensors format, a job whose store cannot be reached: those ranks
return their results once their data is durable, as before).

**The protocol scales with the ranks, not with their number of keys.** The ranks of one save
share a *group* of three keys (:func:`group_of`): a rank's report appends ``rank:save_id;`` to
``<group>/who`` (and, on failure, a line with its error to ``<group>/err``), then adds 1 to the
counter ``<group>/n`` (:data:`ERROR_WEIGHT` on failure). The coordinator polls the counter, one
round trip per look whatever the number of ranks, and reads ``who`` once it reached the number
of ranks it waits for: every awaited ``rank:save_id`` must be there (a late report of an earlier,
failed save with the same group is not counted), and a failure fails the save naming the rank and
its error. Ranks agree on the group without talking (the n-th such save of a process, and the
checkpoint path); should they not, they fall into several groups, each waited for alike.

**A rank that dies is named within a bounded time.** While its data flushes, a reporting rank
bumps a heartbeat counter of its own (``hb/<save_id>``) every ``liveness_s / 4`` from a thread
of its own. From ``liveness_s / 4`` into its wait, the coordinator reads, every ``liveness_s /
4``, the heartbeats of the ranks that have not reported yet (one ``multi_get``): a rank whose
heartbeat did not move for ``liveness_s`` (the writer's ``rank_liveness``, 60 s by default) died
or hangs, and the save fails naming it; nothing is committed. A slow rank keeps its heartbeat
going and is waited for up to ``timeout_s`` (the writer's ``rank_timeout``, the 30 minutes of
DCP's default collective timeout). The rank deletes its heartbeat key when its save ends; the
coordinator deletes the group's keys when it is done with them (a report arriving after a failed
save leaves a few bytes behind).

Polling, not ``Store.wait``: a TCPStore client serves one request at a time, and a blocking wait
would hold up every other use of the store in the coordinator's process (a new process group, a
barrier) for as long as the flush takes. The poll starts at 0.5 ms and backs off to 20 ms.

Threads: :func:`wait_for_ranks` runs in the coordinator's save thread (the GIL is released while
it sleeps); :meth:`Reporter.report` in the reporting rank's completion thread; the heartbeat in a
daemon thread per save in flight (``dcp_datastates-heartbeat``), stopped by the report or by
:meth:`Reporter.close`. Nothing here raises into a reporting rank: a store it cannot reach makes
the coordinator's wait fail, naming it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointSaveError

logger = logging.getLogger(__name__)

#: How long the coordinator waits for the other ranks' data by default (seconds): the 30 minutes
#: of DCP's default collective timeout, which the same wait had inside DCP's gather.
RANK_WAIT_TIMEOUT_S = 1800.0
#: How long a rank's heartbeat may stand still before it is named dead, by default (seconds).
RANK_LIVENESS_S = 60.0
#: What a failed report adds to its group's counter: the coordinator sees a failure at once.
ERROR_WEIGHT = 1 << 32

_KEY_PREFIX = "dcp_datastates/durable/"
_POLL_FIRST_S = 0.0005
_POLL_MAX_S = 0.02
_sequence = itertools.count()


def store() -> Any | None:
    """The default process group's key-value store, or None (no process group, no store)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


@dataclass(frozen=True)
class Ticket:
    """What the coordinator needs to wait for one rank's report: the rank, its save id (the
    report names it, so a late report of another save is not taken for this one) and the
    group whose keys the report goes to."""

    rank: int
    save_id: str
    group: str

    def entry(self) -> str:
        """The rank's entry in its group's ``who`` list."""
        return f"{self.rank}:{self.save_id};"


def group_of(path: str) -> str:
    """The group of this process's next early hand-over to ``path``: the ranks of one save reach
    the same number, since each process hands over in the order DCP's collectives run."""
    digest = hashlib.sha1(path.encode(), usedforsecurity=False).hexdigest()[:12]
    return f"{next(_sequence)}-{digest}"


def _count_key(group: str) -> str:
    return f"{_KEY_PREFIX}{group}/n"


def _who_key(group: str) -> str:
    return f"{_KEY_PREFIX}{group}/who"


def _err_key(group: str) -> str:
    return f"{_KEY_PREFIX}{group}/err"


def _beat_key(save_id: str) -> str:
    return f"{_KEY_PREFIX}hb/{save_id}"


class AwaitedResults(list):  # type: ignore[type-arg]
    """A rank's write results that reached the coordinator before that rank's data was durable.

    ``ticket`` names the report the coordinator waits for before it commits. Otherwise a plain
    list of ``WriteResult``.
    """

    def __init__(self, results: Iterable[Any], ticket: Ticket) -> None:
        super().__init__(results)
        self.ticket = ticket

    @property
    def rank(self) -> int:
        return self.ticket.rank


def awaited_tickets(results: Iterable[Any]) -> list[Ticket]:
    """The tickets of the ranks among ``results`` (DCP's gathered write results) whose data may
    still flush."""
    return [r.ticket for r in results if isinstance(r, AwaitedResults)]


def report(kv: Any, ticket: Ticket, error: str | None) -> None:
    """Tells the coordinator that ``ticket``'s data is durable (``error`` is None) or never will
    be. Never raises: should the store be unreachable, the coordinator names the rank."""
    try:
        if error is not None:
            line = " ".join(error.split())
            kv.append(_err_key(ticket.group), f"{ticket.rank}\t{ticket.save_id}\t{line}\n")
        kv.append(_who_key(ticket.group), ticket.entry())
        kv.add(_count_key(ticket.group), 1 if error is None else ERROR_WEIGHT)
    except Exception as e:  # noqa: BLE001 - any store failure ends in the coordinator's wait
        logger.error("rank %d cannot report its save %s to the coordinator: %s",
                     ticket.rank, ticket.save_id, e)


class Reporter:
    """A rank's side of one save that handed its results over early: its heartbeat while its
    data flushes, then its report (module docstring). Created before the results leave the
    rank, so the heartbeat key exists whenever the coordinator can know the ticket."""

    def __init__(self, kv: Any, ticket: Ticket, liveness_s: float = RANK_LIVENESS_S) -> None:
        self.kv = kv
        self.ticket = ticket
        self._stop = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._beat()
        self._thread = threading.Thread(
            target=self._run, args=(max(liveness_s / 4, 0.01),), daemon=True,
            name="dcp_datastates-heartbeat",
        )
        self._thread.start()

    def _beat(self) -> None:
        try:
            self.kv.add(_beat_key(self.ticket.save_id), 1)
        except Exception as e:  # noqa: BLE001 - a store that cannot be reached: see report()
            logger.debug("heartbeat of rank %d not sent: %s", self.ticket.rank, e)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._beat()

    def report(self, error: str | None) -> None:
        """Stops the heartbeat and reports (:func:`report`). Never raises."""
        self._stop.set()
        report(self.kv, self.ticket, error)

    def close(self) -> None:
        """The save ended (committed or failed): stops the heartbeat, deletes its key. Never
        raises; later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            # a beat stuck on a store that stopped answering must not hold up the save's end
            self._thread.join(timeout=5.0)
        try:
            self.kv.delete_key(_beat_key(self.ticket.save_id))
        except Exception:  # noqa: BLE001, S110 - nothing to clean is fine
            pass


class _Wait:
    """The coordinator's view of one wait (:func:`wait_for_ranks`)."""

    def __init__(self, kv: Any, tickets: list[Ticket], where: str, liveness_s: float) -> None:
        self.kv = kv
        self.where = where
        self.liveness_s = liveness_s
        self.groups: dict[str, dict[str, Ticket]] = {}
        for t in tickets:
            self.groups.setdefault(t.group, {})[t.entry()] = t
        self.open = set(self.groups)
        self.seen_count: dict[str, int] = {}
        self.arrived: set[str] = set()
        now = time.monotonic()
        self.beats: dict[int, tuple[int, float]] = {t.rank: (0, now) for t in tickets}

    def poll(self) -> None:
        """Looks at every open group's counter; settles those whose reports may all be in.
        Raises the save's error on a failed report."""
        for g in list(self.open):
            n = int(self.kv.add(_count_key(g), 0))
            if n < len(self.groups[g]) or n == self.seen_count.get(g):
                continue
            self.seen_count[g] = n
            if n >= ERROR_WEIGHT:
                self._raise_failures(g)
            self._read_who(g)
            if all(e in self.arrived for e in self.groups[g]):
                self.open.discard(g)

    def _read_who(self, g: str) -> None:
        if self.kv.check([_who_key(g)]):
            raw = self.kv.get(_who_key(g)).decode(errors="replace")
            self.arrived.update(e + ";" for e in raw.split(";") if e)

    def _raise_failures(self, g: str) -> None:
        raw = self.kv.get(_err_key(g)).decode(errors="replace")
        failures = []
        for line in raw.splitlines():
            rank, _, rest = line.partition("\t")
            save_id, _, msg = rest.partition("\t")
            if f"{rank}:{save_id};" in self.groups[g]:
                failures.append(f"rank {rank}: {msg}")
        if failures:
            raise CheckpointSaveError(
                f"save to {self.where} failed, nothing was committed: " + "; ".join(failures)
            )

    def missing(self) -> list[Ticket]:
        """The tickets not reported yet, in rank order (reads each open group's list)."""
        for g in self.open:
            self._read_who(g)
        return sorted((t for g in self.open for e, t in self.groups[g].items()
                       if e not in self.arrived), key=lambda t: t.rank)

    def check_liveness(self) -> None:
        """Reads the heartbeats of the ranks not reported yet; raises naming those whose
        heartbeat stood still for ``liveness_s``."""
        late = self.missing()
        if not late:
            return
        keys = [_beat_key(t.save_id) for t in late]
        if self.kv.check(keys):
            values = self.kv.multi_get(keys)
        else:  # some rank's save ended meanwhile (it reported, or failed): read the others
            values = [self.kv.get(k) if self.kv.check([k]) else None for k in keys]
        now = time.monotonic()
        dead = []
        for t, raw in zip(late, values, strict=True):
            if raw is None:
                continue
            beat = int(raw)
            last, since = self.beats[t.rank]
            if beat != last:
                self.beats[t.rank] = (beat, now)
            elif now - since >= self.liveness_s:
                dead.append(t.rank)
        if dead:
            raise CheckpointSaveError(
                f"save to {self.where} failed, nothing was committed: rank(s) {dead} stopped "
                f"sending heartbeats for {self.liveness_s:g} s before their data was durable "
                "(a rank that died or hangs?)"
            )

    def forget(self) -> None:
        """Deletes the keys of every group (reports arriving later leave a few bytes)."""
        for g in self.groups:
            for k in (_count_key(g), _who_key(g), _err_key(g)):
                try:
                    self.kv.delete_key(k)
                except Exception:  # noqa: BLE001, S110 - nothing to clean is fine
                    pass


def wait_for_ranks(
    kv: Any, tickets: list[Ticket], where: str, timeout_s: float | None = None,
    liveness_s: float | None = None,
) -> None:
    """Returns once every rank of ``tickets`` reported its data durable.

    Raises :class:`CheckpointSaveError` naming the rank and its error if one reported a failure,
    the ranks whose heartbeat stood still for ``liveness_s`` (default :data:`RANK_LIVENESS_S`),
    or the ranks that never reported after ``timeout_s`` (default :data:`RANK_WAIT_TIMEOUT_S`).
    ``where`` (the checkpoint) is named in the errors. Deletes the keys it read.
    """
    timeout = RANK_WAIT_TIMEOUT_S if timeout_s is None else timeout_s
    liveness = RANK_LIVENESS_S if liveness_s is None else liveness_s
    w = _Wait(kv, tickets, where, liveness)
    start = time.monotonic()
    deadline = start + timeout
    next_liveness = start + liveness / 4
    delay = _POLL_FIRST_S
    try:
        while True:
            w.poll()
            if not w.open:
                return
            now = time.monotonic()
            if now >= next_liveness:
                w.check_liveness()
                next_liveness = now + liveness / 4
            if now >= deadline:
                late = [t.rank for t in w.missing()]
                raise CheckpointSaveError(
                    f"save to {where} failed, nothing was committed: rank(s) {late} did not "
                    f"report their data durable within {timeout:g} s (a rank that died or "
                    "hangs?)"
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
    finally:
        w.forget()


__all__ = ["ERROR_WEIGHT", "RANK_LIVENESS_S", "RANK_WAIT_TIMEOUT_S", "AwaitedResults",
           "Reporter", "Ticket", "awaited_tickets", "group_of", "report", "store",
           "wait_for_ranks"]
