"""The Python flush path for non-local fsspec URLs (object stores, memory://, ...).

The native engine writes POSIX files only. For other file systems the engine still copies every
tensor into the host cache, but the entries are placed *external*: this module streams them out
of the cache into one sequential object per rank (object stores cannot write at offsets),
computing the same per-chunk CRC-32C, and releases each chunk's cache space as soon as it is
copied out. Items are written in the order the engine copies them, so a cache smaller than the
checkpoint never deadlocks (the chunk waited for is always the oldest one in the cache).

Where the bytes go (:func:`open_object`):

* ``s3://`` (s3fs): a :class:`~dcp_datastates.storage.s3.MultipartUpload`, parts of ``part_bytes``
  uploaded ``concurrency`` at a time, memory bounded by ``(concurrency + 1) * part_bytes``;
* any other file system: the file object of ``fs.open(path, "wb")``.

Either way the object is completed only after its last byte (an object store shows it only
then), and on a failure it is abandoned (multipart upload aborted, ``discard()`` of the file
object where it has one, else the partial file removed); the error names the object's path.

Runs in the DCP save thread (``write_data``); blocking waits release the GIL.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from .. import _core
from ..engine import Engine
from .s3 import MultipartUpload, is_s3

logger = logging.getLogger(__name__)

DEFAULT_PART_BYTES = 16 * 1024**2
DEFAULT_CONCURRENCY = 4


@dataclass
class SinkItem:
    """One item of the sequential stream: a tensor entry with its archive, or raw bytes."""

    offset: int  # where the item starts in the file (padding before it is zero-filled)
    entry: int = -1  # engine entry, or -1 for raw bytes
    prefix: bytes = b""
    suffix: bytes = b""
    data: bytes = b""
    spill: Any = None  # a SpilledTensor holding the payload (the entry is not in the cache)


class ObjectWriter(Protocol):
    """A sequential writer of one object: ``write`` copies, ``close`` completes, ``abort``
    abandons (never raises; returns what could not be cleaned up, or None)."""

    def write(self, data: bytes | bytearray | memoryview) -> int: ...

    def close(self) -> None: ...

    def abort(self) -> str | None: ...


def abort_after(out: ObjectWriter, err: BaseException) -> None:
    """Abandons ``out`` after ``err``: what the abort could not clean up is logged and added to
    ``err`` as a note."""
    left = out.abort()
    if left is not None:
        logger.warning("%s", left)
        if isinstance(err, Exception):
            err.add_note(left)


class _FsspecFile:
    """An fsspec file object opened for writing, with an abort that does not commit it."""

    def __init__(self, fs: Any, path: str) -> None:
        self._fs = fs
        self._path = path
        self._f = fs.open(path, "wb")

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return int(self._f.write(data) or 0)

    def close(self) -> None:
        self._f.close()

    def abort(self) -> str | None:
        discard = getattr(self._f, "discard", None)
        try:
            if callable(discard):
                discard()  # buffered remote files: drop the buffer, abort any upload
                return None
            self._f.close()  # plain files: close, then remove what was written
            if self._fs.exists(self._path):
                self._fs.rm_file(self._path)
        except Exception as e:  # noqa: BLE001 - abort never raises over the original error
            return f"partial {self._path} was not removed: {type(e).__name__}: {e}"
        return None


def open_object(
    fs: Any,
    path: str,
    *,
    part_bytes: int = DEFAULT_PART_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> ObjectWriter:
    """A sequential writer of ``path`` on ``fs``: an S3 multipart upload for s3fs, else the file
    system's own file object (see the module docstring)."""
    if is_s3(fs):
        return MultipartUpload(fs, path, part_bytes=part_bytes, max_in_flight=concurrency)
    return _FsspecFile(fs, path)


def write_sequential(
    engine: Engine,
    job: int,
    fs: Any,
    path: str,
    items: list[SinkItem],
    *,
    part_bytes: int = DEFAULT_PART_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> list[tuple[int, int, int, int, int]]:
    """Writes ``items`` (sorted by offset) to ``path``; returns chunk records.

    Each record is (entry, chunk, file_offset, bytes, crc32c), as the engine reports for the
    files it writes itself. On any failure the object is abandoned (see :func:`open_object`)
    and the error, naming ``path``, is raised; the caller fails the job, which returns the cache
    space of the chunks not written yet.
    """
    records: list[tuple[int, int, int, int, int]] = []
    pos = 0
    out = open_object(fs, path, part_bytes=part_bytes, concurrency=concurrency)
    try:
        for it in sorted(items, key=lambda i: i.offset):
            if it.offset > pos:
                out.write(b"\0" * (it.offset - pos))
                pos = it.offset
            if it.entry < 0:
                out.write(it.data)
                pos += len(it.data)
                continue
            out.write(it.prefix)
            pos += len(it.prefix)
            if it.spill is not None:
                it.spill.stream_to(out)
                records.append((it.entry, 0, pos, it.spill.nbytes, it.spill.crc))
                pos += it.spill.nbytes
                out.write(it.suffix)
                pos += len(it.suffix)
                continue
            for c in range(engine.chunk_count(job, it.entry)):
                addr, n = engine.wait_chunk(job, it.entry, c)
                chunk = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
                crc = _core.crc32c(chunk)
                out.write(chunk)  # copied (or written) before this returns
                records.append((it.entry, c, pos, n, crc))
                pos += n
                engine.release_chunk(job, it.entry, c)
            out.write(it.suffix)
            pos += len(it.suffix)
        out.close()
    except BaseException as e:
        abort_after(out, e)
        if isinstance(e, OSError) and path not in str(e):
            if e.errno is None:
                raise OSError(f"writing {path}: {e}") from e
            raise OSError(e.errno, f"{e.strerror} (writing {path})") from e
        raise
    return records
