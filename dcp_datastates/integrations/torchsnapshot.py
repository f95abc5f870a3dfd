"""torchsnapshot: a storage plugin that writes and reads every object through the native engine.

torchsnapshot picks its storage by the URL's protocol and finds plugins under the entry-point
group ``storage_plugins``; this package registers :func:`storage_plugin` there as ``datastates``
(pyproject.toml). The one line a user changes is the URL::

    Snapshot.take("datastates:///ckpt/step-10", app_state)         # was "/ckpt/step-10"
    Snapshot("datastates:///ckpt/step-10").restore(app_state)

Writes (:meth:`DataStatesStoragePlugin.write`): each object is one engine job with one file,
``<root>/<object path>``. An object of at least 1 MiB is copied into the plugin's host buffer
(``buffer_size``, the bound on its host memory: a larger object streams through it in
``chunk_size`` chunks) by the copy threads, and the flush threads write it from there with
O_DIRECT where the file system takes it; smaller objects are written from torchsnapshot's buffer
in one ``pwritev``. Every chunk gets a CRC-32C; the file is ``fdatasync``ed; then the chunks'
checksums are appended to this writer's log under ``<root>/.datastates/`` (the format:
:mod:`dcp_datastates.format.object_index`), which is ``fdatasync``ed too, and the directory
entries created are ``fsync``ed. Only then does ``write`` return: torchsnapshot writes
``.snapshot_metadata`` (its commit) after every rank's writes returned, so a committed snapshot's
objects and checksums are durable. The object files hold exactly the bytes torchsnapshot gave:
its stock ``fs`` plugin reads a snapshot this plugin wrote (``Snapshot("/ckpt/step-10")``).

Reads (:meth:`DataStatesStoragePlugin.read`): through the native parallel reader, each chunk
checked against its CRC-32C (an :class:`~dcp_datastates.errors.IntegrityError` names the file and
byte range on a mismatch, or when the file's size differs from its record). A partial read
(``byte_range``, torchsnapshot's batched objects) reads the whole chunks that hold the range;
verified chunks are kept in a small cache (``read_cache_size``) for the next ranges. A snapshot
without an index (written by the stock plugin) is read unverified; one with an index but no
record for an object fails that read.

Threads: torchsnapshot runs the coroutines on its event loop; each blocking step runs in the
plugin's thread pool (``io_threads``), and the engine's native threads do the copies and writes.
The engine (and its buffer) is created at the first write; a plugin that only reads has none.
Failures: a failed write raises :class:`~dcp_datastates.errors.CheckpointSaveError` naming the
object and its file; torchsnapshot then does not commit. ``close`` waits for nothing in flight
(torchsnapshot awaited every write), stops the threads and frees the buffer; a plugin dropped
without ``close`` frees them when collected. Local paths only: an object store URL is refused
when the plugin is created (use torchsnapshot's ``s3://`` / ``gs://`` plugins there).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import functools
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from torchsnapshot.io_types import ReadIO, StoragePlugin, WriteIO

from .. import _core
from ..config import WriterConfig, parse_size
from ..engine import Engine
from ..errors import CheckpointSaveError, IntegrityError
from ..format.object_index import CrcLog, DirSync, ObjectRecord, load_index

logger = logging.getLogger(__name__)

PROTOCOL = "datastates"
_T = TypeVar("_T")


@dataclass(frozen=True)
class PluginOptions:
    """``storage_options`` of the plugin (sizes as ``"256MiB"`` or bytes).

    Attributes:
        buffer_size: the host buffer objects are copied into before they are written.
        chunk_size: largest single copy and write; also the CRC-32C granularity.
        flush_threads / copy_threads: the engine's native threads.
        o_direct: write buffered chunks with O_DIRECT where the file system takes it.
        io_threads: objects written or read at once (torchsnapshot keeps up to 16 in flight).
        read_threads: concurrent ``pread``s of one read.
        verify_reads: check each chunk read against its CRC-32C.
        read_cache_size: verified chunks kept for partial reads of the same object.
    """

    buffer_size: int = 256 << 20
    chunk_size: int = 4 << 20
    flush_threads: int = 2
    copy_threads: int = 1
    o_direct: bool = True
    io_threads: int = 16
    read_threads: int = 4
    verify_reads: bool = True
    read_cache_size: int = 64 << 20

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> PluginOptions:
        """Builds options from torchsnapshot's ``storage_options``; an unknown key or a bad
        value is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        given = dict(options or {})
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"unknown datastates storage option(s) {unknown}; "
                             f"known: {sorted(known)}")
        for key in ("buffer_size", "chunk_size", "read_cache_size"):
            if key in given:
                given[key] = parse_size(given[key], default_unit=1, what=key)
        out = cls(**given)
        if min(out.flush_threads, out.copy_threads, out.io_threads, out.read_threads) < 1:
            raise ValueError("thread counts must be at least 1")
        if out.chunk_size % _core.DIRECT_ALIGN:
            raise ValueError(f"chunk_size must be a multiple of {_core.DIRECT_ALIGN} bytes")
        return out


