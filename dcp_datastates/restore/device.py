"""Restore into GPU tensors at the link's speed: the reader's device path.

A chunk whose load target is a whole, contiguous CUDA tensor of the saved dtype and shape is read
by the native :class:`~dcp_datastates._core` ``DeviceReader`` (``csrc/engine/device_reader.hpp``)
straight into the tensor's device memory: ``pread``s into page-locked staging slots, each slot
copied to the device asynchronously on the reader's own streams while the next is filled, many
small tensors packed into one slot (one read, one copy call or one ``cudaMemcpyBatchAsync`` per
slot). From a memory tier (``/dev/shm``) or the page cache the reads and the DMA overlap; no
temporary tensor is made and torch's caching host allocator is not used.

:class:`DeviceTargets` holds one staging per device (``slots`` of ``slot_bytes``, two slots per
reader thread, registered once with the CUDA runtime torch loaded), made on first use and kept
by its reader for the next load (freed with the reader: the allocation and registration, which
grow with the staging's size, are paid once per reader, not per load).

Ordering: at each load, before the first read into a device, everything queued on it is waited for
(``torch.cuda.synchronize``: a kernel still writing or reading a target must not race the
copies, which run on streams of their own); the native read returns only once its copies are
complete, so the targets hold the checkpoint's bytes when ``read_data`` returns.

Failures: a device whose staging cannot be set up (no CUDA runtime loaded, registration or
stream errors) is logged once and its targets take the generic path (pinned temporaries and
``copy_``); a failing read raises like any native read (``OSError`` / ``IntegrityError``
naming the tensor and file, or the CUDA error naming the tensor). ``DCPDS_NO_DEVICE_READ=1``
turns the path off; ``DCPDS_NO_CUDA_BATCH=1`` keeps the copies one call each.
"""

from __future__ import annotations

import logging
import os

import torch

from .. import _core
from ..engine import loaded_cuda_runtime

logger = logging.getLogger(__name__)

# Largest staging slot; a read thread owns two (one filled while the other is copied).
SLOT_BYTES = 8 << 20
MIN_SLOT_BYTES = 1 << 20


def device_of(t: torch.Tensor) -> int | None:
    """The CUDA device index of ``t``, or None for a tensor that is not on a CUDA device."""
    if t.is_cuda:
        return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return None


def settle_device(device: int) -> None:
    """Waits for everything queued on ``device`` (before its targets are written)."""
    torch.cuda.synchronize(device)


def enabled() -> bool:
    """Whether device reads are on (``DCPDS_NO_DEVICE_READ`` not set to 1)."""
    return os.environ.get("DCPDS_NO_DEVICE_READ", "0") != "1"


class DeviceTargets:
    """The device path of one ``read_data``: a staging per device, made on first use.

    Args:
        threads: reader threads per device read (two staging slots each).
        buffer_bytes: bound on one device's staging (slots of at most SLOT_BYTES, at least
            MIN_SLOT_BYTES).

    Threads: :meth:`staging` is called from the caller's thread; the stagings are used by the
    read helper thread, one read at a time. One load at a time: :meth:`start_load` first.
    """

    def __init__(self, threads: int, buffer_bytes: int) -> None:
        self.threads = max(1, threads)
        self.buffer_bytes = buffer_bytes
        per_slot = buffer_bytes // (2 * self.threads)
        self.slot_bytes = max(MIN_SLOT_BYTES, min(SLOT_BYTES, per_slot))
        self._stagings: dict[int, _core.DeviceStaging | None] = {}
        self._settled: set[int] = set()  # devices waited for in this load

    def start_load(self) -> None:
        """A new load: each device is settled again before its first read."""
        self._settled.clear()

    def staging(self, device: int) -> _core.DeviceStaging | None:
        """The staging of ``device`` (made on first use; the device settled once per load);
        None when it cannot be had (the reason is logged once)."""
        if device not in self._stagings:
            self._stagings[device] = self._make(device)
        staging = self._stagings[device]
        if staging is not None and device not in self._settled:
            settle_device(device)
            self._settled.add(device)
        return staging

    def _make(self, device: int) -> _core.DeviceStaging | None:
        """A new staging for ``device``, or None (logged) when it cannot be set up."""
        runtime = loaded_cuda_runtime()
        if not runtime:
            logger.warning("device reads: no CUDA runtime is loaded in this process; reading "
                           "through temporaries instead")
            return None
        try:
            staging = _core.DeviceStaging(
                runtime, device, 2 * self.threads, self.slot_bytes,
                batch_copies=os.environ.get("DCPDS_NO_CUDA_BATCH", "0") != "1")
        except (_core.EngineError, RuntimeError, OSError) as e:
            logger.warning("device reads on device %d unavailable (%s); reading through "
                           "temporaries instead", device, e)
            return None
        if not staging.pinned:
            logger.warning("device reads: staging could not be pinned, copies will be slower: "
                           "%s", staging.pin_error)
        return staging


__all__ = ["DeviceTargets", "device_of", "enabled", "settle_device"]
