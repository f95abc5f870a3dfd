"""Per-item cost of a save with many small tensors: one native registration and one native
at-call copy per save (not one call per tensor), all-or-nothing batch registration, and
bit-exact round trips of many tiny tensors through async_save and dcp.save."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, in_thread, zeros_like_state

from dcp_datastates import CheckpointSaveError, DataStatesReader, DataStatesWriter
from dcp_datastates.config import WriterConfig
from dcp_datastates.engine import Engine
from dcp_datastates.format.manifest import ItemRecord, RankManifest, encode_manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

N = 2000


def small_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"m": {f"t{i}": torch.randn(4, generator=g) for i in range(N)}, "step": 5}


class _CountingCore:
    """Wraps the native engine handle and counts the calls by name."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **kw)

        return call


def test_stage_makes_one_native_call_per_save_not_per_tensor(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    w = DataStatesWriter(root, host_cache_size="64MiB", prefault=False)
    try:
        counting = _CountingCore(w.engine._core)
        w.engine._core = counting  # type: ignore[assignment]
        sd = small_state()
        in_thread(lambda: dcp.async_save(sd, storage_writer=w, checkpoint_id=root).result(),
                  what="async_save")
        assert counting.calls.get("add_entry", 0) == 0, counting.calls
        assert counting.calls.get("add_entries") == 1, counting.calls
        assert counting.calls.get("capture_now", 0) == 0, counting.calls  # all fit at once
        assert counting.calls.get("capture_now_many") == 1, counting.calls
        w.engine._core = counting._core
    finally:
        w.close()
    dest = zeros_like_state(sd)
    dcp.load(dest, checkpoint_id=root, no_dist=True)
    assert_state_equal(sd, dest)


@pytest.mark.parametrize("cache", ["64MiB", "2MiB"])
def test_many_small_tensors_round_trip(tmp_path: Any, cache: str) -> None:
    """2 MiB cannot hold 2000 at-call snapshots at once (4 KiB each in the cache): the ones that
    do not fit wait for space or spill, after the batch took what fit."""
    root = str(tmp_path / "ckpt")
    w = DataStatesWriter(root, host_cache_size=cache, chunk_size="64KiB", prefault=False)
    try:
        sd = small_state()
        for k in range(2):
            cid = f"{root}-{k}"
            in_thread(lambda cid=cid: dcp.async_save(sd, storage_writer=w, checkpoint_id=cid)
                      .result(), what="async_save")
            # changed after the call: the checkpoint holds the state of the call
            snapshot = {"m": {n: t.clone() for n, t in sd["m"].items()}, "step": sd["step"]}
            for t in sd["m"].values():
                t.add_(1)
            dest = zeros_like_state(snapshot)
            dcp.load(dest, storage_reader=DataStatesReader(cid), checkpoint_id=cid, no_dist=True)
            assert_state_equal(snapshot, dest)
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=f"{root}-sync"),
                  what="dcp.save")
        dest = zeros_like_state(sd)
        dcp.load(dest, checkpoint_id=f"{root}-sync", no_dist=True)
        assert_state_equal(sd, dest)
    finally:
        w.close()


def test_batch_registration_is_all_or_nothing_and_names_the_tensor() -> None:
    eng = Engine(WriterConfig(cache_bytes=1 << 20, prefault=False))
    try:
        a = torch.randn(8)
        job = eng.create_job("t")
        with pytest.raises(CheckpointSaveError, match="'broken'"):
            eng.add_entries(job, ["ok", "broken"], [a.data_ptr(), 0], [32, 32], [-1, -1], [0, 0],
                            [0, 0])
        first = eng.add_entries(job, ["x", "y"], [a.data_ptr(), a.data_ptr() + 16], [16, 16],
                                [-1, -1], [0, 0], [0, 0])
        assert first == 0  # nothing of the refused batch was added
        with pytest.raises(CheckpointSaveError, match="differ in length"):
            eng.add_entries(job, ["z"], [], [4], [-1], [0], [0])
        assert eng.capture_now_many(job, [0, 1]) == b"\x01\x01"
        eng.forget(job)
    finally:
        eng.close()


