"""Python facade of the native engine (``dcp_datastates._core``).

The facade owns one ``_core.Engine`` (host cache + copy and flush threads) and translates its
errors into :class:`~dcp_datastates.errors.CheckpointSaveError`. It knows nothing of DCP; the
writer drives it. Contracts (see csrc/engine/engine.hpp for the full list):

* threads: the native threads never call Python; every blocking call here releases the GIL;
* lifetimes: a source address handed to :meth:`add_entry` must stay valid until the job is
  captured; :meth:`cache_view` is invalid after :meth:`close`;
* failures: the first error of a job is latched; :meth:`wait_captured` / :meth:`wait_done` raise it;
* fork: the engine belongs to the process that created it (:attr:`owner_pid`). In a forked child
  every call raises CheckpointSaveError naming that process, and :meth:`close` (or garbage
  collection) leaks the native engine instead of joining threads that exist only in the parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from . import _core
from .config import WriterConfig
from .errors import CheckpointSaveError

logger = logging.getLogger(__name__)

#: Offset that turns the engine's steady-clock seconds into ``time.perf_counter()`` seconds.
_CLOCK_OFFSET = time.perf_counter() - time.monotonic()


def engine_time_to_perf(t: float) -> float:
    """Converts an engine timestamp (CLOCK_MONOTONIC seconds) to ``time.perf_counter()`` time."""
    return t + _CLOCK_OFFSET if t >= 0 else t


@contextlib.contextmanager
def translate_errors(context: str) -> Iterator[None]:
    """Re-raises engine errors as CheckpointSaveError prefixed with ``context``."""
    try:
        yield
    except _core.EngineError as e:
        raise CheckpointSaveError(f"{context}: {e}") from None


def loaded_cuda_runtime() -> str:
    """Path of the libcudart mapped into this process (loaded by torch), or '' if none is."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return ""


