"""The per-rank manifest: where each item lies and the CRC-32C of each chunk of its payload.

Written by every rank (``__datastates_manifest_<rank>.json``, atomically) after its data files are
durable and before the coordinator commits ``.metadata``. The stock readers ignore it; the verify
tool (``python -m dcp_datastates verify``) and ``verify_checkpoint`` read it (docs/format.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_VERSION = 1


@dataclass
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


@dataclass
class RankManifest:
    rank: int
    checksums: bool
    save_id: str
    items: list[ItemRecord]
    version: int = MANIFEST_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RankManifest:
        raw: dict[str, Any] = json.loads(text)
        if raw.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unsupported manifest version {raw.get('version')!r}")
        items = [
            ItemRecord(**{**it, "chunks": [tuple(c) for c in it["chunks"]]}) for it in raw["items"]
        ]
        return cls(
            rank=int(raw["rank"]),
            checksums=bool(raw["checksums"]),
            save_id=str(raw["save_id"]),
            items=items,
        )
