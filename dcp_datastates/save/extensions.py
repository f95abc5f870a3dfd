"""Stream-transform extensions (``_extensions``): compression and the like, as DCP applies them.

``DataStatesWriter(path, _extensions=[ZStandard()])`` takes the same keyword, with the same
semantics, as torch's ``FileSystemWriter``: every item (tensor archive or serialized value) is
written through the transform chain that torch's own ``_StorageWriterTransforms`` builds from
the list (the last extension sees the data first), and ``.metadata`` records, for each item, the
stored (transformed) byte range and the descriptors (``_StorageInfo.transform_descriptors``,
outermost first). torch's stock ``FileSystemReader``, with its default extension registry (which
knows ``ZStandard``) or one the caller registers custom extensions in, undoes them on load.
Only :class:`~torch.distributed.checkpoint._extension.StreamTransformExtension` instances are
accepted (:func:`check_extensions` names anything else).

How a transformed save is written (:func:`write_transformed`, in DCP's save thread: for
``async_save`` never in the caller's call). Capture is unchanged: the engine snapshots every
tensor into the host cache (at the call, lazily, or directly from the source for ``dcp.save``),
but the entries are placed *external*, as for the fsspec path. The save thread and, with
``files_per_rank`` > 1 on a local directory, one helper thread per further data file
(``dcp_datastates-transform``) then take items in copy order (at-call copies, then lazy copies in
queue order, then serialized values), each writing the items it takes into its own data file
``__<rank>_<f>.distcp``, one after the other: archive header, then each payload chunk as it lands
in the cache (copied out in blocks of at most 4 MiB, then the chunk's cache space is released),
then the trailer, all through the item's transform stream. A cache smaller than the checkpoint
therefore never deadlocks (the oldest chunk in the cache always belongs to an item being
written). Transformed lengths are known only once written, so ``write_data`` returns after the
last item is written; the wait for durability, the check that no lazily captured tensor changed
before its copy landed, and the manifest follow as for untransformed saves. Saves without
``_extensions`` never enter this module: their pipeline (early placement, native flushes from the
cache) is unchanged.

Manifest: each transformed item records its stored range with one CRC-32C chunk over the stored
bytes, its ``transform`` descriptors, and the length and CRC-32C of its decoded bytes
(:class:`~dcp_datastates.format.manifest.ItemRecord`, manifest version 3); ``verify`` checks both,
the latter by decoding with torch's default registry (an extension it does not know is reported as
not verified, exit status 3).

Failures: an error in a transform, a write or a copy fails the save, naming the item, the file
and the rank; the other writing threads stop (the engine job is aborted, which wakes any wait for
a chunk), the partial data files are removed, and nothing is committed. Incompatible settings
(``format="safetensors"``, ``incremental``) are refused by the writer's constructor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageWriterTransforms
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .. import _core
from ..errors import CheckpointSaveError, reraisable
from ..format.commit import manifest_name
from ..format.layout import data_file_name
from ..format.manifest import ItemRecord, encode_manifest
from ..runtime.gcpause import gc_paused
from ..storage.fsspec_sink import ObjectWriter, open_object
from .capture import wait_written

if TYPE_CHECKING:
    from ..format.layout import ArchiveTemplate
    from .capture import CapturedTensor, SaveJob
    from .contexts import SaveContext
    from .late_capture import ItemPlacer

logger = logging.getLogger(__name__)

_BLOCK_BYTES = 4 * 1024 * 1024  # largest piece of a cache chunk handed to a transform at once
_FILE_BUFFER_BYTES = 8 * 1024 * 1024  # local data files: bytes gathered per write(2)


def check_extensions(
    extensions: Sequence[StreamTransformExtension] | None,
) -> tuple[StreamTransformExtension, ...]:
    """Validates a writer's ``_extensions``; returns them as a tuple (empty: no transforms).

    Raises TypeError naming the position and type of anything that is not a
    ``StreamTransformExtension`` instance (a class instead of an instance, another
    ``Extension`` kind), or a descriptor that is not a string.
    """
    if extensions is None:
        return ()
    if isinstance(extensions, (str, bytes)) or not isinstance(extensions, Sequence):
        raise TypeError(
            "_extensions must be a sequence of StreamTransformExtension instances (e.g. "
            f"[ZStandard()]), not {type(extensions).__name__}"
        )
    out: list[StreamTransformExtension] = []
    for i, ext in enumerate(extensions):
        if not isinstance(ext, StreamTransformExtension):
            what = f"the class {ext.__name__}" if isinstance(ext, type) else type(ext).__name__
            raise TypeError(
                f"_extensions[{i}] is {what}: DataStatesWriter supports instances of "
                "torch.distributed.checkpoint._extension.StreamTransformExtension only (e.g. "
                "ZStandard())"
            )
        desc = ext.get_descriptor()
        if not isinstance(desc, str) or not desc:
            raise TypeError(
                f"_extensions[{i}] ({type(ext).__name__}): get_descriptor() returned {desc!r}, "
                "not a non-empty string"
            )
        out.append(ext)
    return tuple(out)


class _StoredFile:
    """One data file written sequentially under the transforms: counts the position and the
    CRC-32C of the stored bytes since :meth:`begin`. ``write``/``flush`` are what torch's
    transform streams call; ``close`` completes the file (durable on a local path when asked),
    ``abort`` removes what was written."""

    def __init__(self, local: bool, fs: Any, path: str, durable: bool, placer: ItemPlacer) -> None:
        self.path = path
        self.pos = 0
        self.crc = 0
        self._durable = durable
        self._fd = -1
        self._obj: ObjectWriter | None = None
        self._buf = bytearray()
        if local:
            self._fd = os.open(
                path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
            )
        else:
            self._obj = open_object(
                fs, path, part_bytes=placer.config.part_bytes,
                concurrency=placer.config.upload_concurrency,
            )

    def begin(self) -> int:
        """Starts an item: returns its offset and resets the running CRC-32C."""
        self.crc = 0
        return self.pos

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n == 0:
            return 0
        self.crc = _core.crc32c(view, self.crc)
        self.pos += n
        if self._obj is not None:
            self._obj.write(view)  # copied (or written) before it returns
            return n
        self._buf += view
        if len(self._buf) >= _FILE_BUFFER_BYTES:
            self._drain()
        return n

    def flush(self) -> None:
        """Nothing to do: the buffer is written at 8 MiB and by :meth:`close`."""

    def _drain(self) -> None:
        view = memoryview(self._buf)
        done = 0
        try:
            while done < len(view):
                done += os.write(self._fd, view[done:])
        finally:
            view.release()
        del self._buf[:]

    def close(self) -> None:
        if self._obj is not None:
            self._obj.close()
            return
        self._drain()
        if self._durable:
            os.fdatasync(self._fd)
        fd, self._fd = self._fd, -1
        os.close(fd)

    def abort(self) -> None:
        """Abandons the file (never raises)."""
        if self._obj is not None:
            left = self._obj.abort()
            if left is not None:
                logger.warning("%s", left)
            return
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except OSError as e:
            logger.warning("partial %s was not removed: %s", self.path, e)


@dataclass
class _Item:
    """One planned item and, once written, where its stored bytes lie."""

    item: WriteItem
    cap: CapturedTensor | None = None  # None: a bytes item
    data: bytes = b""
    tmpl: ArchiveTemplate | None = None
    file: int = -1
    offset: int = 0
    length: int = 0
    stored_crc: int = 0
    decoded_bytes: int = 0
    decoded_crc: int = 0
    descriptors: list[str] = field(default_factory=list)


class _Decoded:
    """What goes into one item's transform stream, with its length and CRC-32C."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.n = 0
        self.crc = 0

    def write(self, b: Any) -> int:
        n = len(memoryview(b))
        self.crc = _core.crc32c(b, self.crc)
        self.n += n
        self._stream.write(b)
        return n


