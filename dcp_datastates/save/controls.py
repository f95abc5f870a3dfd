"""A writer's state and its public control API beyond DCP: barriers, waits, stats, ``close``.

:class:`WriterControls` is the base of :class:`~dcp_datastates.DataStatesWriter`: it adopts the
parts :func:`dcp_datastates.save.parts.build_parts` built (as the writer's attributes) and holds
the calls a training loop makes besides DCP's: ``protect`` (:class:`ProtectHandle`),
``wait_captured``, the automatic step barrier's ``_step_barrier``
(:mod:`dcp_datastates.save.barrier`), ``wait``, ``wait_persisted``, ``persist_stats``,
``unpersisted``, ``save_stats``, ``engine_counters``, ``close``, and the ownership checks.

Threads: these calls run in the training thread (the step barrier in whichever thread calls
``optimizer.step()``), concurrently with save threads and native threads; shared state is
guarded by the job table's lock (``_lock``, which also guards ``_protects``). Barriers and waits
release the GIL while they wait.

Failures: ``wait_captured``, a ``protect()`` hook and ``wait`` raise the error of a failed save the
caller has not seen yet, once (the error channels are described in
:mod:`dcp_datastates.save.finish` and :mod:`dcp_datastates.save.jobs`); the automatic step
barrier never raises (it logs), ``close()`` logs such an error instead of raising it.

Fork: a writer belongs to the process that created it. In a forked child (DataLoader workers)
finalizers do nothing, ``close()`` only marks it closed (nothing is joined or freed), and every
other use raises RuntimeError naming the owner process. ``AsyncCheckpointerType.PROCESS`` is
refused by ``stage`` (the host cache and threads cannot move to another process), and a writer
cannot be pickled.

Lifetime: the engine (host cache and threads) is freed by :meth:`WriterControls.close`, or when
the writer is garbage-collected (:func:`dcp_datastates.save.parts.close_engine`); nothing the
writer registers (the barrier, protect hooks, finalizers) holds it strongly.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, TypeVar

import torch

from ..engine import Engine
from ..errors import CheckpointSaveError
from ..lifecycle import replicas
from ..lifecycle.tiers import attach_persist_stats
from . import barrier
from .jobs import async_save_uses_process_executor
from .parts import WriterParts, close_engine

# Messages keep the writer's logger name (this code was part of dcp_datastates.save.writer).
logger = logging.getLogger("dcp_datastates.save.writer")

_W = TypeVar("_W", bound="WriterControls")


class ProtectHandle:
    """Returned by :meth:`DataStatesWriter.protect`; ``remove()`` undoes it."""

    def __init__(self, writer: WriterControls, optimizer: torch.optim.Optimizer) -> None:
        self._writer = weakref.ref(writer)
        self._opt = weakref.ref(optimizer)
        self._hook = optimizer.register_step_pre_hook(self._pre_step)

    def _pre_step(self, *_: Any) -> None:
        w = self._writer()
        if w is not None and not w.closed and w._pid == os.getpid():
            w.wait_captured()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._opt()

    def remove(self) -> None:
        self._hook.remove()
        w = self._writer()
        if w is not None:
            w._unprotect(self)


class WriterControls:
    """A writer's parts as its attributes, and the public API beyond DCP (module docstring)."""

    def __init__(self, parts: WriterParts) -> None:
        super().__init__()
        self.path = parts.path
        self.overwrite = parts.overwrite
        self._pid = parts.pid
        self.config = parts.config
        self.storage_options = parts.storage_options
        self._incremental = parts.incremental
        self._extensions = parts.extensions
        self._promoter = parts.promoter
        self._engine = parts.engine
        self._stager = parts.stager
        self._templates = parts.templates
        self._placer = parts.placer
        self._table = parts.table  # jobs in flight, their order, failures, stats
        # async_save results (Metadata) freed on a save thread, not the caller's (release.py)
        self._released = parts.released
        self._lock = self._table.lock  # also guards _protects
        self._protects: list[ProtectHandle] = []
        self._tls = threading.local()  # per save thread: its context holder and job binding
        self._closed = False
        weakref.finalize(self, close_engine, self._engine, self._pid)
        barrier.register_writer(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owner_pid(self) -> int:
        """The process that created this writer; a forked child cannot use it."""
        return self._pid

    def protect(self, optimizer: torch.optim.Optimizer) -> ProtectHandle:
        """Makes ``optimizer.step()`` wait until every save in flight is in the host cache.

        The automatic step barrier already makes each optimizer wait for the copies of its own
        tensors, without raising; this explicit form waits for every save in flight and raises
        their errors (CaptureError, CheckpointSaveError) from ``step()``. It also marks the
        optimizer as an owner before its first step, and keeps working with
        ``step_barrier=False``. Returns a handle whose ``remove()`` undoes it.
        """
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(f"protect() needs a torch.optim.Optimizer, got {type(optimizer)!r}")
        barrier.remember_optimizer(optimizer)
        handle = ProtectHandle(self, optimizer)
        with self._lock:
            self._protects.append(handle)
        return handle

    def _unprotect(self, handle: ProtectHandle) -> None:
        with self._lock:
            if handle in self._protects:
                self._protects.remove(handle)

    def _optimizer_owners(self) -> dict[int, int]:
        """For ``stage``: the storages owned by the optimizers this writer knows (protected
        ones, and with the step barrier every optimizer that stepped), to capture lazily."""
        owners: dict[int, int] = {}
        # (incremental saves never reference optimizer-owned tensors: owners are needed then too)
        if self.config.capture in ("auto", "owned") or self._incremental is not None:
            with self._lock:
                opts = [o for o in (h.optimizer for h in self._protects) if o is not None]
            if self.config.step_barrier:
                opts += barrier.known_optimizers()
            owners = barrier.owned_storages(opts)
        return owners

    def wait_captured(self, timeout: float | None = None) -> bool:
        """The barrier: blocks until every save in flight has all its tensors in the host cache.

        Verifies that no lazily captured tensor was modified in place meanwhile; raises
        CaptureError (that save fails, nothing torn is written) or the CheckpointSaveError of a
        save that failed since the last barrier. Returns False if ``timeout`` (seconds) expired.
        Safe to call at any time, from the training thread; releases the GIL while waiting.
        """
        self._check_owner()
        deadline = None if timeout is None else time.perf_counter() + timeout
        for job in self._table.unverified():
            remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not self._table.barrier_one(job, remaining, path=self.path):
                return False
        self._table.raise_unreported()
        return True

    def _step_barrier(self, optimizer: torch.optim.Optimizer) -> None:
        """The automatic barrier (runs before ``optimizer.step()``; see
        dcp_datastates.save.barrier).

        Waits for the saves in flight holding lazy copies of this optimizer's tensors. A save
        that fails here (a tensor changed) is failed and logged, not raised: its future and the
        next save report it.
        """
        if self._closed or not self.config.step_barrier:
            return
        ids = barrier.owner_ids(optimizer)
        for job in self._table.waiting_for(ids):
            try:
                self._table.barrier_one(job, None, report=False, path=self.path)
            except CheckpointSaveError as e:  # pragma: no cover - report=False does not raise
                logger.warning("%s", str(e))

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every save in flight has ended: committed, or failed. False on timeout
        (nothing raised then).

        Then raises the :class:`CheckpointSaveError` of a failed save whose error the caller has
        not seen yet: not read from its future (``result()`` that raised, or ``exception()``),
        not raised by a barrier or an earlier ``wait``. One per call, oldest first, each once;
        whatever failed (the capture, the writes, the commit, another rank). So a loop that
        never looks at the futures of the plain call still learns of a failed save here, and
        one that reads them is not told twice. The future always carries its save's error,
        whether or not ``wait`` raised it. (An ``exception()`` call already waiting when the
        save's thread started is not noticed: ``wait`` may raise that error once more.)

        With ``persist_to`` it does not wait for the copies to the persistent tier (those never
        delay training): :meth:`wait_persisted` does, and raises their failures.
        """
        if not self._wait_idle(timeout):
            return False
        self._table.raise_unreported()
        return True

    def _wait_idle(self, timeout: float | None) -> bool:
        self._check_owner()
        return self._table.wait_idle(timeout)

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """With ``persist_to``: blocks until every checkpoint committed so far on this rank was
        copied to the persistent tier (or failed). False on timeout. Then raises
        :class:`~dcp_datastates.lifecycle.tiers.PersistError` for failed copies not reported yet
        (once). Without ``persist_to`` it returns True at once."""
        self._check_owner()
        if self._promoter is None:
            return True
        return self._promoter.wait(timeout)

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """With ``replicas``: blocks until every replication round queued so far in this process
        ended (copied, or failed: see :meth:`replica_stats`). False on timeout. Without
        ``replicas`` it returns True at once. Every rank queues the round of a save when that
        save's future completes, so wait on the future first."""
        self._check_owner()
        rep = replicas.current()
        if rep is None or not self.config.replicas:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._table.wait_idle(timeout):  # released jobs have queued their rounds
            return False
        return rep.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def replica_stats(self) -> list[dict[str, Any]]:
        """The replication rounds of this process, oldest first: ``path``, ``commit_id``,
        ``sent``/``received`` bytes, ``seconds``, ``error`` (None when it succeeded)."""
        rep = replicas.current()
        return [] if rep is None else rep.records()

    def persist_stats(self) -> list[dict[str, Any]]:
        """With ``persist_to``: this rank's recent promotions, oldest first (``source``,
        ``target``, ``persist_s``, ``bytes``, ``error``); ``[]`` without it."""
        return [] if self._promoter is None else self._promoter.records()

    def unpersisted(self) -> list[str]:
        """With ``persist_to``: fast-tier checkpoints not (yet) on the persistent tier: in flight
        or failed. Pass them as ``exclude=`` when pruning the fast tier."""
        return [] if self._promoter is None else self._promoter.unpersisted()

    def save_stats(self) -> list[dict[str, Any]]:
        """Telemetry of the recent saves on this rank (oldest first), as dicts (see SaveStats).

        With ``persist_to`` each dict also has ``persist_state`` ("pending", "done", "failed",
        or None when the save was not promoted), ``persist_s`` (submit to end of the copy,
        NaN until then) and ``persist_error``, from :meth:`persist_stats`."""
        self._check_owner()
        with self._lock:
            out = [s.as_dict() for s in self._table.stats]
        if self._promoter is not None:
            attach_persist_stats(out, self._promoter.records())
        return out

    def engine_counters(self) -> dict[str, int]:
        """Host cache use, live jobs, open files and queue lengths (for monitoring and tests)."""
        return self._engine.counters()

    @property
    def engine(self) -> Engine:
        """The native engine (test hooks: pause_copies, set_delays)."""
        return self._engine

    def close(self) -> None:
        """Waits for saves in flight, then stops the engine and frees the host cache.

        With ``persist_to`` it also waits for every copy to the persistent tier already queued,
        within ``persist_timeout`` in all (copies not done by then fail; failures are logged,
        not raised; call :meth:`wait_persisted` first to get them).

        Idempotent. In a forked child it only marks this process's view of the writer closed:
        the engine belongs to the parent and is neither waited for, joined nor freed here.
        """
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True  # no lock: a parent thread may have held it at the fork
            self._engine.close()  # the binding leaks the native engine in a child
            return
        self._wait_idle(None)
        try:
            self._table.raise_unreported()
        except CheckpointSaveError as e:  # close() never raises for a save: it says so
            logger.error("a save failed and its error was never read: %s", str(e))
        if self._promoter is not None:
            self._promoter.close()  # waits for the copies in flight; logs failures
        with self._lock:
            for h in list(self._protects):
                h._hook.remove()
            self._protects.clear()
            self._closed = True
        barrier.unregister_writer(self)
        self._released.clear()
        self._engine.close()

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "DataStatesWriter cannot be pickled: its host cache and native threads live in this "
            "process. Use dcp.async_save with the default thread executor, not "
            "AsyncCheckpointerType.PROCESS."
        )

    def _refuse_process_executor(self) -> None:
        if async_save_uses_process_executor():
            raise ValueError(
                "DataStatesWriter does not support dcp.async_save(async_checkpointer_type="
                "AsyncCheckpointerType.PROCESS): its host cache and native threads live in this "
                "process. Use the default AsyncCheckpointerType.THREAD."
            )

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this DataStatesWriter belongs to process {self._pid}; a forked child (process "
                f"{os.getpid()}) cannot use it: create a new writer in the child"
            )

    def _check_open(self) -> None:
        self._check_owner()
        if self._closed:
            raise RuntimeError("this DataStatesWriter is closed")


__all__ = ["ProtectHandle", "WriterControls"]
