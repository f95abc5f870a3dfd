"""Nanotron (the DataStates fork's ``CheckpointEngine`` interface) on a DataStatesWriter.

The DataStates fork of Nanotron (``thomas-bouvier/nanotron``, branch ``datastates``) selects its
checkpoint engine from the YAML key ``checkpoints.checkpointing_engine: datastates`` through the
module dict ``nanotron.serialize.engine._CONFIG_TO_CHECKPOINT_ENGINE_CLASS`` and builds it with
``config=asdict(config.datastates)`` (``host_cache_size``, ``parser_threads``,
``pin_host_cache``). :func:`install` puts :class:`DataStatesNanotronEngine` behind that key, so
the user's YAML stays as it is::

    import dcp_datastates.integrations.nanotron as ds_nanotron
    ds_nanotron.install()          # before DistributedTrainer(...)

The engine interface (the fork's ``CheckpointEngine``): ``save(state_dict, path, metadata)``
once per file (per-parameter ``{"data": tensor}`` files with their ``TensorMetadata``, optimizer,
scheduler and random states), ``load(path, framework, device)`` returning a parameter file's
``"data"`` tensor, ``load_unsafe(path, map_location)`` returning any other file's object, and
``wait()``, which the trainer calls before each optimizer step. The fork also reads two class
attributes: ``TENSOR_SUFFIX`` (parameter file names) and ``CHECKPOINT_VERSION``, recorded in
``checkpoint_metadata.json`` and in each sharded parameter's ``TensorMetadata`` and compared at
resume (ours is 2.0: the fork's own DataStates engine, 1.0, refuses our checkpoints, and ours
refuses its single files by name). The fork's trainer never closes its engine: call
``trainer.checkpoint_engine.close()`` after training so the last checkpoint is durable.

What this engine guarantees, beyond the fork's own:

* **Every state resumes**, optimizer included: each file is a DCP checkpoint directory at
  ``path`` written from :func:`dcp_datastates.integrations.pack.pack`, so int keys, OrderedDicts
  and empty containers come back exactly (the fork saves optimizer state in its own format but
  loads it with ``torch.load``, which cannot read it).
* ``save`` returns once the state is registered: optimizer-owned tensors are copied in the
  background and the owning optimizer's next ``step()`` waits for them (the automatic step
  barrier); everything else is copied at the call. ``wait()`` waits for every save's snapshot.
* ``load``/``load_unsafe`` first wait until the saves in flight to that path are durable; a path
  whose save never completed has no ``.metadata`` and fails with ``FileNotFoundError`` naming it.
  Nanotron writes ``latest.txt`` right after issuing the saves, before they are durable: call
  :meth:`DataStatesNanotronEngine.wait_persisted` (or ``close``) before trusting it after a crash.

Threads: ``save``/``load``/``wait`` from the training thread; each save runs in DCP's save thread.
Failures: a failed save is raised by the next ``wait_persisted`` (and logged by ``close``), and
by ``load`` of that path. CPU tensors and CUDA tensors both work; the fork's engine required CUDA.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..save.writer import DataStatesWriter
from .config import writer_kwargs
from .pack import load_packed, pack

logger = logging.getLogger(__name__)

__all__ = ["DataStatesNanotronEngine", "install"]

try:  # the fork's abstract base class, when the fork is installed
    from nanotron.serialize.engine import CheckpointEngine as _Base  # type: ignore[import-not-found]
except ImportError:  # upstream nanotron has no engine interface; stand alone
    _Base = object

#: Format version the fork records in ``checkpoint_metadata.json`` and each ``TensorMetadata``
#: and compares at resume (a checkpoint newer than the engine is refused). Above the fork's own
#: DataStates engine (1.0), whose files are another format: it refuses ours by that check.
_CHECKPOINT_VERSION = "2.0"


def _checkpoint_version() -> Any:
    """``packaging.version.Version`` (what the fork compares), or the text without packaging."""
    try:
        from packaging.version import Version
    except ImportError:  # the fork depends on packaging; without the fork nothing compares it
        return _CHECKPOINT_VERSION
    return Version(_CHECKPOINT_VERSION)


def _metadata_dict(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if hasattr(metadata, "to_str_dict"):
        return dict(metadata.to_str_dict())
    if isinstance(metadata, Mapping):
        return {str(k): str(v) for k, v in metadata.items()}
    raise TypeError(
        f"metadata must be a TensorMetadata or a mapping, not {type(metadata).__name__}"
    )


class DataStatesNanotronEngine(_Base):  # type: ignore[misc,valid-type]
    """Nanotron checkpoint engine on a :class:`~dcp_datastates.DataStatesWriter` (see module)."""

    TENSOR_SUFFIX = "datastates"
    CHECKPOINT_VERSION: Any = _checkpoint_version()

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config) if config is not None else None
        self._writer = DataStatesWriter("", **writer_kwargs(config, where="datastates"))
        self._lock = threading.Lock()
        self._pending: dict[str, Future[Any]] = {}

    @property
    def writer(self) -> DataStatesWriter:
        return self._writer

    def save(
        self, state_dict: dict[str, Any], path: str | os.PathLike[str], metadata: Any = None
    ) -> None:
        """Saves ``state_dict`` as a checkpoint directory at ``path``; returns at once."""
        key = os.fspath(path)
        if metadata is not None and not (
            isinstance(state_dict, Mapping) and isinstance(state_dict.get("data"), torch.Tensor)
        ):
            raise ValueError(f"{key}: tensor metadata given, but the state has no 'data' tensor")
        self._drain(key)  # one save per path at a time (a second save replaces the first)
        packed = pack({"state": state_dict, "metadata": _metadata_dict(metadata)})
        fut = dcp.async_save(packed, storage_writer=self._writer, checkpoint_id=key, no_dist=True)
        assert isinstance(fut, Future)  # our writer is the stager: a plain Future
        with self._lock:
            self._pending[key] = fut

    def load(
        self, path: str | os.PathLike[str], framework: str = "pt", device: str = "cpu"
    ) -> torch.Tensor:
        """The ``"data"`` tensor of a parameter file, on ``device``."""
        if framework != "pt":
            raise ValueError(f"{os.fspath(path)}: only framework='pt' is supported")
        obj = self._load(path, map_location=device, weights_only=True)
        data = obj["state"].get("data") if isinstance(obj["state"], Mapping) else None
        if not isinstance(data, torch.Tensor):
            raise KeyError(f"{os.fspath(path)}: not a parameter file (no 'data' tensor)")
        return data

    def load_unsafe(self, path: str | os.PathLike[str], map_location: Any = None) -> Any:
        """Any file's saved object (optimizer, scheduler, random states), like ``torch.load``."""
        return self._load(path, map_location=map_location, weights_only=False)["state"]

    def load_metadata(self, path: str | os.PathLike[str]) -> dict[str, str] | None:
        """The tensor metadata saved with a parameter file (as ``TensorMetadata.to_str_dict``)."""
        meta: dict[str, str] | None = self._load(path, None, weights_only=True)["metadata"]
        return meta

    def wait(self) -> None:
        """Waits until every save's snapshot is taken (the trainer calls it before a step)."""
        self._writer.wait_captured()

    def wait_persisted(self) -> None:
        """Waits until every save is durable; raises the first failure (naming its path)."""
        with self._lock:
            pending = list(self._pending.items())
        for key, fut in pending:
            self._result(key, fut)

    def close(self) -> None:
        """Waits for the saves in flight (failures are logged), then frees the host cache."""
        try:
            self.wait_persisted()
        except Exception as e:  # noqa: BLE001 - close must release the writer
            logger.error("a Nanotron checkpoint save failed: %s", str(e))
        finally:
            self._writer.close()

    # -- internals -------------------------------------------------------------------------
    def _result(self, key: str, fut: Future[Any]) -> None:
        try:
            fut.result()
        except BaseException as e:
            raise RuntimeError(f"saving the Nanotron checkpoint file {key} failed: {e}") from e
        finally:
            with self._lock:
                if self._pending.get(key) is fut:
                    del self._pending[key]

    def _drain(self, key: str) -> None:
        with self._lock:
            fut = self._pending.get(key)
        if fut is not None:
            self._result(key, fut)

    def _load(self, path: str | os.PathLike[str], map_location: Any, weights_only: bool) -> Any:
        key = os.fspath(path)
        self._drain(key)
        if os.path.isfile(key):
            raise ValueError(
                f"{key}: a single file, not a checkpoint directory written by "
                "DataStatesNanotronEngine; another Nanotron checkpoint engine wrote it "
                "(resume it with that engine)"
            )
        return load_packed(key, map_location=map_location, weights_only=weights_only)


def install() -> None:
    """Puts :class:`DataStatesNanotronEngine` behind ``checkpointing_engine: datastates``.

    Rebinds the ``DATASTATES`` entry of the fork's
    ``nanotron.serialize.engine._CONFIG_TO_CHECKPOINT_ENGINE_CLASS``. Raises ImportError naming
    what is missing when the installed Nanotron has no checkpoint-engine interface (upstream
    Nanotron does not: it needs the DataStates fork).
    """
    try:
        from nanotron.config import CheckpointingEngineType  # type: ignore[import-not-found]
        from nanotron.serialize import engine  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError(
            "dcp_datastates.integrations.nanotron.install() needs a Nanotron with a checkpoint "
            f"engine interface (the DataStates fork: nanotron.serialize.engine): {e}"
        ) from e
    table = engine._CONFIG_TO_CHECKPOINT_ENGINE_CLASS
    table[CheckpointingEngineType.DATASTATES] = DataStatesNanotronEngine