class Engine:
    """One native engine: a host cache of ``config.cache_bytes`` and its worker threads."""

    def __init__(self, config: WriterConfig) -> None:
        self.config = config
        try:
            self._core = _core.Engine(
                cache_bytes=config.cache_bytes,
                chunk_bytes=config.chunk_bytes,
                copy_threads=config.copy_threads,
                flush_threads=config.flush_threads,
                o_direct=config.o_direct,
                prefault=config.prefault,
                checksums=config.checksums,
                durable=config.durable,
                flush_nice=config.flush_nice,
                idle_priority=config.idle_priority,
                flush_idle=config.flush_idle,
            )
        except _core.EngineError as e:
            raise CheckpointSaveError(f"cannot create the host cache engine: {e}") from None

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return bool(self._core.closed)

    @property
    def owner_pid(self) -> int:
        """The process that created the engine; only that process can use it."""
        return int(self._core.owner_pid)

    def close(self) -> None:
        """Aborts unfinished jobs, joins the threads and frees the host cache. Idempotent.

        In a forked child it only drops this process's handle (nothing is joined or freed).
        """
        self._core.close()

    def enable_cuda(self) -> None:
        """Loads the CUDA runtime torch loaded and pins the host cache (once). A cache that
        cannot be pinned is used pageable (correct, slower D2H copies), with a warning.

        Device-to-host copies are issued in batches (``cudaMemcpyBatchAsync``) where the runtime
        has it (CUDA 12.8+), unless ``DCPDS_NO_CUDA_BATCH=1``; :attr:`cuda_batch_error` says why
        they are not."""
        if self._core.cuda_enabled:
            return
        batch = os.environ.get("DCPDS_NO_CUDA_BATCH", "") in ("", "0")
        with translate_errors("cannot enable CUDA copies"):
            self._core.enable_cuda(loaded_cuda_runtime(), batch_copies=batch)
        if not self._core.cache_pinned:
            logger.warning("the host cache could not be pinned, device-to-host copies will be "
                           "slower: %s", self._core.pin_error)

    @property
    def cuda_batch_error(self) -> str:
        """Why device-to-host copies are not batched ("" when they are)."""
        return str(self._core.cuda_batch_error)

    # -- pass-through, typed -----------------------------------------------------------------
    @property
    def chunk_bytes(self) -> int:
        return int(self._core.chunk_bytes)

    def cache_view(self) -> memoryview:
        return self._core.cache_view()

    def create_job(self, label: str) -> int:
        return int(self._core.create_job(label))

    def add_entry(
        self,
        job: int,
        name: str,
        src: int,
        nbytes: int,
        device: int = -1,
        ready_event: int = 0,
        direct: bool = False,
    ) -> int:
        """Registers a source; ``direct`` (host memory private to the save, valid until the job
        is done) is flushed from where it is instead of being copied into the cache."""
        try:  # no context manager: this runs once per tensor of a save
            return int(self._core.add_entry(job, name, src, nbytes, device, ready_event, direct))
        except _core.EngineError as e:
            raise CheckpointSaveError(f"cannot register '{name}': {e}") from None

    def add_entries(
        self,
        job: int,
        names: list[str],
        srcs: list[int],
        nbytes: list[int],
        devices: list[int],
        ready_events: list[int],
        direct: list[int],
    ) -> int:
        """Registers a batch of sources under one lock (as :meth:`add_entry` each, with
        ``direct[i]`` 0 or 1); returns the first entry's index, the others follow it. Nothing is
        registered if any entry is refused (the error names it)."""
        try:
            return int(
                self._core.add_entries(job, names, srcs, nbytes, devices, ready_events, direct)
            )
        except _core.EngineError as e:
            raise CheckpointSaveError(f"cannot register the tensors: {e}") from None

    def start_copies(self, job: int) -> None:
        with translate_errors("cannot start copies"):
            self._core.start_copies(job)

    @property
    def cache_bytes(self) -> int:
        return int(self._core.cache_bytes)

    def capture_now(self, job: int, entry: int, wait: bool = False) -> bool:
        """Copies a contiguous host entry into the cache now, in this thread (GIL released).

        Without ``wait``: False (nothing reserved) if the cache has no room right now. With it:
        waits for space freed by other saves' flushes (the caller must know it will come).
        """
        try:
            return bool(self._core.capture_now(job, entry, wait))
        except _core.EngineError as e:
            raise CheckpointSaveError(f"cannot capture: {e}") from None

    def capture_now_many(self, job: int, entries: list[int]) -> bytes:
        """:meth:`capture_now` without waiting for each of ``entries``, in one native call (GIL
        released): ``result[i]`` is 1 if entry i was copied into the cache, 0 if there was no
        room at that moment (nothing reserved for it)."""
        try:
            return bytes(self._core.capture_now_many(job, entries))
        except _core.EngineError as e:
            raise CheckpointSaveError(f"cannot capture: {e}") from None

    def open_file(self, job: int, path: str, anon_dir: str = "") -> int:
        """Creates the data file ``path``; with ``anon_dir``, an unnamed file in that directory
        (``O_TMPFILE``) that :meth:`dup_fd` lets the caller link under ``path``."""
        with translate_errors("cannot open a data file"):
            return int(self._core.open_file(job, path, anon_dir))

    def link_file(self, job: int, file: int) -> None:
        """Names an unnamed data file (opened with ``anon_dir``) at its path."""
        with translate_errors("cannot name a data file"):
            self._core.link_file(job, file)

    def dup_fd(self, job: int, file: int) -> int:
        """A new descriptor of an open data file of ``job``; the caller closes it."""
        with translate_errors("cannot reach a data file"):
            return int(self._core.dup_fd(job, file))

    def place(
        self, job: int, entry: int, file: int, payload_offset: int, header: bytes, trailer: bytes
    ) -> None:
        try:  # no context manager: this runs once per tensor of a save
            self._core.place(job, entry, file, payload_offset, header, trailer)
        except _core.EngineError as e:
            raise CheckpointSaveError(f"cannot place an entry: {e}") from None

    def place_external(self, job: int, entry: int) -> None:
        with translate_errors("cannot place an entry"):
            self._core.place_external(job, entry)

    def skip(self, job: int, entry: int) -> None:
        self._core.skip(job, entry)

    def write_bytes(self, job: int, file: int, offset: int, data: bytes, name: str = "") -> None:
        """Queues raw bytes for a file; ``name`` (the item) is named if the write fails."""
        with translate_errors("cannot queue a write"):
            self._core.write_bytes(job, file, offset, data, name)

    def seal(self, job: int) -> None:
        with translate_errors("cannot seal the save"):
            self._core.seal(job)

    def chunk_count(self, job: int, entry: int) -> int:
        return int(self._core.chunk_count(job, entry))

    def wait_chunk(self, job: int, entry: int, chunk: int) -> tuple[int, int]:
        """Waits until the chunk has landed; returns (address of its bytes, bytes)."""
        with translate_errors("save failed"):
            off, n = self._core.wait_chunk(job, entry, chunk)
        return int(off), int(n)

    def release_chunk(self, job: int, entry: int, chunk: int) -> None:
        self._core.release_chunk(job, entry, chunk)

    def wait_captured(self, job: int, timeout_s: float | None = None) -> bool:
        """True once captured, False on timeout; raises the job's error (GIL released)."""
        with translate_errors("save failed"):
            return bool(self._core.wait_captured(job, -1.0 if timeout_s is None else timeout_s))

    def help_until_captured(self, job: int, timeout_s: float | None = None) -> bool:
        """As :meth:`wait_captured`, but this thread runs queued host copies meanwhile.

        For barriers in the training thread (it is blocked anyway): the copies progress even
        when the idle-priority copy threads get no CPU time (other busy processes).
        """
        with translate_errors("save failed"):
            t = -1.0 if timeout_s is None else timeout_s
            return bool(self._core.help_until_captured(job, t))

    def wait_done(self, job: int, timeout_s: float | None = None) -> bool:
        with translate_errors("save failed"):
            return bool(self._core.wait_done(job, -1.0 if timeout_s is None else timeout_s))

    def is_captured(self, job: int) -> bool:
        return bool(self._core.is_captured(job))

    def is_done(self, job: int) -> bool:
        return bool(self._core.is_done(job))

    def abort(self, job: int, reason: str) -> None:
        self._core.abort(job, reason)

    def forget(self, job: int) -> None:
        self._core.forget(job)

    def chunk_records(self, job: int) -> list[tuple[int, int, int, int, int, int, int]]:
        return list(self._core.chunk_records(job))

    def stats(self, job: int) -> dict[str, Any]:
        return dict(self._core.stats(job))

    def counters(self) -> dict[str, int]:
        with translate_errors("cannot read the engine counters"):
            return dict(self._core.counters())

    def can_boost(self) -> bool:
        """Whether a barrier can raise the idle-priority copy threads to normal priority (the
        OS allows leaving ``SCHED_IDLE``; probed when the first copy thread started)."""
        return bool(self.counters().get("boost_available", False))

    # -- test hooks ------------------------------------------------------------------------
    def pause_copies(self, paused: bool) -> None:
        self._core.pause_copies(paused)

    def set_delays(self, copy_delay_us_max: int, flush_delay_us_max: int, seed: int = 0) -> None:
        self._core.set_delays(copy_delay_us_max, flush_delay_us_max, seed)
