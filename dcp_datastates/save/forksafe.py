"""One-time native initialisations done in the caller's thread, not half done at a fork.

A C++ function-local static with a destructor registers that destructor with glibc on first use,
under glibc's process-wide atexit lock. If the training thread forks (a DataLoader worker, a
``subprocess`` without ``posix_spawn``) while another thread holds that lock, the child starts
with the lock held by a thread that does not exist there, and the child's first registration of
its own (``torch.set_num_threads`` in every DataLoader worker does one) waits forever: the
DataLoader reports "timed out" and the job stops. Python code holding the GIL is safe (the
forking thread holds it too); native code that runs without the GIL is not.

An ``async_save`` runs DCP's planning and our writer on a background thread, and some of the
torch operators it calls there release the GIL and initialise such statics on their first call
in the process (``Tensor.is_pinned``, which DCP calls for every tensor's metadata, initialises a
dozen: the operator handles and every accelerator's hooks). :func:`warm_up` calls those
operators once in the thread that builds a writer, normally the one that later forks, so the
background thread finds them initialised. The engine's own threads use no such statics (see
``csrc/engine``); an operator added to the background path must be added here, and
``tests/test_forksafe.py`` checks, by a breakpoint on glibc's registration, that a save
registers nothing off the caller's thread.

Contract: idempotent, thread-safe, cheap (microseconds after the first call), no I/O; a failure
of an optional operator (a torch build without it) is ignored, since the warm-up only narrows a
race and never changes a result.
"""

from __future__ import annotations

import io
import threading

import torch

_lock = threading.Lock()
_done = False


def _archive_template() -> None:
    from ..format.layout import build_template  # the save thread builds one per (dtype, shape)

    build_template(torch.float32, (2, 3))


def warm_up() -> None:
    """Initialises, in this thread, the native statics a background save would otherwise create."""
    global _done
    if _done:
        return
    with _lock:
        if _done:
            return
        t = torch.zeros(4)
        steps = (
            t.is_pinned,  # DCP's TensorProperties: operator handles, every accelerator's hooks
            lambda: t.stride(),
            lambda: t.untyped_storage().nbytes(),
            lambda: t.narrow(0, 0, 2).contiguous(),
            lambda: t.view(torch.uint8),
            lambda: t.detach().clone(),
            lambda: torch.save({"x": t, "n": 1}, io.BytesIO()),  # bytes items, torch format
            t.is_inference,  # the capture policy's check (inference tensors have no version)
            _archive_template,  # torch.frombuffer + torch.save under skip_data (layout.py)
        )
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - an optional operator: the race stays as it was
                pass
        _done = True
