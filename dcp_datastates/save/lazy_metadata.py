"""The result DCP broadcasts after a multi-rank ``async_save``: a reference, not the metadata.

Why: once the coordinator committed, DCP's ``save`` broadcasts the checkpoint's ``Metadata`` to
every rank as the save's result (``_DistWrapper.all_reduce``): pickled once on the coordinator
and unpickled on every rank, an object per chunk of every rank (a 70B layout at 256 ranks:
86 MiB, 5.5 s to pickle, 2.6 s to unpickle on each rank, ``benchmarks/scale_sim.py``), for a
result that an ``async_save`` caller rarely reads: its future's value.

What: after the commit of a multi-rank ``async_save``, the coordinator's ``Metadata`` object
becomes a :class:`BroadcastMetadata` (the same object, every field kept: the coordinator's
future holds the whole metadata), which pickles as a :class:`LazyMetadata` naming the
checkpoint. The other ranks receive that (about 100 bytes); its fields are read from the
checkpoint's ``.metadata`` on first access, once. A rank that cannot read the coordinator's
directory (node-local checkpoints) gets the error of that read on first access, naming the path.
``dcp.save`` (whose result callers do read) and one-rank saves broadcast the metadata as DCP
does.

Threads: a :class:`LazyMetadata` loads under a lock; fork: a child reads the file itself.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
_load_lock = threading.Lock()


def _fields_equal(a: Metadata, b: object) -> bool:
    """``Metadata``'s equality by fields, whatever the subclass on either side."""
    if not isinstance(b, Metadata):
        return NotImplemented
    return all(getattr(a, f, None) == getattr(b, f, None) for f in _FIELDS)


class LazyMetadata(Metadata):
    """A checkpoint's ``Metadata`` read from its ``.metadata`` file on first access of a field.

    ``checkpoint`` and ``storage_options`` name where; equal to the ``Metadata`` it loads.
    """

    def __init__(self, checkpoint: str, storage_options: dict[str, Any] | None = None) -> None:
        # No Metadata.__init__: its fields are absent until first read (__getattr__).
        self.__dict__["_checkpoint"] = checkpoint
        self.__dict__["_storage_options"] = dict(storage_options or {})

    def _loaded(self) -> dict[str, Any]:
        """The fields, read from the checkpoint the first time."""
        d = self.__dict__
        with _load_lock:
            if "_fields" not in d:
                loaded = _read(d["_checkpoint"], d["_storage_options"])
                d["_fields"] = {f: getattr(loaded, f, None) for f in _FIELDS}
        return d["_fields"]  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:
        return (LazyMetadata, (self.__dict__["_checkpoint"], self.__dict__["_storage_options"]))

    __eq__ = _fields_equal  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]


def _field(name: str) -> property:
    # A data descriptor: Metadata's class-level defaults (storage_data = None, ...) would
    # otherwise answer before any __getattr__.
    def get(self: LazyMetadata) -> Any:
        return self._loaded()[name]

    def set_(self: LazyMetadata, value: Any) -> None:
        self._loaded()[name] = value

    return property(get, set_)


for _name in _FIELDS:
    setattr(LazyMetadata, _name, _field(_name))


class BroadcastMetadata(Metadata):
    """The coordinator's ``Metadata`` once committed: every field as it was, but pickled as a
    :class:`LazyMetadata` of ``_checkpoint`` (module docstring)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (LazyMetadata, (self.__dict__["_checkpoint"],
                               self.__dict__.get("_storage_options") or {}))

    __eq__ = _fields_equal  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]


def broadcast_as_reference(
    metadata: Metadata, checkpoint: str, storage_options: dict[str, Any] | None
) -> None:
    """Makes ``metadata`` (committed to ``checkpoint``) pickle as a reference to it."""
    metadata.__dict__["_checkpoint"] = checkpoint
    metadata.__dict__["_storage_options"] = dict(storage_options or {})
    metadata.__class__ = BroadcastMetadata


def _read(checkpoint: str, storage_options: dict[str, Any]) -> Metadata:
    import fsspec

    fs, root = fsspec.core.url_to_fs(checkpoint, **storage_options)
    path = root.rstrip("/") + "/.metadata"
    try:
        with fs.open(path, "rb") as f:
            md = pickle.load(f)
    except OSError as e:
        raise OSError(
            f"the metadata of {checkpoint} (this save's result, read on first use) cannot be "
            f"read from this rank: {e}"
        ) from e
    if not isinstance(md, Metadata):
        raise TypeError(f"{path} holds a {type(md).__name__}, not a DCP Metadata")
    return md


__all__ = ["BroadcastMetadata", "LazyMetadata", "broadcast_as_reference"]
