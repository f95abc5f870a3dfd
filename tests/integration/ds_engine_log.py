"""Builds a DeepSpeed engine with ``"datastates_ckpt"`` and leaves logging as DeepSpeed sets it.

Run by tests/test_integration_deepspeed.py under ``torchrun --nproc_per_node=2``: no logging
configuration here, so what the test finds on stdout/stderr is what a user sees by default.
"""

from __future__ import annotations

import deepspeed
import deepspeed.ops
import torch.distributed as dist
import torch.nn as nn

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build on CPU

import dcp_datastates.integrations.deepspeed as dsds  # noqa: E402  (the one line)

deepspeed.init_distributed(dist_backend="gloo")
model = nn.Linear(4, 2)
engine, _, _, _ = deepspeed.initialize(
    model=model,
    model_parameters=model.parameters(),
    config={
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "datastates_ckpt": {"host_cache_size": "8MiB"},
    },
)
assert isinstance(engine.checkpoint_engine, dsds.DataStatesCheckpointEngine)
engine.destroy()
dist.destroy_process_group()
print("BUILT", flush=True)
