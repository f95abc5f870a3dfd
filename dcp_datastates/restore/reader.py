"""DataStatesReader: a fast restore for checkpoints written by DataStatesWriter.

A :class:`~torch.distributed.checkpoint.FileSystemReader` whose ``read_data`` reads the tensor
payloads of our checkpoints with the native engine (``csrc/engine/reader.hpp``): parallel
``pread``s, ``O_DIRECT`` where the file system takes it, and the CRC-32C of every chunk recorded
in the rank manifests (docs/format.md) verified in the same pass. It skips ``torch.load`` per
item: the manifest says where each payload lies, and its dtype and shape are checked against
``.metadata``. Everything else is the stock reader's: ``.metadata``, the load planner,
resharding (each read item's storage offsets and lengths are honoured) and ``commit_tensor``.

Use it where a restart pays for loading::

    dcp.load(state, storage_reader=DataStatesReader("ckpt/step-1000"))

From a memory file system (tmpfs such as ``/dev/shm``, ramfs: :func:`memory_backed`) a read is
a copy out of memory: ``O_DIRECT`` is not attempted (whatever ``o_direct`` says), reads are cut
at 1 MiB and each piece's CRC-32C is computed while it is still in the CPU's cache, at most one
thread per core copies, and batches of reads straight into their targets are larger
(``MEMORY_BATCH_BYTES``). ``last_read`` says which (``memory_fs``) and how many bytes were
verified.

What takes the stock path (``FileSystemReader.read_data``, no checksum): checkpoints without
our manifests (any other DCP checkpoint), items a manifest does not describe exactly as
``.metadata`` does, and non-local paths. The stock ``dcp.load`` keeps reading our checkpoints.

References (items of an incremental save whose bytes live in a sibling checkpoint, the *owner*)
are read natively from ``../<owner>/<file>``, with the CRC-32C the referring manifest recorded.
Before anything is read, every reference in the plan is checked against its owner
(:mod:`dcp_datastates.format.refcheck`: committed, by the save that wrote the referenced bytes, not
rewritten by another writer since, the file long enough); a reference that fails raises
:class:`~dcp_datastates.errors.IntegrityError` naming the keys, the owner and file, and what
differs, and no target is written.

Into GPU tensors (``device_reads``, on by default): a read item that is a whole saved chunk and
whose target is a contiguous CUDA tensor of the same dtype is read straight into device memory
by the native device path (:mod:`dcp_datastates.restore.device`): reads into page-locked staging
slots overlapped with asynchronous host-to-device copies on the reader's own streams, many small
tensors packed into one slot; from a memory file system, one thread per core (at most
``DEVICE_MEMORY_THREADS``). The device is synchronized once before the first such read.

Memory: a read item that is a whole saved chunk and whose target is a contiguous CPU tensor of
the same dtype is read straight into the target. Other items (resharded parts, other dtypes,
CUDA targets off the device path) are read into temporary CPU tensors in batches of at most
``buffer_size`` bytes (one chunk larger than that is read alone), then copied into their
targets; while one batch is copied, the next is read, so at most two batches of temporaries
exist. Temporaries of CUDA
targets are pinned (page-locked) where possible and copied asynchronously in the current
stream's order; ``read_data`` synchronizes those devices before it returns.

Targets count as modified: every tensor the load writes into has its version counter bumped
before the first byte lands in it (and, for reads straight into the target, once more after the
read), as an in-place op would. The native reads are invisible to torch; without this, a lazy save
whose source the load overwrites would commit the loaded values, and an incremental save after a
rollback would keep referencing the bytes the tensor held before the load
(:func:`mark_modified`). Inference tensors have no version counter and are not marked.

Failures: a checksum mismatch, a truncated file or an I/O error raises
:class:`~dcp_datastates.errors.IntegrityError` (damage) or ``OSError`` naming the tensor, the
file and the byte range; DCP reports it from ``dcp.load`` like any reader error. Targets of a
failed load may hold partial data.

Garbage collector: paused (process-wide, nesting with other pauses, see
:mod:`dcp_datastates.runtime.gcpause`) from ``read_metadata`` to the end of ``read_data``, at most
``READ_PAUSE_MAX_S`` seconds: the load's per-item objects all die when it returns, and a
collection meanwhile scanned them and the rest of the heap (0.1-0.2 s of a 0.45 s restore of
2,032 tensors).

Threads: ``read_data`` runs in the caller's thread. One helper thread (``dcp_datastates-read``)
runs the native reads, batch by batch (the native reader starts ``threads`` threads per batch and
joins them before returning; the GIL is released meanwhile), while the caller's thread resolves
the targets of the next batch and copies the previous one: reads begin once the first 16 MiB
of targets are resolved. The helper is joined before ``read_data`` returns or raises (reads not
yet begun are cancelled), so no temporary is freed while a read may write into it.
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import _core
from ..config import parse_size
from ..errors import IntegrityError
from ..format.commit import MANIFEST_PREFIX
from ..format.manifest import ItemRecord, RankManifest
from ..format.refcheck import OwnerChecks, may_be_rewritten, reference_error
from ..format.refs import is_reference_path, relative_path
from ..runtime.gcpause import ProtocolPause
from .device import DeviceTargets, device_of
from .device import enabled as device_path_enabled

logger = logging.getLogger(__name__)

# Longest collector pause of one load (should DCP never call read_data: it only costs speed).
READ_PAUSE_MAX_S = 10.0
# Batches of the native reads (see DataStatesReader._batches): the first is small, so reads
# begin while the rest of the targets are still being resolved.
FIRST_BATCH_BYTES = 16 << 20
BATCH_BYTES = 64 << 20
BATCH_CHUNKS = 1024
# From a memory file system (tmpfs, ramfs: memory_backed) a read is a memory copy: batches of
# reads straight into their targets are larger (fewer native thread starts and joins), reads
# are cut at MEMORY_BLOCK_BYTES (each piece's checksum runs while it is still in the CPU's
# cache), and the threads are the cores (more only contend for them).
MEMORY_BATCH_BYTES = 512 << 20
MEMORY_BLOCK_BYTES = 1 << 20
# File systems whose files live in memory: O_DIRECT means nothing there (tmpfs refuses it on
# older kernels and, since Linux 6.6, accepts it and copies through the page cache more slowly).
MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs"})
# Reads into device memory from a memory file system: at most this many threads (one per core).
DEVICE_MEMORY_THREADS = 16

_Key = tuple[str, tuple[int, ...] | None]


@dataclass
class _Chunk:
    """One saved chunk read by the native reader: its manifest record and where it goes."""

    rec: ItemRecord
    dtype: torch.dtype
    reqs: list[ReadItem]
    dst: torch.Tensor | None = None  # filled by the read: the target itself or a temporary
    direct: bool = False  # dst is the (only) request's target
    target: torch.Tensor | None = None  # reqs[0]'s resolved target, once resolved
    device: int | None = None  # direct into this CUDA device's memory (the device path)


class DataStatesReader(FileSystemReader):
    """A ``StorageReader`` that restores our checkpoints with the native engine.

    Args:
        path: the checkpoint directory (``checkpoint_id`` of ``dcp.load`` also sets it).
        threads: concurrent reads (I/O depth; more than the cores is normal).
        o_direct: read payloads through ``O_DIRECT`` (bypassing the page cache) where possible.
        verify: check every chunk's CRC-32C from the manifest while reading.
        buffer_size: bound on the temporary tensors of resharded or converted items (bytes,
            or a size string such as ``"256MiB"``).
        block_size: largest single read.
        device_reads: read whole, contiguous CUDA targets straight into device memory through
            pinned staging (:mod:`dcp_datastates.restore.device`); False: through temporaries.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int = 8,
        o_direct: bool = True,
        verify: bool = True,
        buffer_size: int | str = "256MiB",
        block_size: int | str = "8MiB",
        device_reads: bool = True,
    ) -> None:
        super().__init__(path)
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self.o_direct = o_direct
        self.verify = verify
        self.buffer_bytes = parse_size(buffer_size)
        self.block_bytes = parse_size(block_size)
        self.device_reads = device_reads
        self._device: DeviceTargets | None = None  # the device path of the running read_data
        self._device_kept: DeviceTargets | None = None  # its stagings, kept for the next load
        self._records: dict[_Key, ItemRecord] = {}
        self._checksummed: set[_Key] = set()
        self._metadata: Metadata | None = None
        self._owner_checks = OwnerChecks()
        self._gc_pause: ProtocolPause | None = None
        self._memory_fs: bool | None = None  # memory_backed(path), once asked
        self._native_stats: dict[str, int] = {}
        #: What the last ``read_data`` did: items read natively / by the stock path, bytes read
        #: natively, of which through ``O_DIRECT``, checksum-verified and straight into device
        #: memory (``device_bytes``, with ``device_copy_calls`` / ``device_batch_calls``: the
        #: copy calls that carried them), and whether the checkpoint was on a memory file system
        #: (1) or not (0); ``read_data_us``: the wall time of ``read_data`` (the data phase of a
        #: load, without DCP's planning), in microseconds.
        self.last_read: dict[str, int] = {}

    # -- StorageReader protocol ---------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._end_gc_pause()  # a load DCP abandoned midway
        super().reset(checkpoint_id)
        self._records = {}
        self._checksummed = set()
        self._metadata = None
        self._owner_checks = OwnerChecks()
        self._memory_fs = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # The load's per-item work (unpickling .metadata, DCP's planning, our manifests) makes
        # an object or more per item, all dead once the load returns: a collection meanwhile
        # only scans them and the rest of the heap (in a process holding torch, 0.1-0.2 s of a
        # 0.45 s restore). Paused from here to the end of read_data, as for a save's planning.
        self._begin_gc_pause()
        try:
            return super().read_metadata(*args, **kwargs)
        except BaseException:
            self._end_gc_pause()
            raise

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._begin_gc_pause()  # (a caller that read the metadata elsewhere)
        try:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self._metadata = metadata
            self._load_manifests()
        except BaseException:
            self._end_gc_pause()
            raise

    def _begin_gc_pause(self) -> None:
        if self._gc_pause is None or self._gc_pause.ended:
            self._gc_pause = ProtocolPause(READ_PAUSE_MAX_S)

    def _end_gc_pause(self) -> None:
        pause, self._gc_pause = self._gc_pause, None
        if pause is not None:
            pause.end()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the plan's items: ours natively (verified), the rest by the stock path."""
        try:
            return self._read_data(plan, planner)
        finally:
            self._end_gc_pause()

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.perf_counter()
        self._check_references(plan)  # before anything is written into a target
        native: dict[MetadataIndex, _Chunk] = {}
        byte_items: list[tuple[ReadItem, ItemRecord]] = []
        rest: list[ReadItem] = []
        for req in plan.items:
            rec = self._record_for(req.storage_index)
            if rec is None:
                rest.append(req)
            elif req.type == LoadItemType.BYTE_IO:
                byte_items.append((req, rec))
            else:
                dtype = self._dtype_of(req.storage_index, rec)
                if dtype is None:
                    rest.append(req)
                    continue
                ch = native.get(req.storage_index)
                if ch is None:
                    native[req.storage_index] = _Chunk(rec, dtype, [req])
                else:
                    ch.reqs.append(req)
        if rest:
            marking = cast(LoadPlanner, _MarkingPlanner(planner))
            super().read_data(LoadPlan(rest, plan.storage_data), marking).wait()
        for req, rec in byte_items:
            self._read_bytes(req, rec, planner)
        self._native_stats = {"direct_bytes": 0, "verified_bytes": 0, "device_bytes": 0,
                              "device_copy_calls": 0, "device_batch_calls": 0}
        nbytes = self._read_tensors(list(native.values()), planner)
        self.last_read = {
            "native_items": sum(len(c.reqs) for c in native.values()) + len(byte_items),
            "stock_items": len(rest),
            "native_bytes": nbytes,
            **self._native_stats,
            "memory_fs": int(self.memory_fs),
            "read_data_us": int((time.perf_counter() - t0) * 1e6),
        }
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- manifests ----------------------------------------------------------------------------
    def _load_manifests(self) -> None:
        self._records = {}
        self._checksummed = set()
        if not self._local_dir():
            return
        root = os.fspath(self.path)
        try:
            names = [n for n in os.listdir(root) if n.startswith(MANIFEST_PREFIX)]
        except OSError:
            return
        for name in sorted(names):
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    m = RankManifest.from_json(f.read())
            except (OSError, ValueError) as e:
                logger.warning("%s: manifest %s unusable (%s); its items take the stock reader",
                               root, name, e)
                continue
            for rec in m.items:
                key: _Key = (rec.fqn, tuple(rec.offset) if rec.offset is not None else None)
                self._records[key] = rec
                if m.checksums:
                    self._checksummed.add(key)

    def _check_references(self, plan: LoadPlan) -> None:
        """Raises IntegrityError if an item of the plan refers to another checkpoint (an
        incremental save) that is not the one referenced: not committed, rewritten by another
        writer, saved again, or its data file missing or short
        (:mod:`dcp_datastates.format.refcheck`). Each chunk's CRC-32C is checked as it is read
        (``verify``)."""
        if not self._local_dir():
            return
        root = os.fspath(self.path)
        problems: dict[str, list[str]] = {}
        for req in plan.items:
            info: _StorageInfo | None = self.storage_data.get(req.storage_index)
            rel = getattr(info, "relative_path", None)
            if not isinstance(rel, str) or not is_reference_path(rel):
                continue
            idx = req.storage_index
            rec = self._records.get(
                (idx.fqn, tuple(idx.offset) if idx.offset is not None else None)
            )
            if rec is not None and rec.ref is not None and relative_path(rec) == rel:
                why = self._owner_checks.item_problem(root, rec)
            elif may_be_rewritten(os.path.basename(rel)):  # no manifest record: its owner
                why = self._owner_checks.commit_problem(os.path.join(root, os.path.dirname(rel)))
            else:
                why = None  # a file named after its save: the read checks it is there
            if why is not None:
                keys = problems.setdefault(why, [])
                keys.append(f"'{idx.fqn}' ({rel[3:]})")
        if problems:
            raise IntegrityError(reference_error(root, problems))

    def _local_dir(self) -> bool:
        # Only a local directory: fsspec paths (FsspecReader) are not this class anyway.
        return isinstance(self.path, (str, os.PathLike)) and os.path.isdir(os.fspath(self.path))

    def _record_for(self, index: MetadataIndex) -> ItemRecord | None:
        """The manifest record of a stored item, if it describes exactly what .metadata does."""
        if not self._records:
            return None
        key: _Key = (index.fqn, tuple(index.offset) if index.offset is not None else None)
        rec = self._records.get(key)
        if rec is None:
            return None
        info: _StorageInfo | None = self.storage_data.get(index)
        if (
            info is None
            or info.relative_path != relative_path(rec)
            or info.offset != rec.archive_offset
            or info.length != rec.archive_length
            or info.transform_descriptors
            or os.sep in rec.file
            or (rec.ref is not None and not is_reference_path(relative_path(rec)))
            or sum(c[1] for c in rec.chunks) != rec.payload_bytes
        ):
            return None
        return rec

    def _dtype_of(self, index: MetadataIndex, rec: ItemRecord) -> torch.dtype | None:
        """The saved chunk's dtype if the manifest agrees with .metadata on dtype and shape."""
        md = self._metadata.state_dict_metadata.get(index.fqn) if self._metadata else None
        if not isinstance(md, TensorStorageMetadata):
            return None
        dtype = md.properties.dtype
        if str(dtype).replace("torch.", "") != rec.dtype:
            return None
        for chunk in md.chunks:
            if tuple(chunk.offsets) == tuple(index.offset or ()):
                if list(chunk.sizes) != rec.shape:
                    return None
                break
        else:
            return None
        elem = torch.empty(0, dtype=dtype).element_size()
        n = 1
        for s in rec.shape:
            n *= s
        return dtype if n * elem == rec.payload_bytes else None

    # -- reading ------------------------------------------------------------------------------
    def _read_bytes(self, req: ReadItem, rec: ItemRecord, planner: LoadPlanner) -> None:
        path = os.path.join(os.fspath(self.path), relative_path(rec))
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), rec.archive_length, rec.archive_offset)
        if len(data) != rec.archive_length:
            raise IntegrityError(
                f"'{rec.fqn}': {path} ends inside its data (bytes [{rec.archive_offset}, "
                f"{rec.archive_offset + rec.archive_length})): the file is truncated"
            )
        key: _Key = (rec.fqn, None)
        if self.verify and key in self._checksummed and rec.chunks:
            crc = _core.crc32c(data)
            if crc != rec.chunks[0][2]:
                raise IntegrityError(
                    f"checksum mismatch in '{rec.fqn}' ({path}, bytes [{rec.archive_offset}, "
                    f"{rec.archive_offset + rec.archive_length})): the manifest records "
                    f"0x{rec.chunks[0][2]:08x}, the file holds 0x{crc:08x}: the checkpoint is "
                    "damaged"
                )
        planner.load_bytes(req, io.BytesIO(data))

    def _read_tensors(self, chunks: list[_Chunk], planner: LoadPlanner) -> int:
        """Reads the chunks in batches (temporaries bounded by buffer_bytes); returns bytes.

        A helper thread reads each batch (native, GIL released) while this thread resolves the
        targets of the next one (:meth:`_batches`) and then copies the previous one into its
        targets: at most two batches of temporaries exist at a time. Temporaries for CUDA
        targets are pinned where possible and copied asynchronously; every device copied to is
        synchronized before this returns.
        """
        devices: set[torch.device] = set()  # targets of asynchronous copies
        self._device = None
        if self.device_reads and device_path_enabled():
            threads = self._device_threads()
            kept = self._device_kept
            if kept is None or kept.threads != threads or kept.buffer_bytes != self.buffer_bytes:
                kept = self._device_kept = DeviceTargets(threads, self.buffer_bytes)
            kept.start_load()
            self._device = kept
        try:
            return self._read_pipelined(self._batches(chunks, planner), planner, devices)
        finally:
            for device in devices:
                torch.cuda.synchronize(device)
            self._device = None

    def _batches(self, chunks: list[_Chunk], planner: LoadPlanner) -> Iterator[list[_Chunk]]:
        """Resolves each chunk's destination and yields the chunks in batches, lazily: reads
        begin once the first batch (FIRST_BATCH_BYTES) is resolved, not once every target is.
        A batch closes at BATCH_BYTES (MEMORY_BATCH_BYTES from a memory file system) or
        BATCH_CHUNKS, or before its temporaries would exceed
        buffer_bytes (a chunk larger than that is a batch of its own)."""
        batch: list[_Chunk] = []
        temp_bytes = size = 0
        limit = FIRST_BATCH_BYTES
        for ch in chunks:
            self._choose_destination(ch, planner)
            n = ch.rec.payload_bytes
            if batch and (
                size + n > limit
                or len(batch) >= BATCH_CHUNKS
                or (not ch.direct and temp_bytes + n > self.buffer_bytes)
            ):
                yield batch
                batch, temp_bytes, size = [], 0, 0
                limit = MEMORY_BATCH_BYTES if self.memory_fs else BATCH_BYTES
            batch.append(ch)
            size += n
            if not ch.direct:
                temp_bytes += n
        if batch:
            yield batch

    def _read_pipelined(
        self, batches: Iterator[list[_Chunk]], planner: LoadPlanner, devices: set[torch.device]
    ) -> int:
        """Batch k+1 is resolved here and read by one helper thread while batch k is read, then
        delivered here. Whatever happens, no temporary is dropped while a native read may
        still write into it (the helper is joined first; reads not yet begun are cancelled)."""
        total = 0
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_datastates-read")
        try:
            prev: tuple[list[_Chunk], concurrent.futures.Future[int]] | None = None
            for batch in batches:
                self._allocate(batch)
                fut = pool.submit(self._read_batch, batch)
                if prev is not None:
                    total += prev[1].result()
                    self._deliver_batch(prev[0], planner, devices)
                prev = (batch, fut)
            if prev is not None:
                total += prev[1].result()
                self._deliver_batch(prev[0], planner, devices)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return total

    @staticmethod
    def _allocate(batch: list[_Chunk]) -> None:
        """The temporaries of a batch's chunks that are not read into their targets."""
        for ch in batch:
            if ch.direct:
                continue
            pin = ch.target is not None and ch.target.is_cuda
            if pin:
                try:
                    ch.dst = torch.empty(ch.rec.shape, dtype=ch.dtype, pin_memory=True)
                    continue
                except RuntimeError:  # no page-locked memory left: pageable, synchronous copy
                    pass
            ch.dst = torch.empty(ch.rec.shape, dtype=ch.dtype)

    def _choose_destination(self, ch: _Chunk, planner: LoadPlanner) -> None:
        """Reads straight into the target when one request wants the whole chunk as it is: a
        CPU target, or a CUDA target through the device path (its device's staging)."""
        if len(ch.reqs) != 1:
            return
        req = ch.reqs[0]
        if any(o != 0 for o in req.storage_offsets) or list(req.lengths) != ch.rec.shape:
            return
        target = planner.resolve_tensor(req).detach()
        plain = (
            target.dtype == ch.dtype
            and list(target.shape) == ch.rec.shape
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
            and target.layout == torch.strided
        )
        path = self._device
        device = device_of(target) if plain and path is not None else None
        if device is not None and path is not None and path.staging(device) is not None:
            ch.device = device
        elif not (plain and target.is_cpu):
            ch.target = target  # resolved once: _deliver copies into it
            return
        mark_modified(target)  # before the read lands in it (lazy saves see the change)
        ch.dst = target
        ch.direct = True

    def _read_batch(self, batch: list[_Chunk]) -> int:
        """Reads a batch's payloads into their destinations (native, GIL released); returns
        the bytes read. Runs in this thread or the pipeline's helper. Chunks read into device
        memory go through their device's staging, one native read per device."""
        by_device: dict[int | None, list[_Chunk]] = {}
        for ch in batch:
            by_device.setdefault(ch.device, []).append(ch)
        nbytes = 0
        for device, chunks in by_device.items():
            staging = None
            if device is not None:
                assert self._device is not None
                staging = self._device.staging(device)
            nbytes += self._read_spans(chunks, staging)
        return nbytes

    def _read_spans(self, batch: list[_Chunk], staging: _core.DeviceStaging | None) -> int:
        """One native read of the chunks' manifest chunks (CRC-32C checked where recorded)."""
        root = os.fspath(self.path)
        paths: list[str] = []
        path_ids: dict[str, int] = {}
        files: list[int] = []
        offsets: list[int] = []
        lengths: list[int] = []
        dsts: list[int] = []
        crcs: list[int] = []
        names: list[str] = []
        name_of: list[int] = []
        for ch in batch:
            rec = ch.rec
            assert ch.dst is not None
            if rec.payload_bytes == 0:
                continue
            where = relative_path(rec)  # ../<owner>/<file> for a reference (checked before)
            fid = path_ids.get(where)
            if fid is None:
                fid = path_ids[where] = len(paths)
                paths.append(os.path.join(root, where))
            base = ch.dst.data_ptr()
            checked = self.verify and (rec.fqn, _key_offset(rec)) in self._checksummed
            names.append(rec.fqn)
            for off, n, crc in rec.chunks:
                rel = off - rec.payload_offset
                if rel < 0 or rel + n > rec.payload_bytes:
                    raise IntegrityError(
                        f"'{rec.fqn}': its manifest chunk [{off}, {off + n}) lies outside its "
                        f"payload in {where}: the manifest is damaged"
                    )
                files.append(fid)
                offsets.append(off)
                lengths.append(n)
                dsts.append(base + rel)
                crcs.append(crc if checked else -1)
                name_of.append(len(names) - 1)
        if not files:
            return 0
        try:
            threads, o_direct, block = self._read_options()
            if staging is not None:  # pieces fill the staging slots; preads are <= 1 MiB
                threads, block = staging.slots // 2, self.block_bytes
            st = _core.read_spans(paths, files, offsets, lengths, dsts, crcs, names, name_of,
                                  threads, o_direct, block, staging)
        except _core.EngineError as e:
            msg = str(e)
            if "checksum mismatch" in msg or "truncated" in msg:
                raise IntegrityError(f"{root}: {msg}") from None
            raise OSError(f"{root}: {msg}") from None
        self._count(st, staging is not None)
        return int(st["bytes"])

    def _count(self, st: dict[str, int], device: bool) -> None:
        """Adds one native read's figures to the load's (one batch at a time: no lock)."""
        for k in ("direct_bytes", "verified_bytes"):
            self._native_stats[k] += int(st[k])
        if device:
            self._native_stats["device_bytes"] += int(st["bytes"])
            self._native_stats["device_copy_calls"] += int(st["copy_calls"])
            self._native_stats["device_batch_calls"] += int(st["batch_calls"])

    @property
    def memory_fs(self) -> bool:
        """Whether the checkpoint lies on a memory file system (:func:`memory_backed`)."""
        if self._memory_fs is None:
            self._memory_fs = self._local_dir() and memory_backed(os.fspath(self.path))
        return self._memory_fs

    def _read_options(self) -> tuple[int, bool, int]:
        """The native reader's threads, O_DIRECT and largest read for this checkpoint.

        From a memory file system a read is a copy out of the page cache: no ``O_DIRECT``
        (meaningless there, and slower where the kernel accepts it), reads of at most
        MEMORY_BLOCK_BYTES (verified while in cache) and one thread per core at most.
        """
        if not self.memory_fs:
            return self.threads, self.o_direct, self.block_bytes
        threads = min(self.threads, max(2, _cores()))
        return threads, False, min(self.block_bytes, MEMORY_BLOCK_BYTES)

    def _device_threads(self) -> int:
        """Threads of a read into device memory: as for host reads, except from a memory file
        system, where each is a CPU copy into staging that the link outruns: one per core (at
        most DEVICE_MEMORY_THREADS), however few ``threads`` asks for."""
        threads = self._read_options()[0]
        if not self.memory_fs:
            return threads
        return max(threads, min(DEVICE_MEMORY_THREADS, _cores()))

    def _deliver_batch(
        self, batch: list[_Chunk], planner: LoadPlanner, devices: set[torch.device]
    ) -> None:
        for ch in batch:
            self._deliver(ch, planner, devices)

    def _deliver(self, ch: _Chunk, planner: LoadPlanner, devices: set[torch.device]) -> None:
        assert ch.dst is not None
        if ch.direct:
            mark_modified(ch.dst)  # and after: a save called during the read is not trusted
            planner.commit_tensor(ch.reqs[0], ch.dst)
            return
        for i, req in enumerate(ch.reqs):
            src = narrow_tensor_by_index(ch.dst, req.storage_offsets, req.lengths)
            target = ch.target if i == 0 and ch.target is not None else None
            if target is None:
                target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise ValueError(
                    f"'{req.storage_index.fqn}': the load plan wants shape {tuple(target.size())} "
                    f"but reads {tuple(src.size())} from the checkpoint"
                )
            mark_modified(target)  # before the copy (copy_ itself counts only once it is done)
            # From pinned memory into a GPU tensor: asynchronous, in the current stream's order
            # (later work on it waits); read_data synchronizes the device before it returns.
            if target.is_cuda and src.is_pinned():
                target.copy_(src, non_blocking=True)
                devices.add(target.device)
            else:
                target.copy_(src)
            planner.commit_tensor(req, target)
        ch.dst = None  # the temporary is freed with the batch
        ch.target = None


