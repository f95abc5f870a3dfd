"""On-disk layout: torch.save archive templates and the placement of items in data files.

Why this works with the stock readers (see docs/format.md): DCP's FileSystemReader reads each
tensor chunk as ``torch.load(file[offset:offset+length])``. A ``torch.save`` archive of a
contiguous CPU tensor is a zip whose bytes are ``prefix + payload + suffix``, where prefix and
suffix depend only on dtype and shape. So the writer builds the template once per (dtype, shape)
with ``torch.serialization.skip_data()`` (nothing is copied), and the engine writes the payload
straight from the host cache between the prefix and suffix bytes.

Building a template allocates nothing the size of the tensor, not even address space: the
prototype ``torch.save`` describes is a CPU tensor over a storage that claims the payload's size
but maps no memory of its own (:func:`_prototype`). A job limited with ``RLIMIT_AS`` saves a
tensor larger than its remaining address space (``tests/test_memory_bound.py``).
"""

from __future__ import annotations

import ctypes
import functools
import io
import struct
import threading
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.serialization import skip_data

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_HEADER_SIG = 0x04034B50


@dataclass(frozen=True)
class ArchiveTemplate:
    """The bytes around a tensor payload inside its torch.save archive."""

    prefix: bytes
    suffix: bytes
    payload_bytes: int
    total_bytes: int = field(init=False)  # prefix + payload + suffix (read once per item)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "total_bytes", len(self.prefix) + self.payload_bytes + len(self.suffix)
        )


class _SparseFile(io.RawIOBase):
    """A seekable in-memory file that stores only the bytes written to it.

    ``torch.save`` under ``skip_data()`` seeks over the payload; a BytesIO would fill that gap
    with zeros (memory the size of the tensor). Here gaps cost nothing and read back as zeros.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pos = 0
        self._size = 0
        self._segments: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self._segments.append((self._pos, data))
        self._pos += len(data)
        self._size = max(self._size, self._pos)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def range(self, start: int, end: int) -> bytes:
        """The bytes of [start, end) (later writes win; gaps are zeros)."""
        out = bytearray(max(0, end - start))
        for off, data in self._segments:
            a, b = max(off, start), min(off + len(data), end)
            if a < b:
                out[a - start : b - start] = data[a - off : b - off]
        return bytes(out)

    def read(self, size: int = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        data = self.range(self._pos, end)
        self._pos = max(self._pos, end)
        return data


# PyMemoryView_FromMemory(address, size, flags): a memoryview of ``size`` bytes at ``address``
# that neither allocates nor owns them. (ctypes arrays would do too, but ctypes caches one array
# type per length, forever.)
_MEMORYVIEW_FROM_MEMORY = ctypes.pythonapi.PyMemoryView_FromMemory
_MEMORYVIEW_FROM_MEMORY.restype = ctypes.py_object
_MEMORYVIEW_FROM_MEMORY.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200  # writable: torch.frombuffer warns on a read-only buffer
_ANCHOR = ctypes.create_string_buffer(64)  # the address every prototype's storage claims


def _prototype(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous CPU tensor of ``dtype`` and ``shape`` for ``torch.save`` under
    ``skip_data()``, which reads its metadata and its storage's size but never its bytes.

    Its storage claims ``numel * itemsize`` bytes at the address of a 64-byte buffer: nothing is
    allocated or mapped (``torch.empty`` reserved the whole size, which fails under
    ``RLIMIT_AS``). Its bytes must never be read: it lives only inside :func:`build_template`.
    """
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    view = _MEMORYVIEW_FROM_MEMORY(ctypes.addressof(_ANCHOR), nbytes, _PYBUF_WRITE)
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(shape)


