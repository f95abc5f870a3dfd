"""Peer replicas: each node's part of a committed checkpoint copied to the fast tier of other nodes.

With node-local fast tiers (``/dev/shm`` or a local NVMe on each node), a lost node takes its
ranks' files with it, and every checkpoint on the fast tiers becomes unusable. A writer created
with ``replicas=k`` therefore copies, after each committed ``async_save``, every rank's files of
the checkpoint (its data files, its manifest; the coordinator's also ``.metadata``) to ``k`` other
nodes, in a ring: node ``n`` to nodes ``n+1 ... n+k`` (mod the number of nodes), local rank ``i``
of the sender to local rank ``i`` (mod size) of the receiver. After a node is lost,
:func:`dcp_datastates.lifecycle.replica_restore.recover_from_replicas` rebuilds the newest
checkpoint on every node of the restarted job from what survived, without the persistent tier.

Nodes: ranks are grouped by (host name, real path of the checkpoint's parent directory), so
ranks of one machine given distinct node-local roots count as distinct nodes (how tests and
benchmarks simulate several nodes on one machine). One node: nothing to do.

Layout on a receiving rank's fast root ``R`` (next to its own checkpoints)::

    R/.datastates-replicas/<name>.<commit id>/round.json       # who wrote what (below)
    R/.datastates-replicas/<name>.<commit id>/<files of the senders>
    R/.datastates-replicas/<name>.<commit id>/.done-<rank>     # rank's files complete here

``<commit id>`` is the coordinator's save id, the one ``.metadata`` records
(``storage_meta.save_id``); ``round.json`` holds it, the checkpoint's name and step, and each
saving rank's manifest save id and files with their sizes. A replica is used only when it is
complete (its ``.done-<rank>`` marker written after the files were fsynced) and belongs to the
commit of the ``.metadata`` it is restored with: a file of an older or a failed save of the same
name is never mixed in. Retention: a rank keeps the replicas of the newest ``keep`` rounds it
received (2), and drops an older round of the same name once a newer one is complete.

Protocol, per committed save, on a thread of its own (``dcp_datastates-replicas``), in commit
order on every rank: an ``all_gather_object`` of each rank's files (the round), the exchange of
the files (:mod:`dcp_datastates.lifecycle.peer_transfer`), an ``all_gather_object`` of what each
rank sent or received in full; then each receiver writes the markers of the senders whose files
it holds complete. All of it runs on a gloo process group of its own, created by
:func:`replicator` on the first writer with replicas (a collective: every rank creates its
writers in the same order), never the training group's streams.

Failure semantics: replication never fails a save (the local commit is done). A failed round
(a disk error, a peer down) is logged and kept in :meth:`Replicator.records`; its markers are
not written, so its partial replica is never used. A peer that does not answer within
``timeout_s`` leaves the group unusable: replication is then off for the rest of the process
(logged); so does a round whose ranks describe different saves (a save that committed on some
ranks only). Fork: a forked child does not replicate. Exit: the thread is a daemon and ``close()``
does not wait for it; at interpreter exit (``atexit``, also for a writer dropped without
``close()``) the rounds still queued or running are waited for, at most ``timeout_s`` +
``EXIT_MARGIN_S`` (a silent peer fails its round within ``timeout_s``), with a warning: a gloo
operation still in flight while the interpreter tears down aborts the process ("terminate called
without an active exception"). ``wait_replicated`` before exiting chooses when instead. A
process killed meanwhile abandons its round: its peers' round fails, nothing is marked
complete.
Threads: ``submit`` is called by save threads and DCP's future callbacks; ``wait`` by anyone.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import queue
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..format.commit import fsync_dir, manifest_name
from .checkpoints import METADATA_FILE, parse_step
from .peer_transfer import Edge, FileSpan, exchange

logger = logging.getLogger(__name__)

REPLICA_DIR = ".datastates-replicas"
ROUND_FILE = "round.json"
DONE_PREFIX = ".done-"
KEEP_ROUNDS = 2
# At interpreter exit, rounds still running are waited for at most the replica timeout plus this.
EXIT_MARGIN_S = 30.0
_DATA_RE = re.compile(r"^__(\d+)_\d+\.distcp$")
_SID_RE = re.compile(rb'"save_id"\s*:\s*"([^"]*)"')


def manifest_save_id(path: str) -> str | None:
    """The save id a manifest records (read from its head), or None if it has none."""
    try:
        with open(path, "rb") as f:
            m = _SID_RE.search(f.read(4096))
    except OSError:
        return None
    return m.group(1).decode() if m else None


def node_key(root: str) -> tuple[str, str]:
    """The node a rank of fast root ``root`` belongs to (host, real path of the root)."""
    return socket.gethostname(), os.path.realpath(root)


def rank_files(directory: str, rank: int, coordinator: bool) -> dict[str, int]:
    """The files ``rank`` wrote into ``directory`` (data files, manifest; the coordinator's
    ``.metadata`` too), with their sizes."""
    out: dict[str, int] = {}
    for name in os.listdir(directory):
        m = _DATA_RE.match(name)
        if (m and int(m.group(1)) == rank) or name == manifest_name(rank) or (
            coordinator and name == METADATA_FILE
        ):
            out[name] = os.stat(os.path.join(directory, name)).st_size
    return out


@dataclass(frozen=True)
class ReplicaRequest:
    """One rank's part of one committed save, to replicate: its checkpoint directory, and on the
    coordinator the commit's save id."""

    path: str
    rank: int
    commit_id: str | None
    copies: int


