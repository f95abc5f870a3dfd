"""The safetensors format of a checkpoint: each rank's tensors in ``.safetensors`` files.

``DataStatesWriter(path, format="safetensors")`` writes, per rank, files named as torch's
``HuggingFaceStorageWriter(save_distributed=True)`` names them
(``shard-<rank+1>-model-<k>-of-<n>.safetensors``, five digits each) with the DCP sharding
metadata in the header (``__metadata__["DCP_SHARDING_INFO"]``: each key's ``saved_offsets``), so
that ``safetensors.safe_open`` opens each file and torch's ``HuggingFaceStorageReader`` loads and
reshards the checkpoint. See docs/format.md, "safetensors format".

How a file is written without a second copy of the state: the JSON header is computed up front
from the plan (dtype, shape and ``data_offsets`` of every tensor item), padded with spaces (which
the safetensors spec allows) so that the data section starts on a 4 KiB boundary with
``o_direct``; the engine writes each payload straight from the host cache at its planned offset,
as for the torch format (unaligned spans go through buffered writes). Non-tensor values cannot go
in a safetensors file: they go, as the torch.save bytes DCP's planner produces, to the rank's side
file ``__<rank>_0.distcp``, which ``.metadata`` points at. The commit protocol (in-progress
marker, manifests with CRC-32C per chunk, ``.metadata`` last) is the same as for the torch format.

Loading: ``.metadata``'s ``storage_data`` gives each tensor chunk's raw byte range in its file;
the stock ``FileSystemReader`` cannot load those (it expects torch.save archives), so
:class:`SafetensorsCheckpointReader` (used by :func:`dcp_datastates.load`) reads them raw.

Threads: :func:`write_safetensors` runs in the save thread of one save, like
:meth:`Placer.write <dcp_datastates.placement.Placer.write>`; everything else is stateless.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _core
from .capture import wait_written
from .commit import manifest_name
from .errors import CheckpointSaveError
from .fsspec_sink import SinkItem, write_sequential
from .layout import data_file_name
from .manifest import ItemRecord, RankManifest
from .reader import mark_modified

if TYPE_CHECKING:
    from .capture import CapturedTensor, SaveJob
    from .contexts import SaveContext
    from .placement import Placer

SUFFIX = ".safetensors"
HEADER_LEN_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # what the safetensors library accepts
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch's _hf_utils.CUSTOM_METADATA_KEY
SAVED_OFFSETS_KEY = "saved_offsets"
SHARD_FILE_RE = re.compile(r"^shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors$")

# torch dtype <-> safetensors dtype string (the names of the safetensors specification)
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
}
DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}


def shard_file_name(rank: int, index: int, count: int) -> str:
    """The name of a rank's ``index``-th (0-based) of ``count`` files, torch's convention for
    ``HuggingFaceStorageWriter(save_distributed=True)``."""
    return f"shard-{rank + 1:05d}-model-{index + 1:05d}-of-{count:05d}{SUFFIX}"


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``; ValueError naming ``key`` if safetensors has none."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(
            f"'{key}': dtype {str(dtype).replace('torch.', '')} cannot be stored in safetensors "
            f"(supported: {', '.join(sorted(str(d).replace('torch.', '') for d in DTYPE_NAMES))})"
        )
    return name


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: its bytes are [begin, end) of the data section."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    saved_offsets: tuple[int, ...] | None = None


def encode_header(
    entries: list[HeaderEntry], metadata: dict[str, str] | None, align: int = 8
) -> bytes:
    """The first bytes of a safetensors file: the little-endian header length and the JSON
    header, padded with spaces so that the data section starts at a multiple of ``align``."""
    doc: dict[str, Any] = {}
    meta = dict(metadata or {})
    sharding = {e.key: {SAVED_OFFSETS_KEY: list(e.saved_offsets)} for e in entries
                if e.saved_offsets is not None}
    if sharding:
        meta[SHARDING_INFO_KEY] = json.dumps(sharding, separators=(",", ":"))
    if meta:
        doc["__metadata__"] = meta
    for e in entries:
        doc[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    body = json.dumps(doc, separators=(",", ":")).encode()
    align = max(8, align)
    body += b" " * ((-(HEADER_LEN_BYTES + len(body))) % align)
    return struct.pack("<Q", len(body)) + body


def decode_header(read: Callable[[int, int], bytes], file_size: int) -> tuple[dict[str, Any], int]:
    """Parses a safetensors header with ``read(offset, nbytes)``; returns (header, data start).

    Raises ValueError saying what is malformed (the caller names the file)."""
    raw = read(0, HEADER_LEN_BYTES)
    if len(raw) != HEADER_LEN_BYTES:
        raise ValueError(f"file of {file_size} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or HEADER_LEN_BYTES + n > file_size:
        raise ValueError(f"header length {n} does not fit the file ({file_size} bytes)")
    try:
        header = json.loads(read(HEADER_LEN_BYTES, n))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"header is not valid JSON: {err}") from err
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    start = HEADER_LEN_BYTES + n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        ok = (
            isinstance(info, dict)
            and info.get("dtype") in DTYPES
            and isinstance(info.get("shape"), list)
            and isinstance(info.get("data_offsets"), list)
            and len(info["data_offsets"]) == 2
        )
        if not ok:
            raise ValueError(f"header entry '{key}' is malformed: {info!r:.120}")
        b, e = info["data_offsets"]
        numel = 1
        for s in info["shape"]:
            numel *= s
        nbytes = numel * DTYPES[info["dtype"]].itemsize
        if not 0 <= b <= e or start + e > file_size or e - b != nbytes:
            raise ValueError(f"header entry '{key}' has inconsistent data_offsets [{b}, {e}]")
    return header, start


def sharding_info(header: dict[str, Any]) -> dict[str, Any]:
    """The DCP sharding metadata of a parsed header ({} if it has none)."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or SHARDING_INFO_KEY not in meta:
        return {}
    try:
        info = json.loads(meta[SHARDING_INFO_KEY])
    except (TypeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


# --------------------------------------------------------------------------------------------
# Writing (the save thread of one save)


@dataclass
class _Placed:
    item: WriteItem
    cap: CapturedTensor
    file: int = -1
    begin: int = 0  # within the data section
    payload: int = 0  # file offset


def write_safetensors(
    placer: Placer, ctx: SaveContext, job: SaveJob, plan: SavePlan, planner: SavePlanner
) -> list[WriteResult]:
    """Writes this rank's share of ``plan`` as safetensors files plus the side file of non-tensor
    values; returns the WriteResults once the data is durable and the manifest written.

    The counterpart of :meth:`Placer.write <dcp_datastates.placement.Placer.write>` (same
    threads, waits and failure handling: it raises, the writer fails the job).
    """
    d = ctx.directory()
    d.ensure_exists()
    eng = placer._engine
    staged_sd = getattr(planner, "state_dict", None)
    tensors: list[_Placed] = []
    byte_items: list[WriteItem] = []
    added_late = False
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            byte_items.append(item)
            continue
        cap, late = placer.captured_item(ctx, job, staged_sd, item, planner)
        added_late |= late
        try:
            dtype_name(cap.dtype, item.index.fqn)
        except ValueError as err:
            raise CheckpointSaveError(f"save to {ctx.path} (rank {ctx.rank}): {err}") from None
        tensors.append(_Placed(item, cap))
    # Copy order: at-call copies first, then lazy ones in queue order (as Placer.write).
    tensors.sort(key=lambda p: (0 if p.cap.at_call else 1, p.cap.entry))

    # Files: files_per_rank of them (1 for non-local URLs), each key at most once per file.
    want = min(placer.config.files_per_rank if d.local else 1, len(tensors))
    loads: list[int] = [0] * want
    keys: list[set[str]] = [set() for _ in range(want)]
    for p in tensors:
        fqn = p.item.index.fqn
        free = [f for f in range(len(loads)) if fqn not in keys[f]]
        if not free:
            loads.append(0)
            keys.append(set())
            free = [len(loads) - 1]
        p.file = min(free, key=lambda f: loads[f])
        loads[p.file] += p.cap.nbytes
        keys[p.file].add(fqn)
    nfiles = len(loads)
    if not d.local and nfiles > 1:
        raise CheckpointSaveError(
            f"save to {ctx.path} (rank {ctx.rank}): several chunks of one tensor on one rank "
            "need several safetensors files, which the sequential (non-local) path cannot write; "
            "save with format='torch' or to a local path"
        )
    align = 4096 if placer.config.o_direct and d.local else 8
    names = [shard_file_name(ctx.rank, f, nfiles) for f in range(nfiles)]
    headers: list[bytes] = []
    for f in range(nfiles):
        members = [p for p in tensors if p.file == f]
        if d.local and align > 8:
            # Payloads of whole pages first, so that they stay page-aligned (O_DIRECT).
            members.sort(key=lambda p: p.cap.nbytes % align != 0)
        pos = 0
        entries: list[HeaderEntry] = []
        for p in members:
            fqn = p.item.index.fqn
            p.begin = pos
            pos += p.cap.nbytes
            offsets = tuple(int(o) for o in p.item.tensor_data.chunk.offsets)  # type: ignore[union-attr]
            entries.append(
                HeaderEntry(fqn, dtype_name(p.cap.dtype, fqn), p.cap.shape, p.begin, pos, offsets)
            )
        header = encode_header(entries, {"DCP_VERSION": "1.0", "format": "pt"}, align)
        headers.append(header)
        for p in members:
            p.payload = len(header) + p.begin

    file_ids: dict[str, int] = {}

    def fid(name: str) -> int:
        if name not in file_ids:
            file_ids[name] = eng.open_file(job.engine_job, d.join(name))
        return file_ids[name]

    sink: dict[str, list[SinkItem]] = collections.defaultdict(list)
    results: list[WriteResult] = []
    records: list[ItemRecord] = []
    bytes_crcs: list[tuple[WriteItem, str, int, int, int]] = []
    # Headers first (their own files only: a rank without tensors writes no safetensors file).
    for f, header in enumerate(headers):
        if d.local:
            eng.write_bytes(job.engine_job, fid(names[f]), 0, header)
        else:
            sink[names[f]].append(SinkItem(offset=0, data=header))
    spilled: list[_Placed] = []
    for p in tensors:
        name = names[p.file]
        if p.cap.spill is not None and d.local:
            fid(name)
            spilled.append(p)
        elif p.cap.spill is not None:
            sink[name].append(SinkItem(offset=p.payload, entry=p.cap.entry, spill=p.cap.spill))
        elif d.local:
            eng.place(job.engine_job, p.cap.entry, fid(name), p.payload, b"", b"")
        else:
            eng.place_external(job.engine_job, p.cap.entry)
            sink[name].append(SinkItem(offset=p.payload, entry=p.cap.entry))
        results.append(_write_result(p.item, name, p.payload, p.cap.nbytes))
    # Non-tensor values: the planner's torch.save bytes, in the rank's side file.
    side = data_file_name(ctx.rank, 0)
    pos = 0
    for item in byte_items:
        data = planner.resolve_data(item)
        raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
        if d.local:
            eng.write_bytes(job.engine_job, fid(side), pos, raw)
        else:
            sink[side].append(SinkItem(offset=pos, data=raw))
        bytes_crcs.append((item, side, pos, len(raw), _core.crc32c(raw)))
        results.append(_write_result(item, side, pos, len(raw)))
        pos += len(raw)
    if added_late:
        eng.start_copies(job.engine_job)
    ext: list[tuple[int, int, int, int]] = []  # (entry, file offset, bytes, crc)
    for p in spilled:  # before seal: finalize syncs them too
        fd = os.open(d.join(names[p.file]), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            assert p.cap.spill is not None
            p.cap.spill.copy_to(fd, p.payload)
        finally:
            os.close(fd)
        ext.append((p.cap.entry, p.payload, p.cap.nbytes, p.cap.spill.crc))
    eng.seal(job.engine_job)
    for name, items in sink.items():
        for e, _c, off, n, crc in write_sequential(eng, job.engine_job, d.fs, d.join(name), items):
            ext.append((e, off, n, crc))

    wait_written(eng, job, f"{ctx.path} (rank {ctx.rank})")

    by_entry: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
    for e, _c, _file, off, _entry_off, n, crc in eng.chunk_records(job.engine_job):
        by_entry[e].append((off, n, crc))
    for e, off, n, crc in ext:
        by_entry[e].append((off, n, crc))
    for p in tensors:
        offs = p.item.index.offset
        records.append(
            ItemRecord(
                fqn=p.item.index.fqn,
                offset=list(offs) if offs is not None else None,
                file=names[p.file],
                archive_offset=p.payload,
                archive_length=p.cap.nbytes,
                payload_offset=p.payload,
                payload_bytes=p.cap.nbytes,
                dtype=str(p.cap.dtype).replace("torch.", ""),
                shape=list(p.cap.shape),
                chunks=sorted(by_entry.get(p.cap.entry, [])),
            )
        )
    for item, name, off, n, crc in bytes_crcs:
        records.append(
            ItemRecord(
                fqn=item.index.fqn, offset=None, file=name, archive_offset=off,
                archive_length=n, payload_offset=off, payload_bytes=n, dtype="bytes", shape=[],
                chunks=[(off, n, crc)],
            )
        )
    manifest = RankManifest(
        rank=ctx.rank, checksums=placer.config.checksums, save_id=ctx.save_id, items=records
    )
    d.write_atomic(manifest_name(ctx.rank), manifest.to_json().encode(), placer.config.durable)
    return results


def _write_result(item: WriteItem, relative_path: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=relative_path, offset=offset, length=length),
    )


# --------------------------------------------------------------------------------------------
# Loading through .metadata


def is_safetensors_checkpoint(metadata: Metadata) -> bool:
    """True if ``metadata`` (a checkpoint's ``.metadata``) points into safetensors files."""
    return any(
        str(getattr(info, "relative_path", "")).endswith(SUFFIX)
        for info in (metadata.storage_data or {}).values()
    )


def read_into(f: Any, offset: int, t: torch.Tensor, what: str) -> None:
    """Fills the contiguous CPU tensor ``t`` with the bytes of ``f`` at ``offset``; raises
    ValueError naming ``what`` if the file ends first."""
    n = t.numel() * t.element_size()
    if n == 0:
        return
    view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
    f.seek(offset)
    got = 0
    while got < n:
        k = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            raise ValueError(f"{what}: the file ends {n - got} bytes short of byte {offset + n}")
        got += k


class SafetensorsCheckpointReader(FileSystemReader):
    """A ``FileSystemReader`` that also loads checkpoints written with ``format="safetensors"``.

    It reads ``.metadata`` like the stock reader (so non-tensor values, resharding and every
    planner work); tensor chunks stored in ``.safetensors`` files are read raw from their byte
    range, straight into a tensor of the chunk's dtype and shape. Everything else (torch.save
    archives, bytes) goes to the stock code. :func:`dcp_datastates.load` picks it by itself.
    """

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunk_meta: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}
        for fqn, smd in metadata.state_dict_metadata.items():
            if isinstance(smd, TensorStorageMetadata):
                for ch in smd.chunks:
                    key = MetadataIndex(fqn, ch.offsets)
                    self._chunk_meta[key] = (smd.properties.dtype, ch.sizes)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw: dict[str, list[Any]] = collections.defaultdict(list)
        rest = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type != LoadItemType.BYTE_IO and str(info.relative_path).endswith(SUFFIX):
                raw[info.relative_path].append(req)
            else:
                rest.append(req)
        for rel, reqs in raw.items():
            path = self.fs.concat_path(self.path, rel)
            with self.fs.create_stream(path, "rb") as f:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    key = MetadataIndex(req.storage_index.fqn, req.storage_index.offset)
                    dtype, sizes = self._chunk_meta[key]
                    t = torch.empty(sizes, dtype=dtype)
                    if t.numel() * t.element_size() != info.length:
                        raise ValueError(
                            f"'{key.fqn}' in {rel}: .metadata says {info.length} bytes for a "
                            f"{dtype} chunk of shape {list(sizes)}"
                        )
                    read_into(f, info.offset, t, f"'{key.fqn}' in {rel}")
                    src = t
                    for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths,
                                                     strict=True)):
                        src = src.narrow(dim, o, n)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != src.size():
                        raise ValueError(
                            f"'{key.fqn}': read {list(src.size())}, expected {list(target.size())}"
                        )
                    mark_modified(target)  # counted before the copy, as reader.py does
                    target.copy_(src)
                    planner.commit_tensor(req, target)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


