"""Checkpoint roots on object stores (``s3://``) and other fsspec URLs: list, ``latest``, prune,
clean up.

The same layout and states as :mod:`dcp_datastates.lifecycle.checkpoints` (which manages local
roots): a root holds one "directory" (key prefix) per checkpoint named after its step (``step-100``,
``step_100``, ``100``) and an optional ``latest`` object naming one of them. A checkpoint is
*complete* iff ``.metadata`` exists (the writer stores it last, after every data file and manifest
is complete), *partial* if it holds the marker ``.datastates.incomplete`` and no ``.metadata``.
Functions return URLs (``root/name``), not paths.

What differs from local roots, and why:

* **No cross-process lock.** Object stores have no ``flock``; only saves of *this* process are
  known (their claims, :func:`dcp_datastates.format.commit.claimed_paths`) and always skipped. So
  :func:`cleanup_incomplete` requires ``min_age``: a partial checkpoint is removed only if nothing
  under it changed (objects stored, multipart uploads started) for ``min_age`` seconds. The
  marker is stored when a save starts, so a ``min_age`` longer than the longest save never
  removes a save in flight in another process. :func:`prune` deletes only complete checkpoints;
  do not prune a root while another process overwrites one of its checkpoints.
* **Deletion order.** Deleting a complete checkpoint stores the marker, then deletes
  ``.metadata``, then the other objects, then the marker: a crash midway leaves a partial
  checkpoint, never one that looks complete but lacks data. On S3, unfinished multipart uploads
  under a deleted checkpoint (left by a writer that died mid-upload) are aborted too.
* **``latest``** is one object written with one PUT, which S3 makes visible atomically.

Every call lists the store afresh (s3fs's listing cache is invalidated first).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..format.commit import claimed_paths, owner_record
from ..storage.s3 import abort_stale_uploads, is_s3, newest_upload_start, open_fs
from .checkpoints import (
    INCOMPLETE_MARKER,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointState,
    RetentionPolicy,
    parse_step,
)

__all__ = [
    "RemoteCheckpoint",
    "cleanup_incomplete",
    "latest_complete",
    "list_checkpoints",
    "prune",
    "update_latest",
]


@dataclass(frozen=True)
class RemoteCheckpoint:
    """One checkpoint under a remote root.

    Attributes:
        url: the checkpoint's URL (``root/name``), what ``dcp.load``'s checkpoint_id takes.
        step: the step parsed from its name.
        state: complete, partial or unknown.
        mtime: when ``.metadata`` was stored (complete), else the newest object's time, in
            seconds since the epoch (0.0 where the store reports no time).
    """

    url: str
    step: int
    state: CheckpointState
    mtime: float

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def complete(self) -> bool:
        return self.state is CheckpointState.COMPLETE

    @property
    def partial(self) -> bool:
        return self.state is CheckpointState.PARTIAL


class _Root:
    """A root URL with its file system; lists it afresh."""

    def __init__(self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None):
        self.url = os.fspath(root).rstrip("/")
        self.fs, path = open_fs(self.url, storage_options)  # s3: every request bounded
        self.path = path.rstrip("/")

    def join(self, *names: str) -> str:
        return "/".join([self.path, *names])

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def listing(self) -> dict[str, dict[str, dict[str, Any]]]:
        """{checkpoint name: {relative object name: info}} for every prefix under the root."""
        self.fs.invalidate_cache(self.path)
        try:
            found = self.fs.find(self.path, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, dict[str, Any]]] = {}
        base = self.path + "/"
        for full, info in found.items():
            full = full.rstrip("/")
            if not full.startswith(base):
                continue
            rel = full[len(base):]
            if "/" not in rel:
                continue  # an object directly under the root (latest, ...)
            name, sub = rel.split("/", 1)
            out.setdefault(name, {})[sub] = info
        return out


def _mtime(info: dict[str, Any]) -> float:
    for key in ("LastModified", "mtime", "last_modified", "created"):
        v = info.get(key)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return 0.0


def _state(objects: dict[str, dict[str, Any]]) -> CheckpointState:
    if METADATA_FILE in objects:
        return CheckpointState.COMPLETE
    if INCOMPLETE_MARKER in objects:
        return CheckpointState.PARTIAL
    return CheckpointState.UNKNOWN


def _infos(r: _Root) -> list[RemoteCheckpoint]:
    infos = []
    for name, objects in r.listing().items():
        step = parse_step(name)
        if step is None:
            continue
        state = _state(objects)
        if state is CheckpointState.COMPLETE:
            mtime = _mtime(objects[METADATA_FILE])
        else:
            mtime = max((_mtime(i) for i in objects.values()), default=0.0)
        infos.append(RemoteCheckpoint(url=r.url_of(name), step=step, state=state, mtime=mtime))
    infos.sort(key=lambda i: (i.step, i.name))
    return infos


def list_checkpoints(
    root: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> list[RemoteCheckpoint]:
    """The checkpoints under ``root`` (a URL), sorted by step; ``[]`` if there is nothing."""
    return _infos(_Root(root, storage_options))


def _read_latest(r: _Root) -> str | None:
    try:
        raw = r.fs.cat_file(r.join(LATEST_FILE))
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    ok = name not in ("", ".", "..") and "/" not in name and "\0" not in name
    return name if ok else None


def latest_complete(
    root: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> str | None:
    """The URL of the checkpoint to resume from, or None: the one ``latest`` names if it is
    complete, else the complete checkpoint with the highest step."""
    r = _Root(root, storage_options)
    infos = _infos(r)
    name = _read_latest(r)
    for info in infos:
        if info.name == name and info.complete:
            return info.url
    complete = [i for i in infos if i.complete]
    return complete[-1].url if complete else None


def update_latest(
    root: str | os.PathLike[str], name: str, *, storage_options: dict[str, Any] | None = None
) -> str:
    """Points ``root/latest`` at the complete checkpoint ``name`` (one PUT); returns its URL.

    Raises:
        ValueError: ``name`` is not a single path component, or not a complete checkpoint.
    """
    r = _Root(root, storage_options)
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"latest must name a checkpoint directly under {r.url}, got {name!r}")
    r.fs.invalidate_cache(r.join(name))
    if not r.fs.exists(r.join(name, METADATA_FILE)):
        raise ValueError(
            f"refusing to point latest at {r.url_of(name)}: not a complete checkpoint"
        )
    r.fs.pipe_file(r.join(LATEST_FILE), (name + "\n").encode())
    return r.url_of(LATEST_FILE)


def _busy_here(r: _Root, name: str) -> bool:
    """True if a save of this process writes to ``root/name`` now."""
    target = r.join(name).rstrip("/")
    for key in claimed_paths():
        try:
            if r.fs._strip_protocol(key).rstrip("/") == target:
                return True
        except Exception:  # noqa: BLE001 - a claim of another file system
            continue
    return False


def _excluded(r: _Root, exclude: Collection[str | os.PathLike[str]]) -> set[str]:
    out = set()
    for e in exclude:
        text = os.fspath(e).rstrip("/")
        out.add(text.rsplit("/", 1)[-1] if "/" in text else text)
    return out


def _delete(r: _Root, name: str, objects: dict[str, dict[str, Any]], complete: bool) -> None:
    """Deletes one checkpoint so that a crash midway leaves it partial (module docstring)."""
    fs = r.fs
    if complete:
        fs.pipe_file(r.join(name, INCOMPLETE_MARKER), owner_record("a checkpoint deletion"))
        fs.rm_file(r.join(name, METADATA_FILE))
    rest = [r.join(name, o) for o in objects if o not in (METADATA_FILE, INCOMPLETE_MARKER)]
    if rest:
        fs.rm(rest)
    if is_s3(fs):
        abort_stale_uploads(fs, r.join(name) + "/")
    try:
        fs.rm_file(r.join(name, INCOMPLETE_MARKER))
    except FileNotFoundError:
        pass
    fs.invalidate_cache(r.join(name))


def prune(
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    *,
    exclude: Collection[str | os.PathLike[str]] = (),
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Deletes the complete checkpoints that ``policy`` does not keep; returns their URLs.

    Never deletes a partial or unknown checkpoint, one listed in ``exclude`` (names or URLs),
    one a save of this process is writing, or the one :func:`latest_complete` returns.
    Raises OSError naming the checkpoint if a deletion fails.
    """
    if not isinstance(policy, RetentionPolicy):
        raise TypeError(f"policy must be a RetentionPolicy, got {type(policy).__name__}")
    if policy.keeps_everything:
        return []
    r = _Root(root, storage_options)
    skip = _excluded(r, exclude)
    listing = r.listing()
    complete = [
        i for i in _infos(r) if i.complete and i.name not in skip and not _busy_here(r, i.name)
    ]
    kept = policy.kept_steps(i.step for i in complete)
    latest = latest_complete(root, storage_options=storage_options)
    removed = []
    for info in complete:
        if info.step in kept or info.url == latest:
            continue
        try:
            _delete(r, info.name, listing.get(info.name, {}), complete=True)
        except OSError as e:
            raise OSError(f"deleting checkpoint {info.url} failed: {e}") from e
        removed.append(info.url)
    return removed


