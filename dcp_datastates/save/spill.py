"""Spill: at-call snapshots that cannot fit in the host cache go to an anonymous temporary file.

State that must be snapshotted at the save call (tensors no optimizer owns, or every tensor with
``capture="eager"``) normally waits for cache space. When one save alone needs more than the
whole cache for it, waiting cannot help (its own bytes leave the cache only after DCP has planned
the save, which happens after the call returns). Instead of cloning such a tensor, the save call
writes it, with its CRC-32C computed on the way, to an unnamed temporary file (``O_TMPFILE``: the
kernel removes it when its descriptor closes, also after a crash) next to the checkpoints, and
the flush later copies it into the data file (``copy_file_range``: a kernel-side copy, often a
reflink). Host memory stays bounded by the cache; the page cache absorbs the file as it does any
write. The call takes as long as writing that tensor (reported as the save's ``stall_s``).

Lifetime: a :class:`SpilledTensor` owns its descriptor; :meth:`SpilledTensor.close` (run when
the save finishes or fails) or garbage collection releases it. Fork: a child inherits the
descriptor but never uses it (writers refuse to work in a child).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from typing import Any

import torch

from .. import _core

_BLOCK = 64 * 1024 * 1024


class SpilledTensor:
    """The bytes of one tensor in an anonymous temporary file, with their CRC-32C."""

    def __init__(self, fd: int, nbytes: int, crc: int) -> None:
        self._fd = fd
        self.nbytes = nbytes
        self.crc = crc

    def copy_to(self, fd_out: int, offset: int) -> None:
        """Writes the bytes at ``offset`` of the open file ``fd_out`` (kernel-side copy)."""
        done = 0
        while done < self.nbytes:
            n = self.nbytes - done
            try:
                k = os.copy_file_range(self._fd, fd_out, n, done, offset + done)
            except OSError:
                k = 0  # EXDEV, EINVAL on some file systems: plain reads and writes below
            if k <= 0:
                block = os.pread(self._fd, min(n, _BLOCK), done)
                if not block:
                    raise OSError(f"spill file ended at {done} of {self.nbytes} bytes")
                k = os.pwrite(fd_out, block, offset + done)
            done += k

    def stream_to(self, f: Any) -> None:
        """Writes the bytes to the sequential file object ``f`` in bounded blocks."""
        done = 0
        while done < self.nbytes:
            block = os.pread(self._fd, min(self.nbytes - done, _BLOCK), done)
            if not block:
                raise OSError(f"spill file ended at {done} of {self.nbytes} bytes")
            f.write(block)
            done += len(block)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:  # pragma: no cover - interpreter shutdown
            pass


def _open_anonymous(directory: str) -> int:
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            return os.open(directory, flag | os.O_RDWR, 0o600)
        except OSError:
            pass  # file systems without O_TMPFILE support
    fd, name = tempfile.mkstemp(prefix=".datastates-spill-", dir=directory)
    os.unlink(name)
    return fd


def spill_tensor(tensor: torch.Tensor, directories: list[str]) -> SpilledTensor:
    """Writes a contiguous CPU tensor's bytes to an anonymous file in the first usable directory."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous() or flat.device.type != "cpu":
        raise ValueError("spill_tensor needs a contiguous CPU tensor")
    nbytes = flat.numel() * flat.element_size()
    # A view of the tensor's own memory (no numpy, no copy); `flat` keeps it alive meanwhile.
    data = (
        memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())).cast("B")
        if nbytes
        else memoryview(b"")
    )
    errors = []
    for d in directories:
        try:
            fd = _open_anonymous(d)
            break
        except OSError as e:
            errors.append(f"{d}: {e}")
    else:
        raise OSError("no directory to spill to: " + "; ".join(errors))
    crc = 0
    done = 0
    try:
        while done < len(data):
            block = data[done : done + _BLOCK]
            crc = _core.crc32c(block, crc)
            k = os.pwrite(fd, block, done)
            done += k
    except BaseException:
        os.close(fd)
        raise
    return SpilledTensor(fd, len(data), crc)
