"""Checksum index of objects written one file each (the torchsnapshot storage plugin's format).

A torchsnapshot snapshot is a tree of object files that torchsnapshot names and commits itself
(``.snapshot_metadata`` last). The files must stay plain bytes, so that torchsnapshot's stock
``fs`` plugin reads them, so the CRC-32C of each written chunk lives beside them, in an index
under ``<root>/.datastates/``: one append-only JSON-lines log per writer (per rank and take),
``<host>-<pid>-<random>.crc.jsonl``. Each line is one object::

    {"path": "0/model/weight", "bytes": 8388608, "written_ns": 1718000000000000000,
     "chunks": [[0, 4194304, 2868385722], [4194304, 4194304, 91211871]]}

``chunks`` are ``[offset, bytes, crc32c]`` in the object file, covering it from 0 to ``bytes``.
A line is appended only once its object file is durable, and the log is ``fdatasync``ed before
the writer reports the object written (:class:`CrcLog`, group commit), so every object of a
committed snapshot has its line. Where one path has several lines (a path rewritten), the most
recent ``written_ns`` wins. A torn last line (a crash while appending) is ignored.

:func:`verify_snapshot` checks a snapshot directory against its index (``dcp-datastates verify``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import _core
from .commit import fsync_dir

INDEX_DIR = ".datastates"
INDEX_SUFFIX = ".crc.jsonl"
SNAPSHOT_METADATA = ".snapshot_metadata"  # torchsnapshot's commit file
_READ_BLOCK = 16 * 1024 * 1024

Chunk = tuple[int, int, int]  # offset, bytes, crc32c


@dataclass(frozen=True)
class ObjectRecord:
    """The checksums of one object file: ``chunks`` cover ``[0, size)`` in offset order
    (``size`` is the line's ``bytes``)."""

    path: str
    size: int
    chunks: tuple[Chunk, ...]
    written_ns: int

    def to_line(self) -> bytes:
        """The record as one JSON line (what :class:`CrcLog` appends)."""
        doc = {
            "path": self.path,
            "bytes": self.size,
            "written_ns": self.written_ns,
            "chunks": [list(c) for c in self.chunks],
        }
        return (json.dumps(doc, separators=(",", ":")) + "\n").encode()

    @classmethod
    def from_json(cls, doc: Any) -> ObjectRecord:
        """Parses one line's object; raises ValueError if it is not a well-formed record."""
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        path, size, ns, chunks = doc.get("path"), doc.get("bytes"), doc.get("written_ns"), doc.get(
            "chunks"
        )
        if not isinstance(path, str) or not isinstance(size, int) or not isinstance(ns, int):
            raise ValueError("path, bytes or written_ns missing")
        if not isinstance(chunks, list):
            raise ValueError("chunks missing")
        out: list[Chunk] = []
        end = 0
        for c in chunks:
            if not (isinstance(c, list) and len(c) == 3 and all(isinstance(v, int) for v in c)):
                raise ValueError("a chunk is not [offset, bytes, crc32c]")
            if c[0] != end or c[1] <= 0:
                raise ValueError("the chunks do not tile the object")
            end = c[0] + c[1]
            out.append((c[0], c[1], c[2]))
        if end != size:
            raise ValueError(f"the chunks cover {end} of {size} bytes")
        return cls(path, size, tuple(out), ns)

    def covering(self, lo: int, hi: int) -> list[Chunk]:
        """The chunks that hold any byte of ``[lo, hi)`` (all of them for an empty object)."""
        return [c for c in self.chunks if c[0] < hi and c[0] + c[1] > lo]


class GroupSync:
    """Coalesces durability requests: :meth:`ticket` after a change, :meth:`wait` until a sync
    started after that ticket has completed. Concurrent waiters share one sync (group commit).

    Thread-safe. ``sync`` runs in the thread of one waiter, never under the ticket lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _issued
        self._sync_lock = threading.Lock()  # one sync at a time; guards _synced
        self._issued = 0
        self._synced = 0

    def ticket(self) -> int:
        with self._lock:
            self._issued += 1
            return self._issued

    def wait(self, ticket: int, sync: Any) -> None:
        """Returns once a call of ``sync()`` that began after ``ticket`` was issued returned."""
        with self._sync_lock:
            if self._synced >= ticket:
                return
            with self._lock:
                target = self._issued
            sync()
            self._synced = target


class DirSync:
    """Durable directory entries: :meth:`created` notes an entry made in a directory, then
    :meth:`sync` fsyncs each such directory once for any number of concurrent callers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, GroupSync] = {}

    def created(self, directory: str) -> tuple[str, int]:
        with self._lock:
            group = self._groups.setdefault(directory, GroupSync())
        return directory, group.ticket()

    def sync(self, tickets: Iterable[tuple[str, int]]) -> None:
        for directory, ticket in tickets:
            with self._lock:
                group = self._groups[directory]
            group.wait(ticket, lambda d=directory: fsync_dir(d))  # type: ignore[misc]


