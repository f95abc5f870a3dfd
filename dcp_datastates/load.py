"""Loading with verification: checksums first, then the stock DCP reader."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp

from .verify import verify_checkpoint


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    *,
    verify: bool = True,
    **kwargs: Any,
) -> None:
    """Loads ``checkpoint_id`` into ``state_dict`` in place with the stock ``dcp.load``.

    With ``verify=True`` every chunk is first checked against the checksums in the manifests;
    a mismatch, truncation or missing file raises IntegrityError naming the tensor, rank and file,
    and nothing is loaded. Other keyword arguments go to ``dcp.load`` (``process_group``,
    ``planner``, ``no_dist``...). Verification reads the whole checkpoint once more; with
    several ranks each rank verifies everything, so prefer verifying once, offline, at scale.
    """
    path = os.fspath(checkpoint_id)
    if verify:
        verify_checkpoint(path, raise_on_error=True)
    dcp.load(state_dict, checkpoint_id=path, **kwargs)
