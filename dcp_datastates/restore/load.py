"""Loading with verification: the checkpoint is verified, then read by the stock DCP reader."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed.checkpoint as dcp

from ..format.commit import METADATA_FILE
from ..format.refcheck import check_references
from ..format.safetensors import is_safetensors_checkpoint
from ..format.verify import load_metadata, verify_checkpoint
from .safetensors_reader import SafetensorsCheckpointReader

logger = logging.getLogger(__name__)


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    *,
    verify: bool = True,
    **kwargs: Any,
) -> None:
    """Loads ``checkpoint_id`` into ``state_dict`` in place with the stock ``dcp.load``.

    With ``verify=True`` the checkpoint is first checked as ``verify_checkpoint`` does (every
    chunk against its checksum, every archive header and trailer, ``.metadata`` against the
    manifests); damage, truncation, a missing file or a path that is not a checkpoint raises
    IntegrityError naming the tensor, rank and file, and nothing is loaded. Payloads saved with
    ``checksums=False`` cannot be verified: they are loaded with a warning logged. Other keyword
    arguments go to ``dcp.load`` (``process_group``, ``planner``, ``no_dist``...). Verification
    reads the whole checkpoint once more; with several ranks each rank verifies everything, so
    prefer verifying once, offline, at scale.

    References to other checkpoints (incremental saves) are checked against their owners in
    either case (:func:`~dcp_datastates.format.refcheck.check_references`: committed by the save
    that wrote the referenced bytes, not rewritten by another writer since, files long enough); a
    failed check raises IntegrityError naming the keys, the owner and file, and nothing is loaded.

    A checkpoint saved with ``format="safetensors"`` is read with
    :class:`~dcp_datastates.format.safetensors.SafetensorsCheckpointReader` (the stock
    ``FileSystemReader`` cannot read its tensors) unless ``storage_reader`` is given.
    """
    path = os.fspath(checkpoint_id)
    if verify:
        rep = verify_checkpoint(path, raise_on_error=True)
        for what in rep.unverified:
            logger.warning("%s: not verified: %s", path, what)
    if "://" not in path and os.path.isdir(path):
        check_references(path)
    if "storage_reader" not in kwargs and "://" not in path:
        md_path = os.path.join(path, METADATA_FILE)
        if os.path.exists(md_path):
            with open(md_path, "rb") as f:
                md = load_metadata(f.read(), fast=True)  # dcp.load unpickles it too
            if is_safetensors_checkpoint(md):
                kwargs["storage_reader"] = SafetensorsCheckpointReader(path)
    dcp.load(state_dict, checkpoint_id=path, **kwargs)