def write_transformed(
    placer: ItemPlacer,
    ctx: SaveContext,
    job: SaveJob,
    plan: SavePlan,
    planner: SavePlanner,
    extensions: tuple[StreamTransformExtension, ...],
) -> tuple[list[WriteResult], Callable[[], None]]:
    """Writes this rank's items of ``plan`` through ``extensions`` (see the module docstring).

    Returns the WriteResults (every item written already) and the completion: a callable that
    waits until the job's data is captured (checking no lazily captured tensor changed) and
    durable and writes the rank's manifest. Raises on any failure; the caller fails the job.
    Runs in the save thread of one save.
    """
    d = ctx.directory()
    d.ensure_exists()
    eng = placer._engine
    transforms = _StorageWriterTransforms(extensions)
    staged_sd = getattr(planner, "state_dict", None)
    items: list[_Item] = []
    byte_items: list[_Item] = []
    added_late = False
    with gc_paused():  # per-item bookkeeping only (see dcp_datastates.runtime.gcpause)
        if job.adhoc:  # dcp.save: every tensor registered in one batch, in plan order
            added_late = placer.capture_late_many(job, plan.items, planner)
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
                byte_items.append(_Item(item, data=raw))
                continue
            cap, late = placer.captured_item(ctx, job, staged_sd, item, planner)
            added_late |= late
            if cap.spill is None:
                eng.place_external(job.engine_job, cap.entry)
            items.append(_Item(item, cap, tmpl=placer._templates.get(cap.dtype, cap.shape)))
    if added_late:
        eng.start_copies(job.engine_job)
    eng.seal(job.engine_job)
    # Copy order: at-call copies first, then the lazy ones in queue order; bytes items last.
    items.sort(key=lambda it: (0 if it.cap.at_call else 1, it.cap.entry))  # type: ignore[union-attr]
    ordered = items + byte_items
    where = f"{ctx.path} (rank {ctx.rank})"
    nfiles = max(1, min(placer.config.files_per_rank if d.local else 1, len(ordered)))
    _write_all(placer, ctx, job, transforms, ordered, nfiles, d.local, d.fs, d.join, where)

    results = [
        WriteResult(
            index=it.item.index,
            size_in_bytes=it.length,
            storage_data=_StorageInfo(
                data_file_name(ctx.rank, it.file), it.offset, it.length,
                transform_descriptors=it.descriptors or None,
            ),
        )
        for it in ordered
    ]

    def complete() -> None:
        wait_written(eng, job, where)
        text = encode_manifest(
            ctx.rank, placer.config.checksums, ctx.save_id, (_record(ctx, it) for it in ordered)
        )
        d.write_atomic(manifest_name(ctx.rank), text, placer.config.durable)

    return results, complete