def memory_backed(path: str) -> bool:
    """Whether ``path`` lies on a file system held in memory (tmpfs such as ``/dev/shm``,
    ramfs): the mount with the longest mount point above its real path, from
    ``/proc/self/mounts``. False where that cannot be read (not Linux)."""
    real = os.path.realpath(path)
    best, fstype = -1, ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mnt = fields[1].replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= best:
            best, fstype = len(mnt), fields[2]
    return fstype in MEMORY_FS_TYPES


def mark_modified(t: torch.Tensor) -> None:
    """Counts a write into ``t`` as an in-place modification: bumps its version counter (shared
    with every alias and ``detach()`` of it), which incremental saves and lazy capture compare.

    Called *before* a write torch does not see begins (a native read into the tensor's memory),
    so that a lazy save whose copy may overlap the write finds the counter changed when it checks
    its capture, and fails with CaptureError instead of committing a torn or loaded value.
    Inference tensors have no version counter: nothing to mark.
    """
    if not t.is_inference():
        torch.autograd.graph.increment_version(t)


class _MarkingPlanner:
    """A load planner whose ``resolve_tensor`` marks each target modified before the stock
    reader copies into it (every other attribute is the wrapped planner's)."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._planner.resolve_tensor(read_item)
        mark_modified(target)
        return target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS tells, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 2


def _key_offset(rec: ItemRecord) -> tuple[int, ...] | None:
    return tuple(rec.offset) if rec.offset is not None else None


__all__ = ["DataStatesReader", "mark_modified", "memory_backed"]