class CrcLog:
    """One writer's append-only checksum log under ``<root>/.datastates/`` (module docstring).

    Thread-safe: :meth:`commit` may be called from many threads; it returns once the record and
    every record appended before it are durable (``fdatasync``, shared between concurrent
    callers), and the log's own directory entry too. Raises OSError naming the log on failure.
    :meth:`close` closes the descriptor (idempotent); nothing is written after it.
    """

    def __init__(self, root: str, dirs: DirSync) -> None:
        self.directory = os.path.join(root, INDEX_DIR)
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}{INDEX_SUFFIX}"
        self.path = os.path.join(self.directory, name)
        self._dirs = dirs
        self._lock = threading.Lock()  # guards _fd and the appends
        self._fd = -1
        self._made: list[tuple[str, int]] = []  # directory entries to sync once
        self._group = GroupSync()

    def _open_locked(self) -> None:
        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, exist_ok=True)
            self._made.append(self._dirs.created(os.path.dirname(self.directory)))
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o644)
        self._made.append(self._dirs.created(self.directory))

    def commit(self, record: ObjectRecord) -> None:
        """Appends ``record`` and waits until it is durable (see the class docstring)."""
        line = record.to_line()
        try:
            with self._lock:
                if self._fd < 0:
                    self._open_locked()
                os.write(self._fd, line)  # O_APPEND: one write per line, never interleaved
                ticket = self._group.ticket()
                fd, made = self._fd, list(self._made)
            self._group.wait(ticket, lambda: os.fdatasync(fd))
            self._dirs.sync(made)
        except OSError as e:
            raise OSError(e.errno, f"cannot record the checksums of '{record.path}' in "
                          f"{self.path}: {e.strerror or e}") from None

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        yield from enumerate(f, 1)


def load_index(root: str) -> tuple[dict[str, ObjectRecord], list[str], int]:
    """Every object record under ``root``'s index: (records by path, problems, logs read).

    A problem is a line that is not a record (a torn last line of a log is not one: it is
    skipped). An absent index gives ({}, [], 0).
    """
    directory = os.path.join(root, INDEX_DIR)
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(INDEX_SUFFIX))
    except FileNotFoundError:
        return {}, [], 0
    records: dict[str, ObjectRecord] = {}
    problems: list[str] = []
    for name in names:
        path = os.path.join(directory, name)
        lines = list(_lines(path))
        for i, line in lines:
            try:
                rec = ObjectRecord.from_json(json.loads(line))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                if i == len(lines) and not line.endswith(b"\n"):
                    continue  # torn by a crash while appending: that object never completed
                problems.append(f"{path} line {i}: not a checksum record ({e})")
                continue
            old = records.get(rec.path)
            if old is None or rec.written_ns >= old.written_ns:
                records[rec.path] = rec
    return records, problems, len(names)


def check_object(root: str, rec: ObjectRecord) -> tuple[list[str], int]:
    """Reads one object file and compares it with its record: (problems, bytes checked)."""
    path = os.path.join(root, rec.path)
    try:
        size = os.stat(path).st_size
    except OSError as e:
        return [f"{path}: cannot be read: {e.strerror or e}"], 0
    if size != rec.size:
        return [f"{path}: {size} bytes, the checksum record says {rec.size}"], 0
    problems: list[str] = []
    checked = 0
    with open(path, "rb", buffering=0) as f:
        for off, n, want in rec.chunks:
            f.seek(off)
            crc, left = 0, n
            while left:
                block = f.read(min(left, _READ_BLOCK))
                if not block:
                    break
                crc = _core.crc32c(block, crc)
                left -= len(block)
            checked += n - left
            if left or crc != want:
                problems.append(f"{path}: bytes [{off}, {off + n}) fail their CRC-32C "
                                f"(recorded {want:#010x}, read {crc:#010x})")
    return problems, checked


def referenced_locations(root: str) -> list[str] | None:
    """The object paths ``.snapshot_metadata`` names (its ``location`` fields), or None when it
    cannot be parsed here (PyYAML missing) or read."""
    try:
        import yaml  # torchsnapshot's own dependency

        with open(os.path.join(root, SNAPSHOT_METADATA), "rb") as f:
            doc = yaml.safe_load(f)
    except (ImportError, OSError, ValueError):
        return None
    except Exception:  # noqa: BLE001 - yaml.YAMLError and friends: reported as unparsed
        return None
    found: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            loc = v.get("location")
            if isinstance(loc, str):
                found.add(loc)
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(doc)
    return sorted(found)


def verify_snapshot(root: str, rep: Any) -> None:
    """Checks a torchsnapshot snapshot written through the plugin, filling ``rep`` (a
    :class:`~dcp_datastates.format.verify.VerifyReport`): every object in the index against its
    CRC-32C and size; every object ``.snapshot_metadata`` names must have a record. ``root`` is
    the local directory ("" for a non-local URL, which is reported as not checkable)."""
    if not root:
        rep.error = "torchsnapshot snapshots are verified on local paths only"
        return
    records, problems, logs = load_index(root)
    rep.problems.extend(problems)
    rep.ranks = logs
    if not logs:
        rep.error = (f"a torchsnapshot snapshot without a {INDEX_DIR}/ checksum index (not "
                     "written by the datastates plugin): nothing to verify it against")
        return
    if not os.path.exists(os.path.join(root, SNAPSHOT_METADATA)):
        rep.problems.append(f"{SNAPSHOT_METADATA} is missing: the snapshot was never committed")
    referenced = referenced_locations(root)
    if referenced is None:
        rep.unverified.append(f"{SNAPSHOT_METADATA} could not be parsed here (PyYAML): the "
                              "objects it names were not cross-checked with the index")
        referenced = []
    for loc in [SNAPSHOT_METADATA, *referenced]:
        if loc not in records and os.path.exists(os.path.join(root, SNAPSHOT_METADATA)):
            rep.problems.append(f"{os.path.join(root, loc)}: named by the snapshot but has no "
                                "checksum record")
    for rec in records.values():
        found, checked = check_object(root, rec)
        rep.problems.extend(found)
        rep.items += 1
        rep.chunks += len(rec.chunks)
        rep.bytes_checked += checked
    if not rep.problems:
        rep.notes.append(f"torchsnapshot snapshot: {len(records)} object(s) checked against "
                         f"{logs} checksum log(s) in {INDEX_DIR}/")
