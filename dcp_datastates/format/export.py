"""Export: a DCP checkpoint of ours -> consolidated Hugging Face safetensors.

``dcp-datastates export CKPT OUT`` (or :func:`export_checkpoint`) reads ``.metadata``,
reassembles every selected tensor from its chunks (any number of ranks, any sharding) and writes
``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files plus
``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes``.

Selection: by default the model weights only. Optimizer state is left out: an optimizer state
dict (``Optimizer.state_dict()``, ``get_optimizer_state_dict``, flattened or not) always holds
``param_groups``, so every key under ``P + "state."`` or ``P + "param_groups."`` where some key
starts with ``P + "param_groups."`` (``P`` empty or ending in ``.``: ``optim.``, torchtitan's
``optimizer.``, Lightning's ``optimizer_states.0.``) is optimizer state. ``include_all`` exports
everything. ``prefix`` narrows the selection to the tensors named ``prefix...``; a selection
without any tensor is an error (:class:`NothingToExportError`) naming the prefixes that exist.

Integrity: every byte exported is checked against the CRC-32C its rank's manifest recorded, as
it is read (each chunk's bytes are read once, in file order); a mismatch fails the export naming
the tensor, chunk, file and byte range. Chunks of a save made with ``checksums=False`` are
exported unchecked and listed in :attr:`ExportResult.unverified`. Incremental checkpoints are
exported whole: a chunk whose bytes live in a sibling checkpoint (``../<owner>/<file>`` in
``.metadata``) is read from there and checked against the referring manifest's CRC-32C; a missing
owner is an error naming it.

Memory is bounded by ``buffer_bytes``: each output tensor is produced in slabs (a range of one
dimension, all of the inner ones) that fit a third of the buffer; each chunk's share of a slab is
one contiguous byte range of its data file, read straight into the slab (or into a second third,
then copied into place when the chunk is narrower than the slab); the last third holds a slab
converted to ``dtype``. Nothing else scales with the checkpoint. Tensor chunks in torch.save
archives (format "torch") are located through the archive template of their dtype and shape and
the archive header is checked; chunks in ``.safetensors`` files (format "safetensors") are read
raw. Non-tensor values cannot go in safetensors: they are skipped and listed.

Output files are written under a temporary name (``<name>.partial``), synced and renamed only
once every tensor of every file was written and checked; the index comes last. Errors name the
tensor (and chunk, file) and raise :class:`ExportError`; the temporary files of a failed export
are removed and nothing is left under the final names. Single-threaded; no state between calls.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

import torch

from .. import _core
from ..errors import DataStatesError
from ..runtime.progress import Progress
from .commit import MANIFEST_PREFIX, METADATA_FILE
from .layout import TemplateCache
from .manifest import ItemRecord, RankManifest
from .refs import is_reference_path, relative_path
from .safetensors import SUFFIX, HeaderEntry, dtype_name, encode_header, read_into
from .verify import load_metadata

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PARTIAL = ".partial"

DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


class ExportError(DataStatesError):
    """A checkpoint could not be exported; the message names the tensor, chunk or file."""


class NotACheckpointError(ExportError):
    """The input is missing or not a committed checkpoint (no readable ``.metadata``)."""


class OutputExistsError(ExportError):
    """An output file exists already and ``overwrite`` is off."""


class NothingToExportError(ExportError):
    """The selection (``prefix``, the model-only default) holds no tensor; the message lists the
    top-level prefixes the checkpoint's tensors have."""


