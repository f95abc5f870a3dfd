"""Checkpoint-directory management: find, point at, clean up and prune checkpoints.

A *checkpoint root* is a directory holding one subdirectory per checkpoint, named after
the training step (``step-100``, ``step_100`` or plain ``100``), plus an optional
``latest`` pointer file whose content is the name of one of those subdirectories::

    checkpoints/
        latest                 # "step-300\\n"
        step-100/.metadata ...
        step-200/.metadata ...
        step-300/.metadata ...
        step-400/.datastates.incomplete ...   # a save that never committed

States of a checkpoint directory:

- *complete*: it contains ``.metadata``. DCP writes that file last, at the commit
  point (``StorageWriter.finish`` on the coordinator; our writer writes it atomically),
  so its presence is what makes a directory loadable by ``dcp.load``.
- *partial*: it contains the marker ``.datastates.incomplete`` and no ``.metadata``.
  ``DataStatesWriter`` creates the marker when a save starts and removes it after the
  commit, so a partial directory is a save that is still in flight or one that died.
- *unknown*: neither file (an empty directory, or a save by a writer that does not
  write the marker, such as ``FileSystemWriter``). These are never deleted here.

Only subdirectories whose names parse as a step number are listed, cleaned up or
pruned; anything else in the root (``logs/``, ``latest``, temp files, symlinks) is left
alone. Deleting functions take an ``exclude`` collection for saves that are in flight:
a process that has no save in flight can pass nothing, but a process that may have
several writers (or other jobs) writing into the same root must list them.

Deleting a complete checkpoint is crash-safe: the marker is created first, then
``.metadata`` is removed (and the removal made durable) before any data file, and the
marker goes last. A crash midway therefore leaves a *partial* directory, which
:func:`cleanup_incomplete` removes later, never one that looks complete but lacks files.

Concurrency: a save holds an exclusive ``flock`` on its directory's marker from its claim
to its commit (``dcp_datastates.format.commit``). Cleanup and prune take the same lock before
deleting anything and skip a directory whose lock is held, so they never delete a save in
flight in any process, even one not listed in ``exclude``; the kernel drops the lock of a
writer that died, so its partial directory becomes removable at once. Several processes
may run cleanup/prune on one root at the same time: files and directories vanishing
underneath are expected and skipped.

Roots are local paths or ``file://`` URLs. This module uses only the standard library, the
lock helpers of :mod:`dcp_datastates.format.commit` and the reference scan of
:mod:`dcp_datastates.format.refs` (no torch), so job launchers and cron jobs can use it cheaply.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import re
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..format.commit import lock_marker, unlock_marker
from ..format.refs import keep_reason

logger = logging.getLogger(__name__)

__all__ = [
    "INCOMPLETE_MARKER",
    "LATEST_FILE",
    "METADATA_FILE",
    "CheckpointInfo",
    "CheckpointState",
    "RetentionPolicy",
    "cleanup_incomplete",
    "latest_complete",
    "list_checkpoints",
    "local_root",
    "parse_step",
    "prune",
    "update_latest",
]

METADATA_FILE = ".metadata"
"""DCP's commit file: a checkpoint directory is complete iff it contains this file."""

INCOMPLETE_MARKER = ".datastates.incomplete"
"""Created by the writer when a save starts, removed after the commit."""

LATEST_FILE = "latest"
"""Pointer file in the checkpoint root naming the newest committed checkpoint."""

_STEP_RE = re.compile(r"^(?:step[-_])?(\d+)$")

PathLike = str | os.PathLike[str]


class CheckpointState(enum.Enum):
    """What a checkpoint directory holds (see the module docstring)."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint subdirectory of a checkpoint root.

    Attributes:
        path: the directory.
        step: the training step parsed from the directory name.
        state: complete, partial or unknown.
        mtime: modification time (seconds since the epoch) of ``.metadata`` for a
            complete checkpoint (its commit time), else of the directory itself.
    """

    path: Path
    step: int
    state: CheckpointState
    mtime: float

    @property
    def name(self) -> str:
        """The directory name (what the ``latest`` file holds)."""
        return self.path.name

    @property
    def complete(self) -> bool:
        """True if ``.metadata`` exists (loadable with ``dcp.load``)."""
        return self.state is CheckpointState.COMPLETE

    @property
    def partial(self) -> bool:
        """True if the incomplete marker exists and ``.metadata`` does not."""
        return self.state is CheckpointState.PARTIAL


