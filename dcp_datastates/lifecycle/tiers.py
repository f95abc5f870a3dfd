"""Multi-level flush: checkpoints committed on a fast tier, then copied to a persistent tier.

A writer created with ``persist_to=...`` saves exactly as usual into its ``path`` (the *fast
tier*: local NVMe, ``/dev/shm``); the save's future completes when the fast copy is committed.
Then a :class:`Promoter` copies that checkpoint, in the background and in save order, to the same
relative name under ``persist_to`` (the *persistent tier*: a parallel file system path, or any
fsspec URL such as ``s3://bucket/run``), with its own commit::

    fast:   /dev/shm/run/step-100/{__0_0.distcp, ..., __datastates_manifest_0.json, .metadata}
    slow:   s3://bucket/run/step-100/...         (same names, .metadata last)

Protocol, per checkpoint (every rank promotes the files it wrote, so a fast tier local to each
node works):

1. every rank: take a *shared* lock on the fast directory
(:func:`dcp_datastates.format.refs.lock_shared`),
   so ``prune``/``cleanup`` of the fast tier skip it until the copy is over; write the slow
   directory's in-progress marker (``.datastates.incomplete``);
2. every rank: copy its data files, then its manifest (``__datastates_manifest_<rank>.json``),
   streamed through a fixed buffer (local: each file fsynced; ``s3://``: one multipart upload
   per file; other fsspec URLs: ``put_file``);
3. the coordinator (rank 0): the fast tier's ``latest`` is pointed at the checkpoint; once the
   manifests of all ranks are on the slow tier (polled), ``.metadata`` is
   copied (local: written to a temporary name, fsynced, renamed, directory fsynced), the slow
   marker removed, and the slow tier's ``latest`` updated.

Guarantees: a slow-tier directory without ``.metadata`` is *partial* (its marker says so;
``cleanup_incomplete`` removes it), never mistaken for a checkpoint; ``.metadata`` is written only
after every rank's files are there; a failure of the slow tier (server down, permissions, disk
full, a rank that never copied) fails that promotion only: it is logged with both paths, kept in
:meth:`Promoter.records`, raised once by ``wait_persisted()``, and the fast checkpoint stays
complete and usable. Each promotion ends within ``timeout_s`` (``persist_timeout``) from its
start: every slow-tier operation checks the deadline, remote ones are cut at it (and each S3
request is bounded, :func:`dcp_datastates.storage.s3.open_fs`), copies check it between buffers or
parts; past it the promotion fails and its multipart upload is aborted. Saving a checkpoint
again supersedes this rank's promotions of its old contents (:meth:`Promoter.supersede`): the
newest save wins on both tiers, a stopped copy stays partial on the slow tier until the new
contents' promotion commits. Not guaranteed: the fast tier's files are re-verified before the
copy only with ``verify`` (the persistence agent's default; ``verify_checkpoint`` on either tier
checks checksums); with several ranks, saving
again to a checkpoint name whose earlier promotion has not ended on every rank (a rank's own
promotion removes its stale manifest first, but the coordinator may already have seen it); two
*processes* (two jobs) promoting the same name into one persistent root (within one process, a
second writer's promotion of a name another writer is copying fails with :class:`PersistError`).

Retention, per tier (after each promotion, on the promotion thread): ``persist_retention`` is
``prune`` of the persistent root by the coordinator after each commit there (complete
checkpoints only; ``latest`` kept). ``fast_retention`` is applied by every rank to its fast root:
the policy counts every checkpoint directory there, and one it drops is deleted only when it is
*persisted* (committed there by this writer, complete on the persistent tier, or absent there
while a newer one is complete and ``persist_retention`` would drop it there); never a checkpoint
queued, being copied, being saved by this process (its path claim) or whose copy failed, nor one
whose persistent copy is partial, nor one absent there without ``persist_retention`` to explain
it (never copied: the fast copy may be the only one). A failed copy thus keeps its fast
checkpoint until it is saved and promoted again or deleted by hand.
Not covered by the directory locks: a rank of node-local fast tiers (no lock of its own on its
directory, no path claim) re-saving an older step name that ``fast_retention`` drops and whose
persistent copy is complete: its deletion may race the new save's writes (that save or its copy
then fails).

Resume: :func:`resume_path` takes the newest complete checkpoint of either tier, from the fast
tier when it has it (a fast tier wiped by a node replacement falls back to the slow tier).

Where it runs: by default the writer's promoter is an
:class:`~dcp_datastates.lifecycle.persist_client.AgentPromoter`, which only queues requests, and
the :class:`Promoter` below runs in the fast root's persistence agent, a process of its own
(:mod:`dcp_datastates.lifecycle.persist_agent`); with ``persist_agent=False`` it runs in the
trainer, as described here.

Threads: one promotion thread per writer, started when there is a promotion to run and ended
after a few idle seconds; not a daemon, so the interpreter waits for the promotions in flight
at exit (each bounded by ``timeout_s``), even when the writer was dropped without ``close()``;
:meth:`Promoter.close` gives all of them one deadline, ``timeout_s`` from the call.
``submit`` and ``supersede`` are called by the save threads. Fork: a promoter belongs to the
process that created it; a forked child cannot submit.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import CheckpointBusyError, DataStatesError
from ..format.commit import claimed_paths, manifest_name
from ..format.refs import lock_shared, unlock
from ..storage.fsspec_sink import abort_after
from ..storage.s3 import MAX_PART_BYTES, MAX_PARTS, MultipartUpload, fs_bounds, is_s3, open_fs
from .checkpoints import (
    INCOMPLETE_MARKER,
    METADATA_FILE,
    CheckpointState,
    RetentionPolicy,
    _remove_checkpoint_dir,
    latest_complete,
    list_checkpoints,
    parse_step,
    prune,
    update_latest,
)

logger = logging.getLogger(__name__)

_BUFFER = 8 * 1024 * 1024  # bytes per read/write of a local copy
_POLL_S = 0.1
_IDLE_S = 2.0  # the promotion thread ends after this long without work (a new one starts later)
_S3_PART_BYTES = 16 * 1024**2  # parts of an s3:// copy (larger for files above 160 GB)
_S3_PARTS_IN_FLIGHT = 4
_GRACE_S = 5.0  # beyond persist_timeout: a stopped copy's clean-up (non-s3 tiers)


class PersistError(DataStatesError):
    """Copying a committed checkpoint to the persistent tier failed; the fast copy is intact."""


def is_url(path: str) -> bool:
    return "://" in path


def as_policy(value: RetentionPolicy | int | None, what: str) -> RetentionPolicy | None:
    """A tier's retention option: None (keep everything), an int (``keep_last``) or a
    :class:`~dcp_datastates.lifecycle.checkpoints.RetentionPolicy`; anything else is a clear
    error."""
    if value is None or isinstance(value, RetentionPolicy):
        return None if value is None or value.keeps_everything else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{what} must be None, an int (keep_last) or a RetentionPolicy, got {value!r}"
        )
    if value < 1:
        raise ValueError(f"{what} must keep at least 1 checkpoint, got {value!r}")
    return RetentionPolicy(keep_last=value)


# (persistent target, rank) -> the promoter copying it now: two writers of one process copying
# into the same persistent checkpoint would mix their files under one .metadata.
_active: dict[tuple[str, int], int] = {}
_active_lock = threading.Lock()


@dataclass
class Promotion:
    """One rank's promotion of one checkpoint (``Promoter.records`` returns them as dicts)."""

    source: str  # the committed fast-tier directory
    target: str  # the same checkpoint on the persistent tier
    rank: int
    coordinator: bool
    world_size: int
    t_submit: float
    t_done: float = math.nan
    bytes: int = 0
    error: str | None = None
    pruned: list[str] = field(default_factory=list)  # deleted by the tiers' retention after it
    retention_error: str | None = None
    superseded: bool = False  # stopped: a newer save of the same checkpoint replaces it
    # Found by the persistence agent's scan (not saved just now): `latest` is moved to it only
    # where no newer step is complete (a late recovery never moves `latest` backwards).
    recovered: bool = False
    started: bool = False  # taken off the queue by the promotion thread
    reported: bool = False
    done: threading.Event = field(default_factory=threading.Event, repr=False)
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _PRIVATE}
        d["pruned"] = list(self.pruned)  # a copy: the promotion thread may still extend it
        d["persist_s"] = self.t_done - self.t_submit
        return d


