"""``python -m dcp_datastates export``: DCP checkpoints of ours -> Hugging Face safetensors.

Exports are compared bit for bit with the saved state: single file and sharded (with the
index), from both checkpoint formats, from a 2-rank save of DTensor shards (reassembled from
chunks with a tiny buffer, so that slabs cut across chunks), with ``--dtype`` and ``--prefix``.
Damaged inputs fail with an error naming the tensor and exit code 1; the memory bound is
measured with ``VmHWM`` in a fresh process. Every child process has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, in_thread
from dist_utils import run_ranks
from safetensors.torch import load_file

from dcp_datastates import DataStatesWriter
from dcp_datastates.cli import main
from dcp_datastates.format.export import ExportError, export_checkpoint

CLI_TIMEOUT_S = 60


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(300, 77, generator=g),
            "bf16": torch.randn(40, 9, generator=g).to(torch.bfloat16),
            "fp16": torch.randn(6, generator=g).to(torch.float16),
            "e4m3": torch.randn(8, 8, generator=g).to(torch.float8_e4m3fn),
            "e5m2": torch.randn(3, 5, generator=g).to(torch.float8_e5m2),
            "i8": torch.randint(-100, 100, (50,), dtype=torch.int8, generator=g),
            "i64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "mask": torch.rand(11, generator=g) > 0.5,
            "scalar": torch.tensor(-1.5),
            "empty": torch.empty(0, 3),
        },
        "step": 12,
    }


def flat(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in sd["model"].items()}


def save(path: Path, sd: dict[str, Any], fmt: str) -> None:
    with DataStatesWriter(path, host_cache_size="1MiB", chunk_size="16KiB", format=fmt) as w:
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=path))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m dcp_datastates export ARGS`` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "dcp_datastates", "export", *args],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )


def cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The same command in this process (no interpreter start-up): (exit code, stderr)."""
    code = main(["export", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_single_file_bit_exact_with_progress_and_listing(tmp_path: Path, fmt: str) -> None:
    sd = state()
    save(tmp_path / "ckpt", sd, fmt)
    r = cli(str(tmp_path / "ckpt"), str(tmp_path / "out"), "--buffer", "64KiB", "--progress")
    assert r.returncode == 0, r.stderr
    assert "export" in r.stderr and re.search(r"100(\.0)?%", r.stderr)  # tqdm or ours
    assert "skipped 1 non-tensor value(s): step" in r.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert_state_equal(got, flat(sd))


def test_sharded_with_index_dtype_and_prefix(tmp_path: Path) -> None:
    sd = state()
    save(tmp_path / "ckpt", sd, "torch")
    res = export_checkpoint(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=40_000,
                            buffer_bytes=64 * 1024, dtype=torch.bfloat16, prefix="model.",
                            progress=False)
    assert res.skipped == []  # "step" is outside the prefix
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    n = len(res.files) - 1
    assert n >= 2 and res.files[-1] == "model.safetensors.index.json"
    assert set(index["weight_map"].values()) == {
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    }
    got: dict[str, torch.Tensor] = {}
    for name in res.files[:-1]:
        part = load_file(str(tmp_path / "out" / name))
        assert all(index["weight_map"][k] == name for k in part)
        assert os.path.getsize(tmp_path / "out" / name) < 40_000 + 4096 or len(part) == 1
        got.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in got.values())
    want = dict(sd["model"])
    for k, v in want.items():  # floats of 2+ bytes are cast; fp8, ints and bool are kept
        if v.is_floating_point() and v.element_size() >= 2:
            want[k] = v.to(torch.bfloat16)
    assert_state_equal(got, want)


def _dtensor_body(rank: int, world: int, ckpt: str, fmt: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = sharded_full()
    place = {"rows": Shard(0), "cols": Shard(1), "cube": Shard(1)}
    sd: dict[str, Any] = {k: distribute_tensor(v, mesh, [place[k]]) for k, v in full.items()}
    pg = dist.new_group(backend="gloo")
    with DataStatesWriter(ckpt, host_cache_size="1MiB", chunk_size="16KiB", format=fmt) as w:
        dcp.save(sd, storage_writer=w, checkpoint_id=ckpt, process_group=pg)


def sharded_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    return {
        "rows": torch.randn(301, 64, generator=g),  # Shard(0): 151 + 150 rows
        "cols": torch.randn(200, 130, generator=g).to(torch.bfloat16),  # Shard(1): narrow chunks
        "cube": torch.randint(0, 1000, (7, 9, 300), dtype=torch.int64, generator=g),
    }


def test_two_rank_shards_reassembled_with_a_tiny_buffer(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"  # torch format (2-rank safetensors saves: test_safetensors.py)
    run_ranks(_dtensor_body, str(ckpt), "torch", tmp_path=tmp_path / "work", timeout_s=120)
    res = export_checkpoint(ckpt, tmp_path / "out", buffer_bytes=64 * 1024, progress=False)
    assert res.files == ["model.safetensors"]
    full = sharded_full()
    assert_state_equal(load_file(str(tmp_path / "out" / "model.safetensors")), full)
    # Chunks narrower than a slab: every payload byte was still checked as it was read.
    assert res.bytes_verified == sum(t.numel() * t.element_size() for t in full.values())


def test_damaged_inputs_fail_naming_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sd = {"a": torch.randn(64, 64), "b": torch.randn(1000)}
    save(tmp_path / "ckpt", sd, "torch")
    # Not a checkpoint, and an existing output: exit 2.
    code, err = cli_here(capsys, str(tmp_path / "nowhere"), str(tmp_path / "o1"))
    assert code == 2 and "no such checkpoint" in err, err
    assert cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "o1"), "--quiet")[0] == 0
    code, err = cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "o1"))
    assert code == 2 and "--overwrite" in err, err
    assert cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "o1"), "--overwrite")[0] == 0
    code, err = cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "o2"), "--dtype", "int3")
    assert code == 2 and "--dtype" in err
    # A damaged torch.save archive header: exit 1, naming the tensor; nothing left behind.
    files = sorted(p for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".distcp")
    from dcp_datastates.format.manifest import RankManifest

    man = RankManifest.from_json((tmp_path / "ckpt" / "__datastates_manifest_0.json").read_text())
    item = next(it for it in man.items if it.fqn == "b")
    data = tmp_path / "ckpt" / item.file
    raw = bytearray(data.read_bytes())
    raw[item.archive_offset + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, err = cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "o3"))
    assert code == 1 and "'b'" in err and "header" in err, err
    assert not (tmp_path / "o3" / "model.safetensors").exists()
    assert files
    # A truncated safetensors data file: the tensor and file are named.
    save(tmp_path / "st", sd, "safetensors")
    man = RankManifest.from_json((tmp_path / "st" / "__datastates_manifest_0.json").read_text())
    last = max((it for it in man.items if it.dtype != "bytes"), key=lambda it: it.payload_offset)
    os.truncate(tmp_path / "st" / last.file, last.payload_offset + 8)
    with pytest.raises(ExportError, match=f"'{last.fqn}'.*{last.file}.*truncated"):
        export_checkpoint(tmp_path / "st", tmp_path / "o4", progress=False)
    assert os.listdir(tmp_path / "o4") == []


