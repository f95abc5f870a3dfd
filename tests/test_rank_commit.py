"""Several ranks hand their results over before their data is durable; the commit still waits.

With several ranks an ``async_save``'s other ranks return their write results to DCP once every
item is placed, and report through the process group's store once their data is durable
(dcp_datastates/save/rank_commit.py). These tests check, on 2 gloo ranks, that the coordinator never
commits before the other rank's report, that a rank whose flush fails after it handed its results
over fails the save on every rank naming it (nothing committed, the writers keep working), that a
rank that never reports is named by the timeout, and the store protocol on its own.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, captured_logs
from dist_utils import run_ranks

from dcp_datastates.errors import CheckpointSaveError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(10 + rank)
    return {
        "model": {f"r{rank}.w{i}": torch.randn(64 * 1024, generator=g) for i in range(8)},
        "shared": torch.arange(32.0),
    }


def _load_and_check(ckpt: str, sd: dict[str, Any], pg: Any) -> None:
    """Loads ``ckpt`` with the stock reader into zeros shaped like ``sd``; bit for bit."""
    out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
           "shared": torch.zeros(32)}
    dcp.load(out, checkpoint_id=ckpt, process_group=pg)
    assert_state_equal(out, sd)


def _instrument(w: Any, events: dict[str, float]) -> None:
    """Records when write_data returned (and whether it handed its results over early), when
    this rank reported, and when the commit happened."""
    import dcp_datastates.save.rank_commit as rank_commit
    from dcp_datastates.format.commit import CheckpointDir

    real_write, real_report, real_commit = w.write_data, rank_commit.report, CheckpointDir.commit

    def write_data(*a: Any, **k: Any) -> Any:
        fut = real_write(*a, **k)
        events["written"] = time.monotonic()
        events["awaited"] = float(getattr(fut.value(), "awaited", None) is not None)
        return fut

    def report(*a: Any, **k: Any) -> None:
        real_report(*a, **k)
        events["reported"] = time.monotonic()

    def commit(self: Any, *a: Any, **k: Any) -> None:
        events["commit"] = time.monotonic()
        real_commit(self, *a, **k)

    w.write_data = write_data
    rank_commit.report = report  # type: ignore[assignment]
    CheckpointDir.commit = commit  # type: ignore[method-assign]


def _ordered_body(rank: int, world: int, root: str) -> dict[str, float]:
    from dcp_datastates import DataStatesWriter

    sd = _state(rank)
    pg = dist.new_group(backend="gloo")
    events: dict[str, float] = {}
    with DataStatesWriter(root, host_cache_size="8MiB") as w:
        _instrument(w, events)
        if rank == 1:
            w._engine.set_delays(0, 30_000, seed=1)  # a slow flush: up to 30 ms per write
        dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/a", process_group=pg).result(
            120
        )
        w._engine.set_delays(0, 0)
    dist.barrier()
    _load_and_check(f"{root}/a", sd, pg)
    return events


def test_other_ranks_hand_over_early_and_the_commit_waits_for_their_data(tmp_path: Any) -> None:
    root = str(tmp_path / "ck")
    ev = run_ranks(_ordered_body, root, tmp_path=tmp_path, timeout_s=180)
    assert ev[1]["awaited"] == 1.0 and ev[0]["awaited"] == 0.0, ev
    # Rank 1 handed its results over before its (slowed) data was durable ...
    assert ev[1]["written"] < ev[1]["reported"], ev
    # ... and the coordinator committed only after rank 1's report (one clock: CLOCK_MONOTONIC).
    assert ev[0]["commit"] > ev[1]["reported"], ev
    from dcp_datastates import verify_checkpoint

    rep = verify_checkpoint(f"{root}/a")
    assert rep.ok and rep.ranks == 2, rep.summary()


def _failing_body(rank: int, world: int, root: str, how: str) -> list[str]:
    import dcp_datastates.save.rank_commit as rank_commit
    from dcp_datastates import DataStatesWriter

    sd = _state(rank)
    pg = dist.new_group(backend="gloo")
    outcomes: list[str] = []
    real_report = rank_commit.report
    with DataStatesWriter(root, host_cache_size="8MiB") as w:
        if rank == 1:
            w._engine.set_delays(0, 20_000, seed=2)
            real_write = w.write_data

            def write_data(*a: Any, **k: Any) -> Any:
                fut = real_write(*a, **k)
                if how == "flush_fails":  # an I/O error after the results were handed over
                    w._engine.abort(w._context().job.engine_job, "injected: disk on fire")
                return fut

            w.write_data = write_data
            if how == "silent":  # a rank that never reports (as if its process had hung)
                rank_commit.report = lambda *a, **k: None  # type: ignore[assignment]
        else:
            rank_commit.RANK_WAIT_TIMEOUT_S = 2.0
        try:
            dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/bad",
                           process_group=pg).result(120)
            outcomes.append("ok")
        except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (not an Exception)
            outcomes.append(str(e))
        w._engine.set_delays(0, 0)
        w.write_data = type(w).write_data.__get__(w)
        rank_commit.report = real_report  # type: ignore[assignment]
        # The writers keep working: the next save (another path) commits and loads exactly.
        dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/good",
                       process_group=pg).result(120)
        try:
            w.wait()
        except CheckpointSaveError:  # the failed save's error, if the future did not carry it
            pass
    dist.barrier()
    outcomes.append(str(os.path.exists(f"{root}/bad/.metadata")))
    _load_and_check(f"{root}/good", sd, pg)
    return outcomes


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("flush_fails", ("rank 1", "disk on fire")),  # an I/O error after the hand-over
        ("silent", ("rank(s) [1]", "did not report")),  # a rank that never reports
    ],
)
def test_a_rank_that_fails_or_never_reports_after_handing_over_fails_the_save_everywhere(
    tmp_path: Any, how: str, expected: tuple[str, str]
) -> None:
    root = str(tmp_path / "ck")
    res = run_ranks(_failing_body, root, how, tmp_path=tmp_path, timeout_s=180)
    for rank in (0, 1):
        msg, committed = res[rank]
        assert all(e in msg for e in expected), (rank, msg)
        assert committed == "False"  # nothing committed; the partial directory says so
    assert os.path.exists(f"{root}/bad/.datastates.incomplete")


def _fork_and_drop_body(rank: int, world: int, root: str) -> str:
    """While rank 1's completion thread still waits for its slowed flush, rank 1 forks a child
    (a DataLoader worker would) and then drops its writer without closing it."""
    import gc

    from dcp_datastates import DataStatesWriter

    sd = _state(rank)
    pg = dist.new_group(backend="gloo")
    w = DataStatesWriter(root, host_cache_size="8MiB")
    if rank == 1:
        w._engine.set_delays(0, 30_000, seed=3)
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/f", process_group=pg)
    child = ""
    if rank == 1:
        deadline = time.monotonic() + 60
        while not any(t.name == "dcp_datastates-complete" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "no completion thread"
            time.sleep(0.001)
        pid = os.fork()
        if pid == 0:  # the child: the writer refuses, nothing hangs, nothing is written
            try:
                w.wait()
                os._exit(3)
            except RuntimeError as e:
                os._exit(0 if "forked child" in str(e) else 4)
        _, status = os.waitpid(pid, 0)
        child = str(os.waitstatus_to_exitcode(status))
        del w  # dropped, not closed, while its save is in flight
        gc.collect()
    fut.result(120)
    if rank == 0:
        w.close()
    dist.barrier()
    _load_and_check(f"{root}/f", sd, pg)
    return child


def test_a_fork_and_a_dropped_writer_during_the_hand_over_lose_nothing(tmp_path: Any) -> None:
    root = str(tmp_path / "ck")
    res = run_ranks(_fork_and_drop_body, root, tmp_path=tmp_path, timeout_s=180)
    assert res[1] == "0", res  # the child got the forked-child error, exited at once
    from dcp_datastates import verify_checkpoint

    rep = verify_checkpoint(f"{root}/f")
    assert rep.ok and rep.ranks == 2, rep.summary()


# -- the store protocol alone ----------------------------------------------------------------


def test_wait_for_ranks_returns_once_every_report_arrived_and_deletes_the_keys() -> None:
    from dcp_datastates.save import rank_commit

    kv = dist.HashStore()
    ranks = {1: "aaa", 2: "bbb", 3: "ccc"}

    def late() -> None:
        for r in (3, 1, 2):
            time.sleep(0.05)
            rank_commit.report(kv, r, ranks[r], None)

    t = threading.Thread(target=late)
    t0 = time.monotonic()
    t.start()
    rank_commit.wait_for_ranks(kv, ranks, "ckpt", timeout_s=30)
    t.join()
    assert time.monotonic() - t0 >= 0.14
    assert not any(kv.check([f"dcp_datastates/durable/{sid}"]) for sid in ranks.values())


def test_wait_for_ranks_names_the_failed_rank_and_its_error() -> None:
    from dcp_datastates.save import rank_commit

    kv = dist.HashStore()
    rank_commit.report(kv, 1, "aaa", None)
    rank_commit.report(kv, 2, "bbb", "save to ckpt failed on rank 2: OSError: No space left")
    with pytest.raises(CheckpointSaveError, match=r"rank 2: .*No space left") as ei:
        rank_commit.wait_for_ranks(kv, {1: "aaa", 2: "bbb"}, "ckpt", timeout_s=30)
    assert "nothing was committed" in str(ei.value)


def test_wait_for_ranks_times_out_naming_the_silent_ranks_and_ignores_other_saves() -> None:
    from dcp_datastates.save import rank_commit

    kv = dist.HashStore()
    rank_commit.report(kv, 1, "aaa", None)
    rank_commit.report(kv, 2, "an-earlier-save", None)  # another save id: not rank 2's report
    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveError, match=r"rank\(s\) \[2, 3\] did not report"):
        rank_commit.wait_for_ranks(kv, {1: "aaa", 2: "bbb", 3: "ccc"}, "ckpt", timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5


def test_a_report_that_cannot_be_sent_does_not_raise() -> None:
    from dcp_datastates.save import rank_commit

    class Broken:
        def set(self, key: str, value: str) -> None:
            raise RuntimeError("connection reset by peer")

    with captured_logs("dcp_datastates.save.rank_commit") as logs:
        rank_commit.report(Broken(), 3, "xyz", None)
    assert any("rank 3 cannot report" in r.getMessage() for r in logs)


def test_results_handed_over_early_travel_with_their_rank_and_save_id() -> None:
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from dcp_datastates.save.rank_commit import AwaitedResults, awaited_ranks
    from dcp_datastates.save.wire import CompactWriteResults

    wr = WriteResult(index=MetadataIndex("a", torch.Size([0])), size_in_bytes=4,
                     storage_data=_StorageInfo("__1_0.distcp", 0, 4))
    plain = CompactWriteResults([wr])
    early = CompactWriteResults([wr])
    early.awaited = (1, "sid-1")
    back_plain, back_early = pickle.loads(pickle.dumps([plain, early]))
    assert type(back_plain) is list and back_plain == [wr]
    assert isinstance(back_early, AwaitedResults) and back_early == [wr]
    assert (back_early.rank, back_early.save_id) == (1, "sid-1")
    assert awaited_ranks([back_plain, back_early]) == {1: "sid-1"}
