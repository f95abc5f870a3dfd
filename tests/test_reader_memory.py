"""Restore from memory: DataStatesReader on a tmpfs (``/dev/shm``) checkpoint.

What is checked: a memory file system is recognised (no ``O_DIRECT`` is attempted there, not even
when asked for, one thread per core at most), the load is bit-exact and every byte's CRC-32C is
verified in the same pass, a single flipped byte on ``/dev/shm`` is detected (and only by the
checksum: ``verify=False`` loads it silently), and ``resume_path`` takes the newest complete
checkpoint from the fast tier.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, in_thread, zeros_like_state

from dcp_datastates import DataStatesReader, DataStatesWriter, resume_path
from dcp_datastates.format.manifest import RankManifest
from dcp_datastates.lifecycle.checkpoints import INCOMPLETE_MARKER
from dcp_datastates.restore.reader import memory_backed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHM = "/dev/shm"


@pytest.fixture
def shm() -> Iterator[Path]:
    if not os.path.isdir(SHM) or not memory_backed(SHM):
        pytest.skip("no tmpfs at /dev/shm")
    d = Path(SHM) / f"dcpds-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {
        "big": torch.randn(1000, 1100, generator=g),  # 4.4 MB: several 1 MiB pieces
        "odd": torch.randn(3, 7, generator=g),  # not page-aligned
        "bf16": torch.randn(999, generator=g).to(torch.bfloat16),
        "ints": torch.arange(5000, dtype=torch.int64),
        "meta": {"step": 3},
    }


def save(root: str, sd: dict[str, Any]) -> None:
    w = DataStatesWriter(root, host_cache_size="8MiB", chunk_size="1MiB", prefault=False)
    try:
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=root), what="dcp.save")
    finally:
        w.close()


def load(root: str, dest: dict[str, Any], reader: DataStatesReader) -> None:
    in_thread(
        lambda: dcp.load(dest, storage_reader=reader, checkpoint_id=root, no_dist=True),
        what="dcp.load",
    )


def tensor_bytes(sd: dict[str, Any]) -> int:
    return sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))


def test_memory_file_systems_are_recognised(shm: Path) -> None:
    assert memory_backed(str(shm)) and memory_backed(str(shm / "not" / "yet" / "there"))
    assert not memory_backed("/proc")  # procfs: not a memory file system for checkpoints
    reader = DataStatesReader(shm, o_direct=True, threads=64, block_size="8MiB")
    threads, o_direct, block = reader._read_options()
    assert not o_direct and block <= 1 << 20
    assert 2 <= threads <= max(2, os.cpu_count() or 2)


def test_tmpfs_load_is_bit_exact_and_verified_without_o_direct(shm: Path) -> None:
    root = str(shm / "ckpt")
    sd = state()
    save(root, sd)
    dest = zeros_like_state(sd)
    dest["meta"] = {"step": 0}
    reader = DataStatesReader(root, o_direct=True)  # asked for, but meaningless on tmpfs
    load(root, dest, reader)
    assert_state_equal(sd, dest)
    lr = reader.last_read
    assert lr["memory_fs"] == 1 and lr["stock_items"] == 0
    assert lr["native_bytes"] == tensor_bytes(sd)
    assert lr["direct_bytes"] == 0  # no O_DIRECT read at all, not a failed try per file
    assert lr["verified_bytes"] == lr["native_bytes"]  # every byte's checksum, same pass


def _flip_byte(root: str, fqn: str, at: int) -> str:
    for name in sorted(os.listdir(root)):
        if name.startswith("__datastates_manifest_"):
            m = RankManifest.from_json(Path(root, name).read_text())
            for it in m.items:
                if it.fqn == fqn:
                    path = os.path.join(root, it.file)
                    with open(path, "r+b") as f:
                        f.seek(it.payload_offset + at)
                        b = f.read(1)
                        f.seek(it.payload_offset + at)
                        f.write(bytes([b[0] ^ 0x01]))
                    return path
    raise AssertionError(f"{fqn} not in any manifest")


@pytest.mark.parametrize(("fqn", "at"), [("big", 3 * (1 << 20) + 17), ("odd", 5)])
def test_a_flipped_byte_on_tmpfs_is_detected(shm: Path, fqn: str, at: int) -> None:
    root = str(shm / "ckpt")
    sd = state()
    save(root, sd)
    path = _flip_byte(root, fqn, at)
    with pytest.raises(BaseException) as ei:  # DCP wraps reader errors in CheckpointException
        load(root, zeros_like_state(sd), DataStatesReader(root))
    msg = str(ei.value)
    assert "checksum mismatch" in msg and f"'{fqn}'" in msg, msg
    assert os.path.basename(path) in msg, msg
    # Without verification the same damage loads silently: the checksum is what catches it.
    dest = zeros_like_state(sd)
    reader = DataStatesReader(root, verify=False)
    load(root, dest, reader)
    assert reader.last_read["verified_bytes"] == 0
    assert not torch.equal(dest[fqn], sd[fqn])


def test_resume_path_takes_the_newest_complete_checkpoint_of_the_fast_tier(
    shm: Path, tmp_path: Path
) -> None:
    fast, slow = shm / "fast", tmp_path / "slow"
    sd = {"w": torch.arange(8.0)}
    for root, steps in ((fast, (1, 2, 3)), (slow, (1, 2))):
        for step in steps:
            save(str(root / f"step-{step}"), sd)
    assert resume_path(fast, slow) == str(fast / "step-3")  # the newest, from memory
    (fast / "step-3" / INCOMPLETE_MARKER).touch()  # a save still in flight there
    (fast / "step-3" / ".metadata").unlink()
    assert resume_path(fast, slow) == str(fast / "step-2")  # same step on both: the fast copy
    save(str(slow / "step-4"), sd)  # the persistent tier got a newer one (another node's)
    assert resume_path(fast, slow) == str(slow / "step-4")
    dest = {"w": torch.zeros(8)}
    reader = DataStatesReader(fast / "step-2")
    load(str(fast / "step-2"), dest, reader)
    assert torch.equal(dest["w"], sd["w"]) and reader.last_read["memory_fs"] == 1
