"""Checkpoint verification: every byte the stock reader interprets, against what the save wrote.

``verify_checkpoint(path)`` checks one checkpoint directory (local path or fsspec URL):

- ``.metadata`` is unpickled *safely* (a restricted unpickler that only resolves the torch and DCP
  classes checkpoint metadata needs; nothing else is imported or called) and cross-checked with
  the manifests: every ``storage_data`` entry (file, offset, length), every chunk of
  ``state_dict_metadata`` (its storage entry, the manifest's dtype and shape), ``planner_data``;
- each rank's manifest is parsed and type-checked; manifests of another save (left by an
  overwritten checkpoint) are reported as stale and ignored;
- every tensor item's torch.save archive header and trailer (the zip records and ``data.pkl``
  around the payload) are compared byte for byte with the template the installed torch builds for
  the manifest's dtype and shape (``layout.build_template``); every payload chunk against its
  CRC-32C, and the chunks must cover the whole payload; byte items (non-tensor values) against
  their CRC-32C;
- file names in the manifests and ``.metadata`` must be plain names inside the checkpoint, or,
  for an incremental save's references, ``../<sibling checkpoint>/<file>``: those bytes are
  checked in the owner checkpoint against the CRC-32C the referring manifest recorded, and a
  missing owner is reported naming it;
- items written through stream transforms (``_extensions``): the stored bytes against their
  CRC-32C, then, decoded as the stock reader decodes them (torch's default extension registry),
  the decoded length, CRC-32C and archive header and trailer; an extension that registry does not
  know leaves the decoded content unverified.

Every problem is reported, naming the tensor, the rank and the file; nothing raises for damaged
input (``raise_on_error`` turns problems into one IntegrityError). What could not be verified
(payloads of a save made with ``checksums=False``) is reported as *unverified*, never as OK.
``dcp-datastates verify PATH...`` is the command-line front end; its exit status is
:attr:`VerifyReport.exit_code` (0 verified, 1 damaged, 2 could not check, 3 not fully verifiable).

Not detected: a payload byte changed in a save made with ``checksums=False``; damage the CRC-32C
misses (vanishingly unlikely at random, trivial on purpose); a consistent rewrite of data,
manifest and ``.metadata`` together; archive bytes written by a torch whose archive layout differs
from the installed one are reported as damage (verify with the torch that saved).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

try:
    from .. import _core
except ImportError as _e:  # pragma: no cover - exercised by a subprocess test
    _here = os.path.dirname(os.path.abspath(__file__))
    raise ImportError(
        f"dcp_datastates was imported from {_here}, which has no built native module '_core'. "
        "This happens when Python runs in a source checkout (the current directory comes first "
        "on sys.path and shadows the installed package). Use the `dcp-datastates` command, "
        "which works from any directory, or run Python from another directory, or build the "
        "checkout in place with `pip install --no-build-isolation -e .`"
    ) from _e

from ..errors import IntegrityError
from ..runtime.progress import Progress
from .commit import INCOMPLETE_MARKER, MANIFEST_PREFIX, METADATA_FILE, CheckpointDir
from .layout import TemplateCache
from .manifest import ItemRecord, RankManifest
from .object_index import INDEX_DIR, SNAPSHOT_METADATA, verify_snapshot
from .refs import is_reference_path, relative_path
from .safetensors import SUFFIX as SAFETENSORS_SUFFIX
from .safetensors import check_item as check_safetensors_item

_READ_BLOCK = 16 * 1024 * 1024
_MANIFEST_RE = re.compile(r"^__datastates_manifest_(\d+)\.json$")
_MAX_METADATA_BYTES = 1 << 31
_TEMPLATES = TemplateCache()  # the archive layout of (dtype, shape) with the installed torch

EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_ERROR = 2
EXIT_UNVERIFIED = 3

Key = tuple[str, tuple[int, ...] | None]


@dataclass
class VerifyReport:
    """The outcome of verifying one checkpoint.

    ``problems``: damage found (each names tensor, rank and file). ``unverified``: what could not
    be checked (no checksums recorded). ``notes``: harmless findings (stale files ignored).
    ``error``: the path could not be checked at all (missing, not a checkpoint, unreadable).
    ``children``: for a checkpoint *root*, the checkpoints found under it (see verify_paths).
    """

    path: str
    ranks: int = 0
    items: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    children: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No damage found and the path could be checked (it may still be partly unverified)."""
        return not self.problems and self.error is None

    @property
    def fully_verified(self) -> bool:
        """Every byte the reader interprets was checked and found intact."""
        return self.ok and not self.unverified

    @property
    def exit_code(self) -> int:
        """1 damaged, 2 could not check, 3 intact as far as checked but not fully verified, 0 OK."""
        if self.problems:
            return EXIT_DAMAGED
        if self.error is not None:
            return EXIT_ERROR
        if self.unverified:
            return EXIT_UNVERIFIED
        return EXIT_OK

    def summary(self) -> str:
        if self.error is not None and not self.problems:
            return f"{self.path}: ERROR: {self.error}"
        head = (
            f"{self.path}: {self.ranks} rank(s), {self.items} item(s), {self.chunks} chunk(s), "
            f"{self.bytes_checked / 1e6:.1f} MB checked"
        )
        lines: list[str] = []
        if self.problems:
            head += f": DAMAGED, {len(self.problems)} problem(s)"
            lines += [f"  - {p}" for p in self.problems]
        elif self.unverified:
            head += ": no damage found, but NOT FULLY VERIFIED"
        else:
            head += ": OK"
        lines += [f"  - not verified: {u}" for u in self.unverified]
        lines += [f"  - note: {n}" for n in self.notes]
        return "\n".join([head, *lines])