@dataclass
class RoundRecord:
    """One round as this rank saw it (``Replicator.records``)."""

    path: str
    commit_id: str | None = None
    sent: int = 0  # bytes
    received: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class _Mine:
    """What a rank contributes to a round's first all_gather."""

    rank: int
    node: tuple[str, str]
    name: str
    step: int | None
    files: dict[str, int]
    manifest_id: str | None
    commit_id: str | None
    copies: int
    error: str | None = None


@dataclass
class Replicator:
    """The replication thread of this process and its queue (see the module docstring)."""

    group: dist.ProcessGroup
    timeout_s: float
    pid: int = field(default_factory=os.getpid)
    _queue: queue.Queue[ReplicaRequest] = field(default_factory=queue.Queue)
    _records: list[RoundRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None
    _pending: int = 0
    _idle: threading.Condition = field(default_factory=threading.Condition)
    broken: str | None = None

    def submit(self, request: ReplicaRequest) -> None:
        """Queues ``request``; returns at once."""
        if os.getpid() != self.pid:
            return
        with self._idle:
            self._pending += 1
        self._queue.put(request)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dcp_datastates-replicas", daemon=True
                )
                self._thread.start()
                atexit.register(self._at_exit)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every submitted round ended; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _at_exit(self) -> None:
        """Interpreter exit: waits (bounded) for the rounds still queued or running (see the
        module docstring); nothing in a forked child."""
        if os.getpid() != self.pid:
            return
        with self._idle:
            pending = self._pending
        if not pending:
            return
        limit = self.timeout_s + EXIT_MARGIN_S
        logger.warning(
            "waiting for %d replica round(s) to end before the process exits (at most %.0f s; "
            "writer.wait_replicated() before exiting chooses when)", pending, limit)
        if not self.wait(limit):
            logger.error("replica rounds still running after %.0f s at exit: abandoned", limit)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r.__dict__) for r in self._records]

    def _run(self) -> None:
        while True:
            request = self._queue.get()
            rec = RoundRecord(path=request.path, commit_id=request.commit_id)
            t0 = time.perf_counter()
            try:
                if self.broken is not None:
                    raise RuntimeError(f"replication is off: {self.broken}")
                self._round(request, rec)
            except Exception as e:  # noqa: BLE001 - a round's failure never fails a save
                rec.error = f"{type(e).__name__}: {e}"
                logger.error("replicas of %s: %s", request.path, rec.error)
            rec.seconds = time.perf_counter() - t0
            with self._lock:
                self._records.append(rec)
                del self._records[:-256]
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _round(self, request: ReplicaRequest, rec: RoundRecord) -> None:
        """One round: gather the files, exchange them, gather the outcome, write the markers."""
        d = request.path
        mine = _Mine(rank=request.rank, node=node_key(os.path.dirname(os.path.abspath(d))),
                     name=os.path.basename(os.path.normpath(d)),
                     step=parse_step(os.path.basename(os.path.normpath(d))), files={},
                     manifest_id=None, commit_id=request.commit_id, copies=request.copies)
        try:
            mine.files = rank_files(d, request.rank, request.commit_id is not None)
            mine.manifest_id = manifest_save_id(os.path.join(d, manifest_name(request.rank)))
        except OSError as e:
            mine.error = f"rank {request.rank} cannot list {d}: {e}"
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        self._collective(lambda: dist.all_gather_object(everyone, mine, group=self.group))
        try:
            plan = _plan(everyone)
        except _OutOfStep as e:
            self.broken = str(e)  # the ranks' queues no longer match: stop, never guess
            raise
        if plan is None:
            return
        commit_id, edges = plan
        rec.commit_id = commit_id
        target = os.path.join(os.path.dirname(os.path.abspath(d)), REPLICA_DIR,
                              f"{mine.name}.{commit_id}")
        edges = [_local(e, request.rank, d, target) for e in edges]
        incoming = [e for e in edges if e.dst == request.rank]
        if incoming:
            try:
                _prepare_target(target, everyone, commit_id)
            except OSError as e:  # the exchange still runs (its writes fail and drain)
                logger.error("replicas of %s: cannot prepare %s: %s", d, target, e)
        try:
            result = exchange(edges, self.group, timeout_s=self.timeout_s)
        except RuntimeError as e:
            self.broken = f"{e} (round of {d})"
            raise
        ok = [k for k in result.done]
        outcome: list[Any] = [None] * len(everyone)
        self._collective(lambda: dist.all_gather_object(outcome, ok, group=self.group))
        failed = sorted(set(range(len(edges))) - {k for got in outcome for k in got})
        for k in result.done:
            edge = edges[k]
            if _failed_either(k, edge, outcome, everyone):
                continue
            if edge.dst == request.rank:
                _mark_done(target, edge.src)
                rec.received += edge.total
            else:
                rec.sent += edge.total
        if incoming:
            try:
                _prune(os.path.dirname(target), mine.name, commit_id)
            except OSError as e:
                logger.warning("replicas: retention of %s: %s", os.path.dirname(target), e)
        if result.errors or failed:
            raise RuntimeError("; ".join(result.errors.values()) or
                               f"edges {failed} of the round failed on a peer")

    def _collective(self, fn: Any) -> None:
        try:
            fn()
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise


