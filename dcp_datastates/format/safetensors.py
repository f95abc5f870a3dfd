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
:meth:`Placer.write <dcp_datastates.save.placement.Placer.write>`; everything else is stateless.
"""

from __future__ import annotations

import ctypes
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .manifest import ItemRecord

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


# --------------------------------------------------------------------------------------------
# Loading through .metadata


def is_safetensors_checkpoint(metadata: Metadata) -> bool:
    """True if ``metadata`` (a checkpoint's ``.metadata``) points into safetensors files."""
    return any(
        str(getattr(info, "relative_path", "")).endswith(SUFFIX)
        for info in (metadata.storage_data or {}).values()
    )


# --------------------------------------------------------------------------------------------
# Verification (called by dcp_datastates.format.verify for items in safetensors files)


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
    "check_item",
    "decode_header",
    "dtype_name",
    "encode_header",
    "is_safetensors_checkpoint",
    "read_into",
    "shard_file_name",
]