# ------------------------------------------------------------------------------------------------
# .metadata: a restricted unpickler
_DCP_METADATA_CLASSES = frozenset(
    {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    }
)


_PyUnpickler: Any = pickle._Unpickler  # type: ignore[attr-defined]  # the pure-Python one


class _MetadataUnpickler(_PyUnpickler):  # type: ignore[misc]
    """Resolves only the classes a DCP ``Metadata`` pickle refers to; refuses everything else.

    The pure-Python unpickler, not the C one: the C unpickler grows its memo table to twice the
    index a ``LONG_BINPUT`` names, so one flipped byte (``BUILD`` -> ``LONG_BINPUT``) made it
    allocate and zero tens of GB before failing. This one keeps its memo in a dict. It is about
    3.5x slower (100,000 tensors: 28 s instead of 8 s on a loaded 2-core machine). Where it is
    more lenient than the C unpickler the stock reader uses (a frame longer than the data left),
    it is made as strict, so that nothing it accepts fails to load.
    """

    dispatch: dict[int, Any] = dict(_PyUnpickler.dispatch)

    def _load_frame(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > sys.maxsize:
            raise pickle.UnpicklingError(f"frame size {size} is out of range")
        self._unframer.load_frame(size)
        if len(self._unframer.current_frame.getbuffer()) != size:
            raise pickle.UnpicklingError("pickle data was truncated (a frame is cut short)")

    dispatch[pickle.FRAME[0]] = _load_frame

    def find_class(self, module: str, name: str) -> Any:
        return _allowed_class(module, name, super().find_class)


class _FastMetadataUnpickler(pickle.Unpickler):
    """The same restriction on the C unpickler: for bytes that verify already checked, or that
    the stock reader is about to unpickle with the C unpickler anyway (``load(verify=False)``)."""

    def find_class(self, module: str, name: str) -> Any:
        return _allowed_class(module, name, super().find_class)


def _allowed_class(module: str, name: str, find: Any) -> Any:
    """``find(module, name)`` for the classes a DCP ``Metadata`` pickle uses; else refuses."""
    allowed = False
    if module == "torch":
        obj = getattr(torch, name, None)
        allowed = name == "Size" or isinstance(
            obj, (torch.dtype, torch.layout, torch.memory_format)
        )
    elif module == "torch.distributed.checkpoint.metadata":
        allowed = name in _DCP_METADATA_CLASSES
    elif module == "torch.distributed.checkpoint.filesystem":
        allowed = name == "_StorageInfo"
    elif module == "torch.serialization":
        allowed = name == "_get_layout"
    elif module == "collections":
        allowed = name == "OrderedDict"
    if not allowed:
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: not a class checkpoint metadata uses"
        )
    return find(module, name)


