"""torchrun child of tests/test_replicas.py: each rank saves with ``replicas=1`` to its own node
directory, then ends its writer as ``argv[3]`` says (``drop``: no ``close()``; ``close``:
``close()`` without ``wait_replicated()``) and exits normally, with replica rounds possibly still
running and without destroying its process groups."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter


def state(rank: int, mib: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return {"model": {f"w{rank}": torch.randn(mib << 18, generator=g)}}


def main(base: str, mib: int, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = os.path.join(base, f"node{rank}")
    os.makedirs(root, exist_ok=True)
    pg = dist.new_group(backend="gloo")
    w = DataStatesWriter(os.path.join(root, "step-1"), host_cache_size=f"{2 * mib + 8}MiB",
                         replicas=1, replica_timeout=60)
    dcp.async_save(state(rank, mib), storage_writer=w, checkpoint_id=os.path.join(root, "step-1"),
                   process_group=pg).result(120)
    print(f"rank {rank} saved", flush=True)
    if mode == "close":
        w.close()
    del w


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