def _write_all(
    placer: ItemPlacer,
    ctx: SaveContext,
    job: SaveJob,
    transforms: _StorageWriterTransforms,
    ordered: list[_Item],
    nfiles: int,
    local: bool,
    fs: Any,
    join: Callable[[str], str],
    where: str,
) -> None:
    """Writes ``ordered`` into ``nfiles`` data files: this thread and ``nfiles - 1`` helpers
    each take the next item in order and append it to their own file. Raises the first error
    (after every helper has stopped and every partial file is removed)."""
    eng = placer._engine
    lock = threading.Lock()
    state: dict[str, Any] = {"next": 0, "error": None}
    files: list[_StoredFile] = []

    def take() -> _Item | None:
        with lock:
            if state["error"] is not None or state["next"] >= len(ordered):
                return None
            it = ordered[state["next"]]
            state["next"] += 1
            return it

    def run(f: int) -> None:
        out: _StoredFile | None = None
        current: _Item | None = None
        try:
            while (current := take()) is not None:
                if out is None:
                    out = _StoredFile(
                        local, fs, join(data_file_name(ctx.rank, f)), placer.config.durable,
                        placer,
                    )
                    with lock:
                        files.append(out)
                _write_item(eng, job, transforms, out, current)
                current.file = f
            if out is not None:
                out.close()
        except BaseException as e:  # noqa: BLE001 - raised by the save thread below
            name = data_file_name(ctx.rank, f)
            what = f"'{current.item.index.fqn}' " if current is not None else ""
            err = CheckpointSaveError(
                f"save to {where}: writing {what}through _extensions into {name} failed: "
                f"{type(e).__name__}: {e}"
            )
            with lock:
                first = state["error"] is None
                if first:
                    state["error"] = (err, e)
            if first:  # wakes the other threads' waits for chunks that will never come
                eng.abort(job.engine_job, str(err))

    helpers = [
        threading.Thread(target=run, args=(f,), name="dcp_datastates-transform", daemon=True)
        for f in range(1, nfiles)
    ]
    for t in helpers:
        t.start()
    try:
        run(0)
    finally:
        for t in helpers:
            t.join()
    if state["error"] is not None:
        for out in files:
            out.abort()
        err, cause = state["error"]
        if isinstance(job.error, CheckpointSaveError):  # failed elsewhere first: that is the cause
            raise reraisable(job.error) from cause
        raise err from cause


