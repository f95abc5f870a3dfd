"""Deferred release of async_save results (dcp_datastates.save.release): the caller's drop of a
future frees nothing, a later save thread takes the Metadata apart, and nothing a caller still
references (the result, one of its dictionaries, a weak reference) is ever touched."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter
from dcp_datastates.save import release
from dcp_datastates.save.release import DeferredRelease


class Result:
    def __init__(self, n: int = 3000) -> None:
        self.entries = {f"k{i}": (i, [i]) for i in range(n)}
        self.small = {1: 2}
        self.other = [1, 2]


def test_an_unreferenced_result_is_taken_apart_in_slices(monkeypatch: Any) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(release.time, "sleep", lambda s: sleeps.append(s))
    r = DeferredRelease()
    r.hold(Result(2500))
    assert r.collect() == 1 and len(r) == 0
    assert len(sleeps) == 3 + 1  # 2,500 entries in slices of 1,000, then the small dict


def test_a_result_still_referenced_is_kept_intact() -> None:
    r = DeferredRelease()
    res = Result()
    r.hold(res)
    assert r.collect() == 0 and len(r) == 1
    assert len(res.entries) == 3000 and res.small == {1: 2}
    del res
    assert r.collect() == 1 and len(r) == 0


def test_a_dictionary_the_caller_kept_is_not_emptied() -> None:
    r = DeferredRelease()
    res = Result()
    entries = res.entries
    r.hold(res)
    del res
    assert r.collect() == 1
    assert len(entries) == 3000  # only the dictionaries nobody else holds were emptied


def test_a_weakly_referenced_result_is_kept() -> None:
    r = DeferredRelease()
    res = Result()
    ref = weakref.ref(res)
    r.hold(res)
    del res
    assert r.collect() == 0
    alive = ref()
    assert alive is not None and len(alive.entries) == 3000


def test_at_most_keep_results_are_held_and_clear_drops_them() -> None:
    r = DeferredRelease(keep=2)
    kept = [Result(10) for _ in range(3)]
    for k in kept:
        r.hold(k)
    assert len(r) == 2
    r.clear()
    assert len(r) == 0 and all(len(k.entries) == 10 for k in kept)


def test_collect_and_hold_from_threads_lose_nothing() -> None:
    r = DeferredRelease(keep=1000)
    kept: list[Result] = []

    def work(i: int) -> None:
        for j in range(50):
            res = Result(20)
            if j % 2:
                kept.append(res)
            r.hold(res)
            r.collect()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(k.entries) == 20 for k in kept)


def _state(n: int) -> dict[str, Any]:
    return {"m": {f"t{i}": torch.full((4,), float(i)) for i in range(n)}}


def test_async_save_results_are_freed_by_a_later_save_not_by_the_caller(
    tmp_path: Path, monkeypatch: Any
) -> None:
    taken: list[int] = []
    original = release._take_apart

    def recording(obj: Any, expected_attr: int) -> None:
        taken.append(len(obj.state_dict_metadata))
        original(obj, expected_attr)

    monkeypatch.setattr(release, "_take_apart", recording)
    sd = _state(300)
    with DataStatesWriter(str(tmp_path), host_cache_size="16MiB") as w:
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "a"))
        kept_md = fut.result(60)
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "b"))
        fut.result(60)
        # a's result is still referenced here: untouched, and still held
        assert taken == [] and len(kept_md.state_dict_metadata) == 300
        smd = fut.result(60).state_dict_metadata
        del fut, kept_md  # the caller drops both results: neither is freed by this line
        assert len(w._released) == 2
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
        fut.result(60)
        assert taken == [300, 300]  # a and b taken apart on c's save thread ...
        assert len(smd) == 300  # ... except b's dictionary, which the caller kept
        del fut
    assert len(w._released) == 0  # close() drops the rest
    out = _state(300)
    for t in out["m"].values():
        t.zero_()
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert all(torch.equal(out["m"][k], v) for k, v in sd["m"].items())


def test_dcp_save_results_are_left_to_the_caller(tmp_path: Path) -> None:
    # dcp.save runs its protocol on the caller's thread: nothing to move off it.
    with DataStatesWriter(str(tmp_path), host_cache_size="16MiB") as w:
        md = dcp.save(_state(10), storage_writer=w, checkpoint_id=str(tmp_path / "a"))
        assert len(w._released) == 0 and len(md.state_dict_metadata) == 10
