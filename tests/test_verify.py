"""Integrity: the verify tool finds flipped bytes and truncated files, naming tensor and rank."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_datastates
from dcp_datastates import IntegrityError, verify_checkpoint
from dcp_datastates.manifest import RankManifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(tmp_path: Any, writer_factory: Any) -> tuple[str, dict[str, Any]]:
    sd = {"model.w": torch.randn(300, 300), "model.b": torch.randn(300), "step": 4}
    path = str(tmp_path / "ckpt")
    dcp.save(sd, storage_writer=writer_factory(chunk_size="64KiB"), checkpoint_id=path)
    return path, sd


def _item(path: str, fqn: str) -> Any:
    text = open(os.path.join(path, "__datastates_manifest_0.json")).read()
    return next(i for i in RankManifest.from_json(text).items if i.fqn == fqn)


def test_clean_checkpoint_verifies(tmp_path: Any, writer_factory: Any) -> None:
    path, sd = _save(tmp_path, writer_factory)
    rep = verify_checkpoint(path)
    assert rep.ok and rep.items == 3 and rep.bytes_checked >= 300 * 300 * 4, rep.summary()
    out = {"model.w": torch.zeros(300, 300), "model.b": torch.zeros(300), "step": 0}
    dcp_datastates.load(out, path)
    assert torch.equal(out["model.w"], sd["model.w"])


def test_flipped_byte_is_found_and_named(tmp_path: Any, writer_factory: Any) -> None:
    path, _ = _save(tmp_path, writer_factory)
    it = _item(path, "model.w")
    with open(os.path.join(path, it.file), "r+b") as f:
        f.seek(it.payload_offset + 12345)
        b = f.read(1)
        f.seek(it.payload_offset + 12345)
        f.write(bytes([b[0] ^ 0x10]))
    out = {"model.w": torch.zeros(300, 300)}
    dcp.load(out, checkpoint_id=path)  # the stock reader does not notice ...
    rep = verify_checkpoint(path)  # ... verify does
    assert not rep.ok
    assert any("'model.w' (rank 0" in p and "checksum mismatch" in p for p in rep.problems)
    with pytest.raises(IntegrityError, match="model.w"):
        dcp_datastates.load({"model.w": torch.zeros(300, 300)}, path)
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "verify", path],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "model.w" in r.stdout


def test_truncated_file_is_found(tmp_path: Any, writer_factory: Any) -> None:
    path, _ = _save(tmp_path, writer_factory)
    it = _item(path, "model.w")
    fpath = os.path.join(path, it.file)
    os.truncate(fpath, it.archive_offset + it.archive_length - 8)
    rep = verify_checkpoint(path)
    assert any("'model.w'" in p and "truncated" in p for p in rep.problems), rep.summary()


def test_missing_metadata_and_missing_file(tmp_path: Any, writer_factory: Any) -> None:
    path, _ = _save(tmp_path, writer_factory)
    it = _item(path, "model.b")
    os.remove(os.path.join(path, it.file))
    os.remove(os.path.join(path, ".metadata"))
    rep = verify_checkpoint(path)
    assert any("never committed" in p for p in rep.problems)
    assert any("'model.b'" in p and "missing" in p for p in rep.problems)
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "verify", path],
                       capture_output=True, text=True)
    assert r.returncode == 1