def test_unexportable_dtype_names_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(tmp_path / "ckpt", {"ok": torch.ones(2), "z": torch.ones(3, dtype=torch.complex128)},
         "torch")
    code, err = cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert code == 1 and "'z'" in err and "complex128" in err, err


_MEASURE = textwrap.dedent(
    """
    import sys, torch
    from dcp_datastates.format.export import export_checkpoint

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    export_checkpoint(sys.argv[1], sys.argv[2], buffer_bytes=int(sys.argv[3]),
                      max_shard_bytes=48 * 2**20, progress=False)
    print(status("VmHWM") - base)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs VmHWM reset")
def test_memory_bounded_by_the_buffer(tmp_path: Path) -> None:
    """A 96 MiB checkpoint (one tensor of 64 MiB) exported with an 8 MiB buffer grows the
    exporting process by less than buffer + 24 MiB: no tensor is ever held whole."""
    mib = 2**20
    sd = {"big": torch.randn(16 * mib), "rest": torch.randn(8 * mib)}  # 64 + 32 MiB
    ckpt = tmp_path / "ckpt"
    with DataStatesWriter(ckpt, host_cache_size="16MiB", format="safetensors") as w:
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=ckpt), timeout=120)
    r = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(ckpt), str(tmp_path / "out"), str(8 * mib)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    growth = int(r.stdout.strip())
    assert growth < 8 * mib + 24 * mib, f"export grew the process by {growth / mib:.1f} MiB"
    out = load_file(str(tmp_path / "out" / "model-00001-of-00002.safetensors"))
    assert out["big"].shape == (16 * mib,)


def _flip_payload(ckpt: Path, fqn: str, at: int) -> None:
    from dcp_datastates.format.manifest import RankManifest

    man = RankManifest.from_json((ckpt / "__datastates_manifest_0.json").read_text())
    item = next(it for it in man.items if it.fqn == fqn)
    with open(ckpt / item.file, "r+b") as f:
        f.seek(item.payload_offset + at)
        b = f.read(1)
        f.seek(item.payload_offset + at)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_flipped_payload_byte_fails_and_leaves_no_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    """One flipped payload byte: exit 1 naming the tensor and file; no file under a final name
    (sharded output: the shards written before the damage are not left either)."""
    sd = state()
    save(tmp_path / "ckpt", sd, fmt)
    res = export_checkpoint(tmp_path / "ckpt", tmp_path / "ok", progress=False)
    payload = sum(t.numel() * t.element_size() for t in flat(sd).values())
    assert res.bytes_verified == payload and res.unverified == []
    _flip_payload(tmp_path / "ckpt", "model.i64", 13)
    code, err = cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "out"), "--quiet",
                         "--max-shard-size", "20000", "--buffer", "64KiB")
    assert code == 1, err
    assert "'model.i64'" in err and "checksum mismatch" in err, err
    assert (".distcp" if fmt == "torch" else ".safetensors") in err, err
    assert os.listdir(tmp_path / "out") == []


def _adam_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_state_is_left_out_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``{"model", "optim"}`` of a plain Adam, and the torchtitan layout (weights at the top
    level, ``optimizer.state.<fqn>.exp_avg``): the default exports the weights only; ``--all``
    exports everything; a selection of optimizer state alone is an error saying --all."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    model, opt = _adam_state()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    save(tmp_path / "plain", {"model": model.state_dict(), "optim": opt.state_dict(),
                              "step": 1}, "torch")
    code, err = cli_here(capsys, str(tmp_path / "plain"), str(tmp_path / "o1"), "--quiet")
    assert code == 0 and "left out 12 optimizer-state tensor(s)" in err, err
    assert "skipped 1 non-tensor value(s): step" in err, err  # not the param_groups
    got = load_file(str(tmp_path / "o1" / "model.safetensors"))
    assert_state_equal(got, {f"model.{k}": v for k, v in weights.items()})
    assert cli_here(capsys, str(tmp_path / "plain"), str(tmp_path / "o2"), "--quiet",
                    "--all")[0] == 0
    got = load_file(str(tmp_path / "o2" / "model.safetensors"))
    assert "optim.state.0.exp_avg" in got and len(got) == len(weights) + 12  # + step tensors
    code, err = cli_here(capsys, str(tmp_path / "plain"), str(tmp_path / "o3"), "--prefix",
                         "optim.")
    assert code == 2 and "optimizer state" in err and "--all" in err, err

    titan = dict(model.state_dict())  # torchtitan flattens the model into the top level
    titan["optimizer"] = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    titan["train_state"] = {"step": 1}
    save(tmp_path / "titan", titan, "torch")
    res = export_checkpoint(tmp_path / "titan", tmp_path / "o4", progress=False)
    assert_state_equal(load_file(str(tmp_path / "o4" / "model.safetensors")), weights)
    assert res.excluded and all(k.startswith("optimizer.state.") for k in res.excluded)


def test_prefix_matching_nothing_fails_listing_the_prefixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--prefix model.`` on a torchtitan-style checkpoint (weights at the top level) matches
    nothing: exit 2 naming the top-level prefixes there are; no output is written."""
    sd = {"tok_embeddings.weight": torch.randn(8, 4), "layers": {"0": {"w": torch.randn(4, 4)}},
          "norm.weight": torch.ones(4), "train_state": {"step": 3}}
    save(tmp_path / "ckpt", sd, "torch")
    code, err = cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "out"), "--prefix",
                         "model.")
    assert code == 2, err
    assert "'model.'" in err and "layers. (1)" in err and "tok_embeddings. (1)" in err, err
    assert not (tmp_path / "out").exists()
    save(tmp_path / "none", {"step": 3, "name": "x"}, "torch")
    code, err = cli_here(capsys, str(tmp_path / "none"), str(tmp_path / "out"))
    assert code == 2 and "no tensor" in err, err