@dataclass(frozen=True)
class RetentionPolicy:
    """Which complete checkpoints :func:`prune` keeps.

    A checkpoint is kept if it is one of the newest ``keep_last`` complete checkpoints
    (by step) **or** its step is a multiple of ``keep_every``. ``None`` disables a rule;
    with both ``None`` (the default) the policy keeps everything.

    Raises:
        TypeError: a value is not an int (bools are rejected too).
        ValueError: a value is not positive.
    """

    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        for field_name in ("keep_last", "keep_every"):
            value = getattr(self, field_name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"RetentionPolicy.{field_name} must be a positive int or None, got {value!r}"
                )
            if value < 1:
                raise ValueError(
                    f"RetentionPolicy.{field_name} must be a positive int or None, got {value}"
                )

    @property
    def keeps_everything(self) -> bool:
        """True when no rule is set, so nothing would ever be pruned."""
        return self.keep_last is None and self.keep_every is None

    def kept_steps(self, steps: Iterable[int]) -> set[int]:
        """Return the subset of ``steps`` (of complete checkpoints) that the policy keeps."""
        unique = sorted(set(steps))
        if self.keeps_everything:
            return set(unique)
        kept: set[int] = set()
        if self.keep_last is not None:
            kept.update(unique[-self.keep_last :])
        if self.keep_every is not None:
            kept.update(s for s in unique if s % self.keep_every == 0)
        return kept


def parse_step(name: str) -> int | None:
    """Parse the step number from a checkpoint directory name.

    Accepts ``step-100``, ``step_100`` and ``100``; returns ``None`` for anything else.
    """
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def local_root(root: PathLike) -> Path:
    """``root`` as a local path: a path, or a ``file://`` URL.

    Raises:
        ValueError: ``root`` is a URL of another file system (object stores are not managed
            here: list and delete checkpoints there with the store's own tools).
    """
    text = os.fspath(root)
    if "://" not in text:
        return Path(text)
    url = urllib.parse.urlsplit(text)
    if url.scheme in ("file", "local") and url.netloc in ("", "localhost"):
        return Path(urllib.parse.unquote(url.path))
    raise ValueError(
        f"{text}: only local paths and file:// URLs are supported by "
        "dcp_datastates.lifecycle.checkpoints (object stores and other fsspec URLs: "
        "dcp_datastates.lifecycle.remote)"
    )


def _state_of(path: Path) -> CheckpointState:
    if (path / METADATA_FILE).is_file():
        return CheckpointState.COMPLETE
    if os.path.lexists(path / INCOMPLETE_MARKER):  # a link (even dangling) marks it too
        return CheckpointState.PARTIAL
    # A save killed between creating the directory and its marker leaves it empty (or holding
    # only the marker's temporary file): nothing a checkpoint needs, so it is partial too.
    try:
        names = {p.name for p in path.iterdir()}
    except OSError:
        return CheckpointState.UNKNOWN
    if names <= {f"{INCOMPLETE_MARKER}.tmp"}:
        return CheckpointState.PARTIAL
    return CheckpointState.UNKNOWN


def _check_root(root: Path) -> bool:
    """Return False if ``root`` does not exist; raise if it is not a directory."""
    if not root.exists():
        return False
    if not root.is_dir():
        raise NotADirectoryError(f"checkpoint root is not a directory: {root}")
    return True


def list_checkpoints(root: PathLike) -> list[CheckpointInfo]:
    """List the checkpoint subdirectories of ``root``, sorted by step (then name).

    Only real (non-symlink) subdirectories whose names parse with :func:`parse_step`
    are listed. A root that does not exist has no checkpoints (returns ``[]``).

    Raises:
        NotADirectoryError: ``root`` exists but is not a directory.
    """
    root_path = local_root(root)
    if not _check_root(root_path):
        return []
    infos: list[CheckpointInfo] = []
    with os.scandir(root_path) as entries:
        dirs = [e for e in entries if not e.is_symlink() and e.is_dir(follow_symlinks=False)]
    for entry in dirs:
        step = parse_step(entry.name)
        if step is None:
            continue
        path = Path(entry.path)
        try:
            state = _state_of(path)
            stat_path = path / METADATA_FILE if state is CheckpointState.COMPLETE else path
            mtime = stat_path.stat().st_mtime
        except FileNotFoundError:
            continue  # removed while we were listing
        infos.append(CheckpointInfo(path=path, step=step, state=state, mtime=mtime))
    infos.sort(key=lambda info: (info.step, info.name))
    return infos


def _valid_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
        and "\0" not in name
    )


def _read_latest(root: Path) -> str | None:
    try:
        text = (root / LATEST_FILE).read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, UnicodeDecodeError):
        return None
    name = text.strip()
    return name if _valid_name(name) else None


