"""References between checkpoints (incremental saves), for retention, overwrite and saving ranks.

Standard library only (used by :mod:`dcp_datastates.lifecycle.checkpoints` and
:mod:`dcp_datastates.format.commit`). An incremental checkpoint's manifests mark the items whose
bytes live in a sibling checkpoint with ``"ref": "<sibling name>"`` (docs/format.md). This module
answers "who references this directory" (:func:`referrers`), refuses to overwrite a referenced
checkpoint, and provides the *shared* marker lock a saving rank holds on the checkpoints it
references while it records the references.

The locking protocol (closes the race between a save referencing a checkpoint and a prune or
overwrite deleting it): a deletion or overwrite holds the directory's *exclusive* ``flock`` on
``.datastates.incomplete`` (``commit.lock_marker``) while it looks for referrers and deletes; a
saving rank holds the *shared* lock (:func:`lock_shared`) from validating the owner until its
manifest, which names the owner, is durable. Either the deletion sees the manifest and keeps the
owner, or the saving rank finds the owner gone and writes the bytes itself.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import time

from .manifest import ItemRecord

_METADATA = ".metadata"
_MARKER = ".datastates.incomplete"
_MANIFEST_RE = re.compile(r"^__datastates_manifest_(\d+)\.json$")
_LOCK_WAIT_S = 5.0


def stat_key(path: str) -> tuple[int, int, int, int] | None:
    """(device, inode, size, mtime_ns) of ``path`` (not followed if a link); None if missing."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class CheckpointReferencedError(RuntimeError):
    """A checkpoint that others reference (incremental saves) cannot be overwritten."""




def lock_shared(dir_path: str, timeout_s: float | None = None) -> int | None:
    """A shared ``flock`` on ``dir_path``'s marker (created if missing; never a symlink).

    Returns the descriptor (release with :func:`unlock`), or None when the directory is gone or
    an exclusive holder (a prune, cleanup or overwrite of it) kept it past ``timeout_s``.
    """
    marker = os.path.join(dir_path, _MARKER)
    deadline = time.monotonic() + (_LOCK_WAIT_S if timeout_s is None else timeout_s)
    while True:
        try:
            fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
            continue
        except OSError:  # no flock on this file system: the in-process checks only
            return fd
        # The lock counts only if it is on the file under the name now (a deletion may have
        # unlinked the marker between our open and our flock).
        now = stat_key(marker)
        fst = os.fstat(fd)
        if now is not None and now[:2] == (fst.st_dev, fst.st_ino):
            return fd
        os.close(fd)
        if not os.path.isdir(dir_path) or time.monotonic() >= deadline:
            return None


def unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------
# Referrers (retention and overwrite)
def referenced_owner_names(manifest_path: str) -> set[str]:
    """Names of the sibling checkpoints a manifest references (empty if none or unreadable)."""
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read()
    except OSError:
        return set()
    if b'"ref"' not in raw:  # cheap: manifests without references are not parsed
        return set()
    try:
        data = json.loads(raw)
    except ValueError:
        return set()
    items = data.get("items") if isinstance(data, dict) else None
    out: set[str] = set()
    for it in items if isinstance(items, list) else []:
        ref = it.get("ref") if isinstance(it, dict) else None
        if isinstance(ref, str):
            out.add(ref)
    return out


def referrers(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """The sibling directories (complete or partial) whose manifests reference ``checkpoint_dir``.

    Sorted names. Call it while holding the directory's exclusive lock (prune, overwrite) so
    that no save can add a reference meanwhile (savers hold the shared lock).
    """
    path = os.path.realpath(os.fspath(checkpoint_dir))
    parent, name = os.path.dirname(path), os.path.basename(path)
    out: list[str] = []
    try:
        with os.scandir(parent) as it:
            siblings = [e for e in it if e.name != name and e.is_dir(follow_symlinks=False)]
    except OSError:
        return out
    for sib in siblings:
        try:
            with os.scandir(sib.path) as it:
                mans = [e.path for e in it if _MANIFEST_RE.match(e.name)]
        except OSError:
            continue
        if any(name in referenced_owner_names(m) for m in mans):
            out.append(sib.name)
    return sorted(out)


def refuse_if_referenced(dir_path: str) -> None:
    """Raises CheckpointReferencedError if the complete checkpoint ``dir_path`` (about to be
    overwritten; its exclusive lock is held) is referenced by another checkpoint."""
    if not os.path.isfile(os.path.join(dir_path, _METADATA)):
        return
    refs = referrers(dir_path)
    if refs:
        shown = ", ".join(refs[:5]) + (f" and {len(refs) - 5} more" if len(refs) > 5 else "")
        raise CheckpointReferencedError(
            f"refusing to overwrite {dir_path}: the incremental checkpoint(s) {shown} beside it "
            "reference its data files, which an overwrite would delete. Save to a new "
            "checkpoint_id, or delete the referring checkpoint(s) first"
        )




def keep_reason(path: str | os.PathLike[str]) -> str | None:
    """For prune/cleanup (under the directory's exclusive lock): why it must be kept, or None."""
    refs = referrers(path)
    if not refs:
        return None
    return "referenced by " + ", ".join(refs) + " (incremental saves)"


def relative_path(item: ItemRecord) -> str:
    """The path ``.metadata`` records for an item (``../<owner>/<file>`` for a reference)."""
    return f"../{item.ref}/{item.file}" if item.ref is not None else item.file


def is_reference_path(rel: object) -> bool:
    """True for ``../<name>/<file>``: a reference into a sibling checkpoint (plain names only)."""
    if not isinstance(rel, str) or not rel.startswith("../"):
        return False
    parts = rel[3:].split("/")
    return len(parts) == 2 and all(
        p not in ("", ".", "..") and "\\" not in p and "\0" not in p for p in parts
    )


__all__ = [
    "CheckpointReferencedError",
    "keep_reason",
    "lock_shared",
    "referenced_owner_names",
    "referrers",
    "refuse_if_referenced",
    "stat_key",
    "unlock",
]
