"""dcp_datastates: lazy asynchronous checkpointing for torch.distributed.checkpoint.

A StorageWriter (and AsyncStager) that snapshots model and optimizer state into a preallocated
host cache with native threads and flushes it to storage in the background; the checkpoints are
plain DCP checkpoints that the stock ``dcp.load`` reads. See README.md and docs/.

The package, by concern (docs/architecture.md has the whole picture):

* ``engine``, ``config``, ``errors``: the native engine's facade (host cache, copy and flush
  threads in ``_core``), the writer's configuration, the exceptions;
* ``save/``: the DCP StorageWriter and everything one save runs through;
* ``format/``: the on-disk format (archives, manifests, the commit, references, safetensors),
  ``verify`` and ``export``;
* ``restore/``: readers (the stock ``dcp.load`` needs none of them);
* ``storage/``: fsspec and S3 sinks, disk space;
* ``lifecycle/``: retention, promotion to a persistent tier, ``resume_path``;
* ``runtime/``: process-wide helpers (GC pauses, CPU load, DCP's logging);
* ``integrations/``: DeepSpeed, Lightning, Accelerate, Nanotron, torchtitan;
* ``cli``: the ``dcp-datastates`` command.

Imports flow one way: ``save`` and ``restore`` use ``format`` and ``storage``, never the reverse
(``tests/test_architecture.py``).
"""

from __future__ import annotations

import logging
import os

try:
    from . import _core  # noqa: F401  (first, so a missing build is reported clearly)
except ImportError as _e:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        f"dcp_datastates was imported from {os.path.dirname(os.path.abspath(__file__))}, which "
        "has no built native module '_core'. This happens when Python runs in a source checkout "
        "(the current directory comes first on sys.path and shadows the installed package). "
        "Use the `dcp-datastates` command, which works from any directory, or run Python from "
        "another directory, or build the checkout in place with "
        "`pip install --no-build-isolation -e .`"
    ) from _e

from .config import WriterConfig, parse_size
from .errors import (
    CaptureError,
    CheckpointBusyError,
    CheckpointExistsError,
    CheckpointSaveError,
    DataStatesError,
    IntegrityError,
)
from .format.verify import VerifyReport, verify_checkpoint
from .lifecycle import checkpoints  # dcp_datastates.checkpoints.prune(...) and friends
from .lifecycle.replica_restore import recover_from_replicas
from .lifecycle.tiers import PersistError, resume_path
from .restore.load import load
from .restore.reader import DataStatesReader
from .save.controls import ProtectHandle
from .save.planner import DataStatesSavePlanner, planner
from .save.writer import DataStatesWriter

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointSaveError",
    "DataStatesError",
    "DataStatesReader",
    "DataStatesSavePlanner",
    "DataStatesWriter",
    "IntegrityError",
    "PersistError",
    "ProtectHandle",
    "VerifyReport",
    "WriterConfig",
    "checkpoints",
    "load",
    "parse_size",
    "planner",
    "recover_from_replicas",
    "resume_path",
    "verify_checkpoint",
]
