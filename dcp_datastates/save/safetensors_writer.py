"""The save-path writer of the safetensors format: one save's tensors into ``.safetensors`` files.

``DataStatesWriter(path, format="safetensors")`` hands a save's plan here instead of to the torch
format's placement (:mod:`dcp_datastates.save.placement`). The JSON header is computed up front
from the plan (dtype, shape and ``data_offsets`` of every tensor item; the layout is
:mod:`dcp_datastates.format.safetensors`), padded so that the data section starts on a 4 KiB
boundary with ``o_direct``; the engine writes each payload straight from the host cache at its
planned offset. Non-tensor values go, as the torch.save bytes DCP's planner produces, to the
rank's side file ``__<rank>_0.distcp``. The commit protocol is the torch format's.

Threads: :func:`write_safetensors` runs in the save thread of one save, like
:meth:`Placer.write <dcp_datastates.save.placement.Placer.write>`.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from .. import _core
from ..errors import CheckpointSaveError
from ..format.commit import manifest_name
from ..format.layout import data_file_name
from ..format.manifest import ItemRecord, RankManifest
from ..format.safetensors import HeaderEntry, dtype_name, encode_header, shard_file_name
from ..storage.fsspec_sink import SinkItem, write_sequential
from .capture import wait_written

if TYPE_CHECKING:
    from .capture import CapturedTensor, SaveJob
    from .contexts import SaveContext
    from .placement import Placer


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

    The counterpart of :meth:`Placer.write <dcp_datastates.save.placement.Placer.write>` (same
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


__all__ = ["write_safetensors"]
