"""The automatic step barrier: ``optimizer.step()`` waits for the lazy copies of its own tensors.

Parameters and optimizer state change only inside ``optimizer.step()``. So a save may copy them
*lazily*, in the background, while forward and backward run, as long as the next step of the
optimizer that owns them waits until those copies are in the host cache. This module makes that
happen with no trainer edit: importing the package installs one process-wide optimizer step
pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``), which fires for every
``torch.optim.Optimizer`` subclass, ``ZeroRedundancyOptimizer`` and DeepSpeed's ZeRO 0-2
optimizers alike. The hook

* remembers the optimizer (a weak reference): a tensor is *owned* by an optimizer if it is one
  of its parameters or state tensors, and only owned tensors are ever captured lazily under the
  default ``capture="auto"`` (everything else is snapshotted at the save call);
* asks every live :class:`~dcp_datastates.DataStatesWriter` to wait for the saves in flight that
  hold lazy tensors of this optimizer (and for saves made with ``capture="lazy"``, which may hold
  lazy tensors nobody owns).

Why this is exact: an owned tensor is modified by its optimizer's ``step()`` (which waits), by
nothing else in a normal loop. Code that modifies a parameter in place outside ``step()`` (weight
tying tricks, manual clipping of the weights, EMA updates written into the parameters) before the
copy lands is detected by the tensor's version counter and fails that save with
:class:`~dcp_datastates.CaptureError`; it is never written torn. Not detected: writes through
another alias that bypass autograd's version counter (``tensor.data`` of a different Python
object, raw pointers, in-place ops under ``torch.no_grad`` on ``.data``), see
docs/architecture.md.

Threads: the hook runs in the thread that calls ``step()``. Failures of the save it waits for are
not raised from ``step()`` (training goes on): they are raised by the save's future, logged at
the next save, and raised once by ``writer.wait()`` if nobody read them from the future.
``writer.protect(optimizer)`` remains as the explicit, raising form.
Fork: the registries hold weak references only; a forked child inherits the hook, which finds
no writer it may use (writers refuse to work in a child) and returns at once.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

logger = logging.getLogger(__name__)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]


class _Waiter(Protocol):
    def _step_barrier(self, optimizer: torch.optim.Optimizer) -> None: ...


_lock = threading.Lock()
_writers: weakref.WeakSet[Any] = weakref.WeakSet()
_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_handle: Any = None


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer not in _optimizers:
        with _lock:
            _optimizers.add(optimizer)
    if not _writers:
        return
    with _lock:
        writers = list(_writers)
    for w in writers:
        w._step_barrier(optimizer)


def install() -> None:
    """Installs the process-wide optimizer step pre-hook (idempotent)."""
    global _handle
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_pre_step)


def register_writer(writer: _Waiter) -> None:
    """Makes ``writer`` take part in the step barrier (weakly referenced)."""
    install()
    with _lock:
        _writers.add(writer)


def unregister_writer(writer: _Waiter) -> None:
    with _lock:
        _writers.discard(writer)


def remember_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Marks an optimizer as known before its first step (``writer.protect`` does this)."""
    with _lock:
        _optimizers.add(optimizer)


def known_optimizers() -> list[torch.optim.Optimizer]:
    """Every optimizer that has stepped (or was protected) and is still alive."""
    with _lock:
        return list(_optimizers)


def default_world_size() -> int:
    """Ranks in torch.distributed's default group (1 when it is not initialized)."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def _local(t: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(t, DTensor):
        return t._local_tensor
    return t


def owned_storages(optimizers: Iterable[torch.optim.Optimizer]) -> dict[int, int]:
    """Maps the storage address of every parameter and state tensor to ``id(optimizer)``."""
    owners: dict[int, int] = {}
    plain = (torch.Tensor, torch.nn.Parameter)

    def add(t: Any, owner: int) -> None:
        if type(t) not in plain:  # the common cases go on without the subclass checks
            if not isinstance(t, torch.Tensor):
                return
            t = _local(t)
        if t.numel() > 0 and not t.is_meta:
            owners.setdefault(t.untyped_storage().data_ptr(), owner)

    for opt in optimizers:
        for o in (opt, getattr(opt, "optim", None)):  # ZeroRedundancyOptimizer wraps `optim`
            if o is None:
                continue
            for group in getattr(o, "param_groups", ()):
                for p in group.get("params", ()):
                    add(p, id(opt))
            for st in getattr(o, "state", {}).values():
                if isinstance(st, Mapping):
                    for v in st.values():
                        add(v, id(opt))
    return owners


def owner_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids a job may record for ``optimizer`` (itself and a wrapped inner optimizer)."""
    ids = {id(optimizer)}
    inner = getattr(optimizer, "optim", None)
    if inner is not None:
        ids.add(id(inner))
    return ids


install()  # at import: optimizers that step before the first writer exists are known too
