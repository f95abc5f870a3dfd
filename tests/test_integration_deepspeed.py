"""DeepSpeed drop-in (dcp_datastates.integrations.deepspeed) and torch.save-compatible archives.

In-process: the archive planner against ``torch.load`` (weights_only True and False), the
engine on its own (no DeepSpeed engine, one process): durable files, ``latest``, failures.
Subprocesses (torchrun, CPU, gloo, the shm op's JIT build skipped): ZeRO-1 and ZeRO-2 on 1 and
2 ranks (tests/integration/ds_train.py), the Transformers Trainer resuming
(tests/integration/ds_trainer.py), and the engine-choice line with DeepSpeed's default logging
(tests/integration/ds_engine_log.py).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")
import deepspeed.ops  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (  # noqa: E402
    CheckpointCommitInfo,
)

from dcp_datastates.errors import CheckpointSaveError  # noqa: E402
from dcp_datastates.integrations import deepspeed as dsds  # noqa: E402
from dcp_datastates.integrations.torch_archive import plan_archive, write_archive  # noqa: E402

HERE = Path(__file__).resolve().parent


def framework_like_state() -> dict[str, Any]:
    """What DeepSpeed hands save(): int keys, OrderedDicts, empty dicts, views of a flat buffer."""
    flat = torch.arange(4096, dtype=torch.float32)
    p = torch.nn.Parameter(torch.randn(3, 5))
    return {
        "module": collections.OrderedDict([("w", flat[100:164].view(8, 8)), ("b", flat[:8])]),
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(8, 8, dtype=torch.bfloat16),
                          "step": torch.tensor(3.0)}, 1: {}},
            "param_groups": [{"params": [0, 1], "lr": 1e-3}],
        },
        "shared_params": {},
        "fp32_groups": [flat[200:300], p],
        "same_param_twice": (p, p),
        "misc": [torch.tensor(True), torch.empty(0, 4), torch.randn(4, 3).t(), 7, "x", None],
        "param_shapes": [collections.OrderedDict([("w", torch.Size([8, 8]))])],
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.requires_grad == b.requires_grad, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


@pytest.mark.parametrize("weights_only", [True, False])
def test_archive_round_trips_framework_dicts(tmp_path: Path, weights_only: bool) -> None:
    state = framework_like_state()
    f = tmp_path / "x.pt"
    write_archive(plan_archive(state), str(f))
    back = torch.load(f, weights_only=weights_only)
    assert_same(back, state)
    # each tensor is its own storage sized to it (not the 16 KiB flat buffer it views)
    assert back["module"]["w"].untyped_storage().nbytes() == 64 * 4
    assert back["same_param_twice"][0] is back["same_param_twice"][1]
    assert os.path.getsize(f) < 16 * 1024


def test_archive_rejects_unsupported_tensor_naming_key() -> None:
    with pytest.raises(TypeError, match="opt.bad"):
        plan_archive({"opt": {"bad": torch.empty(3, device="meta")}})


def test_unknown_setting_is_an_error_naming_it() -> None:
    cfg = types.SimpleNamespace(
        datastates_config=types.SimpleNamespace(enabled=True, config={"host_cache_sise": 1})
    )
    with pytest.raises(ValueError, match="host_cache_sise"):
        dsds.DataStatesCheckpointEngine(cfg)


def _engine() -> dsds.DataStatesCheckpointEngine:
    return dsds.DataStatesCheckpointEngine(None, host_cache_size="16MiB", o_direct=False)


def test_engine_writes_torch_load_files_and_latest(tmp_path: Path) -> None:
    eng = _engine()
    try:
        state = framework_like_state()
        info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
        eng.create(info)
        os.makedirs(tmp_path / "t1")
        eng.save(state, str(tmp_path / "t1" / "model.pt"))
        assert eng.get_commit_info() == CheckpointCommitInfo("t1", str(tmp_path), False)
        assert eng.commit(eng.get_commit_info())  # type: ignore[arg-type]
        assert eng.get_commit_info() is None
        assert eng.wait(timeout=60)
        assert (tmp_path / "latest").read_text() == "t1"
        assert not list(tmp_path.glob("t1/*" + dsds.TMP_SUFFIX))
        assert_same(torch.load(tmp_path / "t1" / "model.pt", weights_only=True), state)
        assert_same(eng.load(str(tmp_path / "t1" / "model.pt")), state)
    finally:
        eng.cleanup()


def test_tensor_changed_outside_step_fails_tag_without_latest(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()  # the optimizer is known: its state is captured lazily
    eng = _engine()
    try:
        eng.create(CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True))
        path = tmp_path / "optim.pt"
        eng.save({"optimizer": opt.state_dict()}, str(path))
        opt.state[model.weight]["exp_avg"].add_(1.0)  # outside step(): the save must fail
        assert not eng.commit(eng.get_commit_info())  # type: ignore[arg-type]
        with pytest.raises(CheckpointSaveError, match="exp_avg"):
            eng.wait(timeout=60)
        assert not (tmp_path / "latest").exists()
        assert not path.exists() and not list(tmp_path.glob("*" + dsds.TMP_SUFFIX))
        # the engine stays usable
        eng.create(CheckpointCommitInfo(tag="t2", save_dir=str(tmp_path), save_latest=True))
        eng.save({"optimizer": opt.state_dict()}, str(path))
        assert eng.wait(timeout=60)
        assert (tmp_path / "latest").read_text() == "t2"
        assert torch.equal(torch.load(path)["optimizer"]["state"][0]["exp_avg"],
                           opt.state[model.weight]["exp_avg"])
    finally:
        eng.cleanup()


def _torchrun(nproc: int, script: str, *args: str, timeout: int = 240) -> str:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(HERE / "integration" / script), *args]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} on {nproc} ranks timed out: {str(e.stdout)[-3000:]}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_zero1_zero2_save_resume_exact(tmp_path: Path, nproc: int) -> None:
    out = _torchrun(nproc, "ds_train.py", str(tmp_path), "--stages", "1,2")
    # the ranks' outputs share one pipe: count the markers anywhere, not per line
    counts = collections.Counter(re.findall(r"CHECK (\w+) ok", out))
    per_stage = {"routed": 1, "exact": 4, "latest_after_durable": 3, "load_after_save": 3}
    for name, n in per_stage.items():
        assert counts[name] == n * 2 * nproc, (name, counts)
    assert counts["zero_to_fp32"] == 2  # rank 0, both stages
    assert counts["torch_load"] >= 2 * 2 * nproc  # model + optimizer files, per rank
    assert out.count("ALL DONE") == nproc


def test_transformers_trainer_resumes_from_our_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = _torchrun(1, "ds_trainer.py", str(tmp_path / "run"))
    assert "CHECK trainer_engine ok" in out
    assert "CHECK trainer_resume ok" in out


def test_engine_choice_is_visible_with_default_logging() -> None:
    # no logging set up in the script: the line must reach stdout/stderr, once (rank 0 only)
    out = _torchrun(2, "ds_engine_log.py", timeout=180)
    assert out.count("BUILT") == 2
    lines = [ln for ln in out.splitlines() if "'datastates_ckpt' is served by dcp_datastates" in ln]
    assert len(lines) == 1, out[-4000:]
    assert "[Rank 0]" in lines[0] and "DataStates-LLM" in lines[0]
