"""Framework checkpoint dicts through DCP, exactly: ``pack`` / ``unpack`` / ``load_packed``.

Frameworks hand their checkpoint engines nested objects that are not DCP state dicts: optimizer
``state`` keyed by ``int``, ``OrderedDict``/``defaultdict`` containers, empty dicts, tuples,
``None`` and arbitrary objects. DCP's flattening loses them (int keys come back as strings, empty
dicts vanish, and a torch optimizer then silently drops its Adam moments). This module is the one
mechanism every adapter uses instead:

* :func:`pack` turns any picklable object into a flat DCP state dict: every tensor found in it is
  one item under a readable path key (``"optimizer_states/0/state/0/exp_avg"``), and the rest,
  the tensor-free *skeleton*, is pickled by us into one ``bytes`` item (:data:`PACKED_KEY`) that
  DCP stores as an opaque value. Tensors are replaced in the pickle by persistent ids, so tensors
  anywhere (inside dataclasses or other objects too) are found, and containers keep their exact
  types, key types, order and emptiness, because pickle preserves them.
* :func:`unpack` is the inverse on the loaded flat dict; :func:`load_packed` loads a checkpoint
  directory with the stock DCP reader (``_EmptyStateDictLoadPlanner``, ``no_dist=True``: each
  process reads on its own, no collective) and unpacks it.

What round-trips exactly (``tests/test_integration_pack.py``): values, dtypes (bf16, fp8,
complex, bool...), shapes (0-dim and empty included), ``nn.Parameter`` and ``requires_grad``,
object identity (a tensor referenced twice comes back as one object) and storage sharing between
distinct tensors (tied weights, views of one buffer come back as views of one storage, as with
``torch.load``). Tensors that share no storage come back contiguous (strides are not kept, values
are). Not supported (``TypeError`` naming the path): tensor subclasses other than
``nn.Parameter`` (DTensor: save those with DCP directly), sparse/quantized/meta tensors.
Devices: :func:`unpack` returns tensors where ``map_location`` says, like ``torch.load``.

Trust model: loading any DCP checkpoint with the stock reader unpickles its ``.metadata`` and its
``bytes`` items with plain ``pickle``/``torch.load(weights_only=False)``; a DCP checkpoint is
therefore trusted data, exactly like a ``torch.load(weights_only=False)`` file. ``load_packed``
keeps that contract by default only when asked to: with ``weights_only=True`` (and with ``None``,
torch's default, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set, as ``torch.load`` decides),
the ``.metadata`` file, the ``bytes`` items and the skeleton are all read with torch's
weights-only unpickler, so loading runs no code beyond what ``torch.load(weights_only=True)``
would (allowlist more classes with ``torch.serialization.add_safe_globals``). Lightning's default
``TorchCheckpointIO`` passes ``weights_only`` through to ``torch.load`` the same way.

Threads: all functions are pure and may run in any thread; :func:`pack` returns tensors that
alias the caller's (no copy); the caller's save (e.g. ``dcp.async_save`` with a
:class:`~dcp_datastates.DataStatesWriter`) decides when they are copied.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch

#: The state-dict key of the packed skeleton (a ``bytes`` item).
PACKED_KEY = "_dcp_datastates/packed"
_MAGIC = b"DCPDS-PACK\x00\x01"
_FORMAT = 1

MapLocation = (
    None
    | str
    | torch.device
    | Mapping[str, str]
    | Callable[[torch.UntypedStorage, str], Any]
)


class PackError(ValueError):
    """A state dict cannot be unpacked: not packed, damaged, or missing a tensor it names."""


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).rsplit(".", 1)[-1]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise PackError(f"packed checkpoint names an unknown dtype {name!r}")
    return dt


def _walk(obj: Any, path: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (path, tensor) for the tensors reachable through dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if isinstance(obj, (dict, list, tuple)):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            yield from _walk(v, f"{path}/{k}" if path else str(k), seen)


class _Collector(pickle.Pickler):
    """Pickles the skeleton; each distinct tensor becomes persistent id ``int`` (its index)."""

    def __init__(self, file: io.BytesIO, paths: dict[int, str]) -> None:
        super().__init__(file, protocol=2)  # torch's weights-only unpickler expects protocol 2
        self.paths = paths
        self.tensors: list[torch.Tensor] = []
        self.index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        i = self.index.get(id(obj))
        if i is None:
            i = len(self.tensors)
            self.index[id(obj)] = i
            self.tensors.append(obj)
        return i


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"pack: {path}: tensor subclass {type(t).__name__} is not supported; save "
            "distributed tensors with torch.distributed.checkpoint directly"
        )
    if t.layout != torch.strided:
        raise TypeError(f"pack: {path}: {t.layout} tensors are not supported (strided only)")
    if t.is_quantized or t.device.type == "meta":
        what = "quantized" if t.is_quantized else "meta"
        raise TypeError(f"pack: {path}: {what} tensors are not supported")


def _unique(path: str, used: set[str]) -> str:
    key, n = path or "_", 1
    while key in used or key == PACKED_KEY:
        n += 1
        key = f"{path}~{n}"
    used.add(key)
    return key


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    s = t.untyped_storage()
    if s.nbytes() == 0:
        return None  # empty storages are never shared in a way that matters
    return (str(t.device), s.data_ptr())


def pack(obj: Any) -> dict[str, Any]:
    """Returns a flat DCP state dict that :func:`unpack` turns back into ``obj`` exactly.

    Tensors are not copied: the returned items alias ``obj``'s tensors (a plain ``detach()``), so
    save it before changing them, or with a writer that snapshots at the call.

    Raises:
        TypeError: a tensor kind that cannot be packed (the message names its path), or an
            object pickle cannot serialise.
    """
    paths: dict[int, str] = {}
    for p, t in _walk(obj, "", set()):
        paths.setdefault(id(t), p)
    buf = io.BytesIO()
    coll = _Collector(buf, paths)
    try:
        coll.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(f"pack: the checkpoint object cannot be pickled: {e}") from e

    used: set[str] = set()
    keys: list[str] = []
    for i, t in enumerate(coll.tensors):
        path = paths.get(id(t), f"_objects/{i}")
        _check_tensor(t, path)
        keys.append(_unique(path, used))

    # Distinct tensors over one storage: saved once, restored as views of one storage.
    groups: dict[tuple[str, int], list[int]] = {}
    for i, t in enumerate(coll.tensors):
        sk = _storage_key(t)
        if sk is not None:
            groups.setdefault(sk, []).append(i)

    out: dict[str, Any] = {}
    entries: list[dict[str, Any]] = [{} for _ in coll.tensors]
    for i, t in enumerate(coll.tensors):
        entries[i] = {
            "dtype": _dtype_name(t.dtype),
            "device": str(t.device),
            "param": isinstance(t, torch.nn.Parameter),
            "requires_grad": bool(t.requires_grad),
        }
    grouped: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        grouped.update(members)
        ts = [coll.tensors[i] for i in members]
        first = ts[0]
        same = all(
            x.dtype == first.dtype
            and x.storage_offset() == first.storage_offset()
            and x.size() == first.size()
            and x.stride() == first.stride()
            for x in ts
        )
        if same:  # tied weights: one readable item, the others alias it
            out[keys[members[0]]] = first.detach()
            entries[members[0]]["key"] = keys[members[0]]
            for i in members[1:]:
                entries[i]["alias"] = members[0]
            continue
        # Different views of one storage: the raw storage once, each tensor as a view of it.
        skey = _unique(keys[members[0]] + "#storage", used)
        storage = first.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=first.device)
        raw.set_(storage, 0, (storage.nbytes(),), (1,))
        out[skey] = raw
        for i, x in zip(members, ts, strict=True):
            entries[i]["view"] = {
                "storage": skey,
                "offset": x.storage_offset(),
                "size": list(x.size()),
                "stride": list(x.stride()),
            }
    for i, t in enumerate(coll.tensors):
        if i not in grouped:
            out[keys[i]] = t.detach()
            entries[i]["key"] = keys[i]

    header = json.dumps({"format": _FORMAT, "tensors": entries}).encode()
    out[PACKED_KEY] = _MAGIC + len(header).to_bytes(8, "little") + header + buf.getvalue()
    return out


def is_packed(state_dict: Mapping[str, Any]) -> bool:
    """True if ``state_dict`` (as loaded) came from :func:`pack`."""
    v = state_dict.get(PACKED_KEY)
    return isinstance(v, (bytes, bytearray)) and bytes(v[: len(_MAGIC)]) == _MAGIC


def _resolve_weights_only(weights_only: bool | None) -> bool:
    if weights_only is not None:
        return weights_only
    force_off = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower()
    return force_off not in ("1", "y", "yes", "true")


def _move(t: torch.Tensor, location: str, map_location: MapLocation) -> torch.Tensor:
    """Places a loaded tensor as ``torch.load(map_location=...)`` would place its storage."""
    if map_location is None:
        target: Any = location
    elif isinstance(map_location, (str, torch.device)):
        target = map_location
    elif isinstance(map_location, Mapping):
        target = map_location.get(location, location)
    else:
        res = map_location(t.untyped_storage(), location)
        same = isinstance(res, torch.UntypedStorage) and (
            res.data_ptr() == t.untyped_storage().data_ptr()
        )
        if res is None or same:
            return t
        if isinstance(res, torch.UntypedStorage):
            out = torch.empty(0, dtype=t.dtype, device=res.device)
            return out.set_(res, 0, t.size(), t.stride())
        target = res
    dev = torch.device(target)
    return t if t.device == dev else t.to(dev)


class _PlainUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return _lookup(self._tensors, pid)


def _lookup(tensors: list[torch.Tensor], pid: Any) -> torch.Tensor:
    if type(pid) is not int or not 0 <= pid < len(tensors):
        raise PackError(f"packed skeleton refers to tensor {pid!r}, which it does not hold")
    return tensors[pid]


def _unpickle(data: bytes, tensors: list[torch.Tensor], weights_only: bool) -> Any:
    if not weights_only:
        return _PlainUnpickler(data, tensors).load()
    from torch import _weights_only_unpickler as wou

    up = wou.Unpickler(io.BytesIO(data), encoding="utf-8")
    up.persistent_load = lambda pid: _lookup(tensors, pid)  # type: ignore[method-assign]
    try:
        return up.load()
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"weights-only load of the packed checkpoint refused an object: {e}. Load with "
            "weights_only=False if you trust this checkpoint, or allowlist the class with "
            "torch.serialization.add_safe_globals"
        ) from e


def unpack(
    state_dict: Mapping[str, Any],
    *,
    map_location: MapLocation = None,
    weights_only: bool | None = False,
) -> Any:
    """Rebuilds the object :func:`pack` packed, from the loaded flat state dict.

    Args:
        state_dict: the flat dict as loaded (``PACKED_KEY`` plus the tensor items).
        map_location: where tensors go, as for ``torch.load``: None (their saved device), a
            device, a ``{saved: new}`` mapping of device strings, or ``fn(storage, location)``.
        weights_only: unpickle the skeleton with torch's weights-only unpickler (``None``:
            torch's default). The default here is False because the caller already loaded the
            items; :func:`load_packed` defaults to ``None``.

    Raises:
        PackError: not a packed state dict, or a tensor item it names is missing (named).
    """
    raw = state_dict.get(PACKED_KEY)
    if raw is None:
        raise PackError(f"not a packed checkpoint: no {PACKED_KEY!r} item")
    data = bytes(raw)
    if data[: len(_MAGIC)] != _MAGIC:
        raise PackError(f"{PACKED_KEY!r} is not a packed skeleton (bad magic)")
    n = int.from_bytes(data[len(_MAGIC) : len(_MAGIC) + 8], "little")
    start = len(_MAGIC) + 8
    try:
        header = json.loads(data[start : start + n])
    except ValueError as exc:
        raise PackError(f"{PACKED_KEY!r}: damaged header: {exc}") from exc
    if header.get("format") != _FORMAT:
        raise PackError(f"{PACKED_KEY!r}: unsupported pack format {header.get('format')!r}")
    entries: list[dict[str, Any]] = header["tensors"]

    def item(key: str) -> torch.Tensor:
        if key not in state_dict:
            raise PackError(f"packed checkpoint is missing tensor item {key!r}")
        return cast(torch.Tensor, state_dict[key])

    moved: dict[str, torch.Tensor] = {}

    def placed(key: str, location: str) -> torch.Tensor:
        if key not in moved:
            moved[key] = _move(item(key), location, map_location)
        return moved[key]

    tensors: list[torch.Tensor] = [torch.empty(0)] * len(entries)
    for i, e in enumerate(entries):  # values and views first, aliases after their target
        if "key" in e:
            tensors[i] = placed(e["key"], e["device"])
            if tensors[i].dtype != _dtype(e["dtype"]):
                raise PackError(
                    f"packed item {e['key']!r} has dtype {tensors[i].dtype}, not {e['dtype']}"
                )
        elif "view" in e:
            v = e["view"]
            base = placed(v["storage"], e["device"])
            t = torch.empty(0, dtype=_dtype(e["dtype"]), device=base.device)
            tensors[i] = t.set_(base.untyped_storage(), v["offset"], v["size"], v["stride"])
    for i, e in enumerate(entries):
        if "alias" in e:
            b = tensors[e["alias"]]
            tensors[i] = torch.empty(0, dtype=b.dtype, device=b.device).set_(
                b.untyped_storage(), b.storage_offset(), b.size(), b.stride()
            )
    for i, e in enumerate(entries):
        if e["param"]:
            tensors[i] = torch.nn.Parameter(tensors[i], requires_grad=e["requires_grad"])
        elif e["requires_grad"]:
            tensors[i].requires_grad_(True)
    return _unpickle(data[start + n :], tensors, _resolve_weights_only(weights_only))


# ------------------------------------------------------------------------------------------------
# Loading with the stock reader, optionally without unpickling anything unsafe


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_NAMES = frozenset({
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
})  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` pickle, resolving only the classes DCP's metadata is made of.

    torch's weights-only unpickler cannot read it (DCP pickles with protocol 4+), so this is the
    same idea with an explicit allowlist: DCP's metadata dataclasses, ``_StorageInfo``,
    ``torch.Size``, dtypes, layouts, and whatever ``torch.serialization.add_safe_globals``
    allowlisted. Any other global is refused, so no code runs.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE and name in _METADATA_NAMES:
            return super().find_class(module, name)
        if (module, name) in (
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"),
            ("pathlib", "PosixPath"),  # FileSystemWriter records checkpoint_id as a Path
            ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),
        ):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        for g in torch.serialization.get_safe_globals():
            obj = g[0] if isinstance(g, tuple) else g
            full = g[1] if isinstance(g, tuple) else f"{obj.__module__}.{obj.__qualname__}"
            if full == f"{module}.{name}":
                return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _safe_reader(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _WeightsOnlyReader(FileSystemReader):
        """The stock FileSystemReader, reading ``.metadata`` without running code."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            mpath = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(mpath, "rb") as f:
                try:
                    md = _MetadataUnpickler(f).load()
                except pickle.UnpicklingError as e:
                    raise pickle.UnpicklingError(
                        f"{mpath}: weights-only load of the checkpoint metadata refused an "
                        f"object: {e}; load with weights_only=False if you trust it"
                    ) from e
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _WeightsOnlyReader(path)