@dataclass(frozen=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint: a plain name, or ../<owner>/<name> (incremental)
    payload: int  # file offset of the chunk's raw bytes (row-major)
    crcs: tuple[tuple[int, int, int], ...] = ()  # (file offset, bytes, CRC-32C), sorted


@dataclass
class _Tensor:
    fqn: str  # name in the checkpoint
    key: str  # name in the output
    dtype: torch.dtype
    out_dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[_Chunk]

    @property
    def out_bytes(self) -> int:
        return math.prod(self.shape) * self.out_dtype.itemsize


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    files: list[str]  # output file names (the index last, if any)
    tensors: int
    bytes: int  # tensor bytes written
    skipped: list[str] = field(default_factory=list)  # non-tensor values, not exported
    excluded: list[str] = field(default_factory=list)  # optimizer-state tensors left out
    unverified: list[str] = field(default_factory=list)  # tensors saved without checksums
    bytes_verified: int = 0  # payload bytes checked against their CRC-32C


def parse_dtype(name: str) -> torch.dtype:
    """``bf16``/``fp16``/``fp32`` (and their long names) -> torch dtype; ValueError otherwise."""
    try:
        return DTYPE_ALIASES[name.lower()]
    except KeyError:
        raise ValueError(
            f"--dtype {name!r}: expected one of {', '.join(sorted(DTYPE_ALIASES))}"
        ) from None


def optimizer_prefixes(keys: list[str]) -> set[str]:
    """The prefixes ``P`` (``""`` or ending in ``.``) under which ``keys`` hold an optimizer state
    dict: some key starts with ``P + "param_groups."``."""
    out: set[str] = set()
    for k in keys:
        i = k.find("param_groups.")
        while i >= 0:
            if i == 0 or k[i - 1] == ".":
                out.add(k[:i])
            i = k.find("param_groups.", i + 1)
    return out


def _is_optimizer_state(fqn: str, prefixes: set[str]) -> bool:
    return any(fqn.startswith((p + "state.", p + "param_groups.")) for p in prefixes)


def _top_level(keys: list[str]) -> str:
    """``a. (3), b. (1)``: the first name component of ``keys``, with counts (at most 12)."""
    counts: dict[str, int] = {}
    for k in keys:
        head = k.split(".", 1)[0] + ("." if "." in k else "")
        counts[head] = counts.get(head, 0) + 1
    shown = [f"{h} ({n})" for h, n in sorted(counts.items())[:12]]
    more = f" and {len(counts) - 12} more" if len(counts) > 12 else ""
    return ", ".join(shown) + more


def _records(ckpt: str) -> tuple[dict[tuple[str, tuple[int, ...]], list[tuple[ItemRecord, bool]]],
                                 list[str]]:
    """Every tensor item of every manifest in ``ckpt`` by (fqn, offsets), with its manifest's
    ``checksums`` flag; and what was wrong with manifests that could not be read."""
    out: dict[tuple[str, tuple[int, ...]], list[tuple[ItemRecord, bool]]] = {}
    problems: list[str] = []
    for name in sorted(os.listdir(ckpt)):
        if not (name.startswith(MANIFEST_PREFIX) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(ckpt, name), "rb") as f:
                man = RankManifest.from_json(f.read().decode())
        except (ValueError, UnicodeDecodeError, RecursionError, OSError) as e:
            problems.append(f"{name} is damaged: {e}")
            continue
        for it in man.items:
            if it.offset is not None:
                out.setdefault((it.fqn, tuple(it.offset)), []).append((it, man.checksums))
    return out, problems


@dataclass
class _Source:
    """The checkpoint being exported, as :func:`_plan` reads it: its ``.metadata``, the items of
    its manifests and the archive templates of its chunks."""

    ckpt: str
    md: Metadata
    records: dict[tuple[str, tuple[int, ...]], list[tuple[ItemRecord, bool]]]
    manifest_problems: list[str]  # what was wrong with manifests that could not be read
    templates: TemplateCache = field(default_factory=TemplateCache)


def _open(ckpt: str) -> _Source:
    """Reads ``ckpt``'s ``.metadata`` and manifests; raises if it is not a checkpoint."""
    md_path = os.path.join(ckpt, METADATA_FILE)
    if not os.path.isdir(ckpt):
        raise NotACheckpointError(f"{ckpt}: no such checkpoint directory")
    try:
        with open(md_path, "rb") as f:
            md = load_metadata(f.read())
    except FileNotFoundError:
        raise NotACheckpointError(
            f"{ckpt}: not a committed checkpoint (no {METADATA_FILE})"
        ) from None
    except ValueError as e:
        raise ExportError(f"{md_path}: damaged: {e}") from None
    records, manifest_problems = _records(ckpt)
    return _Source(ckpt, md, records, manifest_problems)


def _plan(
    ckpt: str, dtype: torch.dtype | None, prefix: str | None, include_all: bool = False
) -> tuple[list[_Tensor], list[str], list[str], list[str]]:
    """The tensors to export (in the checkpoint's order), the non-tensor keys skipped, the
    optimizer-state tensors left out and the tensors whose bytes have no checksums."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = _open(ckpt)
    md = source.md
    all_tensors = [k for k, v in md.state_dict_metadata.items()
                   if isinstance(v, TensorStorageMetadata)]
    opt = set() if include_all else optimizer_prefixes(list(md.state_dict_metadata))
    tensors: list[_Tensor] = []
    skipped: list[str] = []
    excluded: list[str] = []
    unverified: list[str] = []
    for fqn, smd in md.state_dict_metadata.items():
        if prefix is not None and not fqn.startswith(prefix):
            continue
        key = fqn[len(prefix):] if prefix else fqn
        if _is_optimizer_state(fqn, opt):
            if isinstance(smd, TensorStorageMetadata):
                excluded.append(fqn)
            continue
        if not isinstance(smd, TensorStorageMetadata):
            skipped.append(fqn)
            continue
        tensors.append(_tensor(source, fqn, key, smd, dtype, unverified))
    if not tensors:
        raise NothingToExportError(_nothing(ckpt, prefix, all_tensors, excluded))
    keys = [t.key for t in tensors]
    if len(set(keys)) != len(keys) or "" in keys or "__metadata__" in keys:
        raise ExportError(f"--prefix {prefix!r} leaves empty, duplicate or reserved tensor names")
    return tensors, skipped, excluded, unverified


def _tensor(
    source: _Source, fqn: str, key: str, smd: TensorStorageMetadata, dtype: torch.dtype | None,
    unverified: list[str],
) -> _Tensor:
    """The tensor ``fqn`` to export as ``key``, every chunk of it located and checked; appends
    ``fqn`` to ``unverified`` if some chunk of it has no checksums."""
    src = smd.properties.dtype
    try:
        dtype_name(src, fqn)
    except ValueError as e:
        raise ExportError(str(e)) from None
    out = src
    if dtype is not None and src.is_floating_point and src.itemsize >= 2:
        out = dtype
    shape = tuple(int(s) for s in smd.size)
    chunks: list[_Chunk] = []
    for ch in smd.chunks:
        chunk, checked = _chunk(source, fqn, src, ch)
        if not checked and fqn not in unverified:
            unverified.append(fqn)
        chunks.append(chunk)
    covered = sum(math.prod(c.sizes) for c in chunks)
    if covered != math.prod(shape):
        raise ExportError(
            f"'{fqn}': its chunks hold {covered} elements, the tensor {list(shape)} has "
            f"{math.prod(shape)} ({METADATA_FILE} damaged)"
        )
    return _Tensor(fqn, key, src, out, shape, chunks)


def _chunk(
    source: _Source, fqn: str, src: torch.dtype, ch: ChunkStorageMetadata
) -> tuple[_Chunk, bool]:
    """One chunk of tensor ``fqn``: where its bytes are (its file checked to be one of the
    checkpoint's, or of a sibling it references), with its checksums; and whether it has any."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    ckpt = source.ckpt
    offs = tuple(int(o) for o in ch.offsets)
    sizes = tuple(int(s) for s in ch.sizes)
    where = f"'{fqn}' chunk at {list(offs)}"
    info = source.md.storage_data.get(MetadataIndex(fqn, ch.offsets))
    if info is None:
        raise ExportError(f"{where}: not in {METADATA_FILE}'s storage_data")
    rel = str(info.relative_path)
    if getattr(info, "transform_descriptors", None):
        raise ExportError(
            f"{where} ({rel}): stored through the transforms "
            f"{list(info.transform_descriptors)} (_extensions), which export does not "
            "undo; load it with dcp.load and save it again without _extensions"
        )
    if is_reference_path(rel):
        owner = rel.split("/")[1]
        if not os.path.isdir(os.path.join(ckpt, os.pardir, owner)):
            raise ExportError(
                f"{where}: its bytes live in the checkpoint {owner} this incremental "
                f"checkpoint references ({rel}), which is missing: restore it beside "
                f"{os.path.basename(os.path.normpath(ckpt))}"
            )
    elif os.path.basename(rel) != rel or rel in ("", ".", ".."):
        raise ExportError(f"{where}: {METADATA_FILE} names the file {rel!r}")
    nbytes = math.prod(sizes) * src.itemsize
    payload = _payload(source, where, rel, info, src, sizes, nbytes)
    crcs, checked = _checksums(
        source.records.get((fqn, offs), []), rel, int(info.offset), int(info.length), payload,
        nbytes, f"{where} ({rel})", source.manifest_problems,
    )
    return _Chunk(offs, sizes, rel, payload, crcs), checked


def _payload(
    source: _Source, where: str, rel: str, info: _StorageInfo, src: torch.dtype,
    sizes: tuple[int, ...], nbytes: int,
) -> int:
    """The file offset of a chunk's raw bytes (``nbytes`` of them, in the file ``rel``): where
    ``.metadata`` puts them in a ``.safetensors`` file, past the archive's header (checked) in a
    torch.save archive."""
    if rel.endswith(SUFFIX):
        if info.length != nbytes:
            raise ExportError(
                f"{where} ({rel}): {info.length} bytes for a {src} chunk {list(sizes)}"
            )
        return int(info.offset)
    tmpl = source.templates.get(src, sizes)
    if info.length != tmpl.total_bytes:
        raise ExportError(
            f"{where} ({rel}): not a torch.save archive of a contiguous {src} "
            f"chunk {list(sizes)} as dcp_datastates writes it ({info.length} bytes, "
            f"expected {tmpl.total_bytes})"
        )
    head = _read_exact(os.path.join(source.ckpt, rel), int(info.offset), len(tmpl.prefix),
                       where)
    if head != tmpl.prefix:
        raise ExportError(
            f"{where} ({rel}): the torch.save archive header at byte {info.offset} "
            "is damaged or not laid out as dcp_datastates writes it"
        )
    return int(info.offset) + len(tmpl.prefix)


def _nothing(ckpt: str, prefix: str | None, all_tensors: list[str], excluded: list[str]) -> str:
    """Why nothing would be exported, and what is there."""
    if not all_tensors:
        return f"{ckpt}: the checkpoint holds no tensor (only non-tensor values)"
    there = f"its tensors' names start with: {_top_level(all_tensors)}"
    if excluded:
        under = f" under --prefix {prefix!r}" if prefix else ""
        return (
            f"{ckpt}: every tensor{under} is optimizer state ({len(excluded)}, e.g. "
            f"'{excluded[0]}'), which export leaves out by default: pass --all to export it; "
            + there
        )
    return (
        f"{ckpt}: --prefix {prefix!r} matches no tensor; {there} (torchtitan and "
        "get_model_state_dict checkpoints keep the weights at the top level: no --prefix)"
    )


def _checksums(
    candidates: list[tuple[ItemRecord, bool]], rel: str, offset: int, length: int, payload: int,
    nbytes: int, where: str, manifest_problems: list[str],
) -> tuple[tuple[tuple[int, int, int], ...], bool]:
    """The CRC-32C blocks of one chunk from the manifest record placed where ``.metadata`` puts
    it, and whether its bytes can be checked (False: saved with ``checksums=False``)."""
    rec, checksums = next(
        ((it, c) for it, c in candidates if relative_path(it) == rel
         and it.archive_offset == offset and it.archive_length == length),
        (None, False),
    )
    if rec is None:
        why = "; ".join(manifest_problems) if manifest_problems else "manifest missing"
        raise ExportError(
            f"{where}: no manifest records this chunk where {METADATA_FILE} puts it ({why}), so "
            "its bytes cannot be checked; `dcp-datastates verify` tells more"
        )
    if rec.payload_offset != payload or rec.payload_bytes != nbytes:
        raise ExportError(
            f"{where}: the manifest puts the payload at ({rec.payload_offset}, "
            f"{rec.payload_bytes}), {METADATA_FILE} at ({payload}, {nbytes})"
        )
    if not checksums:
        return (), False
    blocks = tuple(sorted(rec.chunks))
    pos = payload
    for off, n, _crc in blocks:
        if off != pos:
            break
        pos += n
    if pos != payload + nbytes:
        raise ExportError(
            f"{where}: the recorded checksums do not cover bytes [{payload}, {payload + nbytes}) "
            "exactly (manifest damaged)"
        )
    return blocks, True


class _CrcCursor:
    """Checks one chunk's bytes against its CRC-32C blocks as they are read, in file order.

    ``feed`` takes each read (file offset, address, bytes); a block is compared as soon as its
    last byte arrived. Reads out of order (not expected: a chunk's part of each slab follows
    the previous one) switch to re-reading the blocks not yet checked in :meth:`finish`."""

    def __init__(self, chunk: _Chunk, where: str) -> None:
        self.blocks, self.where = chunk.crcs, where
        self.i, self.acc, self.filled, self.verified = 0, 0, 0, 0
        self.pos = self.blocks[0][0] if self.blocks else 0
        self.in_order = True

    def _mismatch(self, off: int, n: int, want: int, got: int) -> ExportError:
        return ExportError(
            f"{self.where}: checksum mismatch in bytes [{off}, {off + n}) (expected crc32c "
            f"{want:08x}, found {got:08x}): the data file is damaged; nothing was exported"
        )

    def feed(self, off: int, addr: int, n: int) -> None:
        if not self.blocks or not self.in_order or n == 0:
            return
        if off != self.pos:
            self.in_order = False
            return
        while n > 0 and self.i < len(self.blocks):
            boff, bn, want = self.blocks[self.i]
            take = min(n, bn - self.filled)
            self.acc = _core.crc32c_address(addr, take, self.acc)
            addr, n, self.filled, self.pos = addr + take, n - take, self.filled + take, \
                self.pos + take
            if self.filled == bn:
                if self.acc != want:
                    raise self._mismatch(boff, bn, want, self.acc)
                self.verified += bn
                self.i, self.acc, self.filled = self.i + 1, 0, 0

    def finish(self, f: BinaryIO) -> int:
        """Checks the blocks the reads did not complete; returns the bytes verified."""
        if not self.in_order:
            self.i, self.verified = 0, 0
        for boff, bn, want in self.blocks[self.i:]:
            f.seek(boff)
            data = f.read(bn)
            got = _core.crc32c(data, 0)
            if len(data) != bn or got != want:
                raise self._mismatch(boff, bn, want, got)
            self.verified += bn
        self.i = len(self.blocks)
        return self.verified


def _read_exact(path: str, offset: int, n: int, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(n)
    except FileNotFoundError:
        raise ExportError(f"{where}: data file {os.path.basename(path)} is missing") from None
    if len(data) != n:
        raise ExportError(f"{where}: data file {os.path.basename(path)} is truncated")
    return data


def _shards(tensors: list[_Tensor], max_shard_bytes: int) -> list[list[_Tensor]]:
    """Greedy, in order: a new file when the next tensor would exceed the limit."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.out_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.out_bytes
    return shards


class _Files:
    """Open data files of the checkpoint, by name."""

    def __init__(self, ckpt: str) -> None:
        self.ckpt = ckpt
        self.open: dict[str, BinaryIO] = {}

    def get(self, name: str, where: str) -> BinaryIO:
        if name not in self.open:
            try:
                self.open[name] = open(os.path.join(self.ckpt, name), "rb")  # noqa: SIM115
            except FileNotFoundError:
                raise ExportError(f"{where}: data file {name} is missing") from None
        return self.open[name]

    def close(self) -> None:
        for f in self.open.values():
            f.close()


def _write_all(out: BinaryIO, t: torch.Tensor) -> None:
    n = t.numel() * t.element_size()
    if n:
        out.write(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"))


@dataclass
class _Slabs:
    """How :func:`_stream_tensor` cuts one tensor into slabs, and reads its chunks into them: a
    slab is a range of rows of dimension ``k`` (all the inner dimensions) at one index ``idx`` of
    the outer ones."""

    t: _Tensor
    files: _Files
    cursors: list[_CrcCursor]  # one per chunk
    read_buf: torch.Tensor  # where a chunk narrower than the slab is read first
    k: int  # the dimension slabs are ranges of (0 for a 0-d tensor)
    inner: int  # elements per row of dimension k

    def read(
        self, c: _Chunk, cursor: _CrcCursor, slab: torch.Tensor, idx: tuple[int, ...], r0: int,
        r1: int,
    ) -> int:
        """Reads chunk ``c``'s part of the slab of rows [r0, r1) at ``idx`` into ``slab``
        (checking its bytes); returns the elements it filled (0 if the chunk has none there)."""
        t, k, inner = self.t, self.k, self.inner
        nd = len(t.shape)
        if math.prod(c.sizes) == 0:
            return 0
        if nd and any(not (o <= i < o + s) for i, o, s in
                      zip(idx, c.offsets[:k], c.sizes[:k], strict=True)):
            return 0
        a = max(r0, c.offsets[k]) if nd else 0
        b = min(r1, c.offsets[k] + c.sizes[k]) if nd else 1
        if a >= b:
            return 0
        # The chunk's part of this slab: contiguous in the chunk (row-major).
        cinner = math.prod(c.sizes[k + 1:]) if nd else 1
        start = 0
        if nd:
            stride = 1
            coords = [i - o for i, o in zip(idx, c.offsets[:k], strict=True)]
            coords.append(a - c.offsets[k])
            for d in range(k, -1, -1):
                start += coords[d] * stride
                stride *= c.sizes[d]
            start *= cinner
        count = (b - a) * cinner
        where = f"'{t.fqn}' chunk at {list(c.offsets)} ({c.file})"
        f = self.files.get(c.file, where)
        off = c.payload + start * t.dtype.itemsize
        full_rows = not nd or tuple(c.sizes[k + 1:]) == tuple(t.shape[k + 1:])
        try:
            if full_rows:
                dst = slab.view(-1)[(a - r0) * inner:(b - r0) * inner]
                read_into(f, off, dst, where)
                cursor.feed(off, dst.data_ptr(), count * t.dtype.itemsize)
            else:
                part_shape = ((b - a),) + tuple(c.sizes[k + 1:])
                part = self.read_buf[: count * t.dtype.itemsize].view(t.dtype).view(part_shape)
                read_into(f, off, part, where)
                cursor.feed(off, part.data_ptr(), count * t.dtype.itemsize)
                box = slab[a - r0:b - r0]
                for d in range(k + 1, nd):
                    box = box.narrow(d - k, c.offsets[d], c.sizes[d])
                box.copy_(part)
        except ValueError as e:
            raise ExportError(f"{e} (data file truncated)") from None
        return count


def _stream_tensor(
    t: _Tensor, out: BinaryIO, unit: int, scratch: list[torch.Tensor], files: _Files,
    progress: Progress,
) -> int:
    """Writes tensor ``t`` (row-major, ``out_dtype``) to ``out`` in slabs of at most ``unit``
    bytes each; ``scratch`` holds the three reusable buffers of ``unit`` bytes. Every byte read
    is checked against its chunk's CRC-32C (before the slab holding it is written); returns
    the bytes verified."""
    shape = t.shape
    numel = math.prod(shape)
    cursors = [_CrcCursor(c, f"'{t.fqn}' chunk at {list(c.offsets)} ({c.file})")
               for c in t.chunks]
    if numel == 0:
        return 0
    isz = max(t.dtype.itemsize, t.out_dtype.itemsize)
    nd = len(shape)
    if nd == 0:
        k, run = 0, 1
    else:
        # The outermost dimension k whose inner block (all dims after k) fits the unit.
        k = next(i for i in range(nd) if math.prod(shape[i + 1:]) * isz <= unit)
        run = max(1, min(shape[k], unit // (math.prod(shape[k + 1:]) * isz)))
    inner = math.prod(shape[k + 1:]) if nd else 1
    slab_buf, read_buf, conv_buf = scratch
    slabs = _Slabs(t, files, cursors, read_buf, k, inner)
    outer = itertools.product(*(range(s) for s in shape[:k])) if nd else iter([()])
    for idx in outer:
        for r0 in range(0, shape[k] if nd else 1, run):
            r1 = min(r0 + run, shape[k]) if nd else 1
            slab_shape = ((r1 - r0),) + tuple(shape[k + 1:]) if nd else ()
            n = (r1 - r0) * inner
            slab = slab_buf[: n * t.dtype.itemsize].view(t.dtype).view(slab_shape)
            filled = sum(slabs.read(c, cursor, slab, idx, r0, r1)
                         for c, cursor in zip(t.chunks, cursors, strict=True))
            if filled != n:
                raise ExportError(
                    f"'{t.fqn}': its chunks cover {filled} of the {n} elements of rows "
                    f"[{r0}, {r1}) (overlapping or missing chunks; {METADATA_FILE} damaged)"
                )
            if t.out_dtype != t.dtype:
                conv = conv_buf[: n * t.out_dtype.itemsize].view(t.out_dtype).view(slab_shape)
                conv.copy_(slab)
                slab = conv
            _write_all(out, slab)
            progress.update(n * t.out_dtype.itemsize)
    return sum(
        cur.finish(files.get(c.file, cur.where)) for c, cur in zip(t.chunks, cursors, strict=True)
    )


def export_checkpoint(
    ckpt: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 * 1000**3,
    buffer_bytes: int = 256 * 1024**2,
    dtype: torch.dtype | None = None,
    prefix: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    include_all: bool = False,
) -> ExportResult:
    """Consolidates the DCP checkpoint ``ckpt`` into Hugging Face safetensors in ``out_dir``.

    Args:
        ckpt: a local checkpoint directory written by DataStatesWriter (either format).
        out_dir: created if missing; gets ``model.safetensors``, or
            ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``.
        max_shard_bytes: largest output file (a single larger tensor gets a file of its own).
        buffer_bytes: the memory used for data (at least 64 KiB).
        dtype: cast floating-point tensors of 2 bytes or more to this dtype (fp8, integers and
            bool are kept).
        prefix: export only tensors whose name starts with it, without it in the output
            (e.g. ``"model."`` for an ``{"model": ..., "optim": ...}`` state; torchtitan and
            ``get_model_state_dict`` checkpoints keep the weights at the top level).
        overwrite: replace existing output files (else an existing one is an error).
        progress: draw a progress bar on stderr.
        include_all: export optimizer state too (by default it is left out: module docstring).

    Raises ExportError naming the tensor for anything that cannot be exported (unsupported
    dtype, damaged or missing data, a checksum mismatch), NotACheckpointError if ``ckpt`` is not
    a checkpoint, NothingToExportError if the selection holds no tensor.
    """
    ckpt, out_dir = os.fspath(ckpt), os.fspath(out_dir)
    if buffer_bytes < 64 * 1024:
        raise ValueError(f"buffer must be at least 64 KiB, got {buffer_bytes} bytes")
    if max_shard_bytes <= 0:
        raise ValueError(f"max shard size must be positive, got {max_shard_bytes}")
    tensors, skipped, excluded, unverified = _plan(ckpt, dtype, prefix, include_all)
    shards = _shards(tensors, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}{SUFFIX}" for i in range(n)
    ]
    os.makedirs(out_dir, exist_ok=True)
    targets = names + ([INDEX_FILE] if n > 1 else [])
    if not overwrite:
        for name in targets:
            if os.path.exists(os.path.join(out_dir, name)):
                raise OutputExistsError(
                    f"{os.path.join(out_dir, name)} exists (pass --overwrite)"
                )
    unit = buffer_bytes // 3
    scratch = [torch.empty(unit, dtype=torch.uint8) for _ in range(3)]
    total = sum(t.out_bytes for t in tensors)
    bar = Progress(total, progress, "export")
    files = _Files(ckpt)
    weight_map: dict[str, str] = {}
    partials: list[str] = []
    verified = 0
    try:
        for name, shard in zip(names, shards, strict=True):
            entries, pos = [], 0
            for t in shard:
                entries.append(
                    HeaderEntry(t.key, dtype_name(t.out_dtype, t.key), t.shape, pos,
                                pos + t.out_bytes)
                )
                pos += t.out_bytes
                weight_map[t.key] = name
            tmp = os.path.join(out_dir, name + _PARTIAL)
            partials.append(tmp)
            with open(tmp, "wb") as out:
                out.write(encode_header(entries, {"format": "pt"}))
                for t in shard:
                    verified += _stream_tensor(t, out, unit, scratch, files, bar)
                out.flush()
                os.fsync(out.fileno())
        for name, tmp in zip(names, partials, strict=True):
            os.replace(tmp, os.path.join(out_dir, name))
        partials.clear()
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            tmp = os.path.join(out_dir, INDEX_FILE + _PARTIAL)
            partials.append(tmp)
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(out_dir, INDEX_FILE))
            partials.clear()
    finally:
        bar.close()
        files.close()
        for tmp in partials:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
    return ExportResult(files=targets, tensors=len(tensors), bytes=total, skipped=skipped,
                        excluded=excluded, unverified=unverified, bytes_verified=verified)


__all__ = [
    "ExportError",
    "ExportResult",
    "NotACheckpointError",
    "NothingToExportError",
    "OutputExistsError",
    "export_checkpoint",
    "parse_dtype",
]
