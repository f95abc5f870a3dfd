"""Writer configuration: sizes with units, validation against the machine, one frozen dataclass."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

CaptureMode = Literal["auto", "owned", "lazy", "eager"]
CheckpointFormat = Literal["torch", "safetensors"]

_UNITS = {
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, default_unit: int = 1024**3, what: str = "size") -> int:
    """Returns a byte count.

    A bare number is in ``default_unit`` (GiB by default, as in the DataStates
    ``host_cache_size`` setting) in every form: ``16``, ``0.5`` and ``"16"`` all mean GiB. A
    string may carry a unit instead: ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``, ``"4096B"``. Raises
    ValueError naming ``what`` for anything else.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number or a size string, not {value!r}")
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{what} must be finite, got {value!r}")
        nbytes = int(value * default_unit)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or (m.group(2) and m.group(2).lower() not in _UNITS):
            raise ValueError(f"{what}: cannot parse {value!r} (examples: 16, '512MiB', '2GiB')")
        unit = m.group(2).lower()
        nbytes = int(float(m.group(1)) * (_UNITS[unit] if unit else default_unit))
    else:
        raise TypeError(f"{what} must be a number or a size string, not {type(value).__name__}")
    if nbytes <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return nbytes


def physical_memory_bytes() -> int | None:
    """Total physical memory of this machine, or None where it cannot be read."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class WriterConfig:
    """Settings of a :class:`~dcp_datastates.DataStatesWriter` (see docs/configuration.md).

    Attributes:
        cache_bytes: size of the host cache, allocated once per writer.
        chunk_bytes: largest single copy and write; tensors above it are split and streamed.
        copy_threads: native threads copying tensors into the host cache.
        flush_threads: native threads writing the cache to files.
        files_per_rank: data files each rank writes (written in parallel).
        o_direct: write payloads with O_DIRECT (4 KiB-aligned), bypassing the page cache.
        early_flush: place a staged save's tensors when its save thread begins, before DCP
            plans (one rank, local directories; dcp_datastates.save.early).
        capture: "auto" (the DataStates policy, chosen by measurement; "owned" is the same)
            copies every optimizer-owned tensor in the background, the owner's next ``step()``
            waiting for it, and snapshots everything else at the call; "lazy"
            copies every contiguous tensor in the background (the caller must not modify any
            before ``wait_captured()``); "eager" snapshots every tensor at the call. State that
            must be taken at the call waits for cache space, it is never cloned.
        checksums: record a CRC-32C per chunk in the manifest.
        durable: fdatasync data files and fsync directories before the commit.
        prefault: touch the cache pages when the writer is created.
        flush_nice: niceness (0..19) of flush threads when they do not run under SCHED_IDLE.
        idle_priority: run copy threads under SCHED_IDLE.
        adapt_to_load: with ``idle_priority`` and no barrier boost (the OS refuses to raise
            the copy threads), copy a save's lazy state at the call instead when other
            processes kept every core busy since the previous save (the idle-priority copy
            threads would starve; dcp_datastates.runtime.cpuload).
        flush_idle: run flush threads under SCHED_IDLE too.
        step_barrier: take part in the automatic optimizer-step barrier.
        format: "torch" (tensors as torch.save archives, loadable by the stock dcp.load) or
            "safetensors" (each rank's tensors in ``.safetensors`` files; docs/format.md).
        part_bytes: object stores (s3://): bytes of each multipart-upload part but the last.
        upload_concurrency: object stores (s3://): parts of one object uploading at once.
        rank_timeout_s: several ranks: how long the coordinator waits for the other ranks' data
            to be durable (dcp_datastates.save.rank_commit).
        rank_liveness_s: several ranks: how long a rank's heartbeat may stand still before the
            coordinator names it dead.
        replicas: peer nodes that get a copy of each node's part of a committed ``async_save``
            (dcp_datastates.lifecycle.replicas); 0: none.
        replica_timeout_s: how long a replication round waits for a peer.
    """

    cache_bytes: int
    chunk_bytes: int = 64 * 1024**2
    copy_threads: int = 2
    flush_threads: int = 2
    files_per_rank: int = 2
    o_direct: bool = True
    early_flush: bool = True
    capture: CaptureMode = "auto"
    checksums: bool = True
    durable: bool = True
    prefault: bool = False
    flush_nice: int = 5
    idle_priority: bool = True
    adapt_to_load: bool = True
    flush_idle: bool = False
    step_barrier: bool = True
    format: CheckpointFormat = "torch"
    part_bytes: int = 16 * 1024**2
    upload_concurrency: int = 4
    rank_timeout_s: float = 1800.0
    rank_liveness_s: float = 60.0
    replicas: int = 0
    replica_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.cache_bytes <= 0:
            raise ValueError(f"host_cache_size must be positive, got {self.cache_bytes} bytes")
        phys = physical_memory_bytes()
        if phys is not None and self.cache_bytes > phys:
            raise ValueError(
                f"host_cache_size of {self.cache_bytes / 1024**3:.2f} GiB exceeds this machine's "
                f"physical memory ({phys / 1024**3:.2f} GiB)"
            )
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_size must be at least 4 KiB, got {self.chunk_bytes} bytes")
        for name in ("copy_threads", "flush_threads", "files_per_rank", "upload_concurrency"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.capture not in ("auto", "owned", "lazy", "eager"):
            raise ValueError(
                f"capture must be 'auto', 'owned', 'lazy' or 'eager', got {self.capture!r}"
            )
        if self.format not in ("torch", "safetensors"):
            raise ValueError(f"format must be 'torch' or 'safetensors', got {self.format!r}")
        if not 5 * 1024**2 <= self.part_bytes <= 5 * 1024**3:  # S3's part limits
            raise ValueError(
                f"upload_part_size must be between 5 MiB and 5 GiB, got {self.part_bytes} bytes"
            )
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or (
            self.replicas < 0
        ):
            raise ValueError(f"replicas must be a non-negative integer, got {self.replicas!r}")
        for name in ("rank_timeout_s", "rank_liveness_s", "replica_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e9:
                raise ValueError(f"{name.removesuffix('_s')} must be a positive number of "
                                 f"seconds, got {v!r}")
        if not 0 <= self.flush_nice <= 19:
            raise ValueError(f"flush_nice must be within 0..19, got {self.flush_nice!r}")