def _planner(weights_only: bool) -> Any:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class _Planner(_EmptyStateDictLoadPlanner):
        """Rebuilds the flat dict from the metadata; bytes items with the chosen unpickler."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=weights_only)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _Planner()


def load_flat(path: str | os.PathLike[str], *, weights_only: bool | None = None) -> dict[str, Any]:
    """Loads every item of the DCP checkpoint at ``path`` into a new flat dict, in this process.

    Uses the stock reader (``FileSystemReader``, or ``FsspecReader`` for URLs) and
    ``no_dist=True`` (no collective: each process reads on its own). ``weights_only``: see the
    module docstring (trust model).

    Raises:
        FileNotFoundError: ``path`` holds no ``.metadata`` (not a committed checkpoint).
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    p = os.fspath(path)
    wo = _resolve_weights_only(weights_only)
    if "://" not in p and not os.path.exists(os.path.join(p, ".metadata")):
        raise FileNotFoundError(f"{p}: not a committed DCP checkpoint (no .metadata)")
    sd: dict[str, Any] = {}
    if wo and "://" not in p:
        reader: Any = _safe_reader(p)
    elif wo:
        raise ValueError(
            f"{p}: weights_only=True is supported for local paths only; pass weights_only=False "
            "for fsspec URLs you trust"
        )
    elif "://" in p:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(p)
    else:
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(p)
    # dcp.load() fills a copy of the dict it is given; the private loader fills ours (this is
    # what torch's own dcp_to_torch_save does with _EmptyStateDictLoadPlanner).
    _load_state_dict(sd, storage_reader=reader, planner=_planner(wo), no_dist=True)
    return sd


def load_packed(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    weights_only: bool | None = None,
) -> Any:
    """Loads a checkpoint saved from :func:`pack` with the stock DCP reader and unpacks it.

    ``map_location`` and ``weights_only`` as for ``torch.load`` (see :func:`unpack` and the
    module docstring's trust model). Needs no process group (``no_dist=True``).

    Raises:
        FileNotFoundError: no committed checkpoint at ``path``.
        PackError: the checkpoint was not written from :func:`pack` (the message names the path).
    """
    sd = load_flat(path, weights_only=weights_only)
    if not is_packed(sd):
        raise PackError(f"{os.fspath(path)}: not a packed checkpoint (no {PACKED_KEY!r} item)")
    return unpack(sd, map_location=map_location, weights_only=weights_only)