def test_incremental_checkpoint_exports_through_its_references(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An incremental save references the frozen tensor in its predecessor: export reads it
    from there and checks it against the referring manifest; damage there, or the predecessor
    gone, fails naming the tensor and the referenced checkpoint."""
    frozen, live = torch.randn(64, 33), torch.zeros(10)
    root = tmp_path / "root"
    with DataStatesWriter(root / "step-1", host_cache_size="1MiB", incremental=True) as w:
        for step in (1, 2):
            live.add_(1.0)
            path = root / f"step-{step}"
            dcp.async_save({"model": {"frozen": frozen, "live": live}}, storage_writer=w,
                           checkpoint_id=str(path)).result(timeout=CLI_TIMEOUT_S)
    md = (root / "step-2" / ".metadata").read_bytes()
    assert b"../step-1/" in md  # the frozen tensor is a reference
    res = export_checkpoint(root / "step-2", tmp_path / "o1", progress=False)
    assert res.bytes_verified == (64 * 33 + 10) * 4
    assert_state_equal(load_file(str(tmp_path / "o1" / "model.safetensors")),
                       {"model.frozen": frozen, "model.live": live})
    _flip_payload(root / "step-1", "model.frozen", 100)
    code, err = cli_here(capsys, str(root / "step-2"), str(tmp_path / "o2"), "--quiet")
    assert code == 1 and "'model.frozen'" in err and "../step-1/" in err, err
    assert "checksum mismatch" in err and os.listdir(tmp_path / "o2") == []
    shutil.rmtree(root / "step-1")
    code, err = cli_here(capsys, str(root / "step-2"), str(tmp_path / "o3"), "--quiet")
    assert code == 1 and "'model.frozen'" in err and "step-1" in err and "missing" in err, err


def test_checksums_false_exports_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sd = {"model": {"w": torch.randn(30, 7)}}
    with DataStatesWriter(tmp_path / "ckpt", host_cache_size="1MiB", checksums=False) as w:
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=tmp_path / "ckpt"))
    code, err = cli_here(capsys, str(tmp_path / "ckpt"), str(tmp_path / "out"), "--quiet")
    assert code == 0 and "saved without checksums" in err and "model.w" in err, err
    assert_state_equal(load_file(str(tmp_path / "out" / "model.safetensors")), flat(sd))
