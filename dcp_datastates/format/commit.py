"""The commit protocol: what makes a directory a checkpoint, who may write it, what marks it busy.

Order of one save (docs/architecture.md, "Commit" and "Failure model"):

1. the coordinator claims the path (:func:`claim_and_prepare`): an in-process registry (a second
   save to the same path from this process fails with CheckpointBusyError) *and*, for local
   paths, an exclusive ``flock`` on the marker ``.datastates.incomplete`` (a save from another
   process fails the same way). It then removes a stale ``.metadata`` (durably, so an overwrite
   that crashes midway never looks complete) and the data files and manifests of the checkpoint
   being overwritten, all before any rank writes (a single-rank save placed early defers this
   removal until its own data is durable: dcp_datastates.save.early);
2. every rank writes and fdatasyncs its data files, then its manifest (checksums);
3. the coordinator writes ``.metadata`` to a temporary file, fsyncs it, renames it into place and
   fsyncs the directory: the commit point. Then it removes the marker and releases the claim.

A directory is a checkpoint iff it holds ``.metadata``; one holding the marker and no
``.metadata`` is partial (``dcp_datastates.lifecycle.checkpoints.cleanup_incomplete`` removes those
whose marker is not locked by a live process).

The lock: the kernel drops an ``flock`` when the process holding it dies, so a lock left by a
crashed writer is recovered automatically (no pid guessing), and a live writer's lock is never
stolen. The marker holds a JSON record (pid, host, process start time, what holds it) for the
busy error's message only. Locks are per open file description: a child forked while a save is
in flight shares the parent's lock until the parent releases it (``flock(LOCK_UN)`` releases it
for both); a child that outlives a dead parent keeps the directory locked until it exits. Non-local
fsspec URLs (object stores) have no such lock: only the in-process check applies to them. On a
local file system without ``flock`` support the lock degrades to the in-process check with a
warning logged.

Every file the writer creates under its own names (marker, temporary files, data files) is opened
with ``O_NOFOLLOW``: a symlink planted under one of those names is never followed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CheckpointBusyError
from ..runtime.gcpause import gc_paused
from ..storage.s3 import open_fs
from .refs import refuse_if_referenced

logger = logging.getLogger(__name__)

METADATA_FILE = ".metadata"
INCOMPLETE_MARKER = ".datastates.incomplete"
MANIFEST_PREFIX = "__datastates_manifest_"

# Names the writer owns inside a checkpoint directory (removed when a checkpoint is overwritten).
_DATA_FILE_RE = re.compile(
    # data files (an incremental writer's carry the save's tag), safetensors format
    r"^(?:__\d+_\d+(?:\.[0-9a-f]+)?\.distcp|shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors)$"
)
_MANIFEST_RE = re.compile(r"^__datastates_manifest_\d+\.json$")
# (the pid.thread suffix: temporary names of the persistent tier's copies,
# dcp_datastates.lifecycle.tiers)
_OWNED_TMP_RE = re.compile(r"^(?:\.metadata|__datastates_manifest_\d+\.json)(?:\.\d+\.\d+)?\.tmp$")

_LOCK_ATTEMPTS = 16

_active_lock = threading.Lock()
_released = threading.Condition(_active_lock)  # notified whenever a claim is released
# A directory is a process-wide resource, hence process-wide: claim key -> the holder's "ended"
# probe (True once its save's caller was told the save ended), or None.
_active_paths: dict[str, Callable[[], bool] | None] = {}
# How long a save waits for the claim of a save that already ended (see claim_path).
ENDED_RELEASE_WAIT_S = 10.0
_held_fds: dict[str, int] = {}  # claim key -> the flock'ed marker descriptor


def manifest_name(rank: int) -> str:
    return f"{MANIFEST_PREFIX}{rank}.json"


def is_owned_name(name: str) -> bool:
    """True for the file names the writer creates in a checkpoint directory (not the marker)."""
    return bool(
        name == METADATA_FILE
        or _DATA_FILE_RE.match(name)
        or _MANIFEST_RE.match(name)
        or _OWNED_TMP_RE.match(name)
    )


def claim_path(key: str, ended: Callable[[], bool] | None = None) -> None:
    """Marks ``key`` as being saved to in this process; raises CheckpointBusyError if it is.

    ``ended``: a probe of the claiming save, True once its caller was told that it ended (its
    future is done). A save's future completes before the save's thread lets go of the claim
    (the release runs as that thread ends), so a caller retrying at once after a failed
    ``async_save`` could find the path still claimed by a save it was told had ended. A claim
    whose holder has ended is therefore waited for, up to ``ENDED_RELEASE_WAIT_S``; a claim of
    a save still in flight is refused at once.
    """
    deadline: float | None = None
    with _released:
        while key in _active_paths:
            holder_ended = _active_paths[key]
            if holder_ended is None or not _probe(holder_ended):
                raise CheckpointBusyError(
                    f"another save to {key} is still in progress in this process; wait for it "
                    "(future.result()) or save to a different checkpoint_id"
                )
            if deadline is None:
                deadline = time.monotonic() + ENDED_RELEASE_WAIT_S
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointBusyError(
                    f"an earlier save to {key} ended but still holds the path after "
                    f"{ENDED_RELEASE_WAIT_S:.0f} s (its save thread has not finished); save to a "
                    "different checkpoint_id"
                )
            _released.wait(left)
        _active_paths[key] = ended


def _probe(ended: Callable[[], bool]) -> bool:
    try:
        return bool(ended())
    except Exception:  # noqa: BLE001 - a broken probe means "not known to have ended"
        return False


def claimed_paths() -> set[str]:
    """The claim keys of the saves in flight in this process (real paths, or URLs)."""
    with _active_lock:
        return set(_active_paths)


def release_path(key: str, untouched: CheckpointDir | None = None) -> None:
    """Releases the claim on ``key``: the in-process mark and the cross-process lock (if any).

    Idempotent. The marker file stays unless the commit removed it: a save that failed leaves a
    partial directory, which cleanup may remove once the lock is gone. ``untouched``: the
    directory, when the save removed and wrote nothing there (its old checkpoint's removal was
    deferred and never ran); its marker goes too if it still holds a complete checkpoint.
    """
    with _active_lock:
        fd = _held_fds.pop(key, None)
    if fd is not None:
        if untouched is not None and untouched.local:
            try:
                if os.path.isfile(untouched.join(METADATA_FILE)):
                    os.unlink(untouched.join(INCOMPLETE_MARKER))  # still locked: ours
            except OSError:
                pass  # a stale marker beside .metadata is harmless (the directory is complete)
        unlock_marker(fd)
    # Last: a save of this process waiting for the claim (claim_path) then finds the marker free.
    with _released:
        _active_paths.pop(key, None)
        _released.notify_all()


def check_claim(key: str, d: CheckpointDir) -> None:
    """Raises FileNotFoundError naming ``d``'s marker if the directory or the marker this
    process's claim on ``key`` locks was removed (or replaced) since it was claimed: a save then
    must not recreate the directory and commit into it. Local claims only."""
    with _active_lock:
        fd = _held_fds.get(key)
    if fd is None or not d.local:
        return
    marker = d.join(INCOMPLETE_MARKER)
    try:
        st: os.stat_result | None = os.stat(marker, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    fst = os.fstat(fd)
    if st is None or (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
        raise FileNotFoundError(
            errno.ENOENT, "the checkpoint directory or its lock marker was removed during the save",
            marker,
        )


# ------------------------------------------------------------------------------------------------
# The cross-process lock (standard library only: checkpoints.py uses it too)
def _proc_start_token(pid: int) -> str | None:
    """The process start time in clock ticks since boot (/proc), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_record(purpose: str) -> bytes:
    """The JSON record a lock holder writes into the marker (for error messages only)."""
    pid = os.getpid()
    return json.dumps(
        {
            "pid": pid,
            "host": socket.gethostname(),
            "start": _proc_start_token(pid),
            "since": time.time(),
            "purpose": purpose,
        }
    ).encode()


