"""Loading checkpoints of the safetensors format through DCP's reader protocol.

``.metadata``'s ``storage_data`` gives each tensor chunk's raw byte range in its
``.safetensors`` file; the stock ``FileSystemReader`` cannot load those (it expects torch.save
archives), so :class:`SafetensorsCheckpointReader` (used by :func:`dcp_datastates.load`) reads
them raw. The file layout is :mod:`dcp_datastates.format.safetensors`.

Threads: a reader serves one ``dcp.load`` at a time, in its caller's thread.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.futures import Future

from ..format.safetensors import SUFFIX, read_into
from .reader import mark_modified


class SafetensorsCheckpointReader(FileSystemReader):
    """A ``FileSystemReader`` that also loads checkpoints written with ``format="safetensors"``.

    It reads ``.metadata`` like the stock reader (so non-tensor values, resharding and every
    planner work); tensor chunks stored in ``.safetensors`` files are read raw from their byte
    range, straight into a tensor of the chunk's dtype and shape. Everything else (torch.save
    archives, bytes) goes to the stock code. :func:`dcp_datastates.load` picks it by itself.
    """

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunk_meta: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}
        for fqn, smd in metadata.state_dict_metadata.items():
            if isinstance(smd, TensorStorageMetadata):
                for ch in smd.chunks:
                    key = MetadataIndex(fqn, ch.offsets)
                    self._chunk_meta[key] = (smd.properties.dtype, ch.sizes)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw: dict[str, list[Any]] = collections.defaultdict(list)
        rest = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type != LoadItemType.BYTE_IO and str(info.relative_path).endswith(SUFFIX):
                raw[info.relative_path].append(req)
            else:
                rest.append(req)
        for rel, reqs in raw.items():
            path = self.fs.concat_path(self.path, rel)
            with self.fs.create_stream(path, "rb") as f:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    key = MetadataIndex(req.storage_index.fqn, req.storage_index.offset)
                    dtype, sizes = self._chunk_meta[key]
                    t = torch.empty(sizes, dtype=dtype)
                    if t.numel() * t.element_size() != info.length:
                        raise ValueError(
                            f"'{key.fqn}' in {rel}: .metadata says {info.length} bytes for a "
                            f"{dtype} chunk of shape {list(sizes)}"
                        )
                    read_into(f, info.offset, t, f"'{key.fqn}' in {rel}")
                    src = t
                    for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths,
                                                     strict=True)):
                        src = src.narrow(dim, o, n)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != src.size():
                        raise ValueError(
                            f"'{key.fqn}': read {list(src.size())}, expected {list(target.size())}"
                        )
                    mark_modified(target)  # counted before the copy, as reader.py does
                    target.copy_(src)
                    planner.commit_tensor(req, target)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


__all__ = ["SafetensorsCheckpointReader"]