def _local(e: Edge, rank: int, source_dir: str, target: str) -> Edge:
    """``e`` with this rank's side filled in: where its files are read, or written."""
    if e.src == rank:
        files = tuple(FileSpan(f.name, f.size, os.path.join(source_dir, f.name)) for f in e.files)
        return Edge(e.src, e.dst, files, e.target)
    if e.dst == rank:
        return Edge(e.src, e.dst, e.files, target)
    return e


def _failed_either(k: int, e: Edge, outcome: list[Any], everyone: list[Any]) -> bool:
    """True unless both ends of edge ``k`` reported it done."""
    ranks = [m.rank for m in everyone]
    return not (k in outcome[ranks.index(e.src)] and k in outcome[ranks.index(e.dst)])


class _OutOfStep(RuntimeError):
    """The ranks' rounds do not describe the same save."""


def _plan(everyone: list[Any]) -> tuple[str, list[Edge]] | None:
    """The round's commit id and edges (the ring), or None when there is nothing to do."""
    names = {m.name for m in everyone}
    coords = [m for m in everyone if m.commit_id is not None]
    if len(names) != 1 or len(coords) != 1:
        raise _OutOfStep(f"the ranks replicate different saves: {sorted(names)} "
                           f"with {len(coords)} coordinators")
    bad = [m.error for m in everyone if m.error]
    if bad:
        raise RuntimeError("; ".join(bad))
    nodes: dict[tuple[str, str], list[int]] = {}
    for m in sorted(everyone, key=lambda m: m.rank):
        nodes.setdefault(m.node, []).append(m.rank)
    order = list(nodes.values())
    copies = min(min(m.copies for m in everyone), len(order) - 1)
    if copies <= 0:
        return None
    by_rank = {m.rank: m for m in everyone}
    edges = []
    for k in range(1, copies + 1):
        for n, senders in enumerate(order):
            receivers = order[(n + k) % len(order)]
            for i, s in enumerate(senders):
                src_dir = by_rank[s]
                files = tuple(
                    FileSpan(name, size, "") for name, size in sorted(src_dir.files.items())
                )
                edges.append(Edge(src=s, dst=receivers[i % len(receivers)], files=files,
                                  target=""))
    return coords[0].commit_id, edges


