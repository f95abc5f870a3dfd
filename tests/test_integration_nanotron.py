"""Nanotron's checkpoint-engine interface (the DataStates fork) on DataStatesWriter.

Nanotron needs CUDA, so the adapter is tested against the interface: the engine in-process
(parameter files with tensor metadata, optimizer state with int keys, the snapshot taken at the
save call while the optimizer keeps stepping), and :func:`install` against a stand-in of the
fork's ``nanotron.serialize.engine`` module in a subprocess (its abstract base class and the
engine table the YAML key ``checkpointing_engine: datastates`` selects from).
``test_with_the_fork_itself`` runs against the fork's own modules where the fork is installed
(docs/integrations.md says how); CI does not install it (not on a package registry).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from dcp_datastates.integrations.nanotron import DataStatesNanotronEngine

CONFIG = {"host_cache_size": "64MiB", "parser_threads": 1, "pin_host_cache": False}


@pytest.fixture
def engine() -> Iterator[DataStatesNanotronEngine]:
    eng = DataStatesNanotronEngine(CONFIG)
    yield eng
    eng.close()


def test_parameter_file_roundtrip_with_metadata(
    engine: DataStatesNanotronEngine, tmp_path: Path
) -> None:
    t = torch.randn(64, 32, dtype=torch.bfloat16)
    meta = {"version": "1.4", "local_global_slices_pairs": "[]"}
    path = tmp_path / "model_weight.datastates"
    engine.save({"data": t}, path, metadata=meta)
    got = engine.load(path)  # right after the save: waits for it
    assert got.dtype == t.dtype and torch.equal(got, t)
    assert engine.load_metadata(path) == meta


def test_optimizer_state_resumes_exactly(
    engine: DataStatesNanotronEngine, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    ref = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
           for k, s in opt.state_dict()["state"].items()}
    engine.save(opt.state_dict(), tmp_path / "optimizer.pt")
    for _ in range(2):  # training goes on: the checkpoint keeps the state of the save call
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    engine.wait_persisted()
    loaded = engine.load_unsafe(tmp_path / "optimizer.pt")
    assert sorted(loaded["state"]) == [0, 1]  # int keys, not '0'/'1'
    opt2 = torch.optim.AdamW(nn.Linear(8, 4).parameters(), lr=1e-2)
    opt2.load_state_dict(loaded)
    for k, s in ref.items():
        for n, v in s.items():
            got = opt2.state_dict()["state"][k][n]
            assert torch.equal(got, v), (k, n)


def test_parameters_captured_at_the_save_call(
    engine: DataStatesNanotronEngine, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()  # the optimizer is known to the step barrier from its first step
    expected = model.weight.detach().clone()
    engine.save({"data": model.weight.detach()}, tmp_path / "w")
    engine.wait()  # the trainer's call before the step
    model(torch.randn(4, 256)).sum().backward()
    opt.step()  # modifies the weight in place
    assert not torch.equal(model.weight.detach(), expected)
    assert torch.equal(engine.load(tmp_path / "w"), expected)


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'host_cache_sze'"):
        DataStatesNanotronEngine({"host_cache_sze": 1})
    eng = DataStatesNanotronEngine(CONFIG)
    try:
        with pytest.raises(FileNotFoundError, match="never"):
            eng.load(tmp_path / "never")
        with pytest.raises(ValueError, match="no 'data' tensor"):
            eng.save({"x": torch.ones(1)}, tmp_path / "bad", metadata={"a": "b"})
        eng.save({"step": 3}, tmp_path / "meta")
        with pytest.raises(KeyError, match="not a parameter file"):
            eng.load(tmp_path / "meta")
    finally:
        eng.close()


def test_engine_declares_the_version_the_fork_records() -> None:
    # The fork reads CHECKPOINT_VERSION at every save (checkpoint_metadata.json, TensorMetadata of
    # sharded parameters) and compares it at resume; its own DataStates engine's files are 1.0.
    from packaging.version import Version

    version = DataStatesNanotronEngine.CHECKPOINT_VERSION
    assert isinstance(version, Version) and version > Version("1.0")


def test_a_file_from_another_engine_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "optimizer.pt"
    torch.save({"state": {}}, path)  # what the fork's TorchCheckpointEngine writes
    eng = DataStatesNanotronEngine(CONFIG)
    try:
        with pytest.raises(ValueError, match="optimizer.pt.*another Nanotron checkpoint engine"):
            eng.load_unsafe(path)
    finally:
        eng.close()


def test_install_against_the_forks_engine_table(tmp_path: Path) -> None:
    # A stand-in for the fork's modules: the engine ABC and the table keyed by the enum.
    pkg = tmp_path / "nanotron"
    (pkg / "serialize").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text(textwrap.dedent('''
        import enum
        class CheckpointingEngineType(str, enum.Enum):
            TORCH = "torch"
            DATASTATES = "datastates"
    '''))
    (pkg / "serialize" / "__init__.py").write_text("")
    (pkg / "serialize" / "engine.py").write_text(textwrap.dedent('''
        from abc import ABC, abstractmethod
        from nanotron.config import CheckpointingEngineType
        class CheckpointEngine(ABC):
            CHECKPOINT_VERSION: "Version"
            def __init__(self, config=None):
                self.config = config
            @abstractmethod
            def save(self, state_dict, path, metadata=None): ...
            @abstractmethod
            def load_unsafe(self, path, map_location=None): ...
            @abstractmethod
            def load(self, path, framework="pt", device="cpu"): ...
            @abstractmethod
            def wait(self): ...
        class DataStatesCheckpointEngine(CheckpointEngine):
            def __init__(self, config=None):
                raise RuntimeError("needs CUDA")
        _CONFIG_TO_CHECKPOINT_ENGINE_CLASS = {
            CheckpointingEngineType.DATASTATES: DataStatesCheckpointEngine,
        }
        def create_checkpoint_engine_class(engine_type):
            return _CONFIG_TO_CHECKPOINT_ENGINE_CLASS[engine_type]
    '''))
    code = textwrap.dedent(f'''
        import sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import dcp_datastates.integrations.nanotron as ds_nanotron
        from nanotron.config import CheckpointingEngineType
        from nanotron.serialize import engine
        ds_nanotron.install()
        cls = engine.create_checkpoint_engine_class(CheckpointingEngineType("datastates"))
        assert cls is ds_nanotron.DataStatesNanotronEngine
        assert issubclass(cls, engine.CheckpointEngine)
        cfg = {{"host_cache_size": 0.0625, "parser_threads": 1, "pin_host_cache": False}}
        eng = cls(config=cfg)
        # what the fork's save_meta records and its load_meta compares at resume
        from packaging.version import Version
        assert Version(str(eng.CHECKPOINT_VERSION)) <= eng.CHECKPOINT_VERSION
        eng.save({{"data": torch.arange(6.0)}}, {str(tmp_path / "p")!r})
        assert torch.equal(eng.load({str(tmp_path / "p")!r}), torch.arange(6.0))
        eng.close()
        print("OK")
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_with_the_fork_itself(tmp_path: Path) -> None:
    """Against the fork's own modules, where it is installed (docs/integrations.md, Nanotron)."""
    engine_mod = pytest.importorskip(
        "nanotron.serialize.engine",
        reason="the Nanotron DataStates fork is not installed (see docs/integrations.md)",
    )
    import dataclasses

    from nanotron.config import CheckpointingEngineType, DataStatesArgs
    from nanotron.serialize.metadata import TensorMetadata

    import dcp_datastates.integrations.nanotron as ds_nanotron

    saved = dict(engine_mod._CONFIG_TO_CHECKPOINT_ENGINE_CLASS)
    ds_nanotron.install()
    try:
        # as the fork's DistributedTrainer builds it from the YAML's datastates: block
        cls = engine_mod.create_checkpoint_engine_class(CheckpointingEngineType.DATASTATES)
        args = DataStatesArgs(host_cache_size=1, parser_threads=1, pin_host_cache=False)
        eng = cls(config=dataclasses.asdict(args))
    finally:
        engine_mod._CONFIG_TO_CHECKPOINT_ENGINE_CLASS.update(saved)
    try:
        assert isinstance(eng, engine_mod.CheckpointEngine)
        t = torch.randn(4, 3)
        meta = TensorMetadata(version=eng.CHECKPOINT_VERSION)
        path = tmp_path / f"model_weight.{eng.TENSOR_SUFFIX}"
        eng.save({"data": t}, path, metadata=meta)
        assert torch.equal(eng.load(path, framework="pt", device="cpu"), t)
        back = TensorMetadata.from_str_dict(eng.load_metadata(path))
        assert back.version <= eng.CHECKPOINT_VERSION  # the fork's resume check
        eng.save({"step": 3, "state": {0: {"exp_avg": t}}}, tmp_path / "optimizer.pt")
        eng.wait()
        got = eng.load_unsafe(tmp_path / "optimizer.pt", map_location="cpu")
        assert got["step"] == 3 and torch.equal(got["state"][0]["exp_avg"], t)
    finally:
        eng.close()
