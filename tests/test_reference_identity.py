"""A reference (incremental saves) is checked against the checkpoint it refers to before use.

Checkpoint ``b`` references the bytes of ``a``. An incremental writer names its data files after
its save (``__0_0.<tag>.distcp``), so another writer saving to ``a`` (the stock
``FileSystemWriter`` rewrites ``__0_0.distcp`` in place) leaves them alone and every reader,
the stock ``dcp.load`` included, loads ``b`` as it was saved. References to files with DCP's own
names (checkpoints written before that naming) are checked against their owner: when ``a`` is
rewritten by another writer, saved again, or damaged, ``DataStatesReader`` and
``dcp_datastates.load`` refuse ``b`` naming the key, the owner and file and what differs, before
any target is written. The writer never references an owner another writer rewrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import in_thread

import dcp_datastates
from dcp_datastates import DataStatesReader, DataStatesWriter, IntegrityError
from dcp_datastates.format import layout
from dcp_datastates.format.refcheck import check_references
from dcp_datastates.format.verify import verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TIMEOUT_S = 60
N = 4096


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"frozen": torch.full((N,), value), "small": torch.full((16,), value)}


def _writer(root: Path, **kw: Any) -> DataStatesWriter:
    return DataStatesWriter(str(root), "16MiB", chunk_size="1MiB", prefault=False,
                            copy_threads=1, flush_threads=1, **kw)


def _save(w: DataStatesWriter, sd: dict[str, Any], path: Path) -> None:
    dcp.async_save(sd, storage_writer=w, checkpoint_id=str(path)).result(timeout=TIMEOUT_S)


def _stock_save(sd: dict[str, Any], path: Path) -> None:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def _refs(path: Path) -> set[str]:
    out: set[str] = set()
    for m in path.glob("__datastates_manifest_*.json"):
        out |= {it["ref"] for it in json.loads(m.read_text())["items"] if "ref" in it}
    return out


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state(0.0).items()}


def _native_load(dest: dict[str, Any], path: Path) -> DataStatesReader:
    reader = DataStatesReader(str(path))
    in_thread(lambda: dcp.load(dest, storage_reader=reader, checkpoint_id=str(path),
                               no_dist=True), what="dcp.load")
    return reader


def _make_a_and_b(tmp_path: Path) -> tuple[Path, Path]:
    w = _writer(tmp_path, incremental=True)
    try:
        sd = _state(1.0)
        _save(w, sd, tmp_path / "a")
        _save(w, sd, tmp_path / "b")
    finally:
        w.close()
    assert _refs(tmp_path / "b") == {"a"}
    return tmp_path / "a", tmp_path / "b"


@pytest.fixture
def a_and_b(tmp_path: Path) -> tuple[Path, Path]:
    """``a`` (ones) saved in full, ``b`` (the same tensors, unchanged) referencing it."""
    return _make_a_and_b(tmp_path)


@pytest.fixture
def legacy_a_and_b(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """As ``a_and_b``, with data files named as DCP names them (``__0_0.distcp``): checkpoints
    written before an incremental writer named its files after its save."""
    monkeypatch.setattr(layout, "SAVE_TAG_HEX", 0)
    a, b = _make_a_and_b(tmp_path)
    assert (a / "__0_0.distcp").exists()
    return a, b


def _values(load: Any, path: Path) -> set[float]:
    dest = _zeros()
    load(dest, path)
    return {float(v) for t in dest.values() for v in t.unique()}


def test_valid_references_are_read_natively_and_checked(a_and_b: tuple[Path, Path]) -> None:
    a, b = a_and_b
    items = [it for m in b.glob("__datastates_manifest_*.json")
             for it in json.loads(m.read_text())["items"]]
    owner_id = json.loads((a / "__datastates_manifest_0.json").read_text())["save_id"]
    assert {it.get("ref_save_id") for it in items} == {owner_id}
    dest = _zeros()
    reader = _native_load(dest, b)
    assert reader.last_read["stock_items"] == 0  # the references too: native, CRC checked
    assert all(bool((t == 1.0).all()) for t in dest.values())
    assert check_references(b) == 2
    stock = _zeros()
    dcp.load(stock, checkpoint_id=str(b), no_dist=True)  # the stock reader still loads it
    assert all(bool((t == 1.0).all()) for t in stock.values())


def _assert_refused(b: Path, *words: str) -> None:
    dest = _zeros()
    with pytest.raises(BaseException) as info:  # DCP may wrap it (CheckpointException)
        _native_load(dest, b)
    msg = str(info.value)
    for word in ("'frozen'", "a/__0_", *words):
        assert word in msg, (word, msg)
    assert all(bool((t == 0).all()) for t in dest.values()), "a target was written"
    with pytest.raises(IntegrityError) as info2:
        dcp_datastates.load(dest, b, verify=False, no_dist=True)
    for word in ("'frozen'", "a/__0_", *words):
        assert word in str(info2.value), (word, str(info2.value))
    assert all(bool((t == 0).all()) for t in dest.values()), "a target was written"


def test_owner_overwritten_by_the_stock_writer_leaves_the_referenced_bytes(
    a_and_b: tuple[Path, Path],
) -> None:
    a, b = a_and_b
    (owner_file,) = a.glob("__0_0.*.distcp")
    _stock_save(_state(2.0), a)  # same shapes, other values, written as __0_0.distcp
    assert owner_file.exists()
    stock = lambda d, p: dcp.load(d, checkpoint_id=str(p), no_dist=True)  # noqa: E731
    assert _values(stock, a) == {2.0}  # a is the other writer's checkpoint now
    assert _values(stock, b) == {1.0}  # b still loads as saved, through the stock reader too
    assert _values(lambda d, p: _native_load(d, p), b) == {1.0}
    assert _values(lambda d, p: dcp_datastates.load(d, p, no_dist=True), b) == {1.0}
    assert check_references(b) == 2


def test_legacy_owner_overwritten_by_the_stock_writer_is_refused(
    legacy_a_and_b: tuple[Path, Path],
) -> None:
    a, b = legacy_a_and_b
    _stock_save(_state(2.0), a)  # same shapes, other values: the same file names, rewritten
    _assert_refused(b, "overwritten by another writer")
    with pytest.raises(IntegrityError, match="overwritten by another writer"):
        check_references(b)
    assert not verify_checkpoint(b).ok  # verify keeps catching it


@pytest.mark.parametrize("legacy", [False, True], ids=["save-named", "dcp-named"])
def test_owner_saved_again_by_our_writer_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, legacy: bool
) -> None:
    if legacy:
        monkeypatch.setattr(layout, "SAVE_TAG_HEX", 0)
    a, b = _make_a_and_b(tmp_path)
    shutil.rmtree(a)  # by hand: an overwrite of a referenced checkpoint is refused
    w = _writer(a.parent, incremental=True)
    try:
        _save(w, _state(3.0), a)
    finally:
        w.close()
    _assert_refused(b, "saved again" if legacy else "is missing")


def test_damaged_owner_bytes_fail_the_native_read(a_and_b: tuple[Path, Path]) -> None:
    a, b = a_and_b
    man = json.loads((a / "__datastates_manifest_0.json").read_text())
    it = next(i for i in man["items"] if i["fqn"] == "frozen")
    with open(a / it["file"], "r+b") as f:  # same size, one payload byte changed
        f.seek(it["payload_offset"] + 100)
        byte = f.read(1)
        f.seek(it["payload_offset"] + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    dest = _zeros()
    with pytest.raises(BaseException, match=r"checksum mismatch in 'frozen'.*\.\./a/"):
        _native_load(dest, b)


def test_an_owner_another_writer_rewrote_is_not_referenced(tmp_path: Path) -> None:
    """The writer checks the owner before it records a reference: ``a`` rewritten by the stock
    writer (with other values) after our save is not referenced by the next save."""
    w = _writer(tmp_path, incremental=True)
    try:
        sd = _state(1.0)
        _save(w, sd, tmp_path / "a")
        _stock_save(_state(2.0), tmp_path / "a")
        _save(w, sd, tmp_path / "b")
    finally:
        w.close()
    assert _refs(tmp_path / "b") == set()
    got = _zeros()
    dcp.load(got, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    assert all(bool((t == 1.0).all()) for t in got.values()), "b holds the other writer's values"


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_the_save_id_is_found_in_metadata_without_unpickling(protocol: int) -> None:
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    from dcp_datastates.format.refcheck import _records_one_of, _save_id_of

    ours, other = "0123456789abcdef" * 2, "fedcba9876543210" * 2
    near = "0123456789abcdef" + "0" * 16
    md = Metadata(state_dict_metadata={}, storage_data={"x": near},
                  storage_meta=StorageMeta(checkpoint_id=Path("/x/y"), save_id=ours))
    raw = pickle.dumps(md, protocol=protocol)
    assert _save_id_of(raw) == ours
    assert _records_one_of(raw, frozenset({other, ours}))
    assert not _records_one_of(raw, frozenset({other}))
    assert not _records_one_of(raw, frozenset({near}))  # in the pickle, but not the save id
    # The key written as a reference to an earlier copy (here the path's last part): the id is
    # still found among the last bytes; another one is not.
    md.storage_meta = StorageMeta(checkpoint_id=Path("/x/save_id"), save_id=ours)
    raw = pickle.dumps(md, protocol=protocol)
    assert _records_one_of(raw, frozenset({ours})) and not _records_one_of(raw, frozenset({other}))
    assert _save_id_of(pickle.dumps(Metadata(state_dict_metadata={}), protocol=protocol)) is None


def test_an_overwrite_removes_the_save_named_files(tmp_path: Path) -> None:
    w = _writer(tmp_path, incremental=True)
    try:
        _save(w, _state(1.0), tmp_path / "a")
    finally:
        w.close()
    (old,) = (tmp_path / "a").glob("__0_0.*.distcp")
    w = _writer(tmp_path)
    try:
        _save(w, _state(2.0), tmp_path / "a")  # not referenced: the overwrite goes ahead
    finally:
        w.close()
    assert not old.exists()
    assert sorted(p.name for p in (tmp_path / "a").glob("*.distcp")) == ["__0_0.distcp"]


def test_a_referring_checkpoint_rewritten_by_another_writer_loads(
    a_and_b: tuple[Path, Path],
) -> None:
    """``b`` itself saved again by the stock writer: its manifests (with references) are stale
    and nothing of them is checked (their owner is gone); the native reader loads it."""
    a, b = a_and_b
    shutil.rmtree(a)
    _stock_save(_state(5.0), b)
    assert check_references(b) == 0
    assert _values(lambda d, p: _native_load(d, p), b) == {5.0}
