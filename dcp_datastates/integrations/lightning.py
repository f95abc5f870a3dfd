"""Lightning (``lightning`` >= 2.4) on DataStatesWriter: one plugin or one strategy argument.

Single device and DDP (``strategy="auto" | "ddp" | "ddp_spawn"``)::

    from dcp_datastates.integrations.lightning import DataStatesCheckpointIO
    trainer = Trainer(plugins=[DataStatesCheckpointIO(host_cache_size=16)], ...)

FSDP2 / tensor parallel (``ModelParallelStrategy``)::

    from dcp_datastates.integrations.lightning import DataStatesModelParallelStrategy
    trainer = Trainer(strategy=DataStatesModelParallelStrategy(host_cache_size=16), ...)

Both take a DataStates config mapping (``{"host_cache_size": 16, "parser_threads": 2,
"pin_host_cache": True}``) and/or any :class:`~dcp_datastates.DataStatesWriter` keyword; an
unknown key is a ``ValueError`` naming it (:mod:`dcp_datastates.integrations.config`).

What is guaranteed (``tests/test_integration_lightning.py``):

* A save call returns once the state is registered with the writer (milliseconds); parameters
  and optimizer state are copied in the background, and the global optimizer step pre-hook
  (:mod:`dcp_datastates.save.barrier`, installed when ``dcp_datastates`` is imported) makes the next
  ``optimizer.step()`` of Lightning's torch optimizer wait for those copies. Each checkpoint
  holds the state at the save call, bit for bit; a resumed ``Trainer`` continues exactly.
* :class:`DataStatesCheckpointIO` writes each checkpoint path (``epoch=0-step=4.ckpt``) as a DCP
  directory through :mod:`~dcp_datastates.integrations.pack`, so Lightning's checkpoint dict (int
  keys, empty dicts, callbacks' state, hyper-parameters) comes back exactly. Lightning calls it
  on global rank 0 only, so it saves with ``no_dist=True`` (no collective). ``.ckpt`` *files*
  written by Lightning's default ``TorchCheckpointIO`` still load through it.
* One save per path at a time: a second save to a path (``last.ckpt``) waits for the first.
  ``load_checkpoint`` and ``remove_checkpoint`` (``ModelCheckpoint(save_top_k=k)`` rotation)
  wait for the save to that path first; ``teardown`` (end of ``fit``) waits for every save and
  frees the host cache, so a checkpoint is durable when ``fit`` returns.
* A failed save is never lost: its error (a :class:`~dcp_datastates.CheckpointSaveError` naming
  the path) is raised by the first save started after it failed, by a load of that path, or
  by ``teardown``.
* :class:`DataStatesModelParallelStrategy` is ``ModelParallelStrategy`` whose distributed
  checkpoints go through ``dcp.async_save`` with a DataStatesWriter on a dedicated gloo group
  (training collectives are not shared with the save thread). Lightning's strategy calls the
  module-level ``_distributed_checkpoint_save`` (a plain ``dcp.save``, no writer argument); the
  subclass rebinds that one name in ``lightning.pytorch.strategies.model_parallel`` for the
  duration of its own ``save_checkpoint`` call only (training thread), so nothing else is
  patched. Loading is Lightning's own (stock ``dcp.load``), after draining.

Threads: the hooks run in the training thread; each save runs in DCP's async-save thread.
Fork/spawn: the writer is created at the first save, in the process that saves (a plugin made
before DDP launches its processes carries only its settings).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.strategies import ModelParallelStrategy

from ..errors import CheckpointSaveError
from ..save.planner import planner
from .config import writer_kwargs
from .pack import MapLocation, load_packed, pack

logger = logging.getLogger(__name__)

__all__ = ["DataStatesCheckpointIO", "DataStatesModelParallelStrategy", "SaveTracker"]


def _merge(config: Mapping[str, Any] | None, kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    merged = dict(writer_kwargs(config, where=where))
    for key, value in writer_kwargs(kwargs, where=where).items():
        if key in merged:
            raise ValueError(f"{where}: {key!r} is given both in the config and as an argument")
        merged[key] = value
    return merged


def _error_of(fut: Future[Any]) -> BaseException | None:
    try:
        fut.result()
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        return e
    return None


def _drain_and_close(owner: Any, then: Callable[[], None] | None = None) -> None:
    """Waits for ``owner``'s saves, closes its writer (then runs ``then``, even on failure),
    then raises a failure nobody has seen yet."""
    try:
        owner._saves.drain_all()
    finally:
        if owner._writer is not None:
            owner._writer.close()
            owner._writer = None
        if then is not None:
            then()
    owner._saves.raise_failed()


class SaveTracker:
    """Futures of the saves in flight by path; failed saves kept until reported (once).

    Not thread-safe: frameworks call their checkpoint hooks from the training thread.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._pending: dict[str, Future[Any]] = {}
        self._failed: list[tuple[str, BaseException]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, path: str, fut: Future[Any]) -> None:
        """Records the save to ``path`` (the caller drained any earlier one first)."""
        self._pending[path] = fut

    def drain(self, path: str | os.PathLike[str]) -> None:
        """Waits for the save to ``path``, if any; a failure is kept for :meth:`raise_failed`."""
        key = os.fspath(path)
        fut = self._pending.pop(key, None)
        if fut is None:
            return
        err = _error_of(fut)
        if err is not None:
            logger.error("%s: checkpoint save to %s failed: %s", self._what, key, str(err))
            self._failed.append((key, err))

    def drain_all(self) -> None:
        for path in list(self._pending):
            self.drain(path)

    def collect_done(self) -> None:
        """Takes the saves that have ended out of the table (recording their failures)."""
        for path, fut in list(self._pending.items()):
            if fut.done():
                self.drain(path)

    def raise_failed(self, path: str | None = None) -> None:
        """Raises the first failure not reported yet (only ``path``'s, if given), once."""
        for i, (p, err) in enumerate(self._failed):
            if path is None or p == path:
                del self._failed[i]
                more = f" ({len(self._failed)} more failed saves)" if self._failed else ""
                raise CheckpointSaveError(
                    f"{self._what}: the checkpoint save to {p} failed: "
                    f"{type(err).__name__}: {err}{more}"
                ) from err


class DataStatesCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO``: asynchronous, exact checkpoints through one DataStatesWriter.

    Args:
        config: DataStates-style settings (``host_cache_size`` GiB, ``parser_threads``,
            ``pin_host_cache``) and/or DataStatesWriter keywords.
        **kwargs: the same settings as keywords (a key may not be in both).

    Do not wrap it in Lightning's ``AsyncCheckpointIO`` (that clones every tensor first, the
    cost this plugin removes).
    """

    def __init__(self, config: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__()
        self._writer_kwargs = _merge(config, kwargs, "DataStatesCheckpointIO")
        self._writer: Any = None
        self._saves = SaveTracker("DataStatesCheckpointIO")

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the trainer's plugins
        state = self.__dict__.copy()
        state["_writer"] = None
        state["_saves"] = SaveTracker("DataStatesCheckpointIO")
        return state

    @property
    def writer(self) -> Any:
        """The DataStatesWriter, created on first use in this process and reused by every save."""
        if self._writer is None or self._writer.closed:
            from ..save.writer import DataStatesWriter

            self._writer = DataStatesWriter("", **self._writer_kwargs)
        return self._writer

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Starts an asynchronous save of ``checkpoint`` to the directory ``path``; returns at once.

        Raises:
            TypeError: ``storage_options`` given (not supported, as for TorchCheckpointIO).
            CheckpointSaveError: an earlier save failed and was not reported yet (names its path).
        """
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                "DataStatesCheckpointIO; configure the writer through its settings instead"
            )
        key = os.fspath(path)
        self._saves.collect_done()
        self._saves.drain(key)  # one save per path: `last.ckpt` is saved again and again
        self._saves.raise_failed()
        fs = get_filesystem(key)
        if fs.isfile(key):  # a torch.save file from an earlier run at this name
            fs.rm(key)
        payload = pack(checkpoint)
        fut = dcp.async_save(payload, storage_writer=self.writer, checkpoint_id=key, no_dist=True)
        self._saves.start(key, cast("Future[Any]", fut))

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: MapLocation = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Loads a checkpoint (after the save to it, if any, is durable).

        A directory written by this plugin is read with the stock DCP reader and unpacked; a
        ``.ckpt`` file (Lightning's default format) is read with ``TorchCheckpointIO``.
        ``weights_only`` as for ``torch.load`` (None: torch's default), see
        :mod:`~dcp_datastates.integrations.pack` for the trust model.

        Raises:
            FileNotFoundError: nothing at ``path`` (the message names it).
            CheckpointSaveError: the save to ``path`` failed.
        """
        key = os.fspath(path)
        self._saves.drain(key)
        self._saves.raise_failed(key)
        fs = get_filesystem(key)
        if not fs.exists(key):
            raise FileNotFoundError(f"Checkpoint file not found: {key}")
        if fs.isfile(key):
            return TorchCheckpointIO().load_checkpoint(
                key, map_location=cast(Any, map_location), weights_only=weights_only
            )
        obj = load_packed(key, map_location=map_location, weights_only=weights_only)
        if not isinstance(obj, dict):
            raise TypeError(f"{key}: holds a {type(obj).__name__}, not a Lightning checkpoint")
        return obj

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Removes the checkpoint at ``path`` after the save to it (if any) has ended."""
        key = os.fspath(path)
        self._saves.drain(key)  # a failure is still reported at the next save / teardown
        fs = get_filesystem(key)
        if fs.exists(key):
            fs.rm(key, recursive=True)
            logger.debug("removed checkpoint %s", key)

    def wait(self) -> None:
        """Blocks until every save started so far is durable; raises an unreported failure."""
        self._saves.drain_all()
        self._saves.raise_failed()

    def teardown(self) -> None:
        """Waits for every save, frees the writer (cache, threads), raises an unreported failure."""
        _drain_and_close(self)


@contextlib.contextmanager
def _rebind(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class DataStatesModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / TP) whose distributed checkpoints use DataStatesWriter.

    Args:
        datastates: DataStates-style settings for the writer (see DataStatesCheckpointIO).
        *args, **kwargs: ``ModelParallelStrategy``'s own arguments, plus writer keywords
            (``host_cache_size``, ...), which are taken out before the parent sees them.

    Saves are ``dcp.async_save`` calls on every rank (a dedicated gloo group is created, on
    every rank, at the first save); ``save_distributed_checkpoint=False`` (a full state dict on
    rank 0) stays Lightning's own synchronous path.
    """

    def __init__(
        self, *args: Any, datastates: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        import inspect

        own = set(inspect.signature(ModelParallelStrategy.__init__).parameters)
        writer_opts = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
        super().__init__(*args, **kwargs)
        self._writer_kwargs = _merge(datastates, writer_opts, type(self).__name__)
        self._writer: Any = None
        self._ckpt_group: Any = None
        self._saves = SaveTracker(type(self).__name__)

    @property
    def writer(self) -> Any:
        """The DataStatesWriter of this process (created at the first save)."""
        if self._writer is None or self._writer.closed:
            from ..save.writer import DataStatesWriter

            self._writer = DataStatesWriter("", **self._writer_kwargs)
        return self._writer

    def _async_dcp_save(self, converted_state: dict[str, Any], path: Path) -> None:
        if self._ckpt_group is None:
            self._ckpt_group = dist.new_group(backend="gloo")
        key = os.fspath(path)
        # our writer is the stager and stages synchronously: async_save returns a plain future
        fut = cast("Future[Any]", dcp.async_save(
            converted_state,
            storage_writer=self.writer,
            checkpoint_id=key,
            process_group=self._ckpt_group,
            planner=planner(),
        ))
        self._saves.start(key, fut)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Lightning's save, with the distributed checkpoint written asynchronously by us."""
        import lightning.pytorch.strategies.model_parallel as mp_module

        path = Path(self.broadcast(filepath))
        self._saves.collect_done()
        self._saves.drain(os.fspath(path))
        self._saves.raise_failed()
        with _rebind(mp_module, "_distributed_checkpoint_save", self._async_dcp_save):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Lightning's load (stock ``dcp.load``) after the save to that path is durable."""
        path = Path(self.broadcast(checkpoint_path))
        self._saves.drain(os.fspath(path))
        self._saves.raise_failed(os.fspath(path))
        return super().load_checkpoint(path, weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        self._saves.drain(os.fspath(filepath))
        super().remove_checkpoint(filepath)

    def teardown(self) -> None:
        """Waits for every save, frees the writer, then Lightning's teardown; raises a failure."""
        _drain_and_close(self, then=super().teardown)
