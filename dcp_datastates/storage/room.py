"""Room on disk: whether a save's data fits before the checkpoint it replaces is removed.

An overwrite removes the old checkpoint's files under the path claim, before the new data files
get their names (:mod:`dcp_datastates.format.commit`). Early placement
(:mod:`dcp_datastates.save.early`) writes the new data *before* that, beside the old checkpoint, so
on a nearly full disk it needs room for both. This module decides, before anything of the old
checkpoint is removed, whether the new data can fit:

* :func:`reserve` (early placement): allocates each unnamed data file to its final size
  (``fallocate``) before any byte of it is placed, so that the flush can no longer run out of
  space; a file larger than the process may write (``RLIMIT_FSIZE``) is refused the same way.
  Where free space is ample (at least twice the bytes plus :data:`AMPLE_SLACK_BYTES`) nothing is
  allocated: ``fallocate`` is cheap on ext4 and xfs but zero-fills memory on tmpfs (0.9 s per GiB).
  When it fails, the caller drops the early placement (the save places everything after the
  removal instead, as ``early_flush=False`` does) and keeps the :class:`NoRoom` it returns.
* :func:`check_replace` (before the removal, on every rank and again under the claim): refuses a
  save that cannot fit even once the old checkpoint's files are gone (a file over
  ``RLIMIT_FSIZE``; free space plus the old files' blocks below what the new data needs), with an
  OSError naming the path: the old checkpoint is left as it was.

Limits: the free-space figure is the file system's at the time of the check; another writer may
take it before the save writes (only a successful :func:`reserve` guarantees room). A file system
without ``fallocate`` gets no reservation, only the checks. Standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger("dcp_datastates.save.writer")

#: Free space beyond twice a save's bytes above which nothing is reserved (see the docstring).
AMPLE_SLACK_BYTES = 256 << 20

# errnos of fallocate that mean "not supported here", not "no room"
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV}
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@dataclass(frozen=True)
class NoRoom:
    """A reservation that failed: the error (naming the file) and the bytes the files need."""

    error: OSError
    needed_bytes: int


def file_size_limit() -> int | None:
    """The largest file this process may write (``RLIMIT_FSIZE``), or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged process may still allocate on the file system holding ``path`` (or
    its nearest existing parent); None if unknown."""
    p = os.path.abspath(path)
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return int(st.f_bavail) * int(st.f_frsize)


_Fallocate = Callable[[int, int, int, int], int]


def _libc_fallocate() -> _Fallocate | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_FALLOCATE = _libc_fallocate()


def allocate(fd: int, nbytes: int) -> None:
    """Allocates ``fd``'s first ``nbytes`` (``fallocate`` mode 0: the size grows to
    ``nbytes``, the blocks read as zeros). Raises OSError; ``EOPNOTSUPP`` where unsupported.
    Unlike ``os.posix_fallocate`` it never falls back to writing zeros."""
    if _FALLOCATE is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available")
    while _FALLOCATE(fd, 0, 0, nbytes) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))


def reserve(files: Sequence[tuple[str, int, int]], where: str) -> NoRoom | None:
    """Makes room for ``files`` (path, descriptor, final size), all empty, before any is
    written; returns None when they fit (or where this cannot be known: no ``fallocate``),
    else a :class:`NoRoom` naming the first file that does not fit, with every file truncated
    back to empty (what was allocated is freed). ``where``: a directory on their file system."""
    needed = sum(size for _, _, size in files)
    limit = file_size_limit()
    for path, _, size in files:
        if limit is not None and size > limit:
            err = OSError(
                errno.EFBIG,
                f"{size} bytes exceed this process's file size limit (RLIMIT_FSIZE) of {limit}",
                path,
            )
            return NoRoom(err, needed)
    free = free_bytes(where)
    if free is not None and free >= 2 * needed + AMPLE_SLACK_BYTES:
        return None
    for path, fd, size in files:
        if size == 0:
            continue
        try:
            allocate(fd, size)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                logger.debug("no space reservation for %s: %s", path, e.strerror)
                return None
            for _, fd2, _ in files:
                try:
                    os.ftruncate(fd2, 0)
                except OSError:
                    pass
            code = e.errno if e.errno in _NO_ROOM else errno.ENOSPC
            return NoRoom(OSError(code, f"cannot reserve {size} bytes ({e.strerror})", path),
                          needed)
    return None


def _replaced_bytes(directory: str, is_replaced: Callable[[str], bool]) -> int:
    """Bytes allocated to the files in ``directory`` that the overwrite removes."""
    total = 0
    try:
        with os.scandir(directory) as it:
            for e in it:
                if is_replaced(e.name):
                    try:
                        total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        continue
    except OSError:
        return 0
    return total


def check_replace(
    directory: str, no_room: NoRoom, is_replaced: Callable[[str], bool]
) -> None:
    """Raises OSError naming ``directory`` when data that ``no_room`` says does not fit beside
    the checkpoint in ``directory`` cannot fit once that checkpoint's files (the names
    ``is_replaced`` accepts) are removed either; returns when it may. Nothing is removed here."""
    err = no_room.error
    if err.errno == errno.EFBIG:
        raise OSError(
            errno.EFBIG,
            f"the save to {directory} cannot be written ({err.filename}: {err.strerror}); "
            "the checkpoint there was left as it was",
            directory,
        )
    free = free_bytes(directory)
    if free is None:
        return  # unknown: removing the old files is the only way it may fit
    old = _replaced_bytes(directory, is_replaced)
    if free + old < no_room.needed_bytes:
        raise OSError(
            errno.ENOSPC,
            f"not enough space for the save to {directory}: it needs {no_room.needed_bytes} "
            f"bytes, {free} are free and the checkpoint it replaces holds {old} "
            f"({err.filename}: {err.strerror}); the checkpoint there was left as it was",
            directory,
        )
    logger.info(
        "%s: no room for the new data beside the checkpoint it replaces (%s); its files are "
        "removed first to make room", directory, err.strerror,
    )


__all__ = ["AMPLE_SLACK_BYTES", "NoRoom", "allocate", "check_replace", "file_size_limit",
           "free_bytes", "reserve"]