def build_template(dtype: torch.dtype, shape: tuple[int, ...]) -> ArchiveTemplate:
    """Builds the archive template of a contiguous CPU tensor of ``dtype`` and ``shape``.

    Touches no tensor-sized memory and reserves no tensor-sized address space: the prototype
    has no payload memory (:func:`_prototype`) and the payload gap of the archive is never
    materialised (:class:`_SparseFile`).
    """
    proto = _prototype(dtype, shape)
    buf = _SparseFile()
    with skip_data():
        torch.save(proto, buf)  # type: ignore[arg-type]  # a seekable binary file
    nbytes = proto.numel() * proto.element_size()
    del proto  # (its storage must not outlive this call: its bytes are not its own)
    total = buf.seek(0, 2)
    buf.seek(0)
    with zipfile.ZipFile(buf) as z:
        records = [i for i in z.infolist() if i.filename.endswith("/data/0")]
        if len(records) != 1:
            raise RuntimeError(f"unexpected torch.save archive layout: {z.namelist()}")
        info = records[0]
    fields = _LOCAL_HEADER.unpack(buf.range(info.header_offset, info.header_offset + 30))
    if fields[0] != _LOCAL_HEADER_SIG or info.compress_type != zipfile.ZIP_STORED:
        raise RuntimeError("unexpected torch.save archive: payload record not stored plainly")
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if info.file_size != nbytes:
        raise RuntimeError(f"payload record holds {info.file_size} bytes, expected {nbytes}")
    return ArchiveTemplate(buf.range(0, start), buf.range(start + nbytes, total), nbytes)


class TemplateCache:
    """Thread-safe memo of :func:`build_template` keyed by (dtype, shape)."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[torch.dtype, tuple[int, ...]], ArchiveTemplate] = {}
        self._max = max_entries

    def get(self, dtype: torch.dtype, shape: tuple[int, ...]) -> ArchiveTemplate:
        hit = self._cache.get((dtype, shape))  # fast path, once per item: a dict read is atomic
        if hit is not None:
            return hit
        key = (dtype, tuple(int(s) for s in shape))
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        t = build_template(*key)
        with self._lock:
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[key] = t
        return t


@functools.lru_cache(maxsize=4096)
def data_file_name(rank: int, index: int, tag: str = "") -> str:
    """Name of a rank's data file (the DCP convention, so tools recognise it).

    ``tag`` (hex digits of the save id; incremental writers, see :func:`save_tag`) makes the name
    ``__<rank>_<index>.<tag>.distcp``, one that no other save writes: the stock
    ``FileSystemWriter`` rewrites ``__<rank>_<index>.distcp`` in place, under an incremental
    checkpoint that references it.

    Cached: every item of a file then refers to one string object, which pickle writes once
    in ``.metadata`` (100,000 items: one name instead of 100,000 copies, in the file and in
    memory while it is pickled)."""
    return f"__{rank}_{index}.{tag}.distcp" if tag else f"__{rank}_{index}.distcp"


SAVE_TAG_HEX = 16  # hex digits of the save id in an incremental writer's data file names


def save_tag(save_id: str) -> str:
    """The part of a save id that names its data files (incremental writers)."""
    return save_id[:SAVE_TAG_HEX]


@dataclass
class FileLayout:
    """Assigns items of one rank to ``nfiles`` files and computes their offsets.

    Tensor payloads of at least ``direct_min`` bytes (the engine's O_DIRECT threshold) are
    padded to start at a multiple of ``payload_align`` (4096 when O_DIRECT is used); smaller
    ones, written through the page cache, are not padded at all: consecutive small items lie
    back to back, and the engine writes a run of them with one ``pwritev`` (no reader depends
    on the file offset of a payload: each item is read as its own archive). Items go to the
    least loaded file, in the order they are given (callers give them in copy order, so each
    file is written roughly front to back).
    """

    nfiles: int
    payload_align: int = 64
    direct_min: int = 4096  # payloads under this size are written buffered: not padded
    sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sizes = [0] * self.nfiles

    def _pick(self) -> int:
        sizes = self.sizes
        return sizes.index(min(sizes))  # the least loaded file (the first of equals)

    def place_tensor(self, template: ArchiveTemplate) -> tuple[int, int, int]:
        """Returns (file index, archive offset, payload offset)."""
        f = self._pick()
        start = self.sizes[f]
        payload = start + len(template.prefix)
        # Alignment only pays for payloads the engine writes with O_DIRECT; padding between small
        # items would split the engine's combined writes of them.
        big = template.payload_bytes >= max(self.direct_min, self.payload_align)
        pad = (-payload) % self.payload_align if big else 0
        start += pad
        payload += pad
        self.sizes[f] = payload + template.payload_bytes + len(template.suffix)
        return f, start, payload

    def place_bytes(self, nbytes: int) -> tuple[int, int]:
        """Returns (file index, offset) of a raw byte item."""
        f = self._pick()
        off = self.sizes[f]
        self.sizes[f] += nbytes
        return f, off
