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
    real_report, real_run = rank_commit.report, rank_commit.Reporter._run
    # the coordinator's waits: 2 s for a silent rank (alive, never reporting); for a dead one,
    # whose heartbeat stops, a long timeout and a 1 s liveness period, which must name it first
    waits = {"rank_timeout": 120.0, "rank_liveness": 1.0} if how == "dead" else {
        "rank_timeout": 2.0}
    with DataStatesWriter(root, host_cache_size="8MiB", **waits) as w:
        if rank == 1:
            w._engine.set_delays(0, 20_000, seed=2)
            real_write = w.write_data

            def write_data(*a: Any, **k: Any) -> Any:
                fut = real_write(*a, **k)
                if how == "flush_fails":  # an I/O error after the results were handed over
                    w._engine.abort(w._context().job.engine_job, "injected: disk on fire")
                return fut

            w.write_data = write_data
            if how in ("silent", "dead"):  # a rank that never reports (as if it had hung)
                rank_commit.report = lambda *a, **k: None  # type: ignore[assignment]
            if how == "dead":  # ... nor beats after its first heartbeat (as if it had died)
                rank_commit.Reporter._run = lambda *a: None  # type: ignore[method-assign]
        try:
            dcp.async_save(sd, storage_writer=w, checkpoint_id=f"{root}/bad",
                           process_group=pg).result(120)
            outcomes.append("ok")
        except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (not an Exception)
            outcomes.append(str(e))
        w._engine.set_delays(0, 0)
        w.write_data = type(w).write_data.__get__(w)
        rank_commit.report = real_report  # type: ignore[assignment]
        rank_commit.Reporter._run = real_run  # type: ignore[method-assign]
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
        ("dead", ("rank(s) [1]", "stopped sending heartbeats")),  # nor beats: died
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


def _tickets(n: int, group: str = "g", first: int = 1) -> list[Any]:
    from dcp_datastates.save.rank_commit import Ticket

    return [Ticket(r, f"sid-{r}", group) for r in range(first, first + n)]


def test_wait_for_ranks_returns_once_every_report_arrived_and_deletes_the_keys() -> None:
    from dcp_datastates.save import rank_commit

    kv = dist.HashStore()
    tickets = _tickets(3)

    def late() -> None:
        for t in (tickets[2], tickets[0], tickets[1]):
            time.sleep(0.05)
            rank_commit.report(kv, t, None)

    t = threading.Thread(target=late)
    t0 = time.monotonic()
    t.start()
    rank_commit.wait_for_ranks(kv, tickets, "ckpt", timeout_s=30)
    t.join()
    assert time.monotonic() - t0 >= 0.14
    assert not any(kv.check([f"dcp_datastates/durable/g/{k}"]) for k in ("n", "who", "err"))


def test_the_coordinator_polls_one_counter_however_many_ranks() -> None:
    """4,095 reports in: the wait reads the counter and the list once each (a store that counts
    its calls), not one key per rank."""
    from dcp_datastates.save import rank_commit

    class Counting:
        def __init__(self) -> None:
            self.kv = dist.HashStore()
            self.calls: dict[str, int] = {}

        def __getattr__(self, name: str) -> Any:
            def call(*a: Any) -> Any:
                self.calls[name] = self.calls.get(name, 0) + 1
                return getattr(self.kv, name)(*a)
            return call

    kv = Counting()
    tickets = _tickets(4095)
    for t in tickets:
        rank_commit.report(kv.kv, t, None)
    rank_commit.wait_for_ranks(kv, tickets, "ckpt", timeout_s=30)
    assert kv.calls.get("add") == 1 and kv.calls.get("get") == 1, kv.calls
    assert sum(kv.calls.values()) <= 8, kv.calls


def test_wait_for_ranks_names_the_failed_rank_and_its_error() -> None:
    from dcp_datastates.save import rank_commit

    kv = dist.HashStore()
    a, b, c = _tickets(3)
    rank_commit.report(kv, a, None)
    rank_commit.report(kv, b, "save to ckpt failed on rank 2: OSError: No space left")
    t0 = time.monotonic()  # rank 3 has not reported: the failure is seen at once all the same
    with pytest.raises(CheckpointSaveError, match=r"rank 2: .*No space left") as ei:
        rank_commit.wait_for_ranks(kv, [a, b, c], "ckpt", timeout_s=30)
    assert "nothing was committed" in str(ei.value)
    assert time.monotonic() - t0 < 5


def test_wait_for_ranks_times_out_naming_only_the_silent_ranks_and_ignores_other_saves() -> None:
    from dcp_datastates.save import rank_commit
    from dcp_datastates.save.rank_commit import Ticket

    kv = dist.HashStore()
    tickets = _tickets(16)
    for t in tickets:
        if t.rank not in (7, 12):
            rank_commit.report(kv, t, None)
    # rank 7's report of an earlier save in the same group does not count as this one's
    rank_commit.report(kv, Ticket(7, "an-earlier-save", "g"), None)
    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveError, match=r"rank\(s\) \[7, 12\] did not report"):
        rank_commit.wait_for_ranks(kv, tickets, "ckpt", timeout_s=0.3, liveness_s=60)
    assert 0.3 <= time.monotonic() - t0 < 5


