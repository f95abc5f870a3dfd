"""HF Accelerate (FSDP) on DataStatesWriter: one line before training.

Accelerate saves FSDP state with ``accelerate.utils.fsdp_utils.save_fsdp_model`` and
``save_fsdp_optimizer`` (called by ``Accelerator.save_state`` and by the Transformers
``Trainer``), which hard-code ``torch.distributed.checkpoint.FileSystemWriter(ckpt_dir)`` and
offer no writer option. The smallest supported route::

    from dcp_datastates.integrations import accelerate as ds_accelerate
    ds_accelerate.enable(host_cache_size=16)      # or enable({"host_cache_size": 16, ...})
    ...
    accelerator.save_state(output_dir)            # model and optimizer via DataStatesWriter

or scoped: ``with ds_accelerate.datastates_fsdp_saves(host_cache_size=16): ...``.

How (and what is touched): :func:`enable` rebinds the two names ``save_fsdp_model`` and
``save_fsdp_optimizer`` in ``accelerate.utils.fsdp_utils``, ``accelerate.utils``,
``accelerate.accelerator`` and, if already imported, ``transformers.trainer`` (modules imported
later take the rebound name from ``accelerate.utils``) to wrappers that call Accelerate's own
function. While a wrapper runs, ``torch.distributed.checkpoint.FileSystemWriter`` is a subclass
whose constructor hands back the one DataStatesWriter (retargeted to that ``ckpt_dir``) to the
thread running the wrapper only; any other thread constructing a ``FileSystemWriter`` then gets
a real one. Outside those calls nothing in torch is changed. :meth:`Handle.disable` restores
every name.

What is guaranteed (``tests/test_integration_accelerate.py``): the saves stay synchronous
``dcp.save`` calls (Accelerate's contract: the checkpoint is durable when they return); the
files are plain DCP checkpoints, so ``load_fsdp_model``/``load_fsdp_optimizer`` (stock
``FileSystemReader``) and ``accelerate merge-weights`` read them unchanged, bit for bit. What
you get over ``FileSystemWriter``: one host cache reused across saves, ``O_DIRECT`` writes, a
CRC-32C per chunk with a manifest (``dcp-datastates verify DIR``), an atomic commit
with in-progress markers. Not asynchronous: Accelerate has no hook to wait for a save in
flight, so an asynchronous save here could not be made safe for its ``load_state``.

FSDP must be active in Accelerate. Accelerate uses its FSDP plugin only in multi-process runs
on a GPU-family device; on CPU (``DistributedType.NO``/``MULTI_CPU``) it ignores the plugin and
``save_state`` writes its plain files (``model.safetensors``, ``optimizer.bin``), which no
writer option can reach. So this route does nothing there, and says so: :func:`enable` warns
(``RuntimeWarning``, naming the ``AcceleratorState`` fields that are missing) if the Accelerator
already exists without FSDP, and otherwise the first ``Accelerator.save_state`` without FSDP
warns (``enable`` wraps that method to check; the save itself is Accelerate's, unchanged).

Threads: enable/disable from the main thread, not while a save runs. Fork: the writer belongs
to the process that called :func:`enable`; call it in each rank's process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint import FileSystemWriter

from .config import writer_kwargs

logger = logging.getLogger(__name__)

__all__ = ["Handle", "datastates_fsdp_saves", "enable", "fsdp_inactive_reason"]

_NAMES = ("save_fsdp_model", "save_fsdp_optimizer")
_MODULES = ("accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator")
_LATE_MODULES = ("transformers.trainer",)  # rebound only if already imported

_tls = threading.local()
_lock = threading.Lock()
_routing = 0  # wrappers running (any thread): FileSystemWriter is _RoutedWriter meanwhile


class _RoutedWriter(FileSystemWriter):
    """Stands in for FileSystemWriter during a wrapped save; never itself instantiated."""

    def __new__(cls, path: Any, *args: Any, **kwargs: Any) -> Any:
        writer = getattr(_tls, "writer", None)
        if writer is None:  # another thread, or not inside a wrapped call
            return FileSystemWriter(path, *args, **kwargs)
        writer.reset(os.fspath(path))  # dcp.save passes no checkpoint_id: the target is set here
        return writer


@contextlib.contextmanager
def _route(writer: Any) -> Iterator[None]:
    global _routing
    if getattr(_tls, "writer", None) is not None:  # nested (model save inside a wrapped call)
        yield
        return
    with _lock:
        if _routing == 0:
            dist_cp.FileSystemWriter = _RoutedWriter  # type: ignore[misc]
        _routing += 1
    _tls.writer = writer
    try:
        yield
    finally:
        _tls.writer = None
        with _lock:
            _routing -= 1
            if _routing == 0:
                dist_cp.FileSystemWriter = FileSystemWriter  # type: ignore[misc]


class Handle:
    """What :func:`enable` did; :meth:`disable` undoes it and closes the writer."""

    def __init__(self, writer: Any, patched: list[tuple[Any, str, Any]]) -> None:
        self.writer = writer
        self._patched = patched
        self.warned_fsdp_inactive = False  # the FSDP-not-active warning was given

    @property
    def active(self) -> bool:
        return bool(self._patched)

    def disable(self) -> None:
        """Restores Accelerate's functions, waits for the writer and frees it (idempotent)."""
        global _active
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched = []
        if _active is self:
            _active = None
        if not self.writer.closed:
            try:
                self.writer.wait()
            finally:
                self.writer.close()