def load_metadata(raw: bytes, *, fast: bool = False) -> Any:
    """Unpickles ``.metadata`` bytes with the restricted unpickler; returns the Metadata.

    Raises ValueError (with the cause) for anything that is not a well-formed DCP Metadata.
    ``fast`` uses the C unpickler (about 3.5x faster), which damaged bytes can make allocate
    gigabytes: only for bytes already verified, or that the stock reader unpickles anyway.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    unpickler = _FastMetadataUnpickler if fast else _MetadataUnpickler
    try:
        md = unpickler(io.BytesIO(raw)).load()
    except Exception as e:  # any damage: UnpicklingError, EOFError, MemoryError, TypeError, ...
        raise ValueError(f"{type(e).__name__}: {e}") from e
    if not isinstance(md, Metadata):
        raise ValueError(f"holds a {type(md).__name__}, not a DCP Metadata")
    try:
        _check_structure(md)
    except ValueError:
        raise
    except Exception as e:  # an object of the right class with odd state: anything may fail
        raise ValueError(f"malformed: {type(e).__name__}: {e}") from e
    return md


def _descriptors_ok(value: object) -> bool:
    """``_StorageInfo.transform_descriptors``: absent, or a sequence of strings."""
    if value is None:
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _check_structure(md: Any) -> None:
    """Raises ValueError unless every object in ``md`` has the attributes and types a DCP
    ``Metadata`` has (the unpickler restores any attribute dict on an allowed class: a flipped
    byte in a field name leaves an object without ``state_dict_metadata``). Values (offsets,
    sizes, file names) are checked later, against the manifests."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    def attr(obj: Any, name: str, what: str) -> Any:
        if name not in getattr(obj, "__dict__", {}) and not hasattr(type(obj), name):
            raise ValueError(f"{what} has no field '{name}'")
        return getattr(obj, name)

    def ints(value: Any, what: str) -> None:
        if not isinstance(value, (tuple, list)) or not all(
            type(v) is int for v in value  # noqa: E721 - bool is not an offset
        ):
            raise ValueError(f"{what} is not a sequence of ints: {value!r:.80}")

    sdm = attr(md, "state_dict_metadata", "Metadata")
    storage = attr(md, "storage_data", "Metadata")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise ValueError("state_dict_metadata or storage_data is not a dict")
    attr(md, "planner_data", "Metadata")
    meta = attr(md, "storage_meta", "Metadata")
    if meta is not None:
        if not isinstance(meta, StorageMeta):
            raise ValueError(f"storage_meta is a {type(meta).__name__}")
        save_id = attr(meta, "save_id", "storage_meta")
        if save_id is not None and not isinstance(save_id, str):
            raise ValueError(f"storage_meta.save_id is a {type(save_id).__name__}")
    for fqn, smd in sdm.items():
        if not isinstance(fqn, str):
            raise ValueError(f"a state_dict_metadata key is a {type(fqn).__name__}, not a str")
        what = f"state_dict_metadata['{fqn}']"
        if isinstance(smd, BytesStorageMetadata):
            continue
        if not isinstance(smd, TensorStorageMetadata):
            raise ValueError(f"{what} is a {type(smd).__name__}")
        props = attr(smd, "properties", what)
        if not isinstance(props, TensorProperties):
            raise ValueError(f"{what}.properties is a {type(props).__name__}")
        if not isinstance(attr(props, "dtype", what), torch.dtype):
            raise ValueError(f"{what} has no torch dtype")
        if not isinstance(attr(props, "layout", what), torch.layout):
            raise ValueError(f"{what} has no torch layout")
        ints(attr(smd, "size", what), f"{what}.size")
        chunks = attr(smd, "chunks", what)
        if not isinstance(chunks, list):
            raise ValueError(f"{what}.chunks is a {type(chunks).__name__}, not a list")
        for ch in chunks:
            if not isinstance(ch, ChunkStorageMetadata):
                raise ValueError(f"{what} has a chunk that is a {type(ch).__name__}")
            ints(attr(ch, "offsets", what), f"{what} chunk offsets")
            ints(attr(ch, "sizes", what), f"{what} chunk sizes")
    for idx, info in storage.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(attr(idx, "fqn", "key"), str):
            raise ValueError("a storage_data key is not a MetadataIndex")
        off = attr(idx, "offset", "a storage_data key")
        if off is not None:
            ints(off, f"storage_data['{idx.fqn}'] offset")
        what = f"storage_data['{idx.fqn}']"
        for name in ("relative_path", "offset", "length"):
            attr(info, name, what)