_PRIVATE = ("done", "cancel", "reported", "started", "recovered")


def _rank_files(names: list[str], rank: int) -> list[str]:
    """The data files ``rank`` wrote (either format), sorted; its manifest is not included."""
    pat = re.compile(
        rf"^(?:__{rank}_\d+\.distcp|shard-{rank + 1:05d}-model-\d{{5}}-of-\d{{5}}\.safetensors)$"
    )
    return sorted(n for n in names if pat.match(n))


def _tmp_name(path: str) -> str:
    return f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"


class _Stopped(Exception):
    """A promotion stopped because a newer save of its checkpoint superseded it."""


class _Slow:
    """The persistent tier: a local directory tree (fsynced) or an fsspec file system.

    Used by the promotion thread only. :meth:`begin` sets the deadline and the cancel event of
    the promotion under way: every operation checks both first, a remote one is cut at the
    deadline (fsspec's ``timeout``; on ``s3://`` each request is bounded besides,
    :func:`dcp_datastates.storage.s3.open_fs`), a copy checks them between buffers or parts.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None, durable: bool) -> None:
        self.root = root.rstrip("/") if is_url(root) else os.path.abspath(root)
        self.remote = is_url(root)
        self.durable = durable
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._async = False
        self.deadline: float | None = None
        self.timeout_s = math.inf
        self._cancel: threading.Event | None = None
        if self.remote:
            from fsspec.asyn import AsyncFileSystem

            self._fs, self._base = open_fs(self.root, self.storage_options)
            self._async = isinstance(self._fs, AsyncFileSystem)

    def begin(
        self, deadline: float | None, timeout_s: float, cancel: threading.Event | None
    ) -> None:
        """Bounds the operations that follow by ``deadline`` (``time.monotonic()``), and stops
        them when ``cancel`` is set."""
        self.deadline, self.timeout_s, self._cancel = deadline, timeout_s, cancel

    def check(self, what: str) -> None:
        """Raises :class:`_Stopped` if the promotion was superseded, PersistError past its
        deadline."""
        if self._cancel is not None and self._cancel.is_set():
            raise _Stopped(what)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise PersistError(
                f"{what}: not done within persist_timeout ({self.timeout_s:g} s)"
            )

    def _kw(self) -> dict[str, Any]:
        """fsspec's per-call ``timeout`` (async file systems only): what is left until the
        deadline."""
        if not self._async or self.deadline is None:
            return {}
        return {"timeout": max(0.01, self.deadline - time.monotonic())}

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.remote else os.path.join(self.root, rel)

    def _p(self, rel: str) -> str:  # the fsspec path of a relative name
        return f"{self._base.rstrip('/')}/{rel}"

    def makedirs(self, rel: str) -> None:
        self.check(f"creating {self.url(rel)}")
        if self.remote:
            self._fs.makedirs(self._p(rel), exist_ok=True, **self._kw())
        else:
            os.makedirs(self.url(rel), exist_ok=True)

    def put_bytes(self, rel: str, data: bytes) -> None:
        self.check(f"writing {self.url(rel)}")
        if self.remote:
            self._fs.pipe_file(self._p(rel), data, **self._kw())
            return
        path = self.url(rel)
        tmp = _tmp_name(path)  # unique: several ranks may write the same marker at once
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        self.sync_dir(os.path.dirname(rel))

    def copy_file(self, src: str, rel: str, atomic: bool = False) -> int:
        """Copies the local file ``src`` to ``rel``; returns its size. ``atomic``: through a
        temporary name renamed at the end (used for ``.metadata``, the commit). Checks the
        deadline and the cancel event between buffers (parts on ``s3://``)."""
        what = f"copying {src} to {self.url(rel)}"
        self.check(what)
        if self.remote and is_s3(self._fs):
            return self._upload(src, rel, what)
        if self.remote:
            self._fs.put_file(src, self._p(rel), **self._kw())
            return os.path.getsize(src)
        dst = self.url(rel)
        tmp = _tmp_name(dst) if atomic else dst
        with open(tmp, "wb", buffering=0) as fo:
            n = self._stream(src, fo.write, what)
            if self.durable:
                os.fsync(fo.fileno())
        if atomic:
            os.replace(tmp, dst)
        return n

    def _stream(self, src: str, write: Callable[[memoryview], object], what: str) -> int:
        """Reads ``src`` in buffers of ``_BUFFER`` bytes into ``write``, checking the deadline
        and a cancel (:meth:`check`) before each; returns the bytes read."""
        n = 0
        with open(src, "rb", buffering=0) as fi:
            buf = bytearray(_BUFFER)
            view = memoryview(buf)
            while True:
                self.check(what)
                k = fi.readinto(buf)
                if not k:
                    return n
                write(view[:k])
                n += k

    def _upload(self, src: str, rel: str, what: str) -> int:
        """``src`` as one S3 object: a multipart upload (parts in flight bounded by the
        deadline), aborted on any failure, a cancel or the deadline: no object appears then."""
        size = os.path.getsize(src)
        part = max(_S3_PART_BYTES, -(-size // MAX_PARTS))
        up = MultipartUpload(
            self._fs, self._p(rel), part_bytes=min(part, MAX_PART_BYTES),
            max_in_flight=_S3_PARTS_IN_FLIGHT, deadline=self.deadline,
        )
        try:
            n = self._stream(src, up.write, what)
            self.check(what)
            up.close()
        except BaseException as e:
            abort_after(up, e)
            raise
        return n

    def exists(self, rel: str) -> bool:
        self.check(f"looking up {self.url(rel)}")
        if self.remote:
            self._fs.invalidate_cache(self._p(os.path.dirname(rel)))
            return bool(self._fs.exists(self._p(rel), **self._kw()))
        return os.path.exists(self.url(rel))

    def remove(self, rel: str) -> None:
        self.check(f"removing {self.url(rel)}")
        try:
            if self.remote:
                self._fs.rm_file(self._p(rel), **self._kw())
            else:
                os.unlink(self.url(rel))
        except FileNotFoundError:
            pass

    def sync_dir(self, rel: str) -> None:
        if self.remote or not self.durable:
            return
        fd = os.open(self.url(rel) if rel else self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def prune(self, policy: RetentionPolicy) -> list[str]:
        """Applies the persistent tier's retention; returns what it deleted."""
        if self.remote:
            from .remote import prune as remote_prune

            return remote_prune(self.root, policy, storage_options=self.storage_options or None)
        if not os.path.isdir(self.root):
            return []
        return [str(x) for x in prune(self.root, policy)]

    def complete_steps(self) -> dict[str, bool]:
        """Checkpoint name -> complete?, for the step-named checkpoints of the tier's root."""
        if self.remote:
            from .remote import list_checkpoints as remote_list

            infos: list[Any] = remote_list(self.root, storage_options=self.storage_options or None)
        else:
            infos = list_checkpoints(self.root) if os.path.isdir(self.root) else []
        return {i.name: bool(i.complete) for i in infos}

    def point_latest(self, name: str) -> None:
        if self.remote:
            from .remote import update_latest as remote_update_latest

            remote_update_latest(self.root, name, storage_options=self.storage_options or None)
        else:
            update_latest(self.root, name)


class Promoter:
    """Copies committed checkpoints from the fast tier (a local root) to the persistent tier.

    Args:
        fast_root: the writer's ``path``; every promoted checkpoint must lie under it.
        slow_root: a local path or an fsspec URL.
        storage_options: fsspec options of ``slow_root``.
        timeout_s: how long one promotion may take (``persist_timeout``), the coordinator's
            wait for the other ranks' files included.
        durable: fsync what is written to a local slow tier.
        fast_retention: retention of the fast tier (see :meth:`_prune_fast`), applied by every
            rank to ``fast_root`` after each of its promotions; None keeps everything.
        persist_retention: retention of the persistent tier (``prune`` semantics), applied by
            the coordinator after each checkpoint it committed there; None keeps everything.
        verify: the coordinator verifies the fast checkpoint (``verify_checkpoint``: every
            checksum) before copying it, when every rank's manifest is in its fast directory; a
            damaged one is not copied (its promotion fails). The persistence agent sets it.
    """

    def __init__(
        self,
        fast_root: str,
        slow_root: str,
        storage_options: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
        durable: bool = True,
        fast_retention: RetentionPolicy | int | None = None,
        persist_retention: RetentionPolicy | int | None = None,
        verify: bool = False,
    ) -> None:
        if not fast_root or is_url(fast_root):
            raise ValueError(
                "persist_to needs the writer's path to be a local directory (the fast tier), "
                f"got {fast_root!r}"
            )
        if not slow_root:
            raise ValueError("persist_to must be a path or a URL")
        if timeout_s <= 0:
            raise ValueError(f"persist_timeout must be positive, got {timeout_s!r}")
        self.fast_root = os.path.abspath(fast_root)
        self.slow = _Slow(os.fspath(slow_root), storage_options, durable)
        if not self.slow.remote and os.path.realpath(self.slow.root) == os.path.realpath(
            self.fast_root
        ):
            raise ValueError(f"persist_to {slow_root!r} is the writer's own path")
        self.timeout_s = float(timeout_s)
        self.fast_policy = as_policy(fast_retention, "fast_retention")
        self.slow_policy = as_policy(persist_retention, "persist_retention")
        self.verify = verify
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._queue: queue.Queue[Promotion | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._records: collections.deque[Promotion] = collections.deque(maxlen=1000)
        self._open: list[Promotion] = []  # submitted, not finished
        self._closed = False
        self._close_deadline = math.inf  # time.monotonic(): set by close()

    # -- submission (save threads) ---------------------------------------------------------------
    def relative(self, checkpoint_path: str) -> str:
        """The checkpoint's name relative to the fast root; ValueError if it is not under it."""
        rel = os.path.relpath(os.path.abspath(checkpoint_path), self.fast_root)
        if rel == "." or rel.startswith(".." + os.sep) or rel == ".." or os.path.isabs(rel):
            raise ValueError(
                f"checkpoint {checkpoint_path} is not inside the writer's path {self.fast_root}: "
                "with persist_to, save to checkpoint ids under the writer's path (the fast tier)"
            )
        return rel.replace(os.sep, "/")

    def submit(
        self, checkpoint_path: str, rank: int, world_size: int, coordinator: bool,
        t_submit: float | None = None, recovered: bool = False,
    ) -> Promotion:
        """Queues the promotion of this rank's part of a committed checkpoint; returns its
        record. ``t_submit``: when it was submitted (``time.perf_counter()``; default now);
        ``recovered``: found by the agent's scan (see :attr:`Promotion.recovered`)."""
        if os.getpid() != self._pid:
            raise RuntimeError("a forked child cannot promote its parent's checkpoints")
        rel = self.relative(checkpoint_path)
        p = Promotion(
            source=os.path.abspath(checkpoint_path),
            target=self.slow.url(rel),
            rank=rank,
            coordinator=coordinator,
            world_size=max(1, world_size),
            t_submit=time.perf_counter() if t_submit is None else t_submit,
            recovered=recovered,
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("the writer is closed: nothing more is promoted")
            self._open.append(p)
            self._records.append(p)
            self._queue.put(p)
            if self._thread is None:  # the thread ends when idle: a dropped writer never
                self._thread = threading.Thread(  # keeps the interpreter from exiting
                    target=self._run, name="dcp_datastates-promoter", daemon=False
                )
                self._thread.start()
        return p

    def supersede(self, checkpoint_path: str, timeout: float | None = None) -> None:
        """A new save of ``checkpoint_path`` begins: this rank's promotions of its previous
        contents stop (queued ones never start; the one under way stops at its next buffer or
        part, aborting its upload). Their persistent copies stay partial (no ``.metadata``)
        until the new save's promotion commits the new contents. Waits (at most ``timeout``,
        default ``persist_timeout``) until none of them holds the fast directory any more.

        Raises:
            CheckpointBusyError: a copy did not stop in time (named, with its target).
        """
        src = os.path.abspath(checkpoint_path)
        with self._lock:
            stopping = [p for p in self._open if p.source == src]
            for p in stopping:
                p.cancel.set()
            # One still queued stops before it touches anything (its first check): no wait.
            stopping = [p for p in stopping if p.started]
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        for p in stopping:
            if not p.done.wait(max(0.0, deadline - time.monotonic())):
                raise CheckpointBusyError(
                    f"{src}: the copy of its previous save to {p.target} (rank {p.rank}) did not "
                    "stop in time; save again once it ended (wait_persisted())"
                )

    # -- waiting, reporting ----------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every submitted promotion ended; False on timeout. Then raises
        :class:`PersistError` for failed promotions nobody was told of yet (once each)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._open)
            if not pending:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            pending[0].done.wait(left)
        self.raise_unreported()
        return True

    def raise_unreported(self) -> None:
        with self._lock:
            failed = [p for p in self._records if p.error and not p.reported]
            for p in failed:
                p.reported = True
        if failed:
            msgs = "; ".join(f"{p.error}" for p in failed)
            raise PersistError(f"{len(failed)} promotion(s) to the persistent tier failed: {msgs}")

    def unpersisted(self) -> list[str]:
        """Fast-tier checkpoints whose promotion is in flight or failed: pass them as
        ``exclude=`` to ``prune``/``cleanup_incomplete`` of the fast tier."""
        with self._lock:
            return sorted(
                src
                for src, p in self._newest().items()
                if p.error or p.superseded or not p.done.is_set()
            )

    def _newest(self) -> dict[str, Promotion]:
        """The newest promotion of each fast checkpoint (a failed copy saved and promoted again
        counts as promoted). Caller holds ``_lock``."""
        return {p.source: p for p in self._records}

    def records(self) -> list[dict[str, Any]]:
        """Every recent promotion of this rank, oldest first (``persist_s``, ``error``...)."""
        with self._lock:
            return [p.as_dict() for p in self._records]

    def close(self, timeout: float | None = None) -> None:
        """Waits for the promotions in flight, then stops: within ``persist_timeout`` (plus one
        request's bound, for an upload's abort) in all, or ``timeout`` if shorter. The copies
        still running or queued at that deadline fail (their persistent copies stay partial).
        Failures are logged, not raised."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            limit = self.timeout_s if timeout is None else min(timeout, self.timeout_s)
            self._close_deadline = time.monotonic() + limit
        if os.getpid() != self._pid:
            return
        if thread is not None:
            self._queue.put(None)
            thread.join(limit + self._grace_s())
            if thread.is_alive():
                logger.error(
                    "copies to %s still running %.0f s after close(): abandoned",
                    self.slow.root, limit + self._grace_s(),
                )
        with self._lock:
            failed = [p for p in self._records if p.error and not p.reported]
            for p in failed:
                p.reported = True
        for p in failed:
            logger.error("promotion of %s to %s failed: %s", p.source, p.target, p.error)

    def _grace_s(self) -> float:
        """How long a copy stopped at its deadline may take to clean up (an abort request)."""
        b = fs_bounds(self.slow._fs) if self.slow.remote else None
        return _GRACE_S + (b.request_s() if b is not None else 0.0)

    # -- the promotion thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                p = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:  # submit() puts under this lock: nothing can slip in
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if p is None:
                return
            with self._lock:
                deadline = min(time.monotonic() + self.timeout_s, self._close_deadline)
                p.started = True
            self.slow.begin(deadline, self.timeout_s, p.cancel)
            try:
                p.bytes = self._promote(p)
            except _Stopped:
                p.superseded = True
                logger.info("copy of %s to %s stopped: a new save replaces it", p.source, p.target)
            except BaseException as e:  # noqa: BLE001 - reported through the record
                reason = f"{type(e).__name__}: {e}"
                if time.monotonic() >= deadline and "persist_timeout" not in reason:
                    reason = f"not done within persist_timeout ({self.timeout_s:g} s): {reason}"
                p.error = f"{p.source} -> {p.target} (rank {p.rank}): {reason}"
                logger.error("promotion failed: %s; the fast checkpoint is kept", p.error)
            try:
                if not p.superseded:
                    self._retain(p)
            except Exception as e:  # noqa: BLE001 - retention never fails the promotion
                p.retention_error = f"{type(e).__name__}: {e}"
                logger.warning(
                    "retention after the promotion of %s failed: %s", p.source, p.retention_error
                )
            finally:
                p.t_done = time.perf_counter()
                with self._lock:
                    if p in self._open:
                        self._open.remove(p)
                p.done.set()

    def _promote(self, p: Promotion) -> int:
        self.slow.check(f"copying {p.source} to {p.target}")  # superseded while queued?
        key = (p.target, p.rank)
        with _active_lock:
            if _active.setdefault(key, id(self)) != id(self):
                raise PersistError(
                    f"{p.target} (rank {p.rank}) is being promoted by another writer of this "
                    "process: the two copies would mix under one .metadata; give the writers "
                    "distinct checkpoint names or persistent roots"
                )
        try:
            return self._promote_claimed(p)
        finally:
            with _active_lock:
                _active.pop(key, None)

    def _promote_claimed(self, p: Promotion) -> int:
        rel = self.relative(p.source)
        fd = lock_shared(p.source)  # fast-tier prune/cleanup skip it while it is copied
        if fd is None:
            raise PersistError(f"the fast checkpoint {p.source} is gone or being deleted")
        try:
            if p.coordinator and "/" not in rel and not self._newer_on(p, fast=True):
                try:
                    update_latest(self.fast_root, rel)  # the fast tier's own `latest`
                except (OSError, ValueError) as e:
                    logger.warning("could not point %s/latest at %s: %s", self.fast_root, rel, e)
            names = os.listdir(p.source)
            data = _rank_files(names, p.rank)
            manifest = manifest_name(p.rank)
            if manifest not in names:
                raise PersistError(f"{p.source} has no manifest of rank {p.rank}")
            if p.coordinator and METADATA_FILE not in names:
                raise PersistError(f"{p.source} is not committed (no {METADATA_FILE})")
            if p.coordinator and self.verify:
                _verify_source(p, names)
            slow = self.slow
            slow.makedirs(rel)
            if not slow.exists(f"{rel}/{INCOMPLETE_MARKER}"):
                slow.put_bytes(f"{rel}/{INCOMPLETE_MARKER}", b"")
            if p.coordinator:  # a stale commit of an earlier save under this name goes first
                slow.remove(f"{rel}/{METADATA_FILE}")
            slow.remove(f"{rel}/{manifest}")  # so is this rank's stale "files are here" mark
            slow.sync_dir(rel)
            total = 0
            for name in [*data, manifest]:  # the manifest last: this rank's files are there
                total += slow.copy_file(os.path.join(p.source, name), f"{rel}/{name}")
            slow.sync_dir(rel)
            if not p.coordinator:
                return total
            missing = [r for r in range(p.world_size) if r != p.rank]
            while missing:
                try:
                    slow.check(f"waiting for the files of rank(s) {missing} on {p.target}")
                except PersistError as e:
                    raise PersistError(f"{e}; its .metadata is not written") from None
                missing = [r for r in missing if not slow.exists(f"{rel}/{manifest_name(r)}")]
                if missing:
                    time.sleep(_POLL_S)
            total += slow.copy_file(
                os.path.join(p.source, METADATA_FILE), f"{rel}/{METADATA_FILE}", atomic=True
            )
            slow.sync_dir(rel)
            slow.remove(f"{rel}/{INCOMPLETE_MARKER}")
            slow.sync_dir(rel)
            if "/" not in rel and not self._newer_on(p, fast=False):
                slow.point_latest(rel)
            return total
        finally:
            unlock(fd)

    def _newer_on(self, p: Promotion, fast: bool) -> bool:
        """For a recovered promotion: True if a tier holds a complete checkpoint of a higher
        step (its `latest` then stays)."""
        step = parse_step(os.path.basename(p.source))
        if not p.recovered or step is None:
            return False
        if fast:
            names = {i.name: i.complete for i in list_checkpoints(self.fast_root)}
        else:
            names = self.slow.complete_steps()
        return any(ok and (s := parse_step(n)) is not None and s > step for n, ok in names.items())

    # -- retention (the promotion thread, after each promotion) ----------------------------------
    def _retain(self, p: Promotion) -> None:
        top = "/" not in self.relative(p.source)  # retention sees the roots' direct children
        if self.slow_policy is not None and p.error is None and p.coordinator and top:
            p.pruned += self.slow.prune(self.slow_policy)
        if self.fast_policy is not None:
            p.pruned += self._prune_fast(p)

    def _prune_fast(self, current: Promotion) -> list[str]:
        """Applies ``fast_retention`` to the fast root; returns the deleted directories.

        The policy is applied to the steps of every checkpoint directory of the fast root
        (complete ones, and the partial-looking ones a rank of node-local tiers holds). A
        directory the policy drops is deleted only if it is *persisted*: committed on the
        persistent tier by this writer's coordinator, complete there, or absent there while a
        newer checkpoint is complete there and ``persist_retention`` would drop it among those
        (dropped by the persistent tier's retention). Never deleted: a checkpoint this writer
        has queued, is copying or failed to copy, one a save of this process has claimed, one
        whose persistent copy is partial, the fast tier's ``latest``, one another process holds
        (a save or a promotion in flight: the directory lock).
        """
        assert self.fast_policy is not None
        if not os.path.isdir(self.fast_root):
            return []
        with self._lock:
            newest = self._newest()
            queued = {r.source for r in self._open if r is not current}
        held = {src for src, r in newest.items() if r.error} | queued
        # Saves of this process in flight (claimed until their promotion is queued): a name
        # saved again is not persisted on the strength of its previous contents' promotion.
        saving = claimed_paths()
        committed = {
            src
            for src, r in newest.items()
            if r.coordinator and r.error is None and not r.superseded
            and (r.done.is_set() or r is current)
        }
        try:  # after a failed copy (the tier may be down), rely on this writer's records
            on_slow = self.slow.complete_steps() if current.error is None else {}
        except Exception as e:  # noqa: BLE001 - the tier is down: rely on this writer's records
            logger.warning("cannot list %s for the fast tier's retention: %s", self.slow.root, e)
            on_slow = {}
        slow_steps = {s for n, ok in on_slow.items() if ok and (s := parse_step(n)) is not None}
        slow_newest = max(slow_steps, default=None)
        infos = [
            i for i in list_checkpoints(self.fast_root) if i.state is not CheckpointState.UNKNOWN
        ]
        kept = self.fast_policy.kept_steps(i.step for i in infos)
        latest = latest_complete(self.fast_root)
        removed: list[str] = []
        for info in infos:
            path = str(info.path)
            if info.step in kept or path in held or info.path == latest:
                continue
            if os.path.realpath(path) in saving:
                continue
            # Absent there is "dropped there" only if persist_retention would drop it among the
            # complete ones there: else it was never copied (saved before persist_to, a crash
            # before its promotion) and the fast copy may be the only one.
            dropped_there = (
                info.name not in on_slow
                and slow_newest is not None
                and slow_newest > info.step
                and self.slow_policy is not None
                and info.step not in self.slow_policy.kept_steps(slow_steps | {info.step})
            )
            persisted = path in committed or on_slow.get(info.name) is True or dropped_there
            if persisted and _remove_checkpoint_dir(info.path, info.state):
                removed.append(path)
        return removed


def _verify_source(p: Promotion, names: list[str]) -> None:
    """Raises PersistError if the fast checkpoint is damaged (``verify_checkpoint``); skipped
    (logged) when some rank's manifest is not in the directory (node-local fast tiers)."""
    missing = [r for r in range(p.world_size) if manifest_name(r) not in names]
    if missing:
        logger.info("%s: ranks %s are on other nodes; not verified before the copy",
                    p.source, missing)
        return
    from ..format.verify import EXIT_DAMAGED, EXIT_ERROR, verify_checkpoint

    report = verify_checkpoint(p.source)
    if report.exit_code in (EXIT_DAMAGED, EXIT_ERROR):
        problems = report.problems[:3] or [str(report.error)]
        raise PersistError(
            f"{p.source} is damaged on the fast tier, not copied: {'; '.join(problems)}"
        )


def attach_persist_stats(stats: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Adds ``persist_state``/``persist_s``/``persist_error`` to save-stats dicts (in place):
    each successful save gets the first unused promotion of its checkpoint submitted after the
    save started (both lists oldest first)."""
    used: set[int] = set()
    for s in stats:
        s.update(persist_state=None, persist_s=math.nan, persist_error=None)
        if s.get("error") is not None:
            continue
        src = os.path.abspath(str(s["checkpoint_id"]))
        for i, r in enumerate(records):
            if i in used or r["source"] != src or not r["t_submit"] >= s["t_stage"]:
                continue
            used.add(i)
            finished = not math.isnan(r["t_done"])
            state = (
                "failed" if r["error"]
                else "superseded" if r["superseded"]
                else "done" if finished
                else "pending"
            )
            s.update(persist_state=state, persist_s=r["persist_s"], persist_error=r["error"])
            break


def resume_path(
    fast_root: str | os.PathLike[str] | None,
    slow_root: str | os.PathLike[str] | None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """The checkpoint to resume from across two tiers, or None if neither has one.

    The newest complete checkpoint (highest step) of either tier, taken from the fast tier when
    it has that step complete, else from the slow tier (a local path or a URL, with
    ``storage_options``). Within a tier, ``latest`` is honoured as :func:`latest_complete` does
    when it names the newest step. A fast root that is missing counts as empty.
    """
    best: tuple[int, int, str] | None = None  # (step, tier rank: 1 fast > 0 slow, path)

    def consider(step: int | None, tier: int, path: str) -> None:
        nonlocal best
        if step is None:
            return
        key = (step, tier, path)
        if best is None or key[:2] > best[:2]:
            best = key

    if fast_root is not None and not is_url(os.fspath(fast_root)):
        for info in list_checkpoints(fast_root):
            if info.complete:
                consider(info.step, 1, str(info.path))
        pointed = latest_complete(fast_root)
        if pointed is not None and parse_step(pointed.name) is None:
            consider(-1, 1, str(pointed))  # a non-step name: used only if nothing else exists
    if slow_root is not None:
        s = os.fspath(slow_root)
        if is_url(s):
            from .remote import list_checkpoints as remote_list

            for rinfo in remote_list(s, storage_options=storage_options):
                if rinfo.complete:
                    consider(rinfo.step, 0, rinfo.url)
        else:
            for info in list_checkpoints(s):
                if info.complete:
                    consider(info.step, 0, str(info.path))
    return None if best is None else best[2]


__all__ = ["PersistError", "Promoter", "resume_path"]