_active: Handle | None = None


def _wrap(original: Callable[..., Any], writer: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if writer.closed:  # a module imported while enabled kept this wrapper after disable()
            return original(*args, **kwargs)
        with _route(writer):
            return original(*args, **kwargs)

    wrapper.__dcp_datastates_original__ = original  # type: ignore[attr-defined]
    return wrapper


def enable(config: Mapping[str, Any] | None = None, **kwargs: Any) -> Handle:
    """Routes Accelerate's FSDP ``save_fsdp_model``/``save_fsdp_optimizer`` through one writer.

    Args:
        config: DataStates-style settings (``host_cache_size`` GiB, ``parser_threads``,
            ``pin_host_cache``) and/or DataStatesWriter keywords; unknown keys raise ValueError
            naming the key.
        **kwargs: the same as keywords (a key may not be in both).

    Raises:
        RuntimeError: already enabled (disable the previous handle first).
        ImportError: Accelerate is not installed.
    """
    global _active
    from ..save.writer import DataStatesWriter

    opts = dict(writer_kwargs(config, where="accelerate.enable config"))
    for key, value in writer_kwargs(kwargs, where="accelerate.enable").items():
        if key in opts:
            raise ValueError(
                f"accelerate.enable: {key!r} is given both in the config and as an argument"
            )
        opts[key] = value
    if _active is not None and _active.active:
        raise RuntimeError("dcp_datastates.integrations.accelerate is already enabled")
    fsdp_utils = importlib.import_module("accelerate.utils.fsdp_utils")
    writer = DataStatesWriter("", **opts)
    patched: list[tuple[Any, str, Any]] = []
    wrappers = {name: _wrap(getattr(fsdp_utils, name), writer) for name in _NAMES}
    modules = [importlib.import_module(m) for m in _MODULES]
    modules += [sys.modules[m] for m in _LATE_MODULES if m in sys.modules]
    for module in modules:
        for name in _NAMES:
            if hasattr(module, name):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, wrappers[name])
    handle = Handle(writer, patched)
    accelerator_cls = importlib.import_module("accelerate.accelerator").Accelerator
    patched.append((accelerator_cls, "save_state", accelerator_cls.__dict__["save_state"]))
    accelerator_cls.save_state = _check_save_state(accelerator_cls.save_state, handle)
    _active = handle
    logger.info("Accelerate FSDP saves go through DataStatesWriter (%s)", opts)
    shared = importlib.import_module("accelerate.state").AcceleratorState._shared_state
    if shared:  # an Accelerator exists: check now (else at the first save_state)
        _warn_if_fsdp_inactive(shared, handle, "enable()")
    return handle


def fsdp_inactive_reason(state: Any) -> str | None:
    """Why Accelerate will not call its FSDP save functions, or None if FSDP is active.

    ``state`` is an ``AcceleratorState`` (or its shared-state mapping).
    """
    from accelerate.utils import DistributedType

    get = state.get if isinstance(state, Mapping) else functools.partial(getattr, state)
    dist_type = get("distributed_type", None)
    if dist_type == DistributedType.FSDP and get("fsdp_plugin", None) is not None:
        return None
    if dist_type == DistributedType.DEEPSPEED:
        why = (
            "Accelerate runs DeepSpeed, whose saves go through DeepSpeed's checkpoint engine "
            "(import dcp_datastates.integrations.deepspeed and use the 'datastates_ckpt' key)"
        )
    elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        why = (
            "an FSDP plugin was given (ACCELERATE_USE_FSDP=true) but Accelerate did not activate "
            "it: Accelerate uses FSDP only with several processes on a GPU-family device "
            "(DistributedType.MULTI_GPU, MULTI_XPU, ...) and ignores the plugin on CPU"
        )
    else:
        why = (
            "no FSDP plugin was given (Accelerator(fsdp_plugin=...), `accelerate config` with "
            "FSDP, or ACCELERATE_USE_FSDP=true)"
        )
    return (
        f"Accelerate's FSDP is not active: AcceleratorState.distributed_type is {dist_type}, "
        f"not DistributedType.FSDP, and AcceleratorState has no fsdp_plugin; {why}. "
        "Accelerator.save_state therefore does not call Accelerate's FSDP save functions "
        "and dcp_datastates.integrations.accelerate does NOT write its checkpoint: "
        "it routes FSDP saves only"
    )


def _warn_if_fsdp_inactive(state: Any, handle: Handle, where: str) -> None:
    """Warns once per handle, pointing at the caller of ``enable``/``save_state``."""
    if handle.warned_fsdp_inactive:
        return
    reason = fsdp_inactive_reason(state)
    if reason is None:
        return
    handle.warned_fsdp_inactive = True
    msg = f"dcp_datastates.integrations.accelerate ({where}): {reason}"
    logger.warning("%s", msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _check_save_state(original: Callable[..., Any], handle: Handle) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        if handle.active:
            _warn_if_fsdp_inactive(self.state, handle, "Accelerator.save_state")
        return original(self, *args, **kwargs)

    return save_state


@contextlib.contextmanager
def datastates_fsdp_saves(
    config: Mapping[str, Any] | None = None, **kwargs: Any
) -> Iterator[Handle]:
    """:func:`enable` for the duration of a ``with`` block (then disabled, writer closed)."""
    handle = enable(config, **kwargs)
    try:
        yield handle
    finally:
        handle.disable()
