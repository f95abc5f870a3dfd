"""A trainer for tests/persist_trials.py and tests/test_persist_agent.py: saves with persist_to
until it is killed (or ``STEPS`` saves are done).

``python persist_child.py FAST SLOW FIRST STEPS PAUSE_S [RETENTION]`` creates a DataStatesWriter
on FAST with ``persist_to=SLOW`` (the persistence agent: the default), prints ``ready <spawned>``
(``spawned``: 1 if this writer started the agent, 0 if it adopted a running one), then saves
``step-FIRST`` .. ``step-(FIRST+STEPS-1)``, printing ``saved N`` after each commit and sleeping
``PAUSE_S`` between saves (a training step). The content of ``step-N`` is :func:`content` ``(N)``.
It exits without ``close()``: what the agent does must not depend on the writer closing.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter


def content(step: int) -> dict[str, Any]:
    """The state saved as step ``step`` (about 8 MB), a pure function of ``step``."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(2_000_000, generator=g),
        "b": torch.randint(0, 255, (70_000,), dtype=torch.uint8, generator=g),
        "h": torch.randn(5000, generator=g).to(torch.bfloat16),
        "step": step,
    }


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    fast, slow, first, steps, pause = argv[0], argv[1], int(argv[2]), int(argv[3]), float(argv[4])
    retention = int(argv[5]) if len(argv) > 5 and argv[5] != "none" else None
    w = DataStatesWriter(fast, host_cache_size="8MiB", persist_to=slow,
                         persist_retention=retention)
    spawned = int(w._promoter._child is not None)  # type: ignore[attr-defined]
    print(f"ready {spawned}", flush=True)
    for n in range(first, first + steps):
        dcp.save(content(n), checkpoint_id=os.path.join(fast, f"step-{n}"), storage_writer=w)
        print(f"saved {n}", flush=True)
        time.sleep(pause)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
