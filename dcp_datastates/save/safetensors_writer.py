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
from dataclasses import dataclass, field
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
from ..engine import Engine
from ..errors import CheckpointSaveError
from ..format.commit import CheckpointDir, manifest_name
from ..format.layout import data_file_name
from ..format.manifest import ItemRecord, RankManifest
from ..format.safetensors import HeaderEntry, dtype_name, encode_header, shard_file_name
from ..storage.fsspec_sink import SinkItem, write_sequential
from .capture import wait_written

if TYPE_CHECKING:
    from .capture import CapturedTensor, SaveJob
    from .contexts import SaveContext
    from .late_capture import ItemPlacer


@dataclass
class _Placed:
    item: WriteItem
    cap: CapturedTensor
    file: int = -1
    begin: int = 0  # within the data section
    payload: int = 0  # file offset


@dataclass
class _Write:
    """One save's safetensors write, shared by the steps of :func:`write_safetensors`."""

    ctx: SaveContext
    job: SaveJob
    d: CheckpointDir
    eng: Engine
    tensors: list[_Placed] = field(default_factory=list)  # in copy order
    byte_items: list[WriteItem] = field(default_factory=list)  # non-tensor values
    added_late: bool = False  # tensors registered only now: their copies are still to start
    names: list[str] = field(default_factory=list)  # the safetensors files, by index
    headers: list[bytes] = field(default_factory=list)  # their headers, padded
    file_ids: dict[str, int] = field(default_factory=dict)  # file name -> engine file id
    sink: dict[str, list[SinkItem]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )  # non-local files: what the sequential consumer writes, by file name
    spilled: list[_Placed] = field(default_factory=list)  # spilled snapshots in local files
    results: list[WriteResult] = field(default_factory=list)
    bytes_crcs: list[tuple[WriteItem, str, int, int, int]] = field(default_factory=list)
    ext: list[tuple[int, int, int, int]] = field(default_factory=list)  # (entry, off, n, crc)

    def fid(self, name: str) -> int:
        """The engine's id of the file ``name``, opened on first use."""
        if name not in self.file_ids:
            self.file_ids[name] = self.eng.open_file(self.job.engine_job, self.d.join(name))
        return self.file_ids[name]


def write_safetensors(
    placer: ItemPlacer, ctx: SaveContext, job: SaveJob, plan: SavePlan, planner: SavePlanner
) -> list[WriteResult]:
    """Writes this rank's share of ``plan`` as safetensors files plus the side file of non-tensor
    values; returns the WriteResults once the data is durable and the manifest written.

    The counterpart of :meth:`Placer.write <dcp_datastates.save.placement.Placer.write>` (same
    threads, waits and failure handling: it raises, the writer fails the job). In steps: the
    tensor items' records, the files and their headers, the tensors placed, the side file, the
    spilled snapshots and the non-local files written, then the wait and the manifest.
    """
    w = _Write(ctx, job, ctx.directory(), placer._engine)
    w.d.ensure_exists()
    _captured_items(placer, w, plan, planner)
    _plan_headers(placer, w, _assign_files(placer, w))
    _place_tensors(w)
    _write_side_file(w, planner)
    if w.added_late:
        w.eng.start_copies(job.engine_job)
    _write_spilled(w)  # before seal: finalize syncs them too
    w.eng.seal(job.engine_job)
    for name, items in w.sink.items():  # non-local files, each front to back
        for e, _c, off, n, crc in write_sequential(
            w.eng, job.engine_job, w.d.fs, w.d.join(name), items
        ):
            w.ext.append((e, off, n, crc))
    wait_written(w.eng, job, f"{ctx.path} (rank {ctx.rank})")
    _write_manifest(placer, w)
    return w.results


def _captured_items(placer: ItemPlacer, w: _Write, plan: SavePlan, planner: SavePlanner) -> None:
    """Sorts the plan's items: the tensor items with their captured records (captured now if
    the save had not, their dtype checked), in copy order, and the bytes items."""
    staged_sd = getattr(planner, "state_dict", None)
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            w.byte_items.append(item)
            continue
        cap, late = placer.captured_item(w.ctx, w.job, staged_sd, item, planner)
        w.added_late |= late
        try:
            dtype_name(cap.dtype, item.index.fqn)
        except ValueError as err:
            raise CheckpointSaveError(
                f"save to {w.ctx.path} (rank {w.ctx.rank}): {err}"
            ) from None
        w.tensors.append(_Placed(item, cap))
    # Copy order: at-call copies first, then lazy ones in queue order (as Placer.write).
    w.tensors.sort(key=lambda p: (0 if p.cap.at_call else 1, p.cap.entry))


def _assign_files(placer: ItemPlacer, w: _Write) -> int:
    """Assigns each tensor a file; returns how many files there are."""
    # Files: files_per_rank of them (1 for non-local URLs), each key at most once per file.
    want = min(placer.config.files_per_rank if w.d.local else 1, len(w.tensors))
    loads: list[int] = [0] * want
    keys: list[set[str]] = [set() for _ in range(want)]
    for p in w.tensors:
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
    if not w.d.local and nfiles > 1:
        raise CheckpointSaveError(
            f"save to {w.ctx.path} (rank {w.ctx.rank}): several chunks of one tensor on one rank "
            "need several safetensors files, which the sequential (non-local) path cannot write; "
            "save with format='torch' or to a local path"
        )
    return nfiles