def plain_name(name: object) -> bool:
    """True if ``name`` is a single file name inside a directory (no separator, not . or ..)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def _key_of(fqn: str, offset: Any) -> Key:
    return (fqn, tuple(int(o) for o in offset) if offset is not None else None)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _dtype_of(name: str) -> torch.dtype | None:
    obj = getattr(torch, name, None) if name.isidentifier() else None
    return obj if isinstance(obj, torch.dtype) else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------------
class _Verifier:
    """State of one verification (one checkpoint)."""

    def __init__(
        self, path: str, rep: VerifyReport, storage_options: dict[str, Any] | None = None
    ) -> None:
        self.d = CheckpointDir(path, storage_options)
        self.d.fs.invalidate_cache(self.d.path)  # object stores: list what is there now
        self.rep = rep
        self.files: dict[str, BinaryIO | None] = {}
        self.sizes: dict[str, int | None] = {}
        self.st_headers: dict[str, Any] = {}  # parsed safetensors headers, by file name
        self.show_progress = False  # set by verify_checkpoint
        self.bar: Progress | None = None
        self._item_done = 0

    def close(self) -> None:
        for f in self.files.values():
            if f is not None:
                f.close()

    def problem(self, text: str) -> None:
        self.rep.problems.append(text)

    # --------------------------------------------------------------------------------------------
    def run(self) -> None:
        d, rep = self.d, self.rep
        if not d.fs.exists(d.path):
            rep.error = "no such checkpoint directory"
            return
        if not d.fs.isdir(d.path):
            rep.error = "not a directory (a checkpoint is a directory holding .metadata)"
            return
        entries = d.fs.ls(d.path, detail=True)
        names = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}
        manifests = sorted(n for n in names if n.startswith(MANIFEST_PREFIX))
        if METADATA_FILE not in names and (SNAPSHOT_METADATA in names or INDEX_DIR in names):
            verify_snapshot(d.path if d.local else "", rep)
            return
        if METADATA_FILE not in names and not manifests and INCOMPLETE_MARKER not in names:
            rep.children = self._checkpoints_below(entries)
            if rep.children:
                rep.error = (
                    f"a checkpoint root, not a checkpoint: it holds {len(rep.children)} "
                    "checkpoint(s); verify each of them (the command line does)"
                )
            else:
                rep.error = "not a checkpoint: no .metadata and no manifest in it"
            return
        md = self._read_metadata(METADATA_FILE in names, INCOMPLETE_MARKER in names)
        try:
            storage = self._storage(md)
        except Exception as e:  # damage of a kind the type checks did not foresee
            self.problem(f"{METADATA_FILE} is malformed: {type(e).__name__}: {e}")
            md, storage = None, {}
        by_key, current = self._manifests(manifests, md, storage)
        if md is not None:
            try:
                self._cross_check(md, storage, by_key)
            except Exception as e:
                self.problem(f"{METADATA_FILE} is malformed: {type(e).__name__}: {e}")
        total = sum(it.archive_length for man in current for it in man.items)
        name = self.d.path.rstrip("/").rsplit("/", 1)[-1] or self.d.path
        self.bar = Progress(total, self.show_progress, f"verify {name}")
        try:
            for man in current:
                self._check_rank(man)
        finally:
            self.bar.close()

    def _checkpoints_below(self, entries: list[dict[str, Any]]) -> list[str]:
        out = []
        for e in entries:
            if e.get("type") != "directory":
                continue
            sub = e["name"].rstrip("/")
            if self.d.fs.exists(f"{sub}/{METADATA_FILE}") or self.d.fs.exists(
                f"{sub}/{INCOMPLETE_MARKER}"
            ):
                base = self.d.url.rstrip("/")
                out.append(f"{base}/{sub.rsplit('/', 1)[-1]}")
        return sorted(out)

    def _read_metadata(self, present: bool, marker: bool) -> Any:
        if not present:
            why = f" ({INCOMPLETE_MARKER} is present: a save is in progress or died)"
            self.problem(
                f"{METADATA_FILE} is missing: the checkpoint was never committed"
                + (why if marker else "")
            )
            return None
        p = self.d.join(METADATA_FILE)
        size = self.d.fs.size(p)
        if size > _MAX_METADATA_BYTES:
            self.problem(f"{METADATA_FILE} is implausibly large ({size} bytes)")
            return None
        with self.d.fs.open(p, "rb") as f:
            raw = f.read()
        try:
            return load_metadata(raw)
        except ValueError as e:
            self.problem(f"{METADATA_FILE} is damaged and cannot be loaded: {e}")
            return None

    def _storage(self, md: Any) -> dict[Key, Any]:
        storage: dict[Key, Any] = {}
        if md is None:
            return storage
        for idx, info in md.storage_data.items():
            fqn = getattr(idx, "fqn", None)
            off = getattr(idx, "offset", None)
            if not isinstance(fqn, str):
                self.problem(f"{METADATA_FILE}: a storage_data key is not a MetadataIndex")
                continue
            key = _key_of(fqn, off)
            rel = getattr(info, "relative_path", None)
            o, n = getattr(info, "offset", None), getattr(info, "length", None)
            if not plain_name(rel) and not is_reference_path(rel):  # (or incremental: ../<ck>/<f>)
                self.problem(
                    f"'{fqn}': {METADATA_FILE} names the file {rel!r}, which is not a plain "
                    "file name inside the checkpoint"
                )
            elif not (isinstance(o, int) and isinstance(n, int) and o >= 0 and n >= 0):
                self.problem(f"'{fqn}': {METADATA_FILE} has a bad location ({o!r}, {n!r})")
            elif not _descriptors_ok(getattr(info, "transform_descriptors", None)):
                self.problem(
                    f"'{fqn}': {METADATA_FILE} has malformed transform descriptors "
                    f"{info.transform_descriptors!r:.80}"
                )
            storage[key] = info
        return storage

    def _manifests(
        self, names: list[str], md: Any, storage: dict[Key, Any]
    ) -> tuple[dict[Key, tuple[RankManifest, ItemRecord]], list[RankManifest]]:
        save_id = getattr(getattr(md, "storage_meta", None), "save_id", None)
        by_key: dict[Key, tuple[RankManifest, ItemRecord]] = {}
        current: list[RankManifest] = []
        for name in names:
            m = _MANIFEST_RE.match(name)
            if m is None:
                if name.endswith(".tmp"):
                    self.rep.notes.append(f"{name}: leftover temporary file, ignored")
                else:
                    self.problem(f"{name}: unexpected file name for a manifest")
                continue
            try:
                with self.d.fs.open(self.d.join(name), "rb") as f:
                    raw = f.read()
                man = RankManifest.from_json(raw.decode())
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                self.problem(f"{name}: manifest is damaged: {e}")
                continue
            if man.rank != int(m.group(1)):
                self.problem(f"{name}: manifest says rank {man.rank}, its name another rank")
                continue
            if md is not None and man.save_id != save_id and not self._referenced(man, storage):
                self.rep.notes.append(
                    f"{name}: stale manifest of another save (id {man.save_id}), ignored"
                )
                continue
            current.append(man)
            for it in man.items:
                key = _key_of(it.fqn, it.offset)
                if key in by_key:
                    self.problem(f"'{it.fqn}' (rank {man.rank}): item recorded twice")
                by_key[key] = (man, it)
        if not current and md is not None:
            self.problem("no manifest of this save found (not written by dcp_datastates?)")
        self.rep.ranks = len(current)
        return by_key, current

    @staticmethod
    def _referenced(man: RankManifest, storage: dict[Key, Any]) -> bool:
        """True if ``.metadata`` points at any item of ``man`` where ``man`` says it lies."""
        for it in man.items:
            info = storage.get(_key_of(it.fqn, it.offset))
            if info is not None and getattr(info, "relative_path", None) == relative_path(it):
                return True
        return False

    def _cross_check(
        self, md: Any, storage: dict[Key, Any], by_key: dict[Key, tuple[RankManifest, ItemRecord]]
    ) -> None:
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            TensorStorageMetadata,
        )

        for key, info in storage.items():
            where = f"'{key[0]}'" + (f" at {list(key[1])}" if key[1] is not None else "")
            hit = by_key.get(key)
            if hit is None:
                self.problem(f"{where}: in {METADATA_FILE} but in no manifest")
                continue
            man, it = hit
            if (info.relative_path, info.offset, info.length) != (
                relative_path(it),
                it.archive_offset,
                it.archive_length,
            ):
                self.problem(
                    f"{where} (rank {man.rank}): {METADATA_FILE} says ({info.relative_path!r}, "
                    f"{info.offset!r}, {info.length!r}), the manifest ({relative_path(it)!r}, "
                    f"{it.archive_offset}, {it.archive_length})"
                )
            transform = list(getattr(info, "transform_descriptors", None) or ()) or None
            if transform != it.transform:
                self.problem(
                    f"{where} (rank {man.rank}): {METADATA_FILE} records the transforms "
                    f"{transform}, the manifest {it.transform}"
                )
        for key, (man, it) in by_key.items():
            if key not in storage:
                self.problem(f"'{it.fqn}' (rank {man.rank}, {it.file}): not in {METADATA_FILE}")
        expected: set[Key] = set()
        for fqn, smd in md.state_dict_metadata.items():
            if not isinstance(fqn, str):
                self.problem(f"{METADATA_FILE}: a state_dict_metadata key is not a string")
                continue
            if isinstance(smd, BytesStorageMetadata):
                expected.add((fqn, None))
                hit = by_key.get((fqn, None))
                if hit is not None and hit[1].dtype != "bytes":
                    self.problem(f"'{fqn}': {METADATA_FILE} says bytes, the manifest a tensor")
                continue
            if not isinstance(smd, TensorStorageMetadata):
                self.problem(f"'{fqn}': {METADATA_FILE} holds a {type(smd).__name__}")
                continue
            self._check_tensor_md(fqn, smd, by_key, expected)
        for key in storage:
            if key not in expected:
                self.problem(f"'{key[0]}': in storage_data but not in state_dict_metadata")
        pd = md.planner_data
        if isinstance(pd, dict) and pd:
            for fqn, path in pd.items():
                ok = isinstance(path, tuple) and all(isinstance(p, (str, int)) for p in path)
                if not ok or ".".join(str(p) for p in path) != fqn:
                    self.problem(f"'{fqn}': planner_data maps it to {path!r}")
                elif fqn not in md.state_dict_metadata:
                    self.problem(f"'{fqn}': in planner_data but not in state_dict_metadata")
            for fqn in md.state_dict_metadata:
                if fqn not in pd:
                    self.problem(f"'{fqn}': in state_dict_metadata but not in planner_data")

    def _check_tensor_md(
        self,
        fqn: str,
        smd: Any,
        by_key: dict[Key, tuple[RankManifest, ItemRecord]],
        expected: set[Key],
    ) -> None:
        props = smd.properties
        dtype = getattr(props, "dtype", None)
        size = smd.size
        if not isinstance(dtype, torch.dtype) or not isinstance(size, torch.Size):
            self.problem(f"'{fqn}': {METADATA_FILE} has a malformed tensor description")
            return
        if getattr(props, "layout", torch.strided) != torch.strided:
            self.problem(f"'{fqn}': {METADATA_FILE} describes a {props.layout} tensor")
        covered = 0
        for ch in smd.chunks:
            offs, sizes = tuple(ch.offsets), tuple(ch.sizes)
            key: Key = (fqn, offs)
            expected.add(key)
            where = f"'{fqn}' at {list(offs)}"
            if len(offs) != len(size) or len(sizes) != len(size) or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(offs, sizes, size, strict=True)
            ):
                self.problem(f"{where}: chunk {list(sizes)} lies outside the tensor {list(size)}")
            covered += _numel(sizes)
            hit = by_key.get(key)
            if hit is None:
                continue  # reported by the storage_data checks
            man, it = hit
            if it.dtype != _dtype_name(dtype) or tuple(it.shape) != sizes:
                self.problem(
                    f"{where} (rank {man.rank}, {it.file}): {METADATA_FILE} says "
                    f"{_dtype_name(dtype)}{list(sizes)}, the manifest {it.dtype}{it.shape}"
                )
        if covered != _numel(tuple(size)):
            # DCP saves cover every tensor exactly (chunks of all ranks, empty shards included)
            self.problem(
                f"'{fqn}': {METADATA_FILE} says the tensor is {list(size)} ({_numel(tuple(size))} "
                f"elements) but its chunks hold {covered}"
            )

    # --------------------------------------------------------------------------------------------
    def _open(self, name: str) -> tuple[BinaryIO | None, int | None]:
        if name not in self.files:
            try:
                p = self.d.join(name)
                self.sizes[name] = self.d.fs.size(p)
                self.files[name] = self.d.fs.open(p, "rb")
            except FileNotFoundError:
                self.files[name] = None
                self.sizes[name] = None
        return self.files[name], self.sizes[name]

    def _read(self, f: BinaryIO, off: int, n: int) -> bytes:
        f.seek(off)
        return f.read(n)

    def _crc(self, f: BinaryIO, off: int, n: int) -> tuple[int, int]:
        f.seek(off)
        got, left = 0, n
        while left > 0:
            block = f.read(min(left, _READ_BLOCK))
            if not block:
                break
            got = _core.crc32c(block, got)
            left -= len(block)
            self._tick(len(block))
        return got, n - left

    def _check_rank(self, man: RankManifest) -> None:
        self._check_owners(man)
        skipped_items, skipped_bytes = 0, 0
        for it in man.items:
            self._item_done = 0
            try:
                if self._check_item(man, it):
                    skipped_items += 1
                    skipped_bytes += it.payload_bytes
            finally:
                self._tick(max(0, it.archive_length - self._item_done))
        if skipped_items:
            self.rep.unverified.append(
                f"rank {man.rank}: the payloads of {skipped_items} tensor item(s) "
                f"({skipped_bytes} bytes) have no checksums (saved with checksums=False); their "
                "archive headers were checked, their data could not be"
            )

    def _tick(self, n: int) -> None:
        self._item_done += n
        if self.bar is not None and n:
            self.bar.update(n)

    def _check_item(self, man: RankManifest, it: ItemRecord) -> bool:
        """Checks one item; True if its payload could not be checked (no checksums)."""
        self.rep.items += 1
        where = f"'{it.fqn}' (rank {man.rank}, {relative_path(it)})"
        if not plain_name(it.file) or (it.ref is not None and not plain_name(it.ref)):
            self.problem(
                f"'{it.fqn}' (rank {man.rank}): the manifest names the file {it.file!r}, "
                "which is not a plain file name inside the checkpoint; not opened"
            )
            return False
        f, size = self._open(relative_path(it))
        if f is None or size is None:
            self.problem(f"{where}: data file is missing" + self._owner_note(it))
            return False
        end = it.archive_offset + it.archive_length
        if size < end:
            self.problem(f"{where}: data file is truncated ({size} bytes, item ends at {end})")
            return False
        if it.transform is not None:  # _extensions: stored bytes, then decoded ones
            self._check_chunks(f, it, where, it.archive_offset, it.archive_length)
            self._check_decoded(f, it, where)
            return False
        if it.dtype == "bytes":
            self._check_chunks(f, it, where, it.archive_offset, it.archive_length)
            return False
        if not self._check_archive(f, it, where):
            return False
        if man.checksums:
            self._check_chunks(f, it, where, it.payload_offset, it.payload_bytes)
            return False
        return True

    def _owner_note(self, it: ItemRecord) -> str:
        """Incremental saves: what is wrong with the checkpoint that owns a referenced item."""
        if it.ref is None:
            return ""
        owner = self.d.join(f"../{it.ref}")
        if not self.d.fs.exists(owner):
            return (
                f" (its bytes live in the referenced checkpoint {it.ref}, which is missing: "
                "deleted? this checkpoint cannot be loaded without it)"
            )
        return f" (its bytes live in the referenced checkpoint {it.ref}, which lacks the file)"

    def _check_owners(self, man: RankManifest) -> None:
        """Incremental saves: notes owners that are no longer committed checkpoints."""
        for ref in sorted({it.ref for it in man.items if it.ref is not None}):
            owner = self.d.join(f"../{ref}")
            if self.d.fs.exists(owner) and not self.d.fs.exists(f"{owner}/{METADATA_FILE}"):
                self.rep.notes.append(
                    f"rank {man.rank}: the referenced checkpoint {ref} is not committed (no "
                    f"{METADATA_FILE}); the bytes this checkpoint needs from it were checked"
                )

    def _check_chunks(self, f: BinaryIO, it: ItemRecord, where: str, start: int, n: int) -> None:
        pos = start
        for off, nbytes, _crc in sorted(it.chunks):
            if off != pos:
                break
            pos += nbytes
        if pos != start + n:
            self.problem(
                f"{where}: the recorded checksums do not cover bytes [{start}, {start + n}) "
                "exactly (manifest damaged)"
            )
            return
        for off, nbytes, crc in it.chunks:
            self.rep.chunks += 1
            got, read = self._crc(f, off, nbytes)
            self.rep.bytes_checked += read
            if read != nbytes or got != crc:
                self.problem(
                    f"{where}: checksum mismatch in bytes [{off}, {off + nbytes}) "
                    f"(expected crc32c {crc:08x}, found {got:08x})"
                )

    def _check_decoded(self, f: BinaryIO, it: ItemRecord, where: str) -> None:
        """A transformed item (``_extensions``): undoes its transforms as the stock reader does
        (torch's default extension registry) and checks the decoded length and CRC-32C and, for
        a tensor, the archive header and trailer. An extension the registry does not know
        leaves the item unverified (its stored bytes were checked against their CRC-32C)."""
        assert it.transform is not None
        try:
            exts = ExtensionRegistry().from_descriptor_list(it.transform)
        except Exception as e:  # noqa: BLE001 - any refusal means: cannot decode here
            self.rep.unverified.append(
                f"{where}: stored bytes match their CRC-32C, but the transforms {it.transform} "
                f"cannot be undone here ({type(e).__name__}: {e}), so the decoded content was "
                "not checked"
            )
            return
        tmpl = None
        if it.dtype != "bytes":
            dtype = _dtype_of(it.dtype)
            if dtype is None:
                self.problem(f"{where}: unknown dtype {it.dtype!r} in the manifest")
                return
            if _numel(tuple(it.shape)) * dtype.itemsize != it.payload_bytes:
                self.problem(
                    f"{where}: the manifest's {it.dtype}{it.shape} does not hold "
                    f"{it.payload_bytes} payload bytes"
                )
                return
            tmpl = _TEMPLATES.get(dtype, tuple(it.shape))
        head_want = tmpl.prefix if tmpl is not None else b""
        tail_len = len(tmpl.suffix) if tmpl is not None else 0
        head = bytearray()
        tail = b""
        crc, n = 0, 0
        try:
            stream: Any = stored_reader(f, it.archive_offset, it.archive_length)
            for ex in exts:
                if isinstance(ex, StreamTransformExtension):
                    stream = ex.transform_from(stream)
            while True:
                block = stream.read(_READ_BLOCK)
                if not block:
                    break
                crc = _core.crc32c(block, crc)
                n += len(block)
                if len(head) < len(head_want):
                    head += block[: len(head_want) - len(head)]
                if tail_len:
                    tail = (tail + bytes(block))[-tail_len:]
        except Exception as e:  # noqa: BLE001 - damaged stored bytes fail to decode
            self.problem(
                f"{where}: the stored bytes cannot be decoded through {it.transform}: "
                f"{type(e).__name__}: {e}"
            )
            return
        self.rep.bytes_checked += n
        if n != it.decoded_bytes or crc != it.decoded_crc:
            self.problem(
                f"{where}: decoded through {it.transform}, it is {n} bytes with crc32c "
                f"{crc:08x}; the manifest recorded {it.decoded_bytes} bytes, {it.decoded_crc:08x}"
            )
        elif tmpl is not None and (
            n != tmpl.total_bytes or bytes(head) != tmpl.prefix or tail != tmpl.suffix
        ):
            self.problem(
                f"{where}: decoded, it is not a torch.save archive of {it.dtype}{it.shape} as "
                f"the installed torch {torch.__version__} lays it out"
            )

    def _check_archive(self, f: BinaryIO, it: ItemRecord, where: str) -> bool:
        """Compares the archive header and trailer with the installed torch's template."""
        dtype = _dtype_of(it.dtype)
        if dtype is None:
            self.problem(f"{where}: unknown dtype {it.dtype!r} in the manifest")
            return False
        numel = 1
        for s in it.shape:
            numel *= s
        if numel * dtype.itemsize != it.payload_bytes:
            self.problem(
                f"{where}: the manifest's {it.dtype}{it.shape} does not hold "
                f"{it.payload_bytes} payload bytes"
            )
            return False
        if it.file.endswith(SAFETENSORS_SUFFIX):  # format="safetensors": a header, no archive
            size = self.sizes.get(it.file) or 0
            problems = check_safetensors_item(f, size, it, self.st_headers)
            for p in problems:
                self.problem(f"{where}: {p}")
            return not problems
        tmpl = _TEMPLATES.get(dtype, tuple(it.shape))
        if (
            it.archive_length != tmpl.total_bytes
            or it.payload_offset != it.archive_offset + len(tmpl.prefix)
        ):
            self.problem(
                f"{where}: the manifest's archive bounds do not fit a torch.save archive of "
                f"{it.dtype}{it.shape}"
            )
            return False
        ok = True
        for what, off, want in (
            ("header", it.archive_offset, tmpl.prefix),
            ("trailer", it.payload_offset + it.payload_bytes, tmpl.suffix),
        ):
            got = self._read(f, off, len(want))
            self.rep.bytes_checked += len(got)
            if got != want:
                diff = (k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
                i = next(diff, len(got))
                found = f"0x{got[i]:02x}" if i < len(got) else "end of file"
                self.problem(
                    f"{where}: torch.save archive {what} damaged at file byte {off + i} (expected "
                    f"0x{want[i]:02x}, found {found}; layout of {it.dtype}{it.shape} with torch "
                    f"{torch.__version__})"
                )
                ok = False
        return ok


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    raise_on_error: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> VerifyReport:
    """Verifies the checkpoint at ``path`` (local path or fsspec URL); never raises for damage.

    Returns a :class:`VerifyReport`. With ``raise_on_error`` a damaged checkpoint, or one that
    cannot be checked, raises IntegrityError with the report's summary instead.
    ``storage_options`` are the fsspec options of a non-local URL (as given to the writer).
    ``progress`` draws the bytes checked on stderr
    (:class:`dcp_datastates.runtime.progress.Progress`).
    """
    spath = os.fspath(path)
    rep = VerifyReport(path=spath)
    if spath.startswith("datastates://"):  # a torchsnapshot URL of our plugin: its local path
        spath = spath[len("datastates://") :]
    try:
        v = _Verifier(spath, rep, storage_options)
    except (ValueError, ImportError, OSError) as e:  # a URL fsspec cannot handle
        rep.error = f"cannot open: {type(e).__name__}: {e}"
    else:
        v.show_progress = progress
        try:
            v.run()
        except OSError as e:
            rep.error = f"I/O error while verifying: {e}"
        except Exception as e:  # a damage no check foresaw: reported, never raised
            rep.error = f"could not be checked: {type(e).__name__}: {e}"
        finally:
            v.close()
    if raise_on_error and not rep.ok:
        raise IntegrityError(rep.summary())
    return rep


def verify_paths(
    paths: list[str], storage_options: dict[str, Any] | None = None, progress: bool = False
) -> list[VerifyReport]:
    """Verifies each path; a checkpoint root is expanded into the checkpoints under it.
    ``progress``: as for :func:`verify_checkpoint`, one counter per checkpoint."""
    out: list[VerifyReport] = []
    for p in paths:
        rep = verify_checkpoint(p, storage_options=storage_options, progress=progress)
        if rep.children:
            out += [
                verify_checkpoint(c, storage_options=storage_options, progress=progress)
                for c in rep.children
            ]
        else:
            out.append(rep)
    return out


def stored_reader(f: Any, offset: int, length: int) -> io.RawIOBase:
    """A readable stream of the ``length`` stored bytes at ``offset`` of the open file ``f``
    (what the transforms are undone from; used by verify)."""
    return _Slice(f, offset, length)


class _Slice(io.RawIOBase):
    def __init__(self, f: Any, offset: int, length: int) -> None:
        self._f = f
        self._pos = offset
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self._left)
        if n <= 0:
            return 0
        self._f.seek(self._pos)
        data = self._f.read(n)
        view[: len(data)] = data
        self._pos += len(data)
        self._left -= len(data)
        return len(data)
