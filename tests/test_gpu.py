"""CUDA path (marked `gpu`; skipped without a CUDA device): D2H copies issued by the engine on its
own stream, ordered after the compute stream by an event recorded at save time."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def _cpu(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return sd.detach().cpu().clone()
    if isinstance(sd, dict):
        return {k: _cpu(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_cpu(v) for v in sd]
    return copy.deepcopy(sd)


@pytest.mark.parametrize("cache", ["64MiB", "1MiB"])
def test_cuda_roundtrip(tmp_path: Any, writer_factory: Any, cache: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {
        "w": torch.randn(1024, 1024, device="cuda", generator=g),
        "bf": torch.randn(333, device="cuda", generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 64, device="cuda", generator=g).t(),
        "step": 5,
    }
    ref = _cpu(sd)
    w = writer_factory(host_cache_size=cache, chunk_size="256KiB", capture="lazy")
    dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c")).result()
    out = {k: (torch.zeros_like(v).cpu() if isinstance(v, torch.Tensor) else 0)
           for k, v in ref.items()}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert_state_equal(ref, out)


def test_copy_is_ordered_after_pending_compute(tmp_path: Any, writer_factory: Any) -> None:
    """The save is issued while a long kernel that produces the tensor is still running: the
    engine's copy must wait for it (event), and must not see what the step writes afterwards."""
    a = torch.randn(4096, 4096, device="cuda")
    x = torch.zeros(4096, 4096, device="cuda")
    for _ in range(8):
        x.add_(a @ a)  # queued on the compute stream, not finished when the save is called
    model = torch.nn.Linear(4, 4).cuda()
    opt = torch.optim.SGD([x.requires_grad_(False)], lr=0.1)
    w = writer_factory(host_cache_size="256MiB", chunk_size="16MiB")
    w.protect(opt)
    fut = dcp.async_save({"x": x}, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    w.wait_captured()
    expected = x.cpu()  # synchronizes: the value at the save call
    x.mul_(0)  # what training does after the barrier must not leak into the checkpoint
    fut.result()
    out = {"x": torch.empty(4096, 4096)}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert torch.equal(out["x"], expected)
    del model


def test_lazy_cuda_training_loop_is_exact(tmp_path: Any, writer_factory: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = writer_factory(host_cache_size="8MiB", chunk_size="1MiB")
    w.protect(opt)
    refs, futs = {}, []
    for step in range(5):
        model(torch.randn(64, 256, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        refs[step] = _cpu(state)
        futs.append(dcp.async_save(state, storage_writer=w,
                                   checkpoint_id=str(tmp_path / f"s{step}")))
    for f in futs:
        f.result()
    for step, ref in refs.items():
        out = _cpu(ref)
        dcp.load(out, checkpoint_id=str(tmp_path / f"s{step}"))
        assert_state_equal(ref, out)
