"""The per-rank manifest: where each item lies and the CRC-32C of each chunk of its payload.

Written by every rank (``__datastates_manifest_<rank>.json``, atomically) after its data files are
durable and before the coordinator commits ``.metadata``. The stock readers ignore it; the verify
tool (``dcp-datastates verify``) and ``verify_checkpoint`` read it (docs/format.md).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..runtime.gcpause import gc_paused

MANIFEST_VERSION = 1
MANIFEST_VERSION_REFS = 2  # a manifest with references to other checkpoints (incremental saves)
MANIFEST_VERSION_TRANSFORMS = 3  # a manifest with transformed items (``_extensions``)
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_quote = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # what _ENCODER uses


@dataclass(slots=True)
class ItemRecord:
    """One saved item (a tensor chunk or a serialized non-tensor value) of one rank."""

    fqn: str
    offset: list[int] | None  # chunk offsets within the global tensor (None for bytes items)
    file: str  # data file, relative to the checkpoint directory
    archive_offset: int  # where the torch.save archive (or the raw bytes) starts in the file
    archive_length: int
    payload_offset: int  # where the tensor bytes start in the file
    payload_bytes: int
    dtype: str  # torch dtype name, or "bytes"
    shape: list[int]
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (file offset, bytes, crc)
    # Incremental saves: the sibling checkpoint directory that holds the bytes (``file`` and the
    # offsets are in it; ``.metadata`` records ``../<ref>/<file>``). None: in this checkpoint.
    ref: str | None = None
    # Items written through stream transforms (``_extensions``, dcp_datastates.save.extensions): the
    # descriptors ``.metadata`` records, outermost first. ``archive_offset``/``archive_length``
    # are then the stored (transformed) bytes, ``chunks`` their CRC-32C, and ``decoded_bytes``/
    # ``decoded_crc`` the length and CRC-32C of what undoing the transforms gives (the torch.save
    # archive, or the raw bytes). None: stored as it is.
    transform: list[str] | None = None
    decoded_bytes: int = 0
    decoded_crc: int = 0
    # With ``ref``: the save id of the owner's manifest that recorded the bytes (the save that was
    # referenced; checked before the reference is trusted, dcp_datastates.format.refcheck). None in
    # manifests written before it was recorded.
    ref_save_id: str | None = None


@dataclass
class RankManifest:
    rank: int
    checksums: bool
    save_id: str
    items: list[ItemRecord]
    version: int = MANIFEST_VERSION

    def to_json(self) -> str:
        """The manifest as compact JSON text (see :func:`encode_manifest`)."""
        return b"".join(
            encode_manifest(self.rank, self.checksums, self.save_id, self.items, self.version)
        ).decode()

    @classmethod
    def from_json(cls, text: str) -> RankManifest:
        """Parses and type-checks a manifest; raises ValueError naming what is malformed."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        if raw.get("version") not in (
            MANIFEST_VERSION, MANIFEST_VERSION_REFS, MANIFEST_VERSION_TRANSFORMS
        ):
            raise ValueError(f"unsupported manifest version {raw.get('version')!r}")
        rank = _field(raw, "rank", int)
        checksums = _field(raw, "checksums", bool)
        save_id = _field(raw, "save_id", str)
        items_raw = _field(raw, "items", list)
        items = [_item(it, i) for i, it in enumerate(items_raw)]
        return cls(rank=rank, checksums=checksums, save_id=save_id, items=items)


def encode_manifest(
    rank: int,
    checksums: bool,
    save_id: str,
    items: Iterable[ItemRecord],
    version: int = MANIFEST_VERSION,
    batch: int = 4096,
) -> Iterator[bytes]:
    """A manifest as compact UTF-8 JSON, in pieces of ``batch`` items: the same text as
    ``json.dumps`` of the whole object, built field by field (``dataclasses.asdict`` recurses
    with deep copies and cost a fifth of a small-tensor save).

    ``items`` may be a generator: with the pieces written as they come, neither the records nor
    the text of 100,000 items (about 50 MB each) are ever all in memory. An item's ``ref``
    appears only when set; a manifest without references stays ``version`` (``"version"`` is the
    last key, so it is known by then). Each piece is built with the cyclic GC paused.
    """
    encode = _ENCODER.encode
    head = encode({"rank": rank, "checksums": checksums, "save_id": save_id})
    yield (head[:-1] + ',"items":[').encode()
    has_refs = False
    has_transforms = False
    first = True
    it = iter(items)
    while True:
        with gc_paused():  # one string per item (see dcp_datastates.runtime.gcpause)
            parts = []
            for rec in itertools.islice(it, batch):
                parts.append(_item_json(rec))
                if rec.ref is not None:
                    has_refs = True
                if rec.transform is not None:
                    has_transforms = True
            if not parts:
                break
            piece = ",".join(parts)
        yield (piece if first else "," + piece).encode()
        first = False
    final = MANIFEST_VERSION_REFS if has_refs else version
    if has_transforms:
        final = MANIFEST_VERSION_TRANSFORMS
    yield ('],"version":' + encode(final) + "}").encode()


def _ints_json(values: Iterable[int]) -> str:
    return "[" + ",".join([str(int(v)) for v in values]) + "]"