def describe_holder(marker: str) -> str:
    """A human-readable description of who last locked ``marker`` (best effort)."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        rec = json.loads(raw.decode())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(rec["since"])))
        what = rec.get("purpose", "a save")
        return f"{what} by pid {rec['pid']} on host {rec['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def lock_marker(dir_path: str, *, create: bool, purpose: str) -> int | None:
    """Opens ``dir_path/.datastates.incomplete`` and locks it exclusively, without blocking.

    Returns the locked descriptor (the caller must pass it to :func:`unlock_marker`), or None when
    a live process holds the lock. With ``create`` the marker is created if missing, and a symlink
    planted under its name is removed (never followed). Raises FileNotFoundError if the directory
    (or, without ``create``, the marker) does not exist or vanishes meanwhile.

    Failure semantics: if the owner record cannot be written into the locked marker (``ENOSPC``,
    ``EIO``...), the lock is released and the descriptor closed before the error is raised (an
    OSError naming the marker's path), and a marker this call created is removed again: nothing
    stays locked, so a later save or cleanup of the directory proceeds.
    """
    marker = os.path.join(dir_path, INCOMPLETE_MARKER)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_LOCK_ATTEMPTS):
        created = False
        try:
            try:
                fd = os.open(marker, flags)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    fd = os.open(marker, flags | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    continue  # made by someone else meanwhile (or a symlink): open it again
                created = True
        except OSError as e:
            if e.errno == errno.ELOOP and create:
                os.unlink(marker)  # a symlink under our name: remove the link, not its target
                continue
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:  # ENOLCK/EOPNOTSUPP: the file system has no flock
            logger.warning("no file lock on %s (%s): only in-process exclusion", marker, str(e))
        # The marker may have been removed (and recreated) between open and flock: the lock
        # only counts if it is on the file that is under the name now.
        try:
            st = os.stat(marker, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        fst = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
            _write_owner_record(fd, marker, purpose, created)
            return fd
        os.close(fd)
        if not create:
            raise FileNotFoundError(errno.ENOENT, "marker removed while locking it", marker)
    raise OSError(errno.EAGAIN, "the marker kept changing while locking it", marker)


def _write_owner_record(fd: int, marker: str, purpose: str, created: bool) -> None:
    """Writes the owner record into the marker ``fd`` locks; on failure removes the marker if
    ``created`` (this process made it, under the lock: nobody else has used it), releases the
    lock, closes ``fd`` and raises OSError naming ``marker``."""
    record = owner_record(purpose)
    try:
        os.ftruncate(fd, 0)
        done = 0
        while done < len(record):
            n = os.pwrite(fd, record[done:], done)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n
    except OSError as e:
        if created:
            try:
                os.unlink(marker)  # still ours: we hold its lock and checked its inode
            except OSError:
                pass
        unlock_marker(fd)
        code = e.errno if e.errno is not None else errno.EIO
        raise OSError(
            code, f"cannot write the lock marker ({e.strerror or e}); nothing was locked", marker
        ) from e


def unlock_marker(fd: int) -> None:
    """Releases a lock taken by :func:`lock_marker` (for forked children too) and closes it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsyncs a local directory so that renames and creations in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def claim_and_prepare(
    d: CheckpointDir,
    durable: bool,
    before_prepare: Callable[[], None] | None = None,
    remove_old: bool = True,
    ended: Callable[[], bool] | None = None,
) -> str:
    """Step 1 (coordinator): claims ``d`` for one save and prepares it; returns the claim key.

    Raises CheckpointBusyError if another save to ``d`` is in flight in this process or (local
    paths) in any process on this host or sharing this file system's locks. Pass the key to
    :func:`release_path` when the save ends, committed or not. ``before_prepare`` runs under the
    claim, right before the overwritten checkpoint's files are removed: if it raises, nothing is
    removed and the claim is released. Without ``remove_old`` the caller removes them later
    (:meth:`CheckpointDir.prepare`, under this claim, before it names any file of its own).
    ``ended``: the probe of this save :func:`claim_path` keeps (a later save waits for the
    claim of a save whose caller was told it ended).
    """
    key = d.claim_key
    claim_path(key, ended)
    try:
        if d.local:
            fd: int | None = None
            for _ in range(_LOCK_ATTEMPTS):
                os.makedirs(d.path, exist_ok=True)
                try:
                    fd = lock_marker(d.path, create=True, purpose="a save")
                except FileNotFoundError:
                    continue  # a concurrent cleanup removed the empty directory: make it again
                if fd is None:
                    holder = describe_holder(d.join(INCOMPLETE_MARKER))
                    raise CheckpointBusyError(
                        f"{d.path} is locked by {holder}: another save to it (or a cleanup of it)"
                        " is in progress; wait for it or save to a different checkpoint_id"
                    )
                break
            if fd is None:
                raise OSError(errno.ENOENT, "checkpoint directory keeps vanishing", d.path)
            with _active_lock:
                _held_fds[key] = fd
            refuse_if_referenced(d.path)  # incremental saves: others may need its data files
        if before_prepare is not None:
            before_prepare()
        if remove_old:
            d.prepare(durable)
    except BaseException:
        release_path(key)
        raise
    return key


class CheckpointDir:
    """File operations on one checkpoint directory, local (native path) or through fsspec."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = path
        self.fs, self.path = open_fs(path, storage_options)  # s3: every request bounded
        self.local = "file" in _protocols(self.fs)

    @property
    def claim_key(self) -> str:
        """The key a save claims: the real path for local directories, else the URL."""
        return os.path.realpath(self.path) if self.local else self.url

    def join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def prepare(self, durable: bool) -> None:
        """Removes the checkpoint being overwritten: ``.metadata`` first, then its other files.

        Run by the coordinator under the claim, before any rank writes. ``.metadata`` goes first
        and durably, so a crash midway leaves a partial directory, never a complete-looking one
        missing files. Data files, manifests and temporary files of the old checkpoint (another
        world size may have written more of them) are removed; other files are left alone.
        For non-local URLs the marker is written here (local ones hold it locked already).
        """
        if not self.local:
            try:
                self._prepare_remote()
            except OSError as e:  # a request's error names an object, or only the endpoint
                msg = f"preparing checkpoint {self.url}: {e}"
                raise (OSError(e.errno, msg) if e.errno is not None else OSError(msg)) from e
            return
        self.fs.makedirs(self.path, exist_ok=True)
        try:
            os.unlink(self.join(METADATA_FILE))
            if durable:
                fsync_dir(self.path)
        except FileNotFoundError:
            pass
        with os.scandir(self.path) as it:
            stale = [e.name for e in it if is_owned_name(e.name)]
        for name in stale:
            try:
                os.unlink(self.join(name))
            except FileNotFoundError:
                pass
        if durable and stale:  # nothing removed (a new directory): nothing to make durable
            fsync_dir(self.path)

    def _prepare_remote(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)
        meta = self.join(METADATA_FILE)
        self.fs.invalidate_cache(self.path)  # object stores: list what is there now
        if self.fs.exists(meta):
            self.fs.rm_file(meta)
        try:
            listed = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:  # object stores: a prefix exists only once it holds objects
            listed = []
        for p in listed:
            if is_owned_name(p.rstrip("/").rsplit("/", 1)[-1]):
                self.fs.rm_file(p)
        with self.fs.open(self.join(INCOMPLETE_MARKER), "wb") as f:
            f.write(owner_record("a save"))

    def ensure_exists(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def write_atomic(self, name: str, data: bytes | Iterable[bytes], durable: bool) -> None:
        """Writes ``name`` via a temporary file, fsync and rename (then fsyncs the directory).

        ``data`` may be an iterable of pieces (a manifest encoded as it is written).

        The temporary file is created afresh with ``O_EXCL | O_NOFOLLOW`` (a file or symlink
        left under its name is removed first, never followed). Raises OSError naming ``name``'s
        full path (ENOSPC, EIO...); the temporary file is removed on failure.
        """
        final = self.join(name)
        tmp = self.join(f"{name}.tmp")
        try:
            if self.local:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                fd = os.open(
                    tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
                )
                try:
                    with os.fdopen(fd, "wb") as f:
                        _write_all(f, data)
                        if durable:
                            f.flush()
                            os.fsync(f.fileno())
                    os.replace(tmp, final)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
                if durable:
                    fsync_dir(self.path)
            else:
                with self.fs.open(tmp, "wb") as f:
                    _write_all(f, data)
                if self.fs.exists(final):
                    self.fs.rm_file(final)
                self.fs.mv(tmp, final)
        except OSError as e:
            if e.errno is None:
                raise OSError(f"cannot write {final}: {e}") from e
            raise OSError(e.errno, f"{e.strerror} (writing {name} atomically)", final) from e

    def commit(self, metadata: Any, durable: bool, blob: bytes | None = None) -> None:
        """Step 3 (coordinator): ``.metadata`` last, atomically; then the marker goes.

        ``blob``: ``metadata`` pickled already (by the caller, while the data was flushing).
        The caller still holds the claim; it releases it (:func:`release_path`) afterwards.
        """
        if blob is None:
            with gc_paused():  # pickling creates an object per item (runtime/gcpause.py)
                blob = pickle.dumps(metadata)
        self.write_atomic(METADATA_FILE, blob, durable)
        marker = self.join(INCOMPLETE_MARKER)
        if self.local:
            try:
                os.unlink(marker)
            except FileNotFoundError:
                pass
            if durable:
                fsync_dir(self.path)
        elif self.fs.exists(marker):
            self.fs.rm_file(marker)


def _write_all(f: Any, data: bytes | Iterable[bytes]) -> None:
    if isinstance(data, (bytes, bytearray, memoryview)):
        f.write(data)
        return
    for piece in data:
        f.write(piece)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
