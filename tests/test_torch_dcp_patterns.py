"""The writer behaviours PyTorch's own DCP tests (test/distributed/checkpoint) rely on, exercised
with DataStatesWriter in place of FileSystemWriter.

Those tests save module state with the deprecated ``save_state_dict(no_dist=True)`` (which calls
``reset()`` without a checkpoint id), mix tensors with ``Stateful`` blobs, save states without a
single tensor, create a fresh writer for every save, save again and again to one directory, load
with other shardings than they saved with, and refuse to overwrite with ``overwrite=False``. Each
pattern is written here from scratch, with a timeout on every save so a hang fails.
"""

from __future__ import annotations

import io
import os
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import in_thread
from dist_utils import run_ranks

from dcp_datastates import DataStatesWriter

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled", "ignore::FutureWarning"
)

T = 30.0


def writer(path: str, **kw: Any) -> DataStatesWriter:
    kw.setdefault("host_cache_size", "4MiB")
    kw.setdefault("chunk_size", "256KiB")
    kw.setdefault("prefault", False)
    return DataStatesWriter(path, **kw)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(7, 5)
        self.emb = torch.nn.EmbeddingBag(6, 9)
        self.norm = torch.nn.BatchNorm1d(5)


class Blob:
    """A Stateful holding raw bytes (DCP saves it as a bytes item)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return {"blob": io.BytesIO(self.data), "len": len(self.data)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        sd["blob"].seek(0)
        self.data = sd["blob"].read()
        assert sd["len"] == len(self.data)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("threads", [1, 2])
def test_module_state_with_deprecated_no_dist_api(tmp_path: Any, threads: int) -> None:
    saved = Net().state_dict()
    w = writer(str(tmp_path), copy_threads=threads, flush_threads=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        in_thread(lambda: dcp.save_state_dict(saved, storage_writer=w, no_dist=True))
        loaded = Net().state_dict()
        dcp.load_state_dict(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path)),
                            no_dist=True)
    assert_same(saved, loaded)
    assert w.wait(timeout=T)
    w.close()


def test_tensors_and_stateful_blob_without_checkpoint_id(tmp_path: Any) -> None:
    model = Net()
    blob = Blob(b"SomeBlobForTesting" * 100)
    w = writer(str(tmp_path))
    in_thread(lambda: dcp.save({"model": model, "blob": blob}, storage_writer=w))  # path of w
    other, blob2 = Net(), Blob(b"")
    dcp.load({"model": other, "blob": blob2}, checkpoint_id=str(tmp_path))
    assert_same(model.state_dict(), other.state_dict())
    assert blob2.data == blob.data
    w.close()


def test_states_without_any_tensor(tmp_path: Any) -> None:
    w = writer(str(tmp_path / "default"))
    states: list[dict[str, Any]] = [
        {"blob": Blob(b"\x00\x01" * 5000), "meta": {"epoch": 3, "name": "run"}},
        {"step": 11},
        {},
    ]
    for i, sd in enumerate(states):
        path = str(tmp_path / f"sync{i}")
        in_thread(lambda sd=sd, path=path: dcp.save(sd, storage_writer=w, checkpoint_id=path))
        apath = str(tmp_path / f"async{i}")
        dcp.async_save(sd, storage_writer=w, checkpoint_id=apath).result(timeout=T)
        for p in (path, apath):
            assert os.path.exists(os.path.join(p, ".metadata"))
    out: dict[str, Any] = {"blob": Blob(b""), "meta": {"epoch": 0, "name": ""}}
    dcp.load(out, checkpoint_id=str(tmp_path / "async0"))
    assert out["blob"].data == b"\x00\x01" * 5000 and out["meta"] == {"epoch": 3, "name": "run"}
    assert w.wait(timeout=T)
    w.close()


def test_a_fresh_writer_for_every_save(tmp_path: Any) -> None:
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    for i in range(6):
        sd = {"w": torch.full((64,), float(i)), "i": i}
        in_thread(lambda sd=sd, i=i: dcp.save(sd, storage_writer=writer(str(tmp_path / f"c{i}"))))
        out = {"w": torch.zeros(64), "i": -1}
        dcp.load(out, checkpoint_id=str(tmp_path / f"c{i}"))
        assert out["i"] == i and bool((out["w"] == i).all())
    import gc

    gc.collect()
    # Dropped writers took their native threads with them. (A Python thread that was joined may
    # still be in /proc for a moment while its OS thread exits: wait for that, bounded.)
    deadline = time.monotonic() + 10
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads() <= before


def test_overwrite_true_then_false(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    w = writer(path)  # overwrite=True by default, as FileSystemWriter
    for value in (1.0, 2.0):
        in_thread(lambda v=value: dcp.save({"x": torch.full((16,), v)}, storage_writer=w))
    out = {"x": torch.zeros(16)}
    dcp.load(out, checkpoint_id=path)
    assert bool((out["x"] == 2.0).all())
    strict = writer(path, overwrite=False)
    with pytest.raises(dcp.api.CheckpointException, match="overwrite=False"):
        in_thread(lambda: dcp.save({"x": torch.full((16,), 3.0)}, storage_writer=strict))
    dcp.load(out, checkpoint_id=path)
    assert bool((out["x"] == 2.0).all())
    w.close()
    strict.close()



def test_overwrite_false_refuses_in_torchs_words(tmp_path: Any) -> None:
    """PyTorch's own tests expect the refusal of FileSystemWriter(overwrite=False): a
    CheckpointException whose rank error is a RuntimeError saying "Checkpoint already exists".
    Ours says the same (and names the path and rank), from dcp.save and async_save alike."""
    path = str(tmp_path / "c")
    w = writer(path)
    in_thread(lambda: dcp.save({"x": torch.ones(16)}, storage_writer=w))
    with pytest.raises(dcp.api.CheckpointException, match="Checkpoint already exists"):
        in_thread(lambda: dcp.save({"x": torch.zeros(16)},
                                   storage_writer=dcp.FileSystemWriter(path, overwrite=False)))
    strict = writer(path, overwrite=False)
    failures = []
    with pytest.raises(dcp.api.CheckpointException, match="Checkpoint already exists") as sync:
        in_thread(lambda: dcp.save({"x": torch.zeros(16)}, storage_writer=strict))
    failures.append(sync.value.failures[0][0])
    with pytest.raises(dcp.api.CheckpointException, match="Checkpoint already exists") as fut:
        dcp.async_save({"x": torch.zeros(16)}, storage_writer=strict).result(timeout=T)
    failures.append(fut.value.failures[0][0])
    for err in failures:
        assert isinstance(err, RuntimeError) and isinstance(err, FileExistsError)
        assert str(err).startswith("Checkpoint already exists") and path in str(err)
        assert "rank 0" in str(err)
    from dcp_datastates import CheckpointExistsError

    assert all(isinstance(err, CheckpointExistsError) for err in failures)
    out = {"x": torch.zeros(16)}
    dcp.load(out, checkpoint_id=path)
    assert bool((out["x"] == 1.0).all())  # nothing was removed
    w.close()
    strict.close()

# --------------------------------------------------------------------------------------------
# Resharding on load (2 ranks), saving repeatedly to one directory with one writer


def _reshard_body(rank: int, world_size: int, root: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    w = writer(os.path.join(root, "ckpt"))
    layouts = [[Shard(0)], [Shard(1)], [Replicate()]]
    for i, save_as in enumerate(layouts):
        for load_as in layouts:
            if load_as == save_as:
                continue
            sd = {"t": distribute_tensor(full + i, mesh, save_as), "step": i}
            if i % 2:
                dcp.async_save(sd, storage_writer=w).result(timeout=T)
            else:
                dcp.save(sd, storage_writer=w)
            dist.barrier()
            out = {"t": distribute_tensor(torch.zeros(12, 10), mesh, load_as), "step": -1}
            dcp.load(out, checkpoint_id=os.path.join(root, "ckpt"))
            assert out["step"] == i
            assert torch.equal(out["t"].full_tensor(), full + i), (save_as, load_as)
            dist.barrier()
    assert w.wait(timeout=T)
    w.close()
    return True


def test_resharding_loads_two_ranks_then_one_process(tmp_path: Any) -> None:
    assert run_ranks(_reshard_body, str(tmp_path), tmp_path=tmp_path, timeout_s=180) == [True] * 2
    out = {"t": torch.zeros(12, 10), "step": -1}  # the last save, into a plain tensor
    dcp.load(out, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert out["step"] == 2
    assert torch.equal(out["t"], torch.arange(120, dtype=torch.float32).reshape(12, 10) + 2)