def cleanup_incomplete(
    root: str | os.PathLike[str],
    *,
    min_age: float,
    exclude: Collection[str | os.PathLike[str]] = (),
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Removes partial checkpoints under ``root`` untouched for ``min_age`` seconds; returns
    their URLs.

    ``min_age`` is required (no lock on object stores, see the module docstring): nothing under a
    removed checkpoint (objects, unfinished multipart uploads) changed for that long. Saves of
    this process and names in ``exclude`` are never removed; their unfinished uploads are
    aborted. Raises OSError naming the checkpoint if a deletion fails.
    """
    if min_age < 0:
        raise ValueError(f"min_age must be >= 0, got {min_age}")
    r = _Root(root, storage_options)
    skip = _excluded(r, exclude)
    listing = r.listing()
    now = time.time()
    removed = []
    for info in _infos(r):
        if not info.partial or info.name in skip or _busy_here(r, info.name):
            continue
        newest = info.mtime
        if is_s3(r.fs):
            started = newest_upload_start(r.fs, r.join(info.name) + "/")
            newest = max(newest, started or 0.0)
        if now - newest < min_age:
            continue
        try:
            _delete(r, info.name, listing.get(info.name, {}), complete=False)
        except OSError as e:
            raise OSError(f"removing partial checkpoint {info.url} failed: {e}") from e
        removed.append(info.url)
    return removed
