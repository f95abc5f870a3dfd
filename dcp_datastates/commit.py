"""The commit protocol: what makes a directory a checkpoint, and what marks one in progress.

Order of one save (docs/architecture.md, "Commit"):

1. the coordinator claims the path (in-process registry: a second concurrent save to the same
   path fails with CheckpointBusyError), removes a stale ``.metadata`` (so an overwrite that
   crashes midway never looks complete) and creates the marker ``.datastates.incomplete``;
2. every rank writes and fdatasyncs its data files, then its manifest (checksums);
3. the coordinator writes ``.metadata`` to a temporary file, fsyncs it, renames it into place and
   fsyncs the directory: the commit point. Then it removes the marker.

A directory is a checkpoint iff it holds ``.metadata``; one holding the marker and no
``.metadata`` is partial (``dcp_datastates.checkpoints.cleanup_incomplete`` removes those).
"""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any

import fsspec

from .errors import CheckpointBusyError

METADATA_FILE = ".metadata"
INCOMPLETE_MARKER = ".datastates.incomplete"
MANIFEST_PREFIX = "__datastates_manifest_"

_active_lock = threading.Lock()
_active_paths: set[str] = set()  # a directory is a process-wide resource, hence process-wide


def manifest_name(rank: int) -> str:
    return f"{MANIFEST_PREFIX}{rank}.json"


def claim_path(key: str) -> None:
    """Marks ``key`` as being saved to; raises CheckpointBusyError if it already is."""
    with _active_lock:
        if key in _active_paths:
            raise CheckpointBusyError(
                f"another save to {key} is still in progress; wait for it (future.result()) or "
                "save to a different checkpoint_id"
            )
        _active_paths.add(key)


def release_path(key: str) -> None:
    with _active_lock:
        _active_paths.discard(key)


def fsync_dir(path: str) -> None:
    """fsyncs a local directory so that renames and creations in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDir:
    """File operations on one checkpoint directory, local (native path) or through fsspec."""

    def __init__(self, path: str) -> None:
        self.url = path
        self.fs, self.path = fsspec.core.url_to_fs(path)
        self.local = "file" in _protocols(self.fs)

    def join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def prepare(self, durable: bool) -> None:
        """Step 1 (coordinator): directory, stale commit removed, in-progress marker."""
        self.fs.makedirs(self.path, exist_ok=True)
        meta = self.join(METADATA_FILE)
        if self.fs.exists(meta):
            self.fs.rm_file(meta)
        # The marker is created in place (its presence is all that matters), not renamed in.
        marker = self.join(INCOMPLETE_MARKER)
        if self.local:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, str(os.getpid()).encode())
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if durable:
                fsync_dir(self.path)
        else:
            with self.fs.open(marker, "wb") as f:
                f.write(str(os.getpid()).encode())

    def ensure_exists(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def write_atomic(self, name: str, data: bytes, durable: bool) -> None:
        """Writes ``name`` via a temporary file, fsync and rename (then fsyncs the directory)."""
        final = self.join(name)
        tmp = self.join(f"{name}.tmp")
        if self.local:
            with open(tmp, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if durable:
                fsync_dir(self.path)
        else:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            if self.fs.exists(final):
                self.fs.rm_file(final)
            self.fs.mv(tmp, final)

    def commit(self, metadata: Any, durable: bool) -> None:
        """Step 3 (coordinator): ``.metadata`` last, atomically; then the marker goes."""
        self.write_atomic(METADATA_FILE, pickle.dumps(metadata), durable)
        marker = self.join(INCOMPLETE_MARKER)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        if durable and self.local:
            fsync_dir(self.path)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
