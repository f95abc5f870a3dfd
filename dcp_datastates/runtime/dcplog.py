"""DCP's per-call debug events, which nobody receives by default.

``torch.distributed.checkpoint`` wraps each top-level value of a saved state dict (and each of
its own steps) in a logger that emits two DEBUG records per call to ``dcp_logger``. That logger
is created at level DEBUG with only a ``NullHandler`` and ``propagate=False``: every record is
built (about 20 us each) and dropped. For a state dict with 20,000 top-level keys that was
0.45 s of a 1.2 s ``async_save`` call, in the training thread.

:func:`skip_unheard_debug_events` raises that logger to INFO when, and only when, nobody could
receive its DEBUG records (level DEBUG or unset, only NullHandlers, no propagation). A program
that attached a handler, or set ``DCPDS_KEEP_DCP_DEBUG_LOG=1``, keeps them. Called once per
process, when the first writer is created; a handler added to that logger later should also set
its level back to DEBUG.

The same records cost more than their logging: before it calls each top-level value's
``state_dict()`` (if it has one), DCP's ``_stateful_to_state_dict`` wraps the call in that
logger, which builds the record's fields whether or not anybody receives it (a ``uuid4``, the
process group's rank and world size, ...), and checks the value against the ``Stateful``
protocol (a runtime protocol check, about 6 us). It runs twice per ``async_save`` (in the
caller, and again in the save thread): with 1,954 top-level tensors and a process group,
36 ms per pass. When the logger is raised to INFO, :func:`skip_unheard_debug_events` also
puts a pass in its place (:func:`_install_fast_stateful_pass`) that gives the same dict
without that work for values of plain built-in types (a tensor, dict, list, tuple, number,
string, bytes, None: none of them has a ``state_dict``), and sends every other value through
DCP's own per-key path, logger and ``Stateful`` check included. It checks the logger's level
on every call: whoever sets DCP's logger back to DEBUG gets DCP's own pass again. The
outer event of the pass is DCP's own decorator, as before. Installed only over the function
this module knows (checked by its name, its wrapped function and its module), and with the
same opt-out (``DCPDS_KEEP_DCP_DEBUG_LOG=1``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

_done = False
_lock = threading.Lock()
logger = logging.getLogger(__name__)


def skip_unheard_debug_events() -> bool:
    """Raises DCP's event logger to INFO if its DEBUG records reach nobody; True if it did."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
    if os.environ.get("DCPDS_KEEP_DCP_DEBUG_LOG", "") not in ("", "0"):
        return False
    try:
        from torch.distributed.checkpoint.logger import _dcp_logger
    except ImportError:  # pragma: no cover - a torch without it
        return False
    dcp_log: logging.Logger = _dcp_logger
    if dcp_log.propagate or dcp_log.getEffectiveLevel() > logging.DEBUG:
        return False
    if not all(isinstance(h, logging.NullHandler) for h in dcp_log.handlers):
        return False
    dcp_log.setLevel(logging.INFO)
    logger.debug("DCP's debug events (%s) had no receiver: its level is now INFO", dcp_log.name)
    _install_fast_stateful_pass()
    return True


def _plain_types() -> frozenset[type]:
    import collections

    import torch

    plain: set[type] = {
        torch.Tensor, torch.nn.Parameter, dict, collections.OrderedDict, list, tuple, int,
        float, bool, complex, str, bytes, type(None),
    }
    try:
        from torch.distributed.tensor import DTensor

        plain.add(DTensor)
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    return frozenset(plain)


def _install_fast_stateful_pass() -> bool:
    """Puts a faster equivalent in place of DCP's ``_stateful_to_state_dict`` (see the module
    docstring); False (nothing changed) where DCP's function is not the one expected."""
    try:
        from torch.distributed.checkpoint import state_dict_saver as sds
        from torch.distributed.checkpoint.logger import _dcp_logger, _dcp_method_logger
    except ImportError:  # pragma: no cover - a torch without them
        return False
    original = getattr(sds, "_stateful_to_state_dict", None)
    inner = getattr(original, "__wrapped__", None)
    if (
        original is None
        or getattr(original, "_dcpds_original", None) is not None  # ours already
        or inner is None
        or getattr(inner, "__name__", "") != "_stateful_to_state_dict"
        or getattr(inner, "__module__", "") != sds.__name__
    ):
        return False
    plain = _plain_types()
    if any(hasattr(t, "state_dict") for t in plain):  # pragma: no cover - never Stateful
        return False

    def _stateful_to_state_dict(state_dict: Any) -> Any:
        if _dcp_logger.isEnabledFor(logging.DEBUG):
            return inner(state_dict)  # someone listens: DCP's own pass, every event
        out = {}
        for key, elem in state_dict.items():
            if type(elem) in plain:
                out[key] = elem  # DCP's per-key path returns it as it is
            else:  # DCP's per-key path: its logger and Stateful check for this key
                out[key] = inner({key: elem})[key]
        return out

    _stateful_to_state_dict.__module__ = sds.__name__
    _stateful_to_state_dict.__doc__ = inner.__doc__
    fast = _dcp_method_logger(log_exceptions=True)(_stateful_to_state_dict)
    fast._dcpds_original = original  # type: ignore[attr-defined]
    sds._stateful_to_state_dict = fast
    return True


__all__ = ["skip_unheard_debug_events"]
