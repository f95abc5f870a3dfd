"""Lightning adapters (issue 11, item 3): CheckpointIO plugin and ModelParallel strategy.

The Trainer tests run tests/integration/pl_train.py in a subprocess (killed on timeout, and the
script dumps its stacks and exits itself before that); the plugin's contract is tested in
process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")  # CI installs it (scripts/install_integrations.sh)

from conftest import in_thread  # noqa: E402

from dcp_datastates.errors import CheckpointSaveError  # noqa: E402
from dcp_datastates.integrations.lightning import (  # noqa: E402
    DataStatesCheckpointIO,
    DataStatesModelParallelStrategy,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SCRIPT = Path(__file__).parent / "integration" / "pl_train.py"


def run_script(mode: str, out: Path, timeout_s: float = 240) -> dict[str, Any]:
    env = dict(os.environ, PL_TRAIN_HANG_S=str(timeout_s - 30), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), mode, str(out)],
        cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    tail = f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{tail}"
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("mode", ["single", "ddp", "mp"])
def test_trainer_checkpoints_are_exact_and_resume_bit_exact(mode: str, tmp_path: Path) -> None:
    res = run_script(mode, tmp_path)
    assert res["exact"] and res["global_step"] == 8 * (2 if mode == "single" else 1)
    # save_top_k=2: the two older of four checkpoints were removed through remove_checkpoint
    assert len(res["kept"]) == 2 and res["resumed_from"] == res["kept"][0]
    kept = sorted(os.listdir(tmp_path / "ckpts"))
    assert kept == res["kept"]
    for name in kept:
        assert (tmp_path / "ckpts" / name / ".metadata").is_file()
    if mode != "mp":
        assert res["checked_at_save_call"] == kept  # every kept checkpoint: values at the call


KEEP: list[Any] = []  # live optimizers: their tensors are captured lazily (the default policy)


def ckpt_dict(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    KEEP.append((model, opt))
    return {
        "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
        "epoch": 1, "global_step": 1, "callbacks": {}, "hyper_parameters": {"lr": 1e-3},
    }  # fmt: skip


def small_io(**kw: Any) -> DataStatesCheckpointIO:
    kw.setdefault("idle_priority", False)
    return DataStatesCheckpointIO({"host_cache_size": "16MiB"}, **kw)


def assert_ckpt_equal(a: Any, b: Any) -> None:
    from test_integration_pack import assert_same

    assert_same(a, b)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="'host_cache_sise'"):
        DataStatesCheckpointIO({"host_cache_sise": 1})
    with pytest.raises(ValueError, match="'host_cache_size' is given both"):
        DataStatesCheckpointIO({"host_cache_size": 1}, host_cache_size=2)
    with pytest.raises(ValueError, match="'parser_thread'"):
        DataStatesModelParallelStrategy(parser_thread=2)
    s = DataStatesModelParallelStrategy(data_parallel_size=1, datastates={"parser_threads": 3})
    assert s._writer_kwargs == {"copy_threads": 3}


def test_save_load_remove_round_trip_and_same_path_again(tmp_path: Path) -> None:
    io = small_io()
    try:
        ck = ckpt_dict()
        path = tmp_path / "last.ckpt"
        (tmp_path / "last.ckpt").write_bytes(b"an old torch.save file at this name")
        io.save_checkpoint(ck, path)
        ck2 = ckpt_dict(seed=1)
        io.save_checkpoint(ck2, path)  # the same path again while the first may be in flight
        back = in_thread(lambda: io.load_checkpoint(path), what="load_checkpoint")
        assert_ckpt_equal(ck2, back)
        assert list(back["optimizer_states"][0]["state"]) == [0, 1]
        io.remove_checkpoint(path)
        assert not path.exists()
        with pytest.raises(FileNotFoundError, match="last.ckpt"):
            io.load_checkpoint(path)
        with pytest.raises(TypeError, match="storage_options"):
            io.save_checkpoint(ck, path, storage_options={"x": 1})
    finally:
        in_thread(io.teardown, what="teardown")


def test_load_and_remove_wait_for_the_save_in_flight(tmp_path: Path) -> None:
    io = small_io()
    try:
        io.save_checkpoint(ckpt_dict(), tmp_path / "warm")  # creates the writer
        io.wait()
        io.writer.engine.pause_copies(True)
        ck = ckpt_dict(seed=2)
        io.save_checkpoint(ck, tmp_path / "a")
        io.save_checkpoint(ckpt_dict(seed=3), tmp_path / "b")
        assert not (tmp_path / "a" / ".metadata").exists()  # held: not durable yet
        assert io.writer.engine_counters()["pending_copies"] > 0  # lazy copies are held
        threading.Timer(0.3, io.writer.engine.pause_copies, args=(False,)).start()
        back = in_thread(lambda: io.load_checkpoint(tmp_path / "a"), what="load_checkpoint")
        assert_ckpt_equal(ck, back)
        in_thread(lambda: io.remove_checkpoint(tmp_path / "b"), what="remove_checkpoint")
        assert not (tmp_path / "b").exists()
    finally:
        in_thread(io.teardown, what="teardown")


def test_failed_save_surfaces_at_next_save_and_at_teardown(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    io = small_io()
    try:
        io.save_checkpoint(ckpt_dict(), blocker / "x.ckpt")  # returns; fails in the background
        # The next save *after the failure* raises it (on a loaded machine x may still be
        # running when the next save starts; that save then goes ahead and teardown raises x).
        concurrent.futures.wait([io._saves._pending[str(blocker / "x.ckpt")]], timeout=60)
        with pytest.raises(CheckpointSaveError, match="file/x.ckpt"):
            in_thread(lambda: io.save_checkpoint(ckpt_dict(), tmp_path / "ok"), what="save")
        io.save_checkpoint(ckpt_dict(), tmp_path / "ok")  # reported once; the writer goes on
        io.save_checkpoint(ckpt_dict(), blocker / "y.ckpt")
    finally:
        with pytest.raises(CheckpointSaveError, match="file/y.ckpt"):
            in_thread(io.teardown, what="teardown")
    assert (tmp_path / "ok" / ".metadata").is_file()
    io.teardown()  # nothing left to report; a later use would create a new writer


def test_loads_lightning_default_ckpt_files(tmp_path: Path) -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    ck = ckpt_dict()
    TorchCheckpointIO().save_checkpoint(ck, tmp_path / "old.ckpt")
    io = small_io()
    back = io.load_checkpoint(tmp_path / "old.ckpt")
    assert_ckpt_equal(ck, back)
    io.teardown()


def test_plugin_pickles_without_its_writer(tmp_path: Path) -> None:
    import pickle

    io = small_io()
    io.save_checkpoint(ckpt_dict(), tmp_path / "c")
    clone = pickle.loads(pickle.dumps(io))  # ddp_spawn ships plugins to the workers
    assert clone._writer is None and clone._writer_kwargs == io._writer_kwargs
    io.teardown()
