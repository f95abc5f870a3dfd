"""Early placement: a staged save's tensors are placed, and start flushing, before DCP plans.

Why: DCP hands a storage writer its items only in ``write_data``, after planning (about 0.3 s
for 6,000 items on 2 cores). Placement (which file, which offset) used to wait for that, so the
first byte reached the disk only after the at-call copy *and* the planning: a serial prefix that
kept a 2 GB save 0.5 s behind ``torch.save``. DataStates places at the save call. Here, when the
save thread begins (when DCP's ``save`` first iterates the staged dict, right after ``reset``
gave it the path, once earlier saves have ended; failing that in ``set_up_storage_writer``),
every tensor the save staged is placed in this rank's data files in copy order,
and the flush threads write each chunk as soon as it lands, while DCP plans.

The data files are *unnamed* (``O_TMPFILE``, created in the checkpoint directory or its nearest
existing parent, on the same file system) until they are linked under their DCP names
(``linkat`` through ``/proc/self/fd``), under the path claim, after the overwritten checkpoint's
files are gone: with one rank only once the save's data is durable (the claim defers the
removal; ``write_data`` makes its own files unnamed too, and ``PendingWrite.complete`` removes the
old checkpoint and names them), with several ranks in ``write_data``. A save that fails or is
refused before that, or a process that dies, leaves nothing behind: the kernel frees an unnamed
file when its last descriptor closes. If linking fails anyway, the files are copied into place
after the flush (``copy_file_range``), so the save still completes, only slower.

Room: the files are written beside the checkpoint they replace, so before any byte is placed they
are allocated to their final size (:func:`dcp_datastates.storage.room.reserve`: ``fallocate``, and
the ``RLIMIT_FSIZE`` check; skipped while free space is ample). Without room nothing is placed
early: the job keeps the :class:`~dcp_datastates.storage.room.NoRoom`, and ``write_data`` places
everything after the old checkpoint is removed, which happens only if the new data then fits
(``Placer.check_replace``); else the save fails naming the path and the old checkpoint stays.

The placement is the one ``write_data`` would have computed from a plan of whole tensors, so
``write_data`` takes it over: each planned tensor item whose captured tensor was placed early
keeps that place (its shape is checked as before); anything else (bytes items, tensors a custom
planner resolves differently) is placed after them, in the same files. A tensor placed early
that the plan does not use is still written, and costs only its bytes in the file.

When: local directories, the ``torch`` format, no incremental saves, and not for ``dcp.save``
(nothing is staged). With several ranks only the shards no other rank holds are placed early
(``CapturedTensor.rank_unique``: DTensors sharded on every dimension of a mesh spanning the
world, as FSDP2 keeps parameters and optimizer state), in ``set_up_storage_writer``, once the
save's rank is known: DCP's deduplication decides which rank writes a replicated tensor only at
planning, so those (and plain tensors, which any rank may hold too) are placed in
``write_data``. ``early_flush=False`` on the writer turns it off.

Threads and lifetimes: an :class:`EarlyPlacement` is created and used by the save thread of its
job; its descriptors are closed when it is linked or copied, and in any case when the job ends
(``SaveJob.release_sources(done=True)``) or the object is collected. A forked child inherits the
descriptors and closes its copies at exit; it never writes through them.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field

from .. import _core
from ..config import WriterConfig
from ..engine import Engine
from ..errors import CheckpointSaveError
from ..format.commit import CheckpointDir
from ..format.layout import FileLayout, TemplateCache, data_file_name
from ..runtime.gcpause import gc_paused
from ..storage.room import reserve
from .capture import SaveJob

logger = logging.getLogger("dcp_datastates.save.writer")


def _close_all(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


@dataclass
class EarlyPlacement:
    """The early placement of one job's tensors (see the module docstring)."""

    directory: str  # real path of the checkpoint directory the files are meant for
    rank: int
    layout: FileLayout  # continued by write_data for the items placed after these
    file_ids: dict[int, int] = field(default_factory=dict)  # layout file -> engine file id
    fds: dict[int, int] = field(default_factory=dict)  # layout file -> descriptor we own
    placed: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # entry -> place
    linked: set[int] = field(default_factory=set)  # files named by link() or link_named()
    anon_dir: str = ""  # where the unnamed files are (write_data makes its new ones there too)

    def __post_init__(self) -> None:
        self._open: list[int] = []  # the descriptors still open, shared with the finalizer
        self._finalizer = weakref.finalize(self, _close_all, self._open)
        # close() may come from another thread (a barrier failing the job): it waits for a
        # copy in progress, so a descriptor is never closed (and its number reused) under it.
        self._lock = threading.Lock()

    def adopt_fd(self, f: int, fd: int) -> None:
        self.fds[f] = fd
        self._open.append(fd)

    def matches(self, d: CheckpointDir) -> bool:
        """Whether ``d`` is the directory these files were placed for."""
        return d.local and os.path.realpath(d.path) == self.directory

    def link(self, engine: Engine, job: SaveJob) -> bool:
        """Gives every file its DCP name (under the path claim). False if a file cannot be
        linked there: then :meth:`copy_into` must run once the data is durable (for the files
        not linked)."""
        for f, fid in sorted(self.file_ids.items()):
            try:
                engine.link_file(job.engine_job, fid)
            except CheckpointSaveError as e:
                if job.error is not None:
                    raise  # the job failed meanwhile: that is the error
                logger.warning("%s; the data file is copied into place after the flush", str(e))
                return False
            self.linked.add(f)
        self.close()
        return True

    def link_named(self, d: CheckpointDir) -> bool:
        """Gives every file its DCP name in ``d`` through this placement's own descriptors (the
        engine has closed its own once the data is durable): the single-rank save, which removes
        the checkpoint it replaces only then. Under the path claim, after that removal. False if
        a file cannot be linked: then :meth:`copy_into` copies the files not linked."""
        with self._lock:
            for f, fd in sorted(self.fds.items()):
                target = d.join(data_file_name(self.rank, f))
                try:
                    try:
                        _link_fd(fd, target)
                    except FileExistsError:  # not the old checkpoint's (removed): a stray file
                        os.unlink(target)
                        _link_fd(fd, target)
                except OSError as e:
                    logger.warning("cannot link the data file %s (%s); the data file is copied "
                                   "into place", target, e.strerror or str(e))
                    return False
                self.linked.add(f)
        self.close()
        return True

    def copy_into(self, d: CheckpointDir, durable: bool) -> None:
        """Copies every (durable) file not linked by :meth:`link` to its DCP name in ``d``: the
        fallback of :meth:`link`. Raises naming the file."""
        with self._lock:
            if not self._open:
                raise CheckpointSaveError(f"save to {d.path} ended before its files were copied")
            for f, fd in sorted(self.fds.items()):
                target = d.join(data_file_name(self.rank, f))
                if f in self.linked and self.matches(d):
                    continue  # named already: copying would truncate the file onto itself
                try:
                    _copy_fd(fd, target, durable)
                except OSError as e:
                    raise CheckpointSaveError(f"cannot write the data file {target}: {e}") from e
        self.close()

    def close(self) -> None:
        """Closes the descriptors (idempotent, any thread). Unlinked files vanish with the
        engine's."""
        with self._lock:
            _close_all(self._open)
            self.fds.clear()


