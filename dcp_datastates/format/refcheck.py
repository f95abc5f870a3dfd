"""Checking a reference (incremental saves) against the checkpoint it refers to, before trusting it.

An incremental checkpoint's item may live in a sibling checkpoint, its *owner*: ``.metadata``
records ``../<owner>/<file>`` and the referring rank's manifest the item with ``"ref": "<owner>"``
(docs/format.md, "Incremental saves"). Another writer that saves to the owner's directory (the
stock ``FileSystemWriter`` opens ``__<rank>_<i>.distcp`` with ``O_TRUNC``, writes its own data
under those names and renames in its own ``.metadata``) leaves files that the stock reader may
parse as tensors of the same shapes holding other values.

An incremental writer therefore names its data files after its save
(``__<rank>_<i>.<tag>.distcp``, the tag being the save id's first hex digits): no other save writes
those names, so a reference to one needs only the file (present, long enough) and, while it is
read, the CRC-32C of each chunk. A reference to a file named ``__<rank>_<i>.distcp`` (written
before data files were named so, or by hand) could have been rewritten under it, and is checked
against its owner first, cheaply (a ``stat``, the owner's ``.metadata`` and the first bytes of
each of its manifests; cached per owner while its ``.metadata`` is the same file):

1. *committed*: ``<owner>/.metadata`` exists;
2. *committed by the save that wrote its data files*: the save id ``.metadata`` records
   (``storage_meta.save_id``, the coordinator's) is the save id of one of the owner's manifests.
   Our writer removes every old manifest when it overwrites a directory, so a directory it
   committed holds only manifests of that save; another writer rewrites ``.metadata`` and leaves
   our manifests behind, and the ids differ;
3. *the save that was referenced*: one of the owner's manifests has the save id the referring
   rank recorded (``"ref_save_id"``; manifests written before this field existed skip this step);
4. (every reference) the data file exists and is long enough to hold the item.

Per chunk, the CRC-32C the referring manifest recorded is compared with the bytes themselves by
:class:`~dcp_datastates.restore.reader.DataStatesReader` as it reads them and by ``verify``.

Who runs the checks: ``DataStatesReader`` (before it writes into any target),
:func:`dcp_datastates.load` (:func:`check_references`, with or without ``verify``) and the writer
before it records a new reference (``incremental.owner_problem``). The stock ``dcp.load``
(``FileSystemReader``) runs no code of this package: it opens ``../<owner>/<file>`` and trusts the
bytes it finds there, which, in a file named after its save, are the ones that save wrote unless
the file itself was damaged or replaced.

Threads: an :class:`OwnerChecks` may be shared by threads (its cache is guarded by a lock).
"""

from __future__ import annotations

import os
import pickletools
import re
import threading
from dataclasses import dataclass

from ..errors import IntegrityError
from .commit import MANIFEST_PREFIX, METADATA_FILE
from .manifest import ItemRecord, RankManifest
from .refs import stat_key

_MANIFEST_RE = re.compile(r"^" + re.escape(MANIFEST_PREFIX) + r"(\d+)\.json$")
_SAVE_ID_RE = re.compile(rb'"save_id"\s*:\s*"([^"\\]*)"')
_REWRITABLE_RE = re.compile(r"^__\d+_\d+\.distcp$")  # DCP's names: other writers use them too
_HEAD_BYTES = 512  # a manifest begins with {"rank":..,"checksums":..,"save_id":"..."


@dataclass(frozen=True)
class _Commit:
    """What an owner directory held when it was last examined."""

    problem: str | None  # why the owner is not the committed checkpoint its files belong to
    save_ids: frozenset[str]  # save ids of its manifests