def test_capture_now_many_takes_what_fits_and_reserves_nothing_for_the_rest() -> None:
    eng = Engine(WriterConfig(cache_bytes=64 << 10, chunk_bytes=64 << 10, prefault=False))
    try:
        big = torch.randn(10_000)  # 40 KB each: two do not fit in 64 KiB at once
        job = eng.create_job("t")
        n = big.nbytes
        eng.add_entries(job, ["a", "b", "c"], [big.data_ptr()] * 3, [n, n, n], [-1] * 3, [0] * 3,
                        [0] * 3)
        assert eng.capture_now_many(job, [0, 1, 2]) == b"\x01\x00\x00"
        assert eng.counters()["live_blocks"] == 1
        eng.abort(job, "test over")
        eng.forget(job)
    finally:
        eng.close()


def test_manifest_json_is_unchanged_by_the_fast_serialiser() -> None:
    m = RankManifest(
        rank=1, checksums=True, save_id="s",
        items=[
            ItemRecord("a", [0, 4], "__1_0.distcp", 0, 100, 64, 16, "float32", [4], [(64, 16, 7)]),
            ItemRecord("b", None, "__1_1.distcp", 0, 9, 0, 9, "bytes", [], [(0, 9, 1)]),
        ],
    )
    # what dataclasses.asdict gave, less the incremental-save fields `ref*` and the stream
    # transform fields when they are unset
    expected = asdict(m)
    for it in expected["items"]:
        del it["ref"], it["ref_save_id"]
        del it["transform"], it["decoded_bytes"], it["decoded_crc"]
    assert m.to_json() == json.dumps(expected, separators=(",", ":"))
    assert RankManifest.from_json(m.to_json()) == m
    empty = RankManifest(rank=0, checksums=False, save_id="é\"x", items=[])
    assert empty.to_json() == json.dumps(asdict(empty), separators=(",", ":"))
    m.items[0].ref = "step-1"  # a reference: kept, and the manifest becomes version 2
    m.items[0].ref_save_id = "0123abcd"
    raw = json.loads(m.to_json())
    assert raw["items"][0]["ref"] == "step-1" and "ref" not in raw["items"][1]
    assert raw["items"][0]["ref_save_id"] == "0123abcd" and "ref_save_id" not in raw["items"][1]
    assert raw["version"] == 2
    assert RankManifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("batch", [1, 2, 3, 4096])
def test_manifest_streamed_in_pieces_is_the_same_text(batch: int) -> None:
    items = [
        ItemRecord(f"t{i}.é\"\\\n✓", [0, i], f"__0_{i % 2}.distcp", 10 * i, 10, 10 * i + 4, 4,
                   "float32", [1, 2 ** 40], [(10 * i + 4, 4, i), (0, 1, 2 ** 32 - 1)][: i % 3],
                   ref="step-1" if i == 3 else None, ref_save_id="s\"1" if i == 3 else None)
        for i in range(5)
    ]
    items.append(ItemRecord("b", None, "__0_0.distcp", 0, 9, 0, 9, "bytes", [], [(0, 9, 1)]))
    m = RankManifest(rank=0, checksums=True, save_id="s", items=items)
    made: list[int] = []

    def lazily() -> Any:  # a generator: the records exist only while they are encoded
        for it in items:
            made.append(1)
            yield it

    pieces = list(encode_manifest(0, True, "s", lazily(), batch=batch))
    assert b"".join(pieces).decode() == m.to_json()
    expected = asdict(m)
    for it in expected["items"]:
        if it["ref"] is None:
            del it["ref"], it["ref_save_id"]
        del it["transform"], it["decoded_bytes"], it["decoded_crc"]  # unset: not written
    expected["version"] = 2  # one item has a reference
    assert m.to_json() == json.dumps(expected, separators=(",", ":"))
    assert len(made) == 6 and len(pieces) == 2 + -(-6 // batch)
    assert b"".join(encode_manifest(0, True, "s", iter([]), batch=batch)).decode() == (
        RankManifest(rank=0, checksums=True, save_id="s", items=[]).to_json()
    )


def test_a_finished_save_keeps_no_per_tensor_objects(tmp_path: Any) -> None:
    # The save's future lives until the caller drops it (`fut = dcp.async_save(...)` in a loop
    # drops it inside the next save call). Before the fix it kept one record per tensor alive:
    # every full GC walked them and freeing them landed inside the next save call (2-3 s for
    # 20,000 tensors).
    import gc

    from dcp_datastates.save.capture import CapturedTensor

    sd = {"keepalive_probe": {f"t{i}": torch.randn(4) for i in range(2000)}}
    w = DataStatesWriter(str(tmp_path), host_cache_size="64MiB")
    try:
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "a"))
        fut.result(timeout=120)
        gc.collect()
        alive = sum(  # this save's records only (other tests' leftovers are theirs to find)
            1 for o in gc.get_objects()
            if isinstance(o, CapturedTensor) and o.name.startswith("keepalive_probe.")
        )
        assert alive == 0, f"{alive} CapturedTensor objects outlive their save"
        out = {"keepalive_probe": {k: torch.zeros(4) for k in sd["keepalive_probe"]}}
        dcp.load(out, checkpoint_id=str(tmp_path / "a"))
        assert all(
            torch.equal(out["keepalive_probe"][k], v) for k, v in sd["keepalive_probe"].items()
        )
        del fut
    finally:
        w.close()


