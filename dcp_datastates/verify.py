"""Checkpoint verification: every chunk's bytes against the CRC-32C in the manifests.

``verify_checkpoint(path)`` reads each rank's manifest, checks that ``.metadata`` exists and
refers to exactly the items the manifests describe, that every data file is long enough, and
recomputes the checksum of every chunk. Problems are reported naming the tensor, the rank and the
file. ``python -m dcp_datastates verify PATH`` is the command-line front end.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from . import _core
from .commit import MANIFEST_PREFIX, METADATA_FILE, CheckpointDir
from .errors import IntegrityError
from .manifest import RankManifest

_READ_BLOCK = 16 * 1024 * 1024


@dataclass
class VerifyReport:
    path: str
    ranks: int = 0
    items: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        head = (
            f"{self.path}: {self.ranks} rank(s), {self.items} item(s), {self.chunks} chunk(s), "
            f"{self.bytes_checked / 1e6:.1f} MB checked"
        )
        if self.ok:
            return head + ": OK"
        return head + f": {len(self.problems)} problem(s)\n" + "\n".join(
            f"  - {p}" for p in self.problems
        )


def verify_checkpoint(path: str, *, raise_on_error: bool = False) -> VerifyReport:
    """Verifies the checkpoint at ``path`` (local path or fsspec URL)."""
    d = CheckpointDir(path)
    rep = VerifyReport(path=path)
    meta_path = d.join(METADATA_FILE)
    storage: dict[tuple[str, tuple[int, ...] | None], object] = {}
    if not d.fs.exists(meta_path):
        rep.problems.append(f"{METADATA_FILE} is missing: the checkpoint was never committed")
    else:
        with d.fs.open(meta_path, "rb") as f:
            md = pickle.load(f)
        for idx, info in md.storage_data.items():
            storage[(idx.fqn, tuple(idx.offset) if idx.offset is not None else None)] = info
    manifests = sorted(
        p for p in d.fs.ls(d.path, detail=False) if p.rsplit("/", 1)[-1].startswith(MANIFEST_PREFIX)
    )
    if not manifests:
        rep.problems.append("no manifest found (not written by dcp_datastates, or incomplete)")
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    for mpath in manifests:
        with d.fs.open(mpath, "rb") as f:
            man = RankManifest.from_json(f.read().decode())
        rep.ranks += 1
        for it in man.items:
            rep.items += 1
            key = (it.fqn, tuple(it.offset) if it.offset is not None else None)
            if it.dtype == "bytes" and key not in storage:
                key = (it.fqn, None)
            seen.add(key)
            where = f"'{it.fqn}' (rank {man.rank}, {it.file})"
            info = storage.get(key)
            if storage and info is None:
                rep.problems.append(f"{where}: not referenced by {METADATA_FILE}")
            elif info is not None and (
                getattr(info, "relative_path", None) != it.file
                or getattr(info, "offset", None) != it.archive_offset
                or getattr(info, "length", None) != it.archive_length
            ):
                rep.problems.append(f"{where}: {METADATA_FILE} and manifest disagree on location")
            fpath = d.join(it.file)
            try:
                size = d.fs.size(fpath)
            except FileNotFoundError:
                rep.problems.append(f"{where}: data file is missing")
                continue
            end = it.archive_offset + it.archive_length
            if size < end:
                rep.problems.append(
                    f"{where}: data file is truncated ({size} bytes, item ends at {end})"
                )
                continue
            if not man.checksums:
                continue
            with d.fs.open(fpath, "rb") as f:
                for off, n, crc in it.chunks:
                    rep.chunks += 1
                    f.seek(off)
                    got = 0
                    left = n
                    while left > 0:
                        block = f.read(min(left, _READ_BLOCK))
                        if not block:
                            break
                        got = _core.crc32c(block, got)
                        left -= len(block)
                    rep.bytes_checked += n - left
                    if left > 0 or got != crc:
                        rep.problems.append(
                            f"{where}: checksum mismatch in bytes [{off}, {off + n}) "
                            f"(expected crc32c {crc:08x}, found {got:08x})"
                        )
    for key in storage:
        if manifests and key not in seen:
            rep.problems.append(f"'{key[0]}': in {METADATA_FILE} but in no manifest")
    if raise_on_error and not rep.ok:
        raise IntegrityError(rep.summary())
    return rep
