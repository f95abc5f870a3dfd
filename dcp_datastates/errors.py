"""Exceptions raised by dcp_datastates.

Every failure of a save surfaces as a :class:`CheckpointSaveError` (on the save's future, at the
next barrier, or at the next save), naming what failed: the checkpoint path, the rank and, where
one is involved, the tensor. Bad arguments raise ``ValueError``/``TypeError`` before anything is
written.
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


class IntegrityError(DataStatesError):
    """A checkpoint's data does not match the checksums recorded in its manifest."""
