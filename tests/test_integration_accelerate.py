"""Accelerate FSDP saves through DataStatesWriter (issue 11, item 4).

Accelerate ignores its FSDP plugin on CPU, so two gloo ranks build a CPU FSDP2 model and call
Accelerate's own ``save_fsdp_model``/``save_fsdp_optimizer`` (through the names Accelerator and
Trainer use) and its ``load_fsdp_model``/``load_fsdp_optimizer`` to read back. A real CPU
``Accelerator`` with an FSDP plugin shows that ignoring: the route then warns, at ``enable()``
or at the first ``save_state``.
"""

from __future__ import annotations

import os
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")  # CI installs it (scripts/install_integrations.sh)

from dist_utils import run_ranks  # noqa: E402

import dcp_datastates.integrations.accelerate as ds_acc  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"w/{n}": p.full_tensor().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"o/{names[id(p)]}/{k}"] = full.clone()
    return out


def _body(rank: int, world_size: int, out: str) -> dict[str, Any]:
    import accelerate.utils
    import torch.distributed as dist
    import torch.distributed.checkpoint as dist_cp
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin, fsdp_utils

    PartialState(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = types.SimpleNamespace(
        process_index=rank, num_processes=world_size, wait_for_everyone=dist.barrier
    )
    model, opt = _model_and_opt(0)
    _train(model, opt, 3)
    expected = _full(model, opt)

    original = fsdp_utils.save_fsdp_model
    handle = ds_acc.enable({"host_cache_size": "16MiB"}, idle_priority=False)
    try:
        assert accelerate.utils.save_fsdp_model is not original
        import accelerate.accelerator as acc_mod

        assert acc_mod.save_fsdp_model is accelerate.utils.save_fsdp_model
        accelerate.utils.save_fsdp_model(plugin, acc, model, out)
        accelerate.utils.save_fsdp_optimizer(plugin, acc, opt, model, out)
        assert dist_cp.FileSystemWriter is ds_acc.FileSystemWriter  # restored after each call
        saves = len(handle.writer.save_stats())
    finally:
        handle.disable()
    assert fsdp_utils.save_fsdp_model is original
    _train(model, opt, 2)  # the live state moves on: the checkpoint must hold step 3

    model2, opt2 = _model_and_opt(1)  # other init; everything must come from the files
    _train(model2, opt2, 1)
    fsdp_utils.load_fsdp_model(plugin, acc, model2, out)
    fsdp_utils.load_fsdp_optimizer(plugin, acc, opt2, model2, out)
    got = _full(model2, opt2)
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), f"rank {rank}: {k} differs"
    return {"saves": saves, "dirs": sorted(os.listdir(out))}


def test_accelerate_fsdp_saves_go_through_our_writer_and_load_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    res = run_ranks(_body, str(out), tmp_path=tmp_path, timeout_s=150)
    assert res[0]["dirs"] == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert all(r["saves"] == 2 for r in res)  # both saves went through the DataStatesWriter
    for d in ("optimizer_0", "pytorch_model_fsdp_0"):
        names = os.listdir(out / d)
        assert ".metadata" in names and "__datastates_manifest_0.json" in names
        from dcp_datastates import verify_checkpoint

        assert verify_checkpoint(str(out / d)).ok


def test_enable_validates_config_and_refuses_twice() -> None:
    with pytest.raises(ValueError, match="'host_cache_sise'"):
        ds_acc.enable({"host_cache_sise": 1})
    with ds_acc.datastates_fsdp_saves(host_cache_size="8MiB", idle_priority=False) as h:
        with pytest.raises(RuntimeError, match="already enabled"):
            ds_acc.enable()
        assert h.active
    assert not h.active and h.writer.closed


def test_other_threads_still_get_a_real_filesystem_writer(tmp_path: Path) -> None:
    import threading

    import torch.distributed.checkpoint as dist_cp

    seen: list[Any] = []
    with ds_acc.datastates_fsdp_saves(host_cache_size="8MiB", idle_priority=False) as h:
        with ds_acc._route(h.writer):
            assert dist_cp.FileSystemWriter(str(tmp_path / "a")) is h.writer
            other = threading.Thread(target=lambda: seen.append(dist_cp.FileSystemWriter("x")))
            t = other
            t.start()
            t.join(30)
        assert dist_cp.FileSystemWriter is ds_acc.FileSystemWriter
    assert type(seen[0]) is ds_acc.FileSystemWriter


# -- Accelerate without active FSDP (CPU): the route cannot apply, and says so -----------------


@pytest.fixture
def fresh_accelerate(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A process-wide Accelerate state for this test only (Accelerator is a singleton)."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # restored (unset) afterwards
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _cpu_accelerator_with_fsdp_plugin() -> Any:
    """What docs/integrations.md's Accelerate route builds, on a CPU-only machine."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = torch.nn.Linear(4, 2)
    acc.prepare(model, torch.optim.AdamW(model.parameters()))
    return acc


def _ours(records: Any) -> list[warnings.WarningMessage]:
    return [
        r for r in records
        if issubclass(r.category, RuntimeWarning) and "dcp_datastates" in str(r.message)
    ]


def test_enable_warns_when_the_accelerator_ignores_its_fsdp_plugin(
    tmp_path: Path, fresh_accelerate: Any
) -> None:
    acc = _cpu_accelerator_with_fsdp_plugin()
    with pytest.warns(RuntimeWarning) as rec:
        handle = ds_acc.enable(host_cache_size="8MiB", idle_priority=False)
    try:
        [w] = _ours(rec)
        msg = str(w.message)
        assert "(enable())" in msg and w.filename == __file__  # points at the enable() call
        assert "distributed_type is DistributedType.NO" in msg
        assert "no fsdp_plugin" in msg and "ignores the plugin on CPU" in msg
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            acc.save_state(str(tmp_path / "s"))
        assert not _ours(again)  # said once, at enable()
        # what the warning says happened: Accelerate's plain save, not through our writer
        assert handle.writer.save_stats() == []
        assert (tmp_path / "s" / "model.safetensors").exists()
    finally:
        handle.disable()


def test_save_state_warns_when_enable_came_before_the_accelerator(
    tmp_path: Path, fresh_accelerate: Any
) -> None:
    with warnings.catch_warnings(record=True) as at_enable:
        warnings.simplefilter("always")
        handle = ds_acc.enable(host_cache_size="8MiB", idle_priority=False)
    try:
        assert not _ours(at_enable)  # no Accelerator yet: nothing to judge
        acc = _cpu_accelerator_with_fsdp_plugin()
        with pytest.warns(RuntimeWarning) as rec:
            acc.save_state(str(tmp_path / "s"))
        [w] = _ours(rec)
        assert "(Accelerator.save_state)" in str(w.message) and w.filename == __file__
        assert "not DistributedType.FSDP" in str(w.message)
        assert handle.writer.save_stats() == []
    finally:
        handle.disable()
    from accelerate import Accelerator

    assert not hasattr(Accelerator.save_state, "__wrapped__")  # disable() restored it


def test_fsdp_inactive_reason_names_the_missing_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.utils import DistributedType

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    active = types.SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=object())
    assert ds_acc.fsdp_inactive_reason(active) is None
    plain = {"distributed_type": DistributedType.MULTI_CPU}
    reason = ds_acc.fsdp_inactive_reason(plain)
    assert reason is not None and "no FSDP plugin was given" in reason
    assert "DistributedType.MULTI_CPU" in reason
    reason = ds_acc.fsdp_inactive_reason({"distributed_type": DistributedType.DEEPSPEED})
    assert reason is not None and "dcp_datastates.integrations.deepspeed" in reason