def latest_complete(root: PathLike) -> Path | None:
    """Return the checkpoint to resume from, or ``None`` if there is none.

    The ``latest`` pointer file wins if it names a complete checkpoint (its name need
    not parse as a step). If it is missing, unreadable, or names a directory that is
    missing, partial or otherwise not complete, this falls back to the complete
    checkpoint with the highest step.

    Raises:
        NotADirectoryError: ``root`` exists but is not a directory.
    """
    root_path = local_root(root)
    if not _check_root(root_path):
        return None
    name = _read_latest(root_path)
    if name is not None:
        candidate = root_path / name
        if candidate.is_dir() and _state_of(candidate) is CheckpointState.COMPLETE:
            return candidate
    complete = [info for info in list_checkpoints(root_path) if info.complete]
    return complete[-1].path if complete else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def update_latest(root: PathLike, name: str) -> Path:
    """Atomically point ``root/latest`` at the checkpoint subdirectory ``name``.

    Writes a temp file in ``root``, fsyncs it, renames it over ``latest`` and fsyncs
    the directory, so a crash leaves either the old or the new pointer.

    Args:
        root: the checkpoint root (must exist).
        name: a subdirectory name (a single path component) holding a complete
            checkpoint. A path whose parent is ``root`` is accepted too.

    Returns:
        The path of the ``latest`` file.

    Raises:
        ValueError: ``name`` is not a single path component inside ``root``, or it
            does not name a complete checkpoint.
        FileNotFoundError / NotADirectoryError: ``root`` is missing or not a directory.
    """
    root_path = local_root(root)
    name_str = os.fspath(name)
    if not _valid_name(name_str):
        as_path = Path(name_str)
        if as_path.name and as_path.parent.resolve() == root_path.resolve():
            name_str = as_path.name
        else:
            raise ValueError(f"latest must name a subdirectory of {root_path}, got {name!r}")
    if not root_path.exists():
        raise FileNotFoundError(f"checkpoint root does not exist: {root_path}")
    if not root_path.is_dir():
        raise NotADirectoryError(f"checkpoint root is not a directory: {root_path}")
    target = root_path / name_str
    if not target.is_dir() or _state_of(target) is not CheckpointState.COMPLETE:
        raise ValueError(f"refusing to point latest at {target}: not a complete checkpoint")

    fd, tmp_name = tempfile.mkstemp(dir=root_path, prefix=f".{LATEST_FILE}.", suffix=".tmp")
    tmp_path = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes it 0600; others may need to read it
            f.write(name_str + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, root_path / LATEST_FILE)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    _fsync_dir(root_path)
    return root_path / LATEST_FILE


def _excluded_paths(root: Path, exclude: Iterable[PathLike]) -> set[Path]:
    """Resolve ``exclude`` entries: bare names are taken relative to ``root``, other
    entries as paths (relative ones against the cwd). A bare name is also tried as a
    path, which can only exclude more, never less."""
    out: set[Path] = set()
    for entry in exclude:
        text = os.fspath(entry)
        out.add(Path(text).resolve())
        if _valid_name(text):
            out.add((root / text).resolve())
    return out


