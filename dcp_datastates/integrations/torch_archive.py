"""``torch.save``-compatible archives whose tensor payloads are written by the native engine.

Framework checkpoint files (DeepSpeed's ``mp_rank_00_model_states.pt``,
``zero_pp_rank_0_mp_rank_00_optim_states.pt``) are read by tools that call ``torch.load`` on
them directly (``zero_to_fp32``, universal-checkpoint conversion). So an adapter that writes them
through the host cache must produce exactly what ``torch.save`` would have produced, bytes of
the tensors aside. :func:`plan_archive` does that without touching tensor memory:

1. the object is walked; every tensor is replaced by a *prototype*, an untouched
   ``torch.empty`` of the same dtype and shape with a storage of its own (sized to the tensor:
   a view into a large flat buffer, as ZeRO hands out, does not drag the whole buffer along).
   Containers are rebuilt with their own type, so int keys, ``OrderedDict`` and empty dicts
   come back from ``torch.load`` exactly as they went in (it is pickle);
2. torch's own serializer (``torch.serialization._save``) pickles the skeleton into torch's own
   zip writer, whose data records are declared with their size but not written
   (``write_record_metadata``, as under ``torch.serialization.skip_data``), into a sparse
   in-memory file. The zip layout, zip64 records and 64-byte payload alignment are torch's;
3. the result is the archive's non-payload bytes (a few KiB of headers, pickle and directory)
   and, per tensor, the file offset where its payload belongs. The caller writes the payloads
   there (the DeepSpeed adapter lets the engine's flush threads write them from the host
   cache) and the gaps with :attr:`ArchivePlan.segments`.

Tensors nested inside objects the walk does not enter (anything but dicts, lists, tuples and
namedtuples) are pickled by torch as usual: their bytes go into ``segments`` (exact, but written
at the call). Tensors on other devices are recorded with location ``cpu``: ``torch.load``
returns them on the CPU (DeepSpeed loads its files with a CPU ``map_location`` anyway).

Relies on ``torch.serialization._save(obj, zip_file, pickle_module, protocol, disable_byteorder)``
(checked on torch 2.13; ``tests/test_integration_deepspeed.py`` loads the result with
``torch.load``).
"""

from __future__ import annotations

import copy
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..format.layout import _LOCAL_HEADER, _LOCAL_HEADER_SIG, _SparseFile

#: torch.save's default pickle protocol.
_PROTOCOL = 2


@dataclass(frozen=True)
class ArchiveTensor:
    """One tensor of an archive: its key path, the tensor, and where its payload goes."""

    name: str
    tensor: torch.Tensor
    payload_offset: int
    nbytes: int


@dataclass(frozen=True)
class ArchivePlan:
    """A planned torch.save archive.

    Attributes:
        segments: ``(file offset, bytes)`` of everything that is not a tensor payload.
        tensors: the tensors whose payloads the caller writes at ``payload_offset``.
        total_bytes: the archive's size.
    """

    segments: list[tuple[int, bytes]]
    tensors: list[ArchiveTensor]
    total_bytes: int


