"""torchtitan: a ``CheckpointManager`` whose DCP saves go through a DataStatesWriter.

torchtitan builds its checkpointer from ``Trainer.Config.checkpoint`` (any
``BaseCheckpointManager.Config``); it has no option for a custom storage writer, so the seam is a
subclass with its own ``Config``. In a torchtitan config_registry function, the one line is::

    from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager

    checkpoint=DataStatesCheckpointManager.Config(
        enable=True, interval=500, async_mode="async",
        datastates={"host_cache_size": 16},            # DataStates keys or writer arguments
    ),

What changes against torchtitan's own manager (``torchtitan.components.checkpointer.dcp``):

* ``async_mode="async"`` and ``"async_with_pinned_mem"`` both save with ``dcp.async_save`` and
  our writer as the stager, in a thread (DCP's ``PROCESS`` mode would have to pickle the writer;
  our host cache and copy threads live in this process). The call returns after the at-call
  snapshot; the optimizer's next ``step()`` waits only for the lazy copies of its own tensors
  (the process-wide step barrier of :mod:`dcp_datastates.save.barrier`), so torchtitan's
  ``maybe_wait_for_staging()`` has nothing left to wait for. One save stays in flight at a time,
  as in torchtitan (its ``maybe_wait_for_saving`` before the next save).
* ``async_mode="disabled"`` saves with ``dcp.save`` through the same writer.
* HF saves (``last_save_in_hf``) and every load are torchtitan's own: checkpoints stay stock
  DCP directories (``step-N/.metadata`` is the commit torchtitan's step discovery looks for),
  loaded by the stock reader.
* The writer (one host cache, reused by every save) is created at the first save under the
  checkpoint folder and closed by ``close()``, after the saves in flight are durable.

Threads: saves are issued from the training thread; DCP runs each asynchronous save in its own
thread. Failures: a failed save raises from its future, which torchtitan reads in
``maybe_wait_for_saving`` (before the next save) and at ``close()``.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager

from ..save.planner import planner
from ..save.writer import DataStatesWriter
from .config import writer_kwargs

__all__ = ["DataStatesCheckpointManager"]


class DataStatesCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with its DCP saves going through a DataStatesWriter.

    Config fields beyond torchtitan's: ``datastates``, a mapping of DataStates keys
    (``host_cache_size``, ``parser_threads``, ``pin_host_cache``) and/or
    :class:`~dcp_datastates.DataStatesWriter` arguments; unknown keys raise ValueError naming
    the key when the config is created. The default ``async_mode`` is ``"async"``.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        async_mode: str = "async"  # type: ignore[assignment]
        """``"async"`` (default) or ``"async_with_pinned_mem"``: ``dcp.async_save`` with the
        DataStatesWriter as stager (both the same here); ``"disabled"``: ``dcp.save``."""

        datastates: dict[str, Any] = dataclasses.field(default_factory=dict)
        """DataStates settings (``host_cache_size``, ...) or DataStatesWriter arguments."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            writer_kwargs(self.datastates, where="checkpoint.datastates")  # fail early, by name

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self._writer_kwargs = writer_kwargs(config.datastates, where="checkpoint.datastates")
        self._writer: DataStatesWriter | None = None
        mode: AsyncMode = self.async_mode  # type: ignore[has-type]
        if mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # Our writer stages into its own (pinned when CUDA is used) host cache; torchtitan's
            # PROCESS-mode path with a DefaultStager would bypass it.
            self.async_mode = mode = AsyncMode.ASYNC
        if mode == AsyncMode.ASYNC and self.pg is None:
            raise RuntimeError("torchtitan did not create the gloo group for asynchronous saves")

    @property
    def writer(self) -> DataStatesWriter:
        """The writer (created at the first save under the checkpoint folder)."""
        if self._writer is None or self._writer.closed:
            self._writer = DataStatesWriter(os.fspath(self.folder), **self._writer_kwargs)
        return self._writer

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | Any | None:
        """Saves through the DataStatesWriter (HF exports keep torchtitan's own writer)."""
        if to_hf:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf=True
            )
        writer = self.writer
        if async_mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
            return dcp.async_save(
                state_dict,
                storage_writer=writer,
                checkpoint_id=checkpoint_id,
                process_group=self.pg,
                planner=planner(),
            )
        dcp.save(
            state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, planner=planner()
        )
        return None

    def _close(self) -> None:
        try:
            future: Future[Any] | None = getattr(self, "save_future", None)
            if future is not None:
                future.result()
                self.save_future = None
        finally:
            try:
                super()._close()
            finally:
                writer = getattr(self, "_writer", None)
                if writer is not None:
                    writer.close()
                    self._writer = None
