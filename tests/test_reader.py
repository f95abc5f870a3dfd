"""DataStatesReader: bit-exact native loads, resharding 2 ranks -> 1, damage detected (naming the
tensor and file), fallback to the stock path, and the stock reader still loading our checkpoints."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, in_thread, zeros_like_state
from dist_utils import run_ranks

from dcp_datastates import DataStatesReader, DataStatesWriter, IntegrityError
from dcp_datastates.format.manifest import RankManifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(300, 1000, generator=g),  # 1.2 MB: several chunks and pieces
        "page": torch.randn(1024, generator=g),  # exactly one 4 KiB page
        "odd": torch.randn(3, 5, generator=g),  # a 60-byte payload, not page-aligned
        "bf16": torch.randn(77, generator=g).to(torch.bfloat16),
        "flags": torch.rand(33, generator=g) > 0.5,
        "cplx": torch.randn(4, 4, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "ints": torch.arange(1000, dtype=torch.int64),
        "meta": {"step": 12, "tag": "x"},
    }


def save(root: str, sd: dict[str, Any], **kw: Any) -> None:
    kw.setdefault("host_cache_size", "4MiB")
    kw.setdefault("chunk_size", "256KiB")
    kw.setdefault("prefault", False)
    w = DataStatesWriter(root, **kw)
    try:
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=root), what="dcp.save")
    finally:
        w.close()


def load(root: str, dest: dict[str, Any], reader: DataStatesReader | None = None) -> None:
    in_thread(
        lambda: dcp.load(dest, storage_reader=reader, checkpoint_id=root, no_dist=True),
        what="dcp.load",
    )


@pytest.mark.parametrize("o_direct", [True, False])
def test_native_load_is_bit_exact(tmp_path: Any, o_direct: bool) -> None:
    root = str(tmp_path / "ckpt")
    sd = state()
    save(root, sd, o_direct=o_direct)
    dest = zeros_like_state(sd)
    dest["meta"] = {"step": 0, "tag": ""}
    # small blocks: a chunk is read as several pieces in parallel, their CRCs combined
    reader = DataStatesReader(root, o_direct=o_direct, block_size="64KiB", threads=3)
    load(root, dest, reader)
    assert_state_equal(sd, dest)
    assert reader.last_read["stock_items"] == 0
    # every read item: the non-empty tensors and the two bytes items (meta.step, meta.tag)
    tensors = [v for v in sd.values() if isinstance(v, torch.Tensor)]
    assert reader.last_read["native_items"] == sum(1 for t in tensors if t.numel()) + 2
    assert reader.last_read["native_bytes"] == sum(t.nbytes for t in tensors)


def test_stock_reader_still_loads(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    sd = state()
    save(root, sd)
    dest = zeros_like_state(sd)
    load(root, dest)  # FileSystemReader
    assert_state_equal(sd, dest)


def test_converting_and_partial_targets_use_bounded_temporaries(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    sd = {"a": torch.randn(64, 64), "b": torch.randn(64, 64), "c": torch.arange(10.0)}
    save(root, sd)
    dest = {
        "a": torch.zeros(64, 64, dtype=torch.float64),  # another dtype: converted
        "b": torch.zeros(64, 128)[:, ::2],  # a non-contiguous target
        "c": torch.zeros(10),
    }
    reader = DataStatesReader(root, buffer_size=4096)  # smaller than one temporary: one per batch
    load(root, dest, reader)
    assert torch.equal(dest["a"], sd["a"].double())
    assert torch.equal(dest["b"], sd["b"])
    assert torch.equal(dest["c"], sd["c"])
    assert reader.last_read["stock_items"] == 0


def _converted_state(n: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``n`` saved tensors and targets that all need temporaries (another dtype, strided)."""
    g = torch.Generator().manual_seed(11)
    sd = {f"t{i:02d}": torch.randn(int(torch.randint(200, 9000, (1,), generator=g)), generator=g)
          for i in range(n)}
    dest = {k: torch.zeros(v.numel(), dtype=torch.float64) if i % 2 else
            torch.zeros(v.numel() * 2)[::2] for i, (k, v) in enumerate(sd.items())}
    return sd, dest