def _unlink_quiet(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rmdir_quiet(path: Path) -> bool:
    """rmdir; False if it is gone already or no longer empty (someone writes into it again)."""
    try:
        path.rmdir()
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


def _remove_checkpoint_dir(
    path: Path, expect: CheckpointState, kept: dict[Path, str] | None = None
) -> bool:
    """Delete a checkpoint directory so that a crash midway leaves it *partial*.

    Takes the directory's lock first (the marker's ``flock``, as a save does) and gives up,
    returning False, if a live process holds it, if the directory vanished, or if it is no
    longer in state ``expect`` (a save committed or started meanwhile). Under the lock: remove
    ``.metadata`` and make that durable, remove every other entry, remove the marker, remove
    the directory. Entries vanishing meanwhile (a concurrent cleanup) are skipped. A directory
    that another checkpoint references (incremental saves,
    :func:`dcp_datastates.format.refs.keep_reason`, checked under the lock) is kept: returns False
    and records why in ``kept``.
    """
    if _state_of(path) is not expect:
        return False
    marker = path / INCOMPLETE_MARKER
    if expect is CheckpointState.PARTIAL and not os.path.lexists(marker):
        # Killed before its marker existed: only an empty directory (or the legacy marker temp
        # file) is removed; rmdir fails harmlessly if a save starts writing into it meanwhile.
        _unlink_quiet(path / f"{INCOMPLETE_MARKER}.tmp")
        return _rmdir_quiet(path)
    # A symlink under the marker's name is no lock anybody holds (writers open the marker with
    # O_NOFOLLOW and replace such a link): lock_marker(create=True) removes the link, never its
    # target, and locks a real marker in its place. Entries are unlinked, never followed.
    create = expect is CheckpointState.COMPLETE or marker.is_symlink()
    try:
        fd = lock_marker(str(path), create=create, purpose="a checkpoint deletion")
    except FileNotFoundError:
        return False  # removed meanwhile (another cleanup or prune, or a commit removed it)
    if fd is None:
        return False  # a live writer (or another deletion) holds it
    try:
        if _state_of(path) is not expect:
            return False
        why = keep_reason(path)
        if why is not None:
            logger.info("keeping %s: %s", path, why)
            if kept is not None:
                kept[path] = why
            return False
        metadata = path / METADATA_FILE
        if metadata.exists():
            metadata.unlink()
            _fsync_dir(path)
        with os.scandir(path) as it:
            entries = [e for e in it if e.name != INCOMPLETE_MARKER]
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass
        _unlink_quiet(path / INCOMPLETE_MARKER)
    finally:
        unlock_marker(fd)
    return _rmdir_quiet(path)


def _age_s(path: Path, now: float) -> float:
    """Seconds since anything in ``path`` (the directory or a direct entry) last changed."""
    newest = path.stat().st_mtime
    with os.scandir(path) as it:
        for e in it:
            try:
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                continue
    return now - newest


def cleanup_incomplete(
    root: PathLike,
    *,
    exclude: Collection[PathLike] = (),
    min_age: float = 0.0,
    kept: dict[Path, str] | None = None,
    failed: dict[Path, OSError] | None = None,
) -> list[Path]:
    """Remove partial checkpoints (marker present, no ``.metadata``) under ``root``.

    Never removes a complete or unknown directory, one whose save is still in flight (its
    marker is locked by a live process, in any process on this host), one listed in
    ``exclude`` (names under ``root`` or paths), nor one in which anything changed less than
    ``min_age`` seconds ago. Safe to run from several processes at once. A root that does
    not exist has nothing to clean (the command line reports it as an error). A directory
    another checkpoint references (incremental saves) is kept, logged, and recorded with the
    reason in ``kept`` if given. A marker that is a symlink is replaced by a real one (the
    link is removed, never followed) and the directory is removed like any other.

    A directory that cannot be removed (an ``OSError``: permissions, I/O) does not stop the
    others: with ``failed`` given, it is recorded there with its error; without it, the first
    such error is raised once every other directory has been handled.

    Returns:
        The removed directories, sorted by step.
    """
    if min_age < 0:
        raise ValueError(f"min_age must be >= 0, got {min_age}")
    root_path = local_root(root)
    excluded = _excluded_paths(root_path, exclude)
    removed: list[Path] = []
    errors: dict[Path, OSError] = {} if failed is None else failed
    now = time.time()
    for info in list_checkpoints(root_path):
        if not info.partial or info.path.resolve() in excluded:
            continue
        try:
            if min_age > 0 and _age_s(info.path, now) < min_age:
                continue
            if _remove_checkpoint_dir(info.path, CheckpointState.PARTIAL, kept):
                removed.append(info.path)
        except FileNotFoundError:
            continue  # removed meanwhile
        except OSError as e:
            logger.warning("could not remove the partial checkpoint %s: %s", info.path, e)
            errors[info.path] = e
    if failed is None and errors:
        path, err = next(iter(errors.items()))
        raise OSError(err.errno, f"could not remove {path}: {err.strerror or err}") from err
    return removed


def prune(
    root: PathLike,
    policy: RetentionPolicy,
    *,
    exclude: Collection[PathLike] = (),
    kept: dict[Path, str] | None = None,
) -> list[Path]:
    """Delete the complete checkpoints that ``policy`` does not keep.

    Never deletes a partial or unknown directory, one listed in ``exclude`` (saves in
    flight), or the checkpoint :func:`latest_complete` returns (the one ``latest``
    points to, or the newest complete one if the pointer is unusable). Excluded and
    partial directories do not count towards ``keep_last``.

    Incremental saves: a checkpoint whose data files another checkpoint of the root
    references (complete or partial, through its manifests) is kept whole, still loadable;
    it is logged and recorded with the reason (the referrers) in ``kept`` if given. The
    check runs under the directory's lock, so a save adding a reference meanwhile is seen.
    Candidates are deleted newest first, so an owner whose only referrers go in the same
    call goes too.

    Returns:
        The deleted directories, sorted by step.
    """
    if not isinstance(policy, RetentionPolicy):
        raise TypeError(f"policy must be a RetentionPolicy, got {type(policy).__name__}")
    root_path = local_root(root)
    if policy.keeps_everything:
        _check_root(root_path)
        return []
    excluded = _excluded_paths(root_path, exclude)
    complete = [
        info
        for info in list_checkpoints(root_path)
        if info.complete and info.path.resolve() not in excluded
    ]
    if not complete:
        return []
    kept_steps = policy.kept_steps(info.step for info in complete)
    latest = latest_complete(root_path)
    protected = latest.resolve() if latest is not None else None
    removed: list[Path] = []
    for info in reversed(complete):  # referrers are newer than what they reference
        if info.step in kept_steps or info.path.resolve() == protected:
            continue
        if _remove_checkpoint_dir(info.path, CheckpointState.COMPLETE, kept):
            removed.append(info.path)
    return removed[::-1]
