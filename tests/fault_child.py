"""Run by test_faults.py in a subprocess without CAP_DAC_OVERRIDE: a save into a read-only
directory must fail with a clear error (exit 0), leave no commit, and the writer must go on."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter


def main(readonly_dir: str, good_dir: str) -> int:
    w = DataStatesWriter(good_dir, host_cache_size="4MiB", prefault=False)
    target = os.path.join(readonly_dir, "ckpt")
    try:
        dcp.save({"w": torch.ones(1000)}, storage_writer=w, checkpoint_id=target)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        msg = str(e)
        if "Permission denied" not in msg or readonly_dir not in msg:
            print(f"unclear error: {msg}")
            return 2
    else:
        print("save into a read-only directory succeeded?")
        return 3
    if os.path.exists(os.path.join(target, ".metadata")):
        return 4
    dcp.save({"w": torch.ones(1000)}, storage_writer=w, checkpoint_id=good_dir)  # still usable
    w.close()
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