def _prepare_target(target: str, everyone: list[Any], commit_id: str) -> None:
    """Creates the round's replica directory and writes its ``round.json`` (fsynced)."""
    os.makedirs(target, exist_ok=True)
    first = everyone[0]
    doc = {
        "name": first.name, "step": first.step, "commit_id": commit_id, "time": time.time(),
        "ranks": {str(m.rank): {"manifest_id": m.manifest_id, "files": m.files}
                  for m in everyone},
    }
    tmp = os.path.join(target, f".{ROUND_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(target, ROUND_FILE))


def _mark_done(target: str, rank: int) -> None:
    path = os.path.join(target, f"{DONE_PREFIX}{rank}")
    with open(path, "w") as f:
        os.fsync(f.fileno())
    fsync_dir(target)


def _prune(area: str, name: str, keep_id: str) -> None:
    """Drops the other rounds of ``name``, and the rounds beyond the newest ``KEEP_ROUNDS``."""
    rounds = []
    for entry in os.listdir(area):
        full = os.path.join(area, entry)
        base, _, cid = entry.rpartition(".")
        if base == name and cid != keep_id:
            shutil.rmtree(full, ignore_errors=True)
            continue
        try:
            rounds.append((os.stat(os.path.join(full, ROUND_FILE)).st_mtime, full))
        except OSError:
            continue
    for _, full in sorted(rounds, reverse=True)[KEEP_ROUNDS:]:
        shutil.rmtree(full, ignore_errors=True)


_replicator: Replicator | None = None
_replicator_lock = threading.Lock()


def replicator(timeout_s: float) -> Replicator:
    """This process's replicator; the first call creates its gloo group (a collective over the
    default process group's ranks: call it on every rank, in the same order)."""
    global _replicator
    with _replicator_lock:
        if _replicator is None or _replicator.pid != os.getpid():
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError(
                    "replicas need torch.distributed initialised before the writer is created "
                    "(the copies go over a gloo group of the job's ranks)"
                )
            group = dist.new_group(backend="gloo",
                                   timeout=datetime.timedelta(seconds=timeout_s))
            _replicator = Replicator(group=group, timeout_s=timeout_s)
        return _replicator


def current() -> Replicator | None:
    """The replicator of this process, if one was created."""
    r = _replicator
    return r if r is not None and r.pid == os.getpid() else None


__all__ = [
    "REPLICA_DIR", "ReplicaRequest", "Replicator", "current", "manifest_save_id", "node_key",
    "rank_files", "replicator",
]