def test_dcp_save_resolves_items_through_a_planner_that_transforms_them(tmp_path: Any) -> None:
    # dcp.save finds plain tensors in the planner's state dict directly, but only for planners
    # that resolve as DefaultSavePlanner does: an override of transform_object is honoured.
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Doubling(DefaultSavePlanner):
        def transform_object(self, write_item: Any, object: Any) -> Any:  # noqa: A002
            out = super().transform_object(write_item, object)
            return out * 2 if isinstance(out, torch.Tensor) else out

    state = {"a": torch.arange(6.0).reshape(2, 3), "p": torch.nn.Parameter(torch.ones(3)), "n": 1}
    w = DataStatesWriter(str(tmp_path / "x"), host_cache_size="8MiB")
    try:
        dcp.save(state, storage_writer=w, checkpoint_id=str(tmp_path / "d"), planner=Doubling())
        dcp.save(state, storage_writer=w, checkpoint_id=str(tmp_path / "p"))
    finally:
        w.close()
    out = {"a": torch.zeros(2, 3), "p": torch.zeros(3), "n": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "d"))
    assert torch.equal(out["a"], state["a"] * 2) and torch.equal(out["p"], torch.full((3,), 2.0))
    dcp.load(out, checkpoint_id=str(tmp_path / "p"))
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["p"], torch.ones(3))


_GOOD_ITEM: dict[str, Any] = {
    "fqn": "w", "offset": [0, 4], "file": "__0_0.distcp", "archive_offset": 0,
    "archive_length": 100, "payload_offset": 64, "payload_bytes": 16, "dtype": "float32",
    "shape": [4], "chunks": [[64, 16, 7]],
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({}, None),
        ({"offset": None, "ref": "step-1", "extra": 1}, None),  # unknown fields are ignored
        ({"archive_offset": True}, "field 'archive_offset' is not a int"),
        ({"payload_bytes": -1}, "field 'payload_bytes' is negative"),
        ({"shape": [4, "x"]}, "'shape' is not a list of non-negative ints"),
        ({"offset": [0, -4]}, "'offset' is not a list of non-negative ints"),
        ({"chunks": [[64, 16]]}, "a chunk is not [offset, bytes, crc]"),
        ({"chunks": [[64, 16, 7.0]]}, "a chunk is not a list of non-negative ints"),
        ({"ref": 3}, "field 'ref' is not a str"),
        ({"fqn": None}, "field 'fqn' is not a str"),
        ({"file": None}, "field 'file' is missing"),
    ],
)
def test_manifest_items_parse_as_the_checked_parser_does(
    change: dict[str, Any], message: str | None
) -> None:
    """Well-formed items take an inline check; whatever it does not accept goes through the
    checked parser, whose error names what is malformed: the two accept the same items."""
    from dcp_datastates.format.manifest import _item, _item_checked

    item = {**_GOOD_ITEM, **change}
    if change.get("file", "") is None:
        del item["file"]
    if message is None:
        assert _item(item, 0) == _item_checked(item, 0)
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        _item(item, 0)