def _write_item(
    eng: Any,
    job: SaveJob,
    transforms: _StorageWriterTransforms,
    out: _StoredFile,
    it: _Item,
) -> None:
    """Appends one item, through its own transform stream, to ``out``."""
    it.offset = out.begin()
    stream, descriptors = transforms.transform_save_stream(it.item, out)  # type: ignore[arg-type]
    sink = _Decoded(stream)
    cap, tmpl = it.cap, it.tmpl
    if cap is None:
        sink.write(it.data)
    else:
        assert tmpl is not None
        sink.write(tmpl.prefix)
        if cap.spill is not None:
            cap.spill.stream_to(sink)
        else:
            e = cap.entry
            for c in range(eng.chunk_count(job.engine_job, e)):
                addr, n = eng.wait_chunk(job.engine_job, e, c)
                view = memoryview((ctypes.c_char * n).from_address(addr)).cast("B") if n else None
                for k in range(0, n, _BLOCK_BYTES):
                    assert view is not None
                    # A copy: an extension may keep what it is given, and the cache space is
                    # reused once released.
                    sink.write(bytes(view[k : k + _BLOCK_BYTES]))
                eng.release_chunk(job.engine_job, e, c)
        sink.write(tmpl.suffix)
    stream.close()  # ends the transform (flushes it into ``out``; ``out`` stays open)
    it.length = out.pos - it.offset
    it.stored_crc = out.crc
    it.decoded_bytes, it.decoded_crc = sink.n, sink.crc
    it.descriptors = list(descriptors)


def _record(ctx: SaveContext, it: _Item) -> ItemRecord:
    """The manifest record of a transformed item (see dcp_datastates.format.manifest.ItemRecord)."""
    offs = it.item.index.offset
    cap = it.cap
    return ItemRecord(
        fqn=it.item.index.fqn,
        offset=list(offs) if offs is not None and cap is not None else None,
        file=data_file_name(ctx.rank, it.file),
        archive_offset=it.offset,
        archive_length=it.length,
        payload_offset=it.offset,
        payload_bytes=cap.nbytes if cap is not None else len(it.data),
        dtype=str(cap.dtype).replace("torch.", "") if cap is not None else "bytes",
        shape=list(cap.shape) if cap is not None else [],
        chunks=[(it.offset, it.length, it.stored_crc)],
        transform=list(it.descriptors),
        decoded_bytes=it.decoded_bytes,
        decoded_crc=it.decoded_crc,
    )


__all__ = ["check_extensions", "write_transformed"]
