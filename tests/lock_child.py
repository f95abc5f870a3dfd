"""A second process with a save in flight: it claims PATH and holds it until killed.

Usage: ``python lock_child.py PATH``. Starts a real ``dcp.async_save`` with the engine's copies
paused, so the save stays between its claim (prepare_global_plan) and its data; prints ``ready``
once this process holds the directory's lock. The parent kills it (SIGKILL, as a crash would).
"""

from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter
from dcp_datastates.format import commit

warnings.filterwarnings("ignore")


def main(path: str) -> None:
    w = DataStatesWriter(path, host_cache_size="4MiB", prefault=False, capture="lazy")
    w.engine.pause_copies(True)
    dcp.async_save({"child": torch.full((1000,), 7.0)}, storage_writer=w, checkpoint_id=path)
    deadline = time.monotonic() + 60
    while not commit._held_fds:
        if time.monotonic() > deadline:
            raise SystemExit("the save never claimed its directory")
        time.sleep(0.01)
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])
