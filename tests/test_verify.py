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
from dcp_datastates.format.manifest import RankManifest

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


def _small(tmp_path: Any, writer_factory: Any, name: str) -> str:
    path = str(tmp_path / name)
    sd = {"m": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 7}
    dcp.save(sd, storage_writer=writer_factory(), checkpoint_id=path)
    return path


def _flipped(raw: bytes, off: int, mask: int) -> bytes:
    b = bytearray(raw)
    b[off] ^= mask
    return bytes(b)


def test_every_metadata_flip_is_reported_never_raised(tmp_path: Any, writer_factory: Any) -> None:
    """Each byte of ``.metadata`` flipped in turn (the bit rotating with the position): verify
    returns a report, never raises; damage is exit 1, never 2; ``load`` raises IntegrityError or
    loads the exact values. A flipped field name once left a ``Metadata`` without
    ``state_dict_metadata`` (AttributeError), and a ``BUILD`` turned into ``LONG_BINPUT`` made
    the C unpickler zero a memo table of tens of GB."""
    import pickletools

    path = _small(tmp_path, writer_factory, "ck")
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        raw = f.read()
    builds = [pos for op, _arg, pos in pickletools.genops(raw) if op.name == "BUILD"]
    cases = [(off, 1 << (off % 8)) for off in range(len(raw))]
    cases += [(raw.index(b"state_dict_metadata"), 0x01), (builds[0], 0x10)]
    wrong: list[str] = []
    damaged = 0
    for n, (off, mask) in enumerate(cases):
        with open(meta, "wb") as f:
            f.write(_flipped(raw, off, mask))
        try:
            rep = verify_checkpoint(path)
        except Exception as e:  # the outcome this test exists to rule out
            wrong.append(f"{off}^{mask:#x}: {type(e).__name__}: {e}")
            continue
        if rep.exit_code not in (0, 1) or (rep.problems and rep.error is not None):
            wrong.append(f"{off}^{mask:#x}: exit {rep.exit_code}: {rep.summary()}")
            continue
        damaged += not rep.ok
        if rep.ok or n % 9 == 0 or n >= len(raw):  # load(verify=True) on a sample of the rest
            out = {"m": {"w": torch.zeros(3, 4)}, "step": 0}
            try:
                dcp_datastates.load(out, path)
            except IntegrityError:
                assert not rep.ok
                continue
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                wrong.append(f"{off}^{mask:#x}: load raised {type(e).__name__}: {e}")
                continue
            if not torch.equal(out["m"]["w"], torch.arange(12.0).reshape(3, 4)) or out[
                "step"
            ] != 7:
                wrong.append(f"{off}^{mask:#x}: verified, but loads wrong values")
    with open(meta, "wb") as f:
        f.write(raw)
    assert not wrong, f"{len(wrong)} of {len(cases)} flips: " + "\n".join(wrong[:5])
    assert damaged > len(raw) // 2  # most flips are found, not harmless


def test_verify_goes_on_after_a_malformed_metadata(tmp_path: Any, writer_factory: Any) -> None:
    """A ``.metadata`` whose objects lack a field is damage (exit 1, naming the file), and the
    later paths of one ``verify`` are still checked."""
    bad = _small(tmp_path, writer_factory, "bad")
    good = _small(tmp_path, writer_factory, "good")
    meta = os.path.join(bad, ".metadata")
    with open(meta, "rb") as f:
        raw = f.read()
    with open(meta, "wb") as f:
        f.write(raw.replace(b"state_dict_metadata", b"rtate_dict_metadata"))
    rep = verify_checkpoint(bad)
    assert rep.exit_code == 1
    assert any(".metadata is damaged" in p and "state_dict_metadata" in p for p in rep.problems)
    with pytest.raises(IntegrityError, match=r"\.metadata"):
        dcp_datastates.load({"m": {"w": torch.zeros(3, 4)}}, bad)
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "verify", bad, good],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{bad}: " in r.stdout and "DAMAGED" in r.stdout
    assert f"{good}: " in r.stdout and ": OK" in r.stdout
