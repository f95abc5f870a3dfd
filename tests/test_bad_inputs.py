"""Bad inputs fail early and clearly, naming the key or the setting, and lose nothing."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter, parse_size
from dcp_datastates.config import physical_memory_bytes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _bad_tensors() -> list[Any]:
    cases = [
        pytest.param(torch.eye(3).to_sparse(), "sparse", id="sparse-coo"),
        pytest.param(torch.eye(3).to_sparse_csr(), "sparse", id="sparse-csr"),
        pytest.param(torch.empty(4, device="meta"), "meta tensor", id="meta"),
        pytest.param(
            torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8), "quantized",
            id="quantized",
        ),
        pytest.param(
            torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested", id="nested"
        ),
    ]
    return cases


@pytest.mark.parametrize(("value", "what"), _bad_tensors())
def test_unsupported_tensors_name_the_key(
    tmp_path: Any, writer_factory: Any, value: torch.Tensor, what: str
) -> None:
    w: DataStatesWriter = writer_factory()
    sd = {"good": torch.ones(3), "model": {"layer": {"weird": value}}}
    path = str(tmp_path / "c")
    key = r"model\.layer\.weird"
    with pytest.raises(TypeError, match=rf"{key}.*{what}|{what}.*{key}"):
        dcp.async_save(sd, storage_writer=w, checkpoint_id=path)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    assert w.engine_counters()["jobs"] == 0
    # The writer is unharmed.
    dcp.async_save({"good": torch.ones(3)}, storage_writer=w, checkpoint_id=path).result()


@pytest.mark.parametrize(
    "size",
    [0, -1, -0.5, "0MiB", "-3GiB", "lots", "12 parsecs", float("nan"), float("inf"), True, None],
)
def test_host_cache_size_rejected(tmp_path: Any, size: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="host_cache_size"):
        DataStatesWriter(str(tmp_path), host_cache_size=size)


def test_host_cache_above_physical_memory(tmp_path: Any) -> None:
    phys = physical_memory_bytes()
    assert phys is not None
    with pytest.raises(ValueError, match="exceeds this machine's physical memory"):
        DataStatesWriter(str(tmp_path), host_cache_size=phys * 2 / 1024**3)


def test_parse_size_units() -> None:
    assert parse_size(16) == 16 * 1024**3
    assert parse_size(0.5) == 512 * 1024**2
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("16") == 16 * 1024**3  # a bare number is GiB in every form
    assert parse_size(" 0.5 ") == 512 * 1024**2
    assert parse_size("4096B") == 4096
    assert parse_size("4096", default_unit=1) == 4096
    assert parse_size("64 KiB") == 65536


@pytest.mark.parametrize(
    "kw",
    [{"copy_threads": 0}, {"flush_threads": -1}, {"files_per_rank": 0}, {"capture": "sometimes"},
     {"chunk_size": "1KiB"}, {"flush_nice": 40}],
)
def test_other_settings_rejected(tmp_path: Any, kw: dict) -> None:
    with pytest.raises(ValueError):
        DataStatesWriter(str(tmp_path), host_cache_size="1MiB", **kw)


def test_no_path_and_no_checkpoint_id(writer_factory: Any) -> None:
    w = DataStatesWriter("", host_cache_size="1MiB", prefault=False)
    try:
        with pytest.raises(BaseException, match="has no path"):
            dcp.save({"x": torch.ones(2)}, storage_writer=w)
    finally:
        w.close()


def test_checkpoint_id_under_a_file(tmp_path: Any, writer_factory: Any) -> None:
    f = tmp_path / "file"
    f.write_text("keep me")
    w: DataStatesWriter = writer_factory()
    with pytest.raises(BaseException, match="file/ckpt|Not a directory|File exists"):
        dcp.save({"x": torch.ones(2)}, storage_writer=w, checkpoint_id=str(f / "ckpt"))
    assert f.read_text() == "keep me"


def test_large_non_tensor_values_work(tmp_path: Any, writer_factory: Any) -> None:
    blob = os.urandom(24 * 1024 * 1024)  # larger than the 8 MiB host cache
    sd = {"blob": blob, "meta": {"names": [f"n{i}" for i in range(100_000)]}, "t": torch.ones(4)}
    w: DataStatesWriter = writer_factory()
    dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c")).result()
    out = {"blob": b"", "meta": {"names": []}, "t": torch.zeros(4)}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert out["blob"] == blob and out["meta"]["names"][-1] == "n99999"


def test_unpicklable_non_tensor_fails_clearly(tmp_path: Any, writer_factory: Any) -> None:
    import threading

    w: DataStatesWriter = writer_factory()
    with pytest.raises(TypeError, match="cannot save 'opts.lock'"):
        dcp.async_save({"opts": {"lock": threading.Lock()}}, storage_writer=w,
                       checkpoint_id=str(tmp_path / "c"))


def test_writer_cannot_be_pickled_for_process_executor(writer_factory: Any) -> None:
    import pickle

    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(writer_factory())


def test_closed_writer_refuses_saves(tmp_path: Any) -> None:
    w = DataStatesWriter(str(tmp_path), host_cache_size="1MiB", prefault=False)
    w.close()
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        dcp.async_save({"x": torch.ones(1)}, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