def test_many_batches_are_read_while_the_previous_is_copied(
    tmp_path: Any, monkeypatch: Any
) -> None:
    # buffer_size far below the state: dozens of batches, the next one read by the helper
    # thread while this thread copies the previous one into its targets; all bit-exact.
    root = str(tmp_path / "ckpt")
    sd, dest = _converted_state(40)
    save(root, sd)
    readers: list[str] = []
    real = DataStatesReader._read_batch

    def read_batch(self: DataStatesReader, batch: Any) -> int:
        readers.append(threading.current_thread().name)
        return real(self, batch)

    monkeypatch.setattr(DataStatesReader, "_read_batch", read_batch)
    reader = DataStatesReader(root, buffer_size="48KiB", threads=2)
    load(root, dest, reader)
    assert len(readers) >= 10 and all(n.startswith("dcp_datastates-read") for n in readers)
    for k, v in sd.items():
        assert torch.equal(dest[k], v.to(dest[k].dtype)), k
    assert reader.last_read["native_bytes"] == sum(v.nbytes for v in sd.values())
    assert reader.last_read["stock_items"] == 0


def test_damage_in_a_later_batch_fails_the_pipelined_load_cleanly(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    sd, dest = _converted_state(40)
    save(root, sd)
    path, off = _payload_offset(root, "t31")
    with open(path, "r+b") as f:
        f.seek(off + 3)
        b = f.read(1)
        f.seek(off + 3)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(BaseException) as ei:
        load(root, dest, DataStatesReader(root, buffer_size="48KiB", threads=2))
    assert "checksum mismatch" in str(ei.value) and "'t31'" in str(ei.value)
    # no helper thread is left behind (writing into freed temporaries), and loading goes on
    assert not [t for t in threading.enumerate() if t.name.startswith("dcp_datastates-read")]
    sd2, dest2 = _converted_state(40)
    load(root, dest2, DataStatesReader(root, verify=False, buffer_size="48KiB"))
    assert torch.equal(dest2["t00"], sd2["t00"].to(dest2["t00"].dtype))


def test_the_collector_is_paused_for_the_load_and_resumes_after(tmp_path: Any) -> None:
    import gc

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    seen: list[bool] = []

    class Probe(DefaultLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            seen.append(gc.isenabled())
            super().commit_tensor(read_item, tensor)

    def collector_back() -> bool:  # a save's pause ends 0.1 s after it (gcpause.py)
        for _ in range(100):
            if gc.isenabled():
                return True
            time.sleep(0.05)
        return False

    root = str(tmp_path / "ckpt")
    sd = state()
    save(root, sd)
    assert collector_back()
    dest = zeros_like_state(sd)
    in_thread(lambda: dcp.load(dest, storage_reader=DataStatesReader(root), checkpoint_id=root,
                               planner=Probe(), no_dist=True), what="dcp.load")
    assert seen and not any(seen)  # paused while the items were read
    assert gc.isenabled()  # at once: the load ends its pause itself
    path, off = _payload_offset(root, "big")  # a failing load resumes it too
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(b"\xff\xff")
    with pytest.raises(BaseException, match="checksum mismatch"):
        load(root, zeros_like_state(sd), DataStatesReader(root))
    assert gc.isenabled()


def _payload_offset(root: str, fqn: str) -> tuple[str, int]:
    for name in os.listdir(root):
        if name.startswith("__datastates_manifest_"):
            with open(os.path.join(root, name)) as f:
                m = RankManifest.from_json(f.read())
            for it in m.items:
                if it.fqn == fqn:
                    return os.path.join(root, it.file), it.payload_offset
    raise AssertionError(f"{fqn} not in any manifest")


@pytest.mark.parametrize("fqn", ["big", "odd", "meta.tag"])
def test_damaged_payload_is_detected(tmp_path: Any, fqn: str) -> None:
    root = str(tmp_path / "ckpt")
    sd = state()
    save(root, sd)
    path, off = _payload_offset(root, fqn)
    with open(path, "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 0x10]))
    dest = zeros_like_state(sd)
    with pytest.raises(BaseException) as ei:  # DCP wraps reader errors in CheckpointException
        load(root, dest, DataStatesReader(root))
    msg = str(ei.value)
    assert "checksum mismatch" in msg and f"'{fqn}'" in msg, msg
    assert os.path.basename(path) in msg, msg
    assert IntegrityError.__name__ in repr(ei.value) or "damaged" in msg


def test_truncated_file_is_reported(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    sd = {"big": torch.randn(300, 1000)}
    save(root, sd, files_per_rank=1)
    path, off = _payload_offset(root, "big")
    os.truncate(path, off + 1000)
    with pytest.raises(BaseException) as ei:
        load(root, {"big": torch.zeros(300, 1000)}, DataStatesReader(root))
    msg = str(ei.value)
    assert "'big'" in msg and "truncated" in msg and os.path.basename(path) in msg, msg


def test_checkpoints_without_manifest_take_the_stock_path(tmp_path: Any) -> None:
    root = str(tmp_path / "stock")
    sd = {"w": torch.randn(8, 8), "meta": {"k": 1}}
    dcp.save(sd, checkpoint_id=root, no_dist=True)  # FileSystemWriter: no manifest
    dest = {"w": torch.zeros(8, 8), "meta": {"k": 0}}
    reader = DataStatesReader(root)
    load(root, dest, reader)
    assert torch.equal(dest["w"], sd["w"]) and dest["meta"] == {"k": 1}
    assert reader.last_read["native_items"] == 0 and reader.last_read["stock_items"] == 2


def test_stale_manifest_entries_take_the_stock_path(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    sd = {"w": torch.randn(8, 8), "v": torch.randn(3)}
    save(root, sd)
    # A manifest whose record of 'w' no longer matches .metadata (moved): never trusted.
    for name in os.listdir(root):
        if name.startswith("__datastates_manifest_"):
            p = os.path.join(root, name)
            with open(p) as f:
                m = RankManifest.from_json(f.read())
            for it in m.items:
                if it.fqn == "w":
                    it.archive_offset += 64
            with open(p, "w") as f:
                f.write(m.to_json())
    dest = {"w": torch.zeros(8, 8), "v": torch.zeros(3)}
    reader = DataStatesReader(root)
    load(root, dest, reader)
    assert torch.equal(dest["w"], sd["w"]) and torch.equal(dest["v"], sd["v"])
    counts = {k: reader.last_read[k] for k in ("native_items", "stock_items", "native_bytes")}
    assert counts == {"native_items": 1, "stock_items": 1, "native_bytes": 12}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "rows": torch.randn(5, 6, generator=g),  # Shard(0): 3 + 2 rows
        "cols": torch.randn(4, 9, generator=g).to(torch.bfloat16),  # Shard(1): 5 + 4 columns
        "rep": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "plain": torch.randn(10, generator=g),
    }


def _save_two_ranks(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    sd: dict[str, Any] = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        "plain": full["plain"].clone(),
        "meta": {"step": 3},
    }
    pg = dist.new_group(backend="gloo")
    w = DataStatesWriter(root, host_cache_size="1MiB", chunk_size="16KiB", prefault=False)
    dcp.save(sd, storage_writer=w, checkpoint_id=root, process_group=pg)
    w.close()


def test_resharding_two_ranks_to_one(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(_save_two_ranks, root, tmp_path=tmp_path, timeout_s=120)
    full = full_tensors()
    # Into plain tensors in one process: each target gathers both ranks' shards (row shards are
    # read straight into views of the target, column shards through temporaries).
    dest: dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items()}
    dest["meta"] = {"step": 0}
    reader = DataStatesReader(root)
    load(root, dest, reader)
    for k, v in full.items():
        assert torch.equal(dest[k], v), k
    assert dest["meta"]["step"] == 3
    assert reader.last_read["stock_items"] == 0