def _proto(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.layout != torch.strided or t.is_nested or t.is_quantized:
        raise TypeError(f"cannot save '{name}': {t.layout} / nested / quantized tensors are "
                        "not supported by the DataStates DeepSpeed engine")
    if t.device.type == "meta":
        raise TypeError(f"cannot save '{name}': it is a meta tensor and holds no data")
    proto = torch.empty(tuple(t.shape), dtype=t.dtype)  # never touched: no pages faulted in
    grad_ok = t.is_floating_point() or t.is_complex()
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(proto, requires_grad=t.requires_grad and grad_ok)
    if t.requires_grad and grad_ok:
        proto.requires_grad_(True)
    return proto


class _Splitter:
    """Replaces tensors by prototypes, rebuilding the containers on the way (see module doc)."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}  # id(original) -> its replacement (keeps aliasing)
        self.tensors: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # name, source, proto

    def split(self, obj: Any, path: str) -> Any:
        key = id(obj)
        if key in self.memo:
            return self.memo[key]
        if isinstance(obj, torch.Tensor):
            proto = _proto(obj, path or "<root>")
            self.tensors.append((path or "<root>", obj, proto))
            out: Any = proto
        elif isinstance(obj, Mapping) and isinstance(obj, dict):
            items = [(k, self.split(v, _join(path, k))) for k, v in obj.items()]
            if type(obj) is dict:
                out = dict(items)
            else:  # OrderedDict, defaultdict, ...: same type, same extra state
                try:
                    out = copy.copy(obj)
                    out.clear()
                    out.update(items)
                except Exception:
                    out = obj  # pickled as it is (its tensors written at the call)
        elif type(obj) is list:
            out = [self.split(v, _join(path, i)) for i, v in enumerate(obj)]
        elif type(obj) is tuple:
            out = tuple(self.split(v, _join(path, i)) for i, v in enumerate(obj))
        elif isinstance(obj, tuple) and hasattr(type(obj), "_make"):  # namedtuple
            out = type(obj)._make(  # type: ignore[attr-defined]
                self.split(v, _join(path, i)) for i, v in enumerate(obj)
            )
        else:
            return obj
        self.memo[key] = out
        return out


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


class _RecordingWriter:
    """Stands in for torch's zip writer during ``_save``: prototype storages become records of
    declared size with no bytes; every other record goes to the real writer."""

    def __init__(self, real: Any, protos: dict[int, int]) -> None:
        self._real = real
        self._protos = protos  # storage _cdata -> tensor index
        self.records: dict[str, int] = {}  # record name ("data/3") -> tensor index

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        idx = self._protos.get(data._cdata) if isinstance(data, torch.UntypedStorage) else None
        if idx is not None and name.startswith("data/"):
            self._real.write_record_metadata(name, nbytes)
            self.records[name] = idx
        else:
            self._real.write_record(name, data, nbytes)

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # pragma: no cover
        raise RuntimeError("plan_archive must not run under torch.serialization.skip_data()")


def plan_archive(obj: Any) -> ArchivePlan:
    """Plans the torch.save archive of ``obj`` (see the module docstring).

    Touches no tensor memory. The returned plan keeps the source tensors referenced; the caller
    must write their bytes as they are at the time it chooses (the snapshot point).

    Raises:
        TypeError: a tensor that cannot be saved (sparse, nested, quantized, meta), naming its
            key path.
    """
    from torch.serialization import _save, get_crc32_options

    sp = _Splitter()
    skeleton = sp.split(obj, "")
    protos = {proto.untyped_storage()._cdata: i for i, (_, _, proto) in enumerate(sp.tensors)}
    buf = _SparseFile()
    real = torch._C.PyTorchFileWriter(buf, get_crc32_options(), 64)  # type: ignore[call-overload]
    rec = _RecordingWriter(real, protos)
    _save(skeleton, rec, pickle, _PROTOCOL, False)
    real.write_end_of_file()
    total = buf.seek(0, 2)
    buf.seek(0)
    payloads: dict[int, tuple[int, int]] = {}  # tensor index -> (offset, bytes)
    with zipfile.ZipFile(buf) as z:
        for info in z.infolist():
            rel = info.filename.split("/", 1)[-1]
            idx = rec.records.get(rel)
            if idx is None:
                continue
            head = _LOCAL_HEADER.unpack(buf.range(info.header_offset, info.header_offset + 30))
            if head[0] != _LOCAL_HEADER_SIG or info.compress_type != zipfile.ZIP_STORED:
                raise RuntimeError(f"unexpected torch.save archive layout at {info.filename}")
            start = info.header_offset + _LOCAL_HEADER.size + head[9] + head[10]
            payloads[idx] = (start, info.file_size)
    if len(payloads) != len(rec.records):
        raise RuntimeError("torch.save archive: a tensor record is missing from the directory")
    tensors: list[ArchiveTensor] = []
    for idx, (name, src, _proto_t) in enumerate(sp.tensors):
        if idx not in payloads:  # pragma: no cover - every prototype storage is serialized
            raise RuntimeError(f"torch.save archive: no record for '{name}'")
        off, n = payloads[idx]
        expected = src.numel() * src.element_size()
        if n != expected:
            raise RuntimeError(f"'{name}': record of {n} bytes, expected {expected}")
        tensors.append(ArchiveTensor(name, src, off, n))
    # The non-payload bytes: the complement of the payload ranges.
    segments: list[tuple[int, bytes]] = []
    pos = 0
    for t in sorted(tensors, key=lambda t: t.payload_offset):
        if t.payload_offset > pos:
            segments.append((pos, buf.range(pos, t.payload_offset)))
        pos = max(pos, t.payload_offset + t.nbytes)
    if total > pos:
        segments.append((pos, buf.range(pos, total)))
    return ArchivePlan(segments=segments, tensors=tensors, total_bytes=total)


def write_archive(plan: ArchivePlan, path: str) -> None:
    """Writes a planned archive synchronously from Python (tests and the no-engine fallback)."""
    with open(path, "wb") as f:
        for off, data in plan.segments:
            f.seek(off)
            f.write(data)
        for t in plan.tensors:
            if t.nbytes:
                f.seek(t.payload_offset)
                src = t.tensor.detach().resolve_conj().resolve_neg().contiguous().cpu()
                f.write(src.reshape(-1).view(torch.uint8).numpy().data)
        f.truncate(plan.total_bytes)


__all__ = ["ArchivePlan", "ArchiveTensor", "plan_archive", "write_archive"]