class OwnerChecks:
    """Checks of owner checkpoints, cached per owner while its ``.metadata`` is unchanged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, int, int, int], _Commit]] = {}

    def commit_problem(self, owner_dir: str) -> str | None:
        """Why ``owner_dir`` is not a checkpoint committed by the save that wrote its data files
        (steps 1 and 2 of the module docstring); None if it is."""
        return self._commit(owner_dir).problem

    def item_problem(self, checkpoint_dir: str, rec: ItemRecord) -> str | None:
        """Why the reference ``rec`` (an item of ``checkpoint_dir``'s manifest with ``ref`` set)
        must not be trusted; None if every check of the module docstring passes (or ``rec`` is
        not a reference)."""
        if rec.ref is None:
            return None
        where = f"{rec.ref}/{rec.file}"
        if not (_plain(rec.ref) and _plain(rec.file)):
            return f"the reference {where!r} is not a file of a sibling checkpoint"
        owner = os.path.join(checkpoint_dir, os.pardir, rec.ref)
        if not os.path.isdir(owner):
            return f"the referenced checkpoint {rec.ref} ({os.path.normpath(owner)}) is missing"
        if may_be_rewritten(rec.file):  # a name other saves write too: check the owner
            problem = self._owner_problem(owner, rec)
            if problem is not None:
                return problem
        key = stat_key(os.path.join(owner, rec.file))
        end = rec.archive_offset + rec.archive_length
        if key is None:
            return f"{where} is missing"
        if key[2] < end:
            return f"{where} is truncated ({key[2]} bytes; the item ends at byte {end})"
        return None

    def _owner_problem(self, owner: str, rec: ItemRecord) -> str | None:
        """Steps 1-3 of the module docstring for the reference ``rec``."""
        commit = self._commit(owner)
        if commit.problem is not None:
            return commit.problem
        if rec.ref_save_id is not None and rec.ref_save_id not in commit.save_ids:
            return (
                f"{rec.ref} was saved again since the reference was made: the reference is to "
                f"save {rec.ref_save_id}, its manifests are of save(s) "
                f"{', '.join(sorted(commit.save_ids)) or '(none)'}"
            )
        return None

    def _commit(self, owner_dir: str) -> _Commit:
        md_path = os.path.join(owner_dir, METADATA_FILE)
        key = stat_key(md_path)
        name = os.path.basename(os.path.normpath(owner_dir))
        if key is None:
            return _Commit(f"the referenced checkpoint {name} is not committed (no "
                           f"{METADATA_FILE})", frozenset())
        real = os.path.realpath(owner_dir)
        with self._lock:
            hit = self._cache.get(real)
        if hit is not None and hit[0] == key:
            return hit[1]
        commit = _examine(owner_dir, name, md_path)
        with self._lock:
            self._cache[real] = (key, commit)
        return commit


def may_be_rewritten(file: str) -> bool:
    """Whether another save may have written a data file of this name (DCP's own names,
    ``__<rank>_<i>.distcp``), so a reference to it needs its owner checked (steps 1-3)."""
    return _REWRITABLE_RE.match(file) is not None


def _plain(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _examine(owner_dir: str, name: str, md_path: str) -> _Commit:
    ids = _manifest_save_ids(owner_dir)
    try:
        with open(md_path, "rb") as f:
            raw = f.read()
    except OSError as e:
        return _Commit(f"{name}/{METADATA_FILE} cannot be read ({e})", ids)
    if _records_one_of(raw, ids):
        return _Commit(None, ids)
    sid = _save_id_of(raw)
    by = f"save {sid!r}" if sid is not None else "another save"
    ours = ", ".join(sorted(ids)) or "no manifest left"
    return _Commit(
        f"{name} was overwritten by another writer: its {METADATA_FILE} was committed by {by}, "
        f"not by the save that wrote its manifests and the referenced bytes ({ours}); its data "
        "files may now hold that writer's values",
        ids,
    )


def _records_one_of(raw: bytes, ids: frozenset[str]) -> bool:
    """Whether the pickled ``.metadata`` ``raw`` records one of ``ids`` as its save id.

    Our ``.metadata`` records the coordinator's save id (``storage_meta.save_id``, 32 random hex
    digits). Nothing is unpickled (another writer's ``.metadata`` may hold classes ours never
    does): the value of the ``save_id`` key is decoded from the opcodes around it
    (:func:`_save_id_of`). Where that key is a reference to an earlier copy of the string (a
    state dict key named ``save_id``), the ids are looked for among the 32-digit hex strings of
    the pickle's last bytes: ``storage_meta`` is the last field but ``version``.
    """
    sid = _save_id_of(raw)
    if sid is not None:
        return sid in ids
    tail = raw[-_TAIL_BYTES:]
    found = {m.decode() for m in _HEX_ID_RE.findall(tail)}
    return any(sid in found if _HEX_ID_FULL_RE.fullmatch(sid) else sid.encode() in tail
               for sid in ids)


_TAIL_BYTES = 16 << 10  # storage_meta (checkpoint_id, save_id, ...) and version
_HEX_ID_RE = re.compile(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")
_HEX_ID_FULL_RE = re.compile(r"[0-9a-f]{32}")
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_MEMO_OPS = frozenset({"MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"})


def _save_id_of(raw: bytes) -> str | None:
    """For messages: the string value of the last ``save_id`` key in a pickle
    (``storage_meta.save_id``), decoded from the opcodes around it without executing anything;
    None if not found (the key may be a reference to an earlier copy of the string)."""
    key = b"save_id"
    pos = raw.rfind(key)
    while pos > 0:
        # The key is a string opcode: 1 byte + a 1-byte (protocol 4+), 4-byte or 8-byte length.
        for start in (pos - 2, pos - 5, pos - 9):
            if start < 0:
                continue
            found = _string_after_key(raw[start:pos + 256])
            if found is not None:
                return found
        pos = raw.rfind(key, 0, pos)
    return None


def _string_after_key(window: bytes) -> str | None:
    """If ``window`` starts with the string opcode ``'save_id'``, the string opcode's value that
    follows it (memo opcodes between them skipped); else None."""
    try:
        ops = pickletools.genops(window)
        op, arg, _ = next(ops)
        if op.name not in _STRING_OPS or arg != "save_id":
            return None
        for op, arg, _ in ops:
            if op.name in _MEMO_OPS:
                continue
            return str(arg) if op.name in _STRING_OPS else None
    except Exception:  # noqa: BLE001 - not an opcode boundary: try the next candidate
        return None
    return None


def _manifest_save_ids(owner_dir: str) -> frozenset[str]:
    """The save ids of the manifests in ``owner_dir``, each read from the manifest's first bytes
    (the whole manifest is parsed only if they do not hold it)."""
    out: set[str] = set()
    try:
        names = [n for n in os.listdir(owner_dir) if _MANIFEST_RE.match(n)]
    except OSError:
        return frozenset()
    for n in names:
        path = os.path.join(owner_dir, n)
        try:
            with open(path, "rb") as f:
                head = f.read(_HEAD_BYTES)
                m = _SAVE_ID_RE.search(head)
                if m is not None:
                    out.add(m.group(1).decode("ascii", "replace"))
                    continue
                f.seek(0)
                out.add(RankManifest.from_json(f.read().decode()).save_id)
        except (OSError, ValueError):
            continue
    return frozenset(out)


def check_references(checkpoint_dir: str | os.PathLike[str],
                     checks: OwnerChecks | None = None) -> int:
    """Checks every reference in the manifests of the local checkpoint ``checkpoint_dir``;
    returns how many there are. Raises :class:`IntegrityError` naming each key, the referenced
    checkpoint and file and what differs (all problems found, one per owner and reason).

    Manifests that the directory's ``.metadata`` was not committed with (another writer saved
    there since, and its ``.metadata`` references nothing) are not checked: 0."""
    root = os.fspath(checkpoint_dir)
    checks = checks or OwnerChecks()
    try:
        names = sorted(n for n in os.listdir(root) if _MANIFEST_RE.match(n))
    except OSError:
        return 0
    if not names or checks.commit_problem(root) is not None:
        return 0
    problems: dict[str, list[str]] = {}
    count = 0
    for n in names:
        path = os.path.join(root, n)
        try:
            with open(path, "rb") as f:
                raw = f.read()
            if b'"ref"' not in raw:  # cheap: manifests without references are not parsed
                continue
            man = RankManifest.from_json(raw.decode())
        except (OSError, ValueError):
            continue  # not ours to judge here: verify reports damaged manifests
        for rec in man.items:
            if rec.ref is None:
                continue
            count += 1
            why = checks.item_problem(root, rec)
            if why is not None:
                problems.setdefault(why, []).append(f"'{rec.fqn}' ({rec.ref}/{rec.file})")
    if problems:
        raise IntegrityError(reference_error(root, problems))
    return count


def reference_error(root: str, problems: dict[str, list[str]]) -> str:
    """One message for references that failed their checks: ``problems`` maps each reason to
    the items it concerns (``'key' (owner/file)``)."""
    parts = []
    for why, keys in problems.items():
        shown = ", ".join(keys[:5])
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        parts.append(f"{shown}{more}: {why}")
    return (
        f"{root}: references to other checkpoints (incremental saves) cannot be trusted: "
        + "; ".join(parts)
        + ". Nothing was loaded"
    )


__all__ = ["OwnerChecks", "check_references", "may_be_rewritten", "reference_error"]