def _link_fd(fd: int, target: str) -> None:
    """Names the open (unnamed) file ``fd`` ``target``: ``linkat(AT_SYMLINK_FOLLOW)`` through
    ``/proc/self/fd`` (``os.link`` calls ``linkat``, which follows that link, only when given a
    directory descriptor; plain ``link`` fails with ``EXDEV``). A link at ``target`` is never
    followed (``EEXIST``)."""
    dfd = os.open(os.path.dirname(target) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(target), dst_dir_fd=dfd,
                follow_symlinks=True)
    finally:
        os.close(dfd)


def _copy_fd(fd: int, target: str, durable: bool) -> None:
    size = os.fstat(fd).st_size
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o644)
    try:
        off = 0
        while off < size:
            n = os.copy_file_range(fd, out, size - off, off, off)
            if n == 0:
                raise OSError(errno.EIO, f"short copy at offset {off} of {size}")
            off += n
        if durable:
            os.fdatasync(out)
    finally:
        os.close(out)


def _anon_dir(path: str) -> str | None:
    """The checkpoint directory if it exists, else its nearest existing parent directory."""
    p = os.path.abspath(path)
    while True:
        if os.path.isdir(p):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def place_early(
    engine: Engine,
    templates: TemplateCache,
    config: WriterConfig,
    job: SaveJob,
    d: CheckpointDir,
    rank: int,
    rank_unique_only: bool = False,
) -> EarlyPlacement | None:
    """Places ``job``'s staged tensors in unnamed data files for ``d`` (rank ``rank``) and lets
    them flush; None where the module docstring's conditions do not hold, or when no unnamed
    file can be made there (the save then places everything in ``write_data``, as before).
    ``rank_unique_only`` (several ranks): only the shards no other rank holds."""
    caps = [
        t for t in job.tensors if t.spill is None and (t.rank_unique or not rank_unique_only)
    ]
    if not caps or not d.local or not os.path.isdir("/proc/self/fd"):
        return None
    where = _anon_dir(d.path)
    if where is None:
        return None
    early = EarlyPlacement(
        directory=os.path.realpath(d.path),
        rank=rank,
        anon_dir=where,
        layout=FileLayout(config.files_per_rank,
                          _core.DIRECT_ALIGN if config.o_direct else 64,
                          direct_min=_core.DIRECT_MIN_BYTES),
    )
    # Every file first: once an entry is placed it cannot be taken back, so a file that cannot
    # be made must be found before any is.
    try:
        for f in range(min(config.files_per_rank, len(caps))):
            fid = engine.open_file(job.engine_job, d.join(data_file_name(rank, f)), where)
            early.file_ids[f] = fid
            early.adopt_fd(f, engine.dup_fd(job.engine_job, fid))
    except CheckpointSaveError as e:
        early.close()  # the engine closes the files it made with the job; they have no name
        logger.info("no early flush for %s: %s", d.path, str(e))
        return None
    # Copy order, as write_data orders them: taken at the call first, then the queue.
    caps.sort(key=lambda c: (0 if c.at_call else 1, c.entry))
    layout, ids, placed = early.layout, early.file_ids, early.placed
    with gc_paused():  # per-item bookkeeping only, no waits (see dcp_datastates.runtime.gcpause)
        planned = []
        for cap in caps:
            tmpl = templates.get(cap.dtype, cap.shape)
            planned.append((cap, tmpl, *layout.place_tensor(tmpl)))
    # Room for every file before any byte is placed: the old checkpoint is still there, and
    # nothing may remove it for a save that will not fit (dcp_datastates.storage.room).
    no_room = reserve(
        [(d.join(data_file_name(rank, f)), fd, layout.sizes[f]) for f, fd in early.fds.items()],
        where,
    )
    if no_room is not None:
        early.close()  # the engine's unnamed files are empty: they vanish with the job
        job.no_room = no_room
        logger.info("no early flush for %s: %s", d.path, str(no_room.error))
        return None
    with gc_paused():
        for cap, tmpl, f, start, payload in planned:
            engine.place(job.engine_job, cap.entry, ids[f], payload, tmpl.prefix, tmpl.suffix)
            placed[cap.entry] = (f, start, payload)
    return early


__all__ = ["EarlyPlacement", "place_early"]