def test_ranks_in_several_groups_are_each_waited_for() -> None:
    from dcp_datastates.save import rank_commit

    kv = dist.HashStore()
    tickets = _tickets(3, "g1") + _tickets(2, "g2", first=4)
    for t in tickets[1:]:
        rank_commit.report(kv, t, None)
    threading.Timer(0.1, rank_commit.report, (kv, tickets[0], None)).start()
    t0 = time.monotonic()
    rank_commit.wait_for_ranks(kv, tickets, "ckpt", timeout_s=30)
    assert time.monotonic() - t0 >= 0.09


def _reporting_rank(host: str, port: int, save_id: str, report_after_s: float) -> None:
    """A rank's process: its heartbeat runs, then it reports (or it is killed first)."""
    from dcp_datastates.save import rank_commit

    kv = dist.TCPStore(host, port, is_master=False)
    r = rank_commit.Reporter(kv, rank_commit.Ticket(5, save_id, "g"), liveness_s=1.0)
    time.sleep(report_after_s)
    r.report(None)
    r.close()


def _tcp_store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_rank_that_dies_is_named_after_the_liveness_period_not_the_timeout() -> None:
    """A real process holding a Reporter is SIGKILLed while its data would still flush: the
    coordinator (timeout 120 s, liveness 1 s) names rank 5 within a few seconds."""
    import multiprocessing as mp
    import signal

    from dcp_datastates.save import rank_commit

    kv = _tcp_store()
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_reporting_rank, args=("127.0.0.1", kv.port, "sid-5", 600.0))
    p.start()
    try:
        deadline = time.monotonic() + 60
        while not kv.check(["dcp_datastates/durable/hb/sid-5"]):
            assert time.monotonic() < deadline and p.is_alive(), "no heartbeat"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        tickets = [rank_commit.Ticket(5, "sid-5", "g")]
        with pytest.raises(CheckpointSaveError, match=r"rank\(s\) \[5\] stopped sending"):
            rank_commit.wait_for_ranks(kv, tickets, "ckpt", timeout_s=120, liveness_s=1.0)
        assert time.monotonic() - t0 < 10
    finally:
        p.kill()
        p.join()


def test_a_slow_rank_keeps_beating_and_is_waited_for() -> None:
    """A live rank that reports after 4 s, with a 1 s liveness: the commit waits for it."""
    import multiprocessing as mp

    from dcp_datastates.save import rank_commit

    kv = _tcp_store()
    p = mp.get_context("spawn").Process(
        target=_reporting_rank, args=("127.0.0.1", kv.port, "sid-slow", 4.0))
    p.start()
    try:
        deadline = time.monotonic() + 60
        while not kv.check(["dcp_datastates/durable/hb/sid-slow"]):
            assert time.monotonic() < deadline and p.is_alive(), "no heartbeat"
            time.sleep(0.01)
        t0 = time.monotonic()
        tickets = [rank_commit.Ticket(5, "sid-slow", "g")]
        rank_commit.wait_for_ranks(kv, tickets, "ckpt", timeout_s=120, liveness_s=1.0)
        assert time.monotonic() - t0 >= 3.0
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert not kv.check(["dcp_datastates/durable/hb/sid-slow"])  # the rank deleted its beat


def test_a_report_that_cannot_be_sent_does_not_raise() -> None:
    from dcp_datastates.save import rank_commit

    class Broken:
        def append(self, key: str, value: str) -> None:
            raise RuntimeError("connection reset by peer")

    with captured_logs("dcp_datastates.save.rank_commit") as logs:
        rank_commit.report(Broken(), rank_commit.Ticket(3, "xyz", "g"), None)
    assert any("rank 3 cannot report" in r.getMessage() for r in logs)


def test_results_handed_over_early_travel_with_their_ticket() -> None:
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from dcp_datastates.save.rank_commit import AwaitedResults, Ticket, awaited_tickets
    from dcp_datastates.save.wire import CompactWriteResults

    wr = WriteResult(index=MetadataIndex("a", torch.Size([0])), size_in_bytes=4,
                     storage_data=_StorageInfo("__1_0.distcp", 0, 4))
    plain = CompactWriteResults([wr])
    early = CompactWriteResults([wr])
    early.awaited = Ticket(1, "sid-1", "3-abc")
    back_plain, back_early = pickle.loads(pickle.dumps([plain, early]))
    assert type(back_plain) is list and back_plain == [wr]
    assert isinstance(back_early, AwaitedResults) and back_early == [wr]
    assert back_early.ticket == Ticket(1, "sid-1", "3-abc")
    assert awaited_tickets([back_plain, back_early]) == [Ticket(1, "sid-1", "3-abc")]