def _buffer_address(buf: Any) -> tuple[int, int, Any]:
    """(address, bytes, keep-alive) of a contiguous buffer; a read-only one that is not a whole
    ``bytes`` object is copied first (torchsnapshot gives ``bytes`` or writable views)."""
    mv = memoryview(buf)
    if not mv.contiguous:
        mv = memoryview(mv.tobytes())
    mv = mv.cast("B")
    n = mv.nbytes
    if n == 0:
        return 0, 0, mv
    if mv.readonly:
        if isinstance(mv.obj, bytes) and len(mv.obj) == n:
            addr = ctypes.cast(ctypes.c_char_p(mv.obj), ctypes.c_void_p).value
            return int(addr or 0), n, mv
        mv = memoryview(bytearray(mv))
    anchor = ctypes.c_char.from_buffer(mv)
    return ctypes.addressof(anchor), n, (mv, anchor)


class _ChunkCache:
    """Verified chunks of partial reads, least recently used dropped beyond ``limit_bytes``;
    concurrent readers of one chunk share one read. Thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._lock = threading.Lock()
        self._data: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        self._bytes = 0
        self._pending: dict[tuple[str, int], concurrent.futures.Future[bytes]] = {}

    def get(self, key: tuple[str, int], read: Callable[[], bytes]) -> bytes:
        with self._lock:
            hit = self._data.get(key)
            if hit is not None:
                self._data.move_to_end(key)
                return hit
            fut = self._pending.get(key)
            owner = fut is None
            if fut is None:
                fut = self._pending[key] = concurrent.futures.Future()
        if not owner:
            return fut.result()
        try:
            data = read()
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self._lock:
                self._pending.pop(key, None)
        fut.set_result(data)
        self._put(key, data)
        return data

    def _put(self, key: tuple[str, int], data: bytes) -> None:
        if len(data) > self._limit:
            return
        with self._lock:
            self._data[key] = data
            self._bytes += len(data)
            while self._bytes > self._limit:
                _, old = self._data.popitem(last=False)
                self._bytes -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0


class DataStatesStoragePlugin(StoragePlugin):
    """A torchsnapshot ``StoragePlugin`` on the native engine (see the module docstring).

    ``root`` is a local directory (relative paths are taken from the current directory);
    ``storage_options`` are :class:`PluginOptions` fields. Thread-safe: torchsnapshot calls the
    coroutines from one event loop, and the blocking work runs in the plugin's pool.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        if "://" in root:
            raise ValueError(
                f"the {PROTOCOL} torchsnapshot plugin writes local paths only, got {root!r}; "
                "use torchsnapshot's own s3:// or gs:// plugin for object stores"
            )
        self.root = os.path.abspath(root)
        self.options = PluginOptions.parse(storage_options)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.options.io_threads, thread_name_prefix="dcp_datastates-tsnap"
        )
        self._lock = threading.Lock()  # guards the lazily built members below and the stats
        self._engine: Engine | None = None
        self._log: CrcLog | None = None
        self._dirs = DirSync()
        self._known_dirs: set[str] = set()
        self._index: tuple[dict[str, ObjectRecord], bool] | None = None  # (records, has index)
        self._written: dict[str, ObjectRecord] = {}
        self._cache = _ChunkCache(self.options.read_cache_size)
        self._failed_sources: list[Any] = []  # sources a failed job may still read until close
        self._closed = False
        self.stats: dict[str, int] = collections.Counter()

    # -- StoragePlugin ---------------------------------------------------------------------
    async def write(self, write_io: WriteIO) -> None:
        """Writes one object durably, with its checksums (returns once both are durable)."""
        await self._run(self._write_sync, write_io.path, write_io.buf)

    async def read(self, read_io: ReadIO) -> None:
        """Reads one object, or its ``byte_range``, verified against its checksums."""
        data = await self._run(self._read_sync, read_io.path, read_io.byte_range)
        read_io.buf = io.BytesIO(data)

    async def delete(self, path: str) -> None:
        await self._run(os.remove, self._local(path))

    async def delete_dir(self, path: str) -> None:
        await self._run(os.rmdir, self._local(path))

    async def close(self) -> None:
        """Stops the threads and frees the host buffer (:meth:`close_now`)."""
        self.close_now()

    def close_now(self) -> None:
        """Synchronous :meth:`close`. Idempotent; every write torchsnapshot awaited is durable
        already, so nothing is waited for but idle threads."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            engine, self._engine = self._engine, None
            log, self._log = self._log, None
        if engine is not None:
            engine.close()  # joins the native threads: failed jobs' sources are free after it
        if log is not None:
            log.close()
        self._failed_sources.clear()
        self._cache.clear()

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self._closed:
            raise CheckpointSaveError(f"the {PROTOCOL} storage plugin of {self.root} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _local(self, rel: str) -> str:
        path = os.path.normpath(os.path.join(self.root, rel))
        if os.path.commonpath([self.root, path]) != self.root:
            raise ValueError(f"object path {rel!r} leaves the snapshot directory {self.root}")
        return path

    # -- write -----------------------------------------------------------------------------
    def _engine_locked(self) -> Engine:
        if self._engine is None:
            o = self.options
            self._engine = Engine(WriterConfig(
                cache_bytes=o.buffer_size, chunk_bytes=o.chunk_size, copy_threads=o.copy_threads,
                flush_threads=o.flush_threads, o_direct=o.o_direct, prefault=False,
                checksums=True, durable=True, idle_priority=False, flush_idle=False,
            ))
            self._log = CrcLog(self.root, self._dirs)
        return self._engine

    def _write_sync(self, rel: str, buf: Any) -> None:
        """Runs in the pool: the object's file, its flush, its directory entries, its record."""
        path = self._local(rel)
        made = self._make_dirs(rel, os.path.dirname(path))
        with self._lock:
            engine = self._engine_locked()
            log = self._log
        assert log is not None
        addr, n, keep = _buffer_address(buf)
        rec = self._flush(engine, rel, path, addr, n, keep)
        made.append(self._dirs.created(os.path.dirname(path)))
        try:
            self._dirs.sync(made)
            log.commit(rec)
        except OSError as e:
            raise CheckpointSaveError(f"torchsnapshot object '{rel}' ({path}): {e}") from None
        with self._lock:
            self._written[rel] = rec
            self.stats["objects_written"] += 1
            self.stats["bytes_written"] += n

    def _make_dirs(self, rel: str, directory: str) -> list[tuple[str, int]]:
        """Creates ``directory`` and its missing parents; returns the entries to make durable."""
        with self._lock:
            if directory in self._known_dirs:
                return []
        missing: list[str] = []
        d = directory
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        made: list[tuple[str, int]] = []
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                pass  # another writer made it; its creator syncs the parent
            except OSError as e:
                raise CheckpointSaveError(
                    f"torchsnapshot object '{rel}': cannot create the directory {d}: "
                    f"{e.strerror or e}"
                ) from None
            made.append(self._dirs.created(os.path.dirname(d)))
        with self._lock:
            self._known_dirs.add(directory)
        return made

    def _flush(
        self, engine: Engine, rel: str, path: str, addr: int, n: int, keep: Any
    ) -> ObjectRecord:
        """One engine job: the file created, the object placed at offset 0, flushed, synced."""
        job = engine.create_job(f"torchsnapshot:{rel}")
        ok = False
        try:
            f = engine.open_file(job, path)
            if n:
                # Large objects through the aligned host buffer (O_DIRECT); small ones straight
                # from torchsnapshot's buffer, which stays valid until this write returns.
                direct = not (self.options.o_direct and n >= _core.DIRECT_MIN_BYTES)
                entry = engine.add_entry(job, rel, addr, n, direct=direct)
                engine.place(job, entry, f, 0, b"", b"")
                engine.start_copies(job)
            engine.seal(job)
            engine.wait_done(job)
            chunks = sorted((r[3], r[5], r[6]) for r in engine.chunk_records(job))
            ok = True
        except CheckpointSaveError as e:
            raise CheckpointSaveError(
                f"torchsnapshot object '{rel}' was not written to {path}: {e}"
            ) from None
        finally:
            if not ok:
                engine.abort(job, f"writing '{rel}' failed")
                self._failed_sources.append(keep)  # a flush may still read it: kept till close
            engine.forget(job)
        return ObjectRecord(rel, n, tuple(chunks), time.time_ns())

    # -- read ------------------------------------------------------------------------------
    def _record(self, rel: str, path: str) -> ObjectRecord | None:
        """The object's checksum record; None for a snapshot without an index (unverified)."""
        with self._lock:
            rec = self._written.get(rel)
            if rec is not None:
                return rec
            if self._index is None:
                records, problems, logs = load_index(self.root)
                for p in problems:
                    logger.warning("torchsnapshot index: %s", p)
                self._index = (records, logs > 0)
            records, has_index = self._index
        rec = records.get(rel)
        if rec is None and has_index:
            raise IntegrityError(
                f"{path}: no checksum record for '{rel}' in {self.root}/.datastates (the object "
                f"was not written by the {PROTOCOL} plugin); storage option verify_reads=False "
                "reads it unverified"
            )
        return rec

    def _read_sync(self, rel: str, byte_range: tuple[int, int] | None) -> bytes:
        """Runs in the pool: reads (part of) one object, chunk by chunk verified."""
        path = self._local(rel)
        rec = self._record(rel, path) if self.options.verify_reads else None
        size = os.stat(path).st_size
        lo, hi = byte_range if byte_range is not None else (0, size)
        if not 0 <= lo <= hi <= size:
            raise ValueError(f"{path}: byte range [{lo}, {hi}) outside its {size} bytes")
        if rec is None:
            data = bytes(self._read_spans(path, rel, [(lo, hi - lo, -1)]))
        else:
            if size != rec.size:
                raise IntegrityError(f"{path}: {size} bytes, its checksum record says "
                                     f"{rec.size}")
            data = self._read_verified(path, rel, rec, lo, hi, whole=byte_range is None)
        with self._lock:
            self.stats["objects_read"] += 1
            self.stats["bytes_read"] += len(data)
        return data

    def _read_verified(
        self, path: str, rel: str, rec: ObjectRecord, lo: int, hi: int, whole: bool
    ) -> bytes:
        chunks = rec.covering(lo, hi)
        if not chunks:
            return b""
        start, end = chunks[0][0], chunks[-1][0] + chunks[-1][1]
        if whole or (start == lo and end == hi):
            buf = self._read_spans(path, rel, chunks)
            return bytes(buf) if (start, end) == (lo, hi) else bytes(buf[lo - start : hi - start])
        parts = [
            self._cache.get((path, c[0]), functools.partial(self._read_chunk, path, rel, c))
            for c in chunks
        ]
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        return joined[lo - start : hi - start]

    def _read_chunk(self, path: str, rel: str, chunk: tuple[int, int, int]) -> bytes:
        return bytes(self._read_spans(path, rel, [chunk]))

    def _read_spans(self, path: str, rel: str, spans: list[tuple[int, int, int]]) -> bytearray:
        """Reads consecutive ``(offset, bytes, crc or -1)`` spans of one file into one buffer."""
        total = sum(s[1] for s in spans)
        buf = bytearray(total)
        if total == 0:
            return buf
        anchor = ctypes.c_char.from_buffer(buf)
        base, start = ctypes.addressof(anchor), spans[0][0]
        k = len(spans)
        try:
            st = _core.read_spans(
                [path], [0] * k, [s[0] for s in spans], [s[1] for s in spans],
                [base + s[0] - start for s in spans], [s[2] for s in spans], [rel], [0] * k,
                self.options.read_threads, True,
            )
        except _core.EngineError as e:
            msg = str(e)
            if "checksum mismatch" in msg or "truncated" in msg:
                raise IntegrityError(f"{path}: {msg}") from None
            raise OSError(f"{path}: {msg}") from None
        finally:
            del anchor
        with self._lock:
            self.stats["bytes_verified"] += int(st.get("verified_bytes", 0))
        return buf


def storage_plugin(path: str, storage_options: dict[str, Any] | None = None) -> StoragePlugin:
    """The ``storage_plugins`` entry point (``datastates``): torchsnapshot calls it with the URL's
    path (after ``datastates://``) and the snapshot's ``storage_options``."""
    return DataStatesStoragePlugin(path, storage_options)
