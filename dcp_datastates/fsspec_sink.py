"""The Python flush path for non-local fsspec URLs (object stores, memory://, ...).

The native engine writes POSIX files only. For other file systems the engine still copies every
tensor into the host cache, but the entries are placed *external*: this module streams them out
of the cache into one sequential fsspec file per rank (object stores cannot write at offsets),
computing the same per-chunk CRC-32C, and releases each chunk's cache space as soon as it is
written. Items are written in the order the engine copies them, so a cache smaller than the
checkpoint never deadlocks (the chunk waited for is always the oldest one in the cache).

Runs in the DCP save thread (``write_data``); blocking waits release the GIL.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from . import _core
from .engine import Engine


@dataclass
class SinkItem:
    """One item of the sequential stream: a tensor entry with its archive, or raw bytes."""

    offset: int  # where the item starts in the file (padding before it is zero-filled)
    entry: int = -1  # engine entry, or -1 for raw bytes
    prefix: bytes = b""
    suffix: bytes = b""
    data: bytes = b""
    spill: Any = None  # a SpilledTensor holding the payload (the entry is not in the cache)


def write_sequential(
    engine: Engine, job: int, fs: Any, path: str, items: list[SinkItem]
) -> list[tuple[int, int, int, int, int]]:
    """Writes ``items`` (sorted by offset) to ``path``; returns chunk records.

    Each record is (entry, chunk, file_offset, bytes, crc32c), as the engine reports for the
    files it writes itself.
    """
    records: list[tuple[int, int, int, int, int]] = []
    pos = 0
    with fs.open(path, "wb") as f:
        for it in sorted(items, key=lambda i: i.offset):
            if it.offset > pos:
                f.write(b"\0" * (it.offset - pos))
                pos = it.offset
            if it.entry < 0:
                f.write(it.data)
                pos += len(it.data)
                continue
            f.write(it.prefix)
            pos += len(it.prefix)
            if it.spill is not None:
                it.spill.stream_to(f)
                records.append((it.entry, 0, pos, it.spill.nbytes, it.spill.crc))
                pos += it.spill.nbytes
                f.write(it.suffix)
                pos += len(it.suffix)
                continue
            for c in range(engine.chunk_count(job, it.entry)):
                addr, n = engine.wait_chunk(job, it.entry, c)
                chunk = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
                crc = _core.crc32c(chunk)
                f.write(chunk)
                records.append((it.entry, c, pos, n, crc))
                pos += n
                engine.release_chunk(job, it.entry, c)
            f.write(it.suffix)
            pos += len(it.suffix)
    return records