def _plan_headers(placer: ItemPlacer, w: _Write, nfiles: int) -> None:
    """Names the ``nfiles`` files and computes their headers, which fix each tensor's payload
    offset."""
    align = 4096 if placer.config.o_direct and w.d.local else 8
    w.names = [shard_file_name(w.ctx.rank, f, nfiles) for f in range(nfiles)]
    for f in range(nfiles):
        members = [p for p in w.tensors if p.file == f]
        if w.d.local and align > 8:
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
        w.headers.append(header)
        for p in members:
            p.payload = len(header) + p.begin


def _place_tensors(w: _Write) -> None:
    """Writes the headers and hands each tensor to what writes it: the engine's flush threads
    (local files), :func:`_write_spilled` (a spilled snapshot in a local file), or the sequential
    consumer of a non-local file."""
    eng, job = w.eng, w.job
    # Headers first (their own files only: a rank without tensors writes no safetensors file).
    for f, header in enumerate(w.headers):
        if w.d.local:
            eng.write_bytes(job.engine_job, w.fid(w.names[f]), 0, header)
        else:
            w.sink[w.names[f]].append(SinkItem(offset=0, data=header))
    for p in w.tensors:
        name = w.names[p.file]
        if p.cap.spill is not None and w.d.local:
            w.fid(name)
            w.spilled.append(p)
        elif p.cap.spill is not None:
            w.sink[name].append(SinkItem(offset=p.payload, entry=p.cap.entry, spill=p.cap.spill))
        elif w.d.local:
            eng.place(job.engine_job, p.cap.entry, w.fid(name), p.payload, b"", b"")
        else:
            eng.place_external(job.engine_job, p.cap.entry)
            w.sink[name].append(SinkItem(offset=p.payload, entry=p.cap.entry))
        w.results.append(_write_result(p.item, name, p.payload, p.cap.nbytes))


def _write_side_file(w: _Write, planner: SavePlanner) -> None:
    """Non-tensor values: the planner's torch.save bytes, in the rank's side file."""
    side = data_file_name(w.ctx.rank, 0)
    pos = 0
    for item in w.byte_items:
        data = planner.resolve_data(item)
        raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
        if w.d.local:
            w.eng.write_bytes(w.job.engine_job, w.fid(side), pos, raw)
        else:
            w.sink[side].append(SinkItem(offset=pos, data=raw))
        w.bytes_crcs.append((item, side, pos, len(raw), _core.crc32c(raw)))
        w.results.append(_write_result(item, side, pos, len(raw)))
        pos += len(raw)


def _write_spilled(w: _Write) -> None:
    """Copies the spilled snapshots placed in local files into them, recording their chunks."""
    for p in w.spilled:
        fd = os.open(w.d.join(w.names[p.file]), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            assert p.cap.spill is not None
            p.cap.spill.copy_to(fd, p.payload)
        finally:
            os.close(fd)
        w.ext.append((p.cap.entry, p.payload, p.cap.nbytes, p.cap.spill.crc))


def _write_manifest(placer: ItemPlacer, w: _Write) -> None:
    """Writes the rank's manifest (once the data is durable): every tensor with its chunk
    records, then the non-tensor values."""
    by_entry: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
    for e, _c, _file, off, _entry_off, n, crc in w.eng.chunk_records(w.job.engine_job):
        by_entry[e].append((off, n, crc))
    for e, off, n, crc in w.ext:
        by_entry[e].append((off, n, crc))
    records: list[ItemRecord] = []
    for p in w.tensors:
        offs = p.item.index.offset
        records.append(
            ItemRecord(
                fqn=p.item.index.fqn,
                offset=list(offs) if offs is not None else None,
                file=w.names[p.file],
                archive_offset=p.payload,
                archive_length=p.cap.nbytes,
                payload_offset=p.payload,
                payload_bytes=p.cap.nbytes,
                dtype=str(p.cap.dtype).replace("torch.", ""),
                shape=list(p.cap.shape),
                chunks=sorted(by_entry.get(p.cap.entry, [])),
            )
        )
    for item, name, off, n, crc in w.bytes_crcs:
        records.append(
            ItemRecord(
                fqn=item.index.fqn, offset=None, file=name, archive_offset=off,
                archive_length=n, payload_offset=off, payload_bytes=n, dtype="bytes", shape=[],
                chunks=[(off, n, crc)],
            )
        )
    manifest = RankManifest(
        rank=w.ctx.rank, checksums=placer.config.checksums, save_id=w.ctx.save_id, items=records
    )
    text = manifest.to_json().encode()
    w.d.write_atomic(manifest_name(w.ctx.rank), text, placer.config.durable)


def _write_result(item: WriteItem, relative_path: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=relative_path, offset=offset, length=length),
    )


__all__ = ["write_safetensors"]
