"""DataStatesWriter(format="safetensors"): files that safetensors and torch's HF reader load.

Every tensor round-trips bit for bit through ``safetensors.safe_open`` (each rank's files),
through torch's ``HuggingFaceStorageReader`` (which reshards: 2 ranks -> 1 and 1 -> 2), and,
non-tensor values included, through ``dcp_datastates.load``; ``verify`` checks the headers and
the checksums. Multi-rank saves run over gloo on 2 spawned ranks (dist_utils.run_ranks).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, in_thread
from dist_utils import run_ranks
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader

import dcp_datastates
from dcp_datastates import DataStatesWriter, verify_checkpoint
from dcp_datastates.format.safetensors import SHARD_FILE_RE


def all_dtypes_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "fp32": torch.randn(64, 129, generator=g),  # not a page multiple: buffered tail
        "big": torch.randn(2048, 8, generator=g),  # 64 KiB: page-aligned O_DIRECT payload
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(5, 3, generator=g).to(torch.float16),
        "e4m3": torch.randn(17, 3, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(4, 9, generator=g).to(torch.float8_e5m2),
        "i8": torch.randint(-128, 127, (31,), dtype=torch.int8, generator=g),
        "i64": torch.randint(-(2**62), 2**62, (3, 4), dtype=torch.int64, generator=g),
        "bool": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "step": 42,
        "meta": {"lr": 0.1, "name": "run-a"},
    }


def tensors_of(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def read_safetensors(ckpt: Path) -> dict[str, list[tuple[str, torch.Tensor, Any]]]:
    """Every tensor of every .safetensors file: key -> [(file, tensor, saved_offsets)]."""
    out: dict[str, list[tuple[str, torch.Tensor, Any]]] = {}
    for name in sorted(os.listdir(ckpt)):
        if not name.endswith(".safetensors"):
            continue
        assert SHARD_FILE_RE.match(name), name
        with safe_open(str(ckpt / name), framework="pt") as f:
            info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for k in f.keys():
                out.setdefault(k, []).append((name, f.get_tensor(k), info[k]["saved_offsets"]))
    return out


@pytest.mark.parametrize("mode", ["save", "async_save"])
@pytest.mark.parametrize("o_direct", [True, False])
def test_every_dtype_round_trips_bit_exact(tmp_path: Path, mode: str, o_direct: bool) -> None:
    sd = all_dtypes_state()
    ckpt = tmp_path / "ckpt"
    with DataStatesWriter(ckpt, host_cache_size="1MiB", chunk_size="16KiB", o_direct=o_direct,
                          format="safetensors") as w:
        if mode == "save":
            in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=ckpt))
        else:
            in_thread(lambda: dcp.async_save(sd, storage_writer=w, checkpoint_id=ckpt).result())
    files = read_safetensors(ckpt)
    expected = tensors_of(sd)
    assert set(files) == set(expected)
    for k, [(_name, t, saved)] in files.items():
        assert_state_equal(t, expected[k], k)
        assert saved == [0] * expected[k].dim()
    # Non-tensor values are in the side file, not in a safetensors file.
    assert "__0_0.distcp" in os.listdir(ckpt)
    # The data section starts on a page with O_DIRECT (header padded with spaces), else on 8.
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors"):
            with open(ckpt / name, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                assert (8 + n) % (4096 if o_direct else 8) == 0
    rep = verify_checkpoint(ckpt)
    assert rep.ok and rep.fully_verified, rep.summary()
    # Everything, non-tensor values included, through dcp_datastates.load.
    dest: dict[str, Any] = {k: torch.zeros_like(v) for k, v in expected.items()}
    dest["step"], dest["meta"] = 0, {"lr": 0.0, "name": ""}
    dcp_datastates.load(dest, ckpt)
    assert_state_equal(dest, sd)
    # Tensors through torch's HuggingFaceStorageReader (no .metadata involved).
    hf = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(hf, storage_reader=HuggingFaceStorageReader(str(ckpt)))
    assert_state_equal(hf, expected)


def test_stock_reader_loads_only_non_tensor_values(tmp_path: Path) -> None:
    """As documented: the stock FileSystemReader reads the side file but not raw tensors."""
    sd = {"w": torch.arange(6.0), "step": 3}
    with DataStatesWriter(tmp_path, host_cache_size="1MiB", format="safetensors") as w:
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=tmp_path))
    only_bytes: dict[str, Any] = {"step": 0}
    dcp.load(only_bytes, checkpoint_id=tmp_path)
    assert only_bytes == {"step": 3}
    with pytest.raises(BaseException):  # noqa: B017 - torch.load of raw bytes (any error)
        dcp.load({"w": torch.zeros(6)}, checkpoint_id=tmp_path)


def test_unsupported_dtype_fails_naming_the_key(tmp_path: Path) -> None:
    with DataStatesWriter(tmp_path, host_cache_size="1MiB", format="safetensors") as w:
        bad = {"ok": torch.ones(3), "cplx": torch.ones(2, dtype=torch.complex128)}
        with pytest.raises(BaseException, match="'cplx'.*complex128.*safetensors"):
            in_thread(lambda: dcp.save(bad, storage_writer=w, checkpoint_id=tmp_path / "a"))
        assert not (tmp_path / "a" / ".metadata").exists()
        # The writer stays usable.
        in_thread(lambda: dcp.save({"ok": torch.ones(3)}, storage_writer=w,
                                   checkpoint_id=tmp_path / "b"))
    assert verify_checkpoint(tmp_path / "b").ok


def test_overwrite_removes_the_old_safetensors_files(tmp_path: Path) -> None:
    """HuggingFaceStorageReader loads every .safetensors file in the directory: an overwrite
    with fewer files must not leave old ones behind."""
    sd = {f"t{i}": torch.full((100,), float(i)) for i in range(4)}
    with DataStatesWriter(tmp_path, host_cache_size="1MiB", files_per_rank=3,
                          format="safetensors") as w:
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=tmp_path))
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) == 3
    sd2 = {"t0": torch.full((100,), 7.0)}
    with DataStatesWriter(tmp_path, host_cache_size="1MiB", files_per_rank=1,
                          format="safetensors") as w:
        in_thread(lambda: dcp.save(sd2, storage_writer=w, checkpoint_id=tmp_path))
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors")) == [
        "shard-00001-model-00001-of-00001.safetensors"
    ]
    assert set(read_safetensors(tmp_path)) == {"t0"}


def test_verify_finds_header_and_payload_damage(tmp_path: Path) -> None:
    sd = {"w": torch.randn(256, 64), "b": torch.randn(64)}
    with DataStatesWriter(tmp_path, host_cache_size="1MiB", files_per_rank=1,
                          format="safetensors") as w:
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=tmp_path))
    f = tmp_path / "shard-00001-model-00001-of-00001.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].decode()
    # Damage the payload: a checksum mismatch naming the tensor.
    good = bytes(raw)
    raw[8 + n + 10] ^= 0xFF
    f.write_bytes(bytes(raw))
    rep = verify_checkpoint(tmp_path)
    assert not rep.ok and any("checksum mismatch" in p for p in rep.problems), rep.problems
    # Damage the header: a shape that no longer matches the manifest.
    f.write_bytes(good[:8] + header.replace("[256,64]", "[64,256]").encode() + good[8 + n:])
    rep = verify_checkpoint(tmp_path)
    assert any("'w'" in p and "safetensors header says" in p for p in rep.problems), rep.problems
    # A header that is not JSON at all.
    f.write_bytes(good[:8] + b"{" * n + good[8 + n:])
    rep = verify_checkpoint(tmp_path)
    assert any("safetensors header damaged" in p for p in rep.problems), rep.problems
    with pytest.raises(dcp_datastates.IntegrityError):
        dcp_datastates.load({"w": torch.zeros(256, 64), "b": torch.zeros(64)}, tmp_path)


# ----------------------------------------------------------------------------------------------
# Two ranks: DTensor shards saved by 2 ranks load resharded into 1 process, and a checkpoint
# saved by 1 process loads into DTensor shards on 2 ranks.


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "rows": torch.randn(5, 6, generator=g),  # Shard(0): 3 + 2 rows
        "cols": torch.randn(4, 7, generator=g).to(torch.bfloat16),  # Shard(1): 4 + 3 columns
        "ints": torch.arange(24, dtype=torch.int64).reshape(4, 6),  # replicated: one writer
        "e4m3": torch.randn(6, 2, generator=g).to(torch.float8_e4m3fn),  # Shard(0)
    }


def _two_rank_body(rank: int, world: int, two_rank_ckpt: str, one_rank_ckpt: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    e4m3 = full.pop("e4m3")  # gloo cannot scatter or gather fp8: shards are made locally

    def local_fp8(t: torch.Tensor, dim: int) -> Any:
        return DTensor.from_local(torch.chunk(t, world, dim)[rank].contiguous(), mesh,
                                  [Shard(dim)], run_check=False)

    place = {"rows": [Shard(0)], "cols": [Shard(1)], "ints": [Replicate()]}
    sd: dict[str, Any] = {k: distribute_tensor(v, mesh, place[k]) for k, v in full.items()}
    sd["e4m3"] = local_fp8(e4m3, 0)
    sd["step"] = 9
    pg = dist.new_group(backend="gloo")
    with DataStatesWriter(two_rank_ckpt, host_cache_size="1MiB", chunk_size="16KiB",
                          files_per_rank=1, format="safetensors") as w:
        dcp.async_save(sd, storage_writer=w, checkpoint_id=two_rank_ckpt,
                       process_group=pg).result(timeout=60)
    dist.barrier()
    # 1 -> 2: the single-process checkpoint into other placements, with torch's HF reader.
    other = {"rows": [Shard(1)], "cols": [Shard(0)], "ints": [Shard(0)]}
    dest = {k: distribute_tensor(torch.zeros_like(v), mesh, other[k]) for k, v in full.items()}
    dest["e4m3"] = local_fp8(torch.zeros_like(e4m3), 1)
    dcp.load(dest, storage_reader=HuggingFaceStorageReader(one_rank_ckpt), process_group=pg)
    for k, v in full.items():
        assert_state_equal(dest[k].full_tensor(), v, k)
    assert_state_equal(dest["e4m3"].to_local(), torch.chunk(e4m3, world, 1)[rank].contiguous())


def test_two_ranks_save_and_reshard_both_ways(tmp_path: Path) -> None:
    full = full_tensors()
    one = tmp_path / "one"
    with DataStatesWriter(one, host_cache_size="1MiB", format="safetensors") as w:
        in_thread(lambda: dcp.save(dict(full), storage_writer=w, checkpoint_id=one))
    two = tmp_path / "two"
    run_ranks(_two_rank_body, str(two), str(one), tmp_path=tmp_path / "work", timeout_s=120)

    # Each rank wrote its own file; each holds that rank's shards at their saved offsets.
    files = read_safetensors(two)
    names = {n for entries in files.values() for n, _t, _o in entries}
    assert names == {"shard-00001-model-00001-of-00001.safetensors",
                     "shard-00002-model-00001-of-00001.safetensors"}
    for k, entries in files.items():
        for _name, t, offs in entries:
            box = full[k]
            for dim, (o, s) in enumerate(zip(offs, t.shape, strict=True)):
                box = box.narrow(dim, o, s)
            assert_state_equal(t, box.contiguous(), k)
    assert len(files["ints"]) == 1  # replicated: deduplicated onto one rank
    # 2 -> 1: torch's HF reader reassembles the shards into plain tensors.
    hf = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(hf, storage_reader=HuggingFaceStorageReader(str(two)))
    assert_state_equal(hf, full)
    # And through .metadata, non-tensor values included.
    dest: dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items()}
    dest["step"] = 0
    dcp_datastates.load(dest, two)
    assert_state_equal(dest, {**full, "step": 9})
    rep = verify_checkpoint(two)
    assert rep.ok and rep.ranks == 2, rep.summary()