def _item_json(rec: ItemRecord) -> str:
    """One item as ``json.dumps`` (compact, ASCII) writes its dict, formatted directly: a
    quarter of the encoder's time per item. Strings go through the encoder's own escaping."""
    offset = "null" if rec.offset is None else _ints_json(rec.offset)
    chunks = ",".join([f"[{int(o)},{int(n)},{int(c)}]" for o, n, c in rec.chunks])
    ref = "" if rec.ref is None else ',"ref":' + _quote(rec.ref)
    if rec.transform is not None:
        ref += (
            ',"transform":[' + ",".join([_quote(t) for t in rec.transform]) + "]"
            f',"decoded_bytes":{int(rec.decoded_bytes)},"decoded_crc":{int(rec.decoded_crc)}'
        )
    if rec.ref_save_id is not None:
        ref += ',"ref_save_id":' + _quote(rec.ref_save_id)
    return (
        f'{{"fqn":{_quote(rec.fqn)},"offset":{offset},"file":{_quote(rec.file)},'
        f'"archive_offset":{int(rec.archive_offset)},"archive_length":{int(rec.archive_length)},'
        f'"payload_offset":{int(rec.payload_offset)},"payload_bytes":{int(rec.payload_bytes)},'
        f'"dtype":{_quote(rec.dtype)},"shape":{_ints_json(rec.shape)},"chunks":[{chunks}]{ref}}}'
    )


def _field(raw: dict[str, Any], name: str, typ: type, where: str = "") -> Any:
    if name not in raw:
        raise ValueError(f"{where}field '{name}' is missing")
    value = raw[name]
    ok = isinstance(value, typ) and (typ is bool or not isinstance(value, bool))
    if not ok:
        raise ValueError(f"{where}field '{name}' is not a {typ.__name__}: {value!r:.80}")
    return value


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{what} is not a list of non-negative ints: {value!r:.80}")
    return list(value)


def _nonneg_ints(values: Any) -> bool:
    return type(values) is list and all(type(v) is int and v >= 0 for v in values)


def _item(it: Any, i: int) -> ItemRecord:
    """One item record. Well-formed items (the common case) are checked inline; anything else
    goes through :func:`_item_checked`, which accepts the same and names what is malformed."""
    if type(it) is dict:
        get: Callable[[str], Any] = it.get
        fqn, file, dtype, shape, chunks_raw = (
            get("fqn"), get("file"), get("dtype"), get("shape"), get("chunks")
        )
        offset, ref, ref_save_id = get("offset"), get("ref"), get("ref_save_id")
        if get("transform") is not None:
            return _item_checked(it, i)  # transformed items: few, checked field by field
        ints = (get("archive_offset"), get("archive_length"), get("payload_offset"),
                get("payload_bytes"))
        if (
            type(fqn) is str
            and type(file) is str
            and type(dtype) is str
            and all(type(v) is int and v >= 0 for v in ints)
            and _nonneg_ints(shape)
            and (offset is None or _nonneg_ints(offset))
            and (ref is None or type(ref) is str)
            and (ref_save_id is None or type(ref_save_id) is str)
            and type(chunks_raw) is list
            and all(_nonneg_ints(c) and len(c) == 3 for c in chunks_raw)
        ):
            return ItemRecord(
                fqn=fqn,
                offset=None if offset is None else list(offset),
                file=file,
                archive_offset=ints[0],
                archive_length=ints[1],
                payload_offset=ints[2],
                payload_bytes=ints[3],
                dtype=dtype,
                shape=list(shape),
                chunks=[(c[0], c[1], c[2]) for c in chunks_raw],
                ref=ref,
                ref_save_id=ref_save_id,
            )
    return _item_checked(it, i)


def _item_checked(it: Any, i: int) -> ItemRecord:
    where = f"item {i}: "
    if not isinstance(it, dict):
        raise ValueError(f"{where}not a JSON object")
    fqn = _field(it, "fqn", str, where)
    where = f"item {i} ('{fqn}'): "
    offset = it.get("offset")
    chunks_raw = _field(it, "chunks", list, where)
    chunks: list[tuple[int, int, int]] = []
    for c in chunks_raw:
        vals = _ints(c, f"{where}a chunk")
        if len(vals) != 3:
            raise ValueError(f"{where}a chunk is not [offset, bytes, crc]: {c!r:.80}")
        chunks.append((vals[0], vals[1], vals[2]))
    ints = {}
    for name in ("archive_offset", "archive_length", "payload_offset", "payload_bytes"):
        ints[name] = _field(it, name, int, where)
        if ints[name] < 0:
            raise ValueError(f"{where}field '{name}' is negative")
    ref = it.get("ref")
    if ref is not None and not isinstance(ref, str):
        raise ValueError(f"{where}field 'ref' is not a str: {ref!r:.80}")
    transform = it.get("transform")
    decoded = {"decoded_bytes": 0, "decoded_crc": 0}
    if transform is not None:
        if not isinstance(transform, list) or not all(isinstance(t, str) for t in transform):
            raise ValueError(f"{where}field 'transform' is not a list of str: {transform!r:.80}")
        for name in decoded:
            decoded[name] = _field(it, name, int, where)
            if decoded[name] < 0:
                raise ValueError(f"{where}field '{name}' is negative")
    ref_save_id = it.get("ref_save_id")
    if ref_save_id is not None and not isinstance(ref_save_id, str):
        raise ValueError(f"{where}field 'ref_save_id' is not a str: {ref_save_id!r:.80}")
    return ItemRecord(
        ref=ref,
        ref_save_id=ref_save_id,
        transform=None if transform is None else list(transform),
        **decoded,
        fqn=fqn,
        offset=None if offset is None else _ints(offset, f"{where}'offset'"),
        file=_field(it, "file", str, where),
        dtype=_field(it, "dtype", str, where),
        shape=_ints(_field(it, "shape", list, where), f"{where}'shape'"),
        chunks=chunks,
        **ints,
    )
