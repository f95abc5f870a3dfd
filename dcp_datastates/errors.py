"""Exceptions raised by dcp_datastates.

Every failure of a save surfaces as a :class:`CheckpointSaveError` naming what failed: the
checkpoint path, the rank and, where one is involved, the tensor. It is on the save's future, and
raised once more by the next explicit barrier or ``DataStatesWriter.wait()`` unless the caller
read it from the future (a later save only logs it). Bad arguments raise
``ValueError``/``TypeError`` before anything is written.
"""

from __future__ import annotations


class DataStatesError(RuntimeError):
    """Base class of the package's runtime errors."""


class CheckpointSaveError(DataStatesError):
    """A save failed: nothing was committed for it, and the writer can be used again."""


class CaptureError(CheckpointSaveError):
    """A lazily captured tensor was modified in place before its copy into the host cache finished.

    The save is failed rather than written torn. Call ``writer.wait_captured()`` (or
    ``writer.protect(optimizer)``) before modifying saved tensors.
    """


class CheckpointBusyError(CheckpointSaveError):
    """Another save to the same checkpoint path is still in progress."""


class CheckpointExistsError(CheckpointSaveError, FileExistsError):
    """A writer with ``overwrite=False`` found a committed checkpoint (``.metadata``) at the
    save's path; nothing was written or removed.

    Its message begins with torch's own words for this refusal ("Checkpoint already exists"), and
    it is a ``RuntimeError`` (the type ``FileSystemWriter`` raises) as well as a
    ``FileExistsError``: code written against either keeps working. DCP raises it wrapped in its
    ``CheckpointException``.
    """


class IntegrityError(DataStatesError):
    """A checkpoint's data does not match the checksums recorded in its manifest."""


def reraisable(err: CheckpointSaveError) -> CheckpointSaveError:
    """A fresh copy of a stored error (same type, message and attributes), to raise again.

    Raising an exception object sets its traceback, and raising it inside an ``except`` block its
    context: a stored error raised as is would keep the raising frames alive (and their locals:
    a save's per-tensor records) for as long as the error is kept.
    """
    try:
        fresh = type(err)(*err.args)
        fresh.__dict__.update(err.__dict__)
        return fresh
    except Exception:  # noqa: BLE001 - an exotic subclass: the message is what matters
        return CheckpointSaveError(str(err))