# --------------------------------------------------------------------------------------------
# Verification (called by dcp_datastates.verify for items in safetensors files)


def check_item(
    f: BinaryIO, size: int, it: ItemRecord, cache: dict[str, Any]
) -> list[str]:
    """Checks a manifest item against its safetensors file's header; returns the problems.

    ``cache`` keeps each file's parsed header (or the error parsing it) across items."""
    if it.file not in cache:

        def read(off: int, n: int) -> bytes:
            f.seek(off)
            return f.read(n)

        try:
            cache[it.file] = decode_header(read, size)
        except ValueError as err:
            cache[it.file] = err
    parsed = cache[it.file]
    if isinstance(parsed, ValueError):
        return [f"safetensors header damaged: {parsed}"]
    header, start = parsed
    entry = header.get(it.fqn)
    if not isinstance(entry, dict):
        return ["not in the safetensors header"]
    problems = []
    dtype = DTYPES.get(entry["dtype"])
    want = str(dtype).replace("torch.", "") if dtype is not None else entry["dtype"]
    if want != it.dtype or list(entry["shape"]) != it.shape:
        problems.append(
            f"the safetensors header says {want}{entry['shape']}, the manifest {it.dtype}{it.shape}"
        )
    b, e = entry["data_offsets"]
    if (start + b, e - b) != (it.payload_offset, it.payload_bytes):
        problems.append(
            f"the safetensors header places it at file bytes [{start + b}, {start + e}), the "
            f"manifest at [{it.payload_offset}, {it.payload_offset + it.payload_bytes})"
        )
    saved = sharding_info(header).get(it.fqn, {}).get(SAVED_OFFSETS_KEY)
    if it.offset is not None and saved is not None and list(saved) != it.offset:
        problems.append(f"the safetensors header's saved_offsets {saved} differ from {it.offset}")
    return problems


__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "HeaderEntry",
    "SHARD_FILE_RE",
    "SafetensorsCheckpointReader",
    "check_item",
    "decode_header",
    "dtype_name",
    "encode_header",
    "is_safetensors_checkpoint",
    "shard_file_name",
    "write_safetensors",
]
