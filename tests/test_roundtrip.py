"""Single-process round trips: what DataStatesWriter writes, stock dcp.load reads bit-exactly."""

from __future__ import annotations

import os
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, zeros_like_state

from dcp_datastates import DataStatesWriter, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def rich_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(64, 48, generator=g)
    shared = torch.randn(1000, generator=g)
    sd: dict[str, Any] = {
        "fp32": torch.randn(300, 200, generator=g),
        "fp64": torch.randn(17, generator=g, dtype=torch.float64),
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(129, generator=g).to(torch.float16),
        "fp8_e4m3": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
        "fp8_e5m2": torch.randn(40, generator=g).to(torch.float8_e5m2),
        "int8": torch.randint(-128, 127, (99,), generator=g, dtype=torch.int8),
        "uint8": torch.randint(0, 255, (99,), generator=g, dtype=torch.uint8),
        "int32": torch.randint(-(2**31), 2**31 - 1, (55,), generator=g, dtype=torch.int32),
        "int64": torch.randint(-(2**62), 2**62, (55,), generator=g, dtype=torch.int64),
        "bool": torch.rand(77, generator=g) > 0.5,
        "complex64": torch.randn(21, generator=g, dtype=torch.complex64),
        "complex128": torch.randn(5, 3, generator=g, dtype=torch.complex128),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "view_a": shared[10:400],
        "view_b": shared[300:900],  # overlaps view_a: both share one storage
        "conj": torch.randn(9, generator=g, dtype=torch.complex64).conj(),
        "param": torch.nn.Parameter(torch.randn(6, 5, generator=g)),  # requires_grad
        "nan_inf": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
        "nested": {
            "list": [torch.arange(6).reshape(2, 3), 5, "text", {"deep": torch.ones(3, 3)}],
            "tuple_of_ints": (1, 2, 3),
        },
        "step": 1234,
        "lr": 3e-4,
        "name": "run-α",
        "none": None,
        "blob": {"bytes": b"\x00\x01" * 50_000},
    }
    return sd


def _load_back(sd: dict[str, Any], path: str) -> dict[str, Any]:
    out = zeros_like_state(sd)
    dcp.load(out, checkpoint_id=path)
    return out


@pytest.mark.parametrize("mode", ["save", "async_save"])
@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({}, id="cache-fits"),
        pytest.param(
            {"host_cache_size": "64KiB", "chunk_size": "16KiB", "flush_threads": 1},
            id="backpressure-1flush",
        ),
        pytest.param(
            {
                "host_cache_size": "96KiB",
                "chunk_size": "8KiB",
                "flush_threads": 3,
                "copy_threads": 3,
                "files_per_rank": 3,
            },
            id="backpressure-3flush",
        ),
        pytest.param({"o_direct": True, "files_per_rank": 1}, id="o_direct"),
        pytest.param({"capture": "lazy"}, id="capture-lazy"),
        pytest.param({"capture": "eager", "checksums": False}, id="capture-eager"),
    ],
)
def test_roundtrip_bit_exact(tmp_path: Any, writer_factory: Any, mode: str, knobs: dict) -> None:
    sd = rich_state()
    w: DataStatesWriter = writer_factory(**knobs)
    path = str(tmp_path / "ckpt")
    if mode == "save":
        dcp.save(sd, storage_writer=w, checkpoint_id=path)
    else:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=path).result()
    assert_state_equal(sd, _load_back(sd, path))
    rep = verify_checkpoint(path)
    assert rep.ok, rep.summary()
    assert w.engine_counters()["cache_used_bytes"] == 0
    assert w.engine_counters()["jobs"] == 0


def test_fsspec_file_url_loads_with_fsspec_reader(tmp_path: Any, writer_factory: Any) -> None:
    sd = rich_state()
    url = f"file://{tmp_path}/ckpt"
    dcp.save(sd, storage_writer=writer_factory(), checkpoint_id=url)
    out = zeros_like_state(sd)
    dcp.load(out, checkpoint_id=url)  # '://' selects FsspecReader
    assert_state_equal(sd, out)


@pytest.mark.parametrize("cache", ["8MiB", "48KiB"])
def test_memory_url_through_python_flush_path(writer_factory: Any, cache: str) -> None:
    sd = rich_state()
    url = f"memory://dcpds-test-{cache}/ckpt"
    w = writer_factory(host_cache_size=cache, chunk_size="16KiB")
    dcp.async_save(sd, storage_writer=w, checkpoint_id=url).result()
    fs = fsspec.filesystem("memory")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"/dcpds-test-{cache}/ckpt", detail=False)}
    assert ".metadata" in names and "__0_0.distcp" in names
    out = zeros_like_state(sd)
    dcp.load(out, checkpoint_id=url)
    assert_state_equal(sd, out)
    assert verify_checkpoint(url).ok


def test_writer_reused_across_many_saves(tmp_path: Any, writer_factory: Any) -> None:
    w = writer_factory(host_cache_size="1MiB", chunk_size="64KiB")
    t = torch.zeros(200_000)
    for step in range(6):
        t.fill_(step)
        path = str(tmp_path / f"step-{step}")
        if step % 2:
            dcp.async_save({"t": t, "step": step}, storage_writer=w, checkpoint_id=path).result()
        else:
            dcp.save({"t": t, "step": step}, storage_writer=w, checkpoint_id=path)
    for step in range(6):
        out = {"t": torch.empty(200_000), "step": -1}
        dcp.load(out, checkpoint_id=str(tmp_path / f"step-{step}"))
        assert out["step"] == step and bool((out["t"] == step).all())


def test_default_path_when_no_checkpoint_id(tmp_path: Any) -> None:
    path = str(tmp_path / "fixed")
    with DataStatesWriter(path, host_cache_size="4MiB", prefault=False) as w:
        dcp.save({"x": torch.arange(10)}, storage_writer=w)
    out = {"x": torch.zeros(10, dtype=torch.int64)}
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["x"], torch.arange(10))


def test_overwrite_replaces_commit(tmp_path: Any, writer_factory: Any) -> None:
    path = str(tmp_path / "ckpt")
    w = writer_factory()
    dcp.save({"x": torch.zeros(10)}, storage_writer=w, checkpoint_id=path)
    dcp.save({"x": torch.ones(10)}, storage_writer=w, checkpoint_id=path)
    out = {"x": torch.full((10,), 7.0)}
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["x"], torch.ones(10))
    assert not os.path.exists(os.path.join(path, ".datastates.incomplete"))
