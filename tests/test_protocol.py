"""The DCP protocol never hangs, errors are reported once per channel, forks are safe, and
dropped writers are collected (docs/architecture.md, "Failure semantics").

Every wait here has a timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import concurrent.futures
import errno
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import in_thread, results_gather_lost
from dist_utils import run_ranks
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_datastates import CheckpointSaveError, DataStatesWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

T = 30.0  # seconds: any wait longer than this is a hang


@pytest.fixture
def make_writer(tmp_path: Any) -> Iterator[Callable[..., DataStatesWriter]]:
    made: list[DataStatesWriter] = []

    def make(path: str | None = None, **kw: Any) -> DataStatesWriter:
        kw.setdefault("host_cache_size", "8MiB")
        kw.setdefault("chunk_size", "1MiB")
        kw.setdefault("prefault", False)
        w = DataStatesWriter(str(tmp_path / "default") if path is None else path, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        assert w.wait(timeout=T), "a save was left behind: close() would hang"
        w.close()


def healthy_save(w: DataStatesWriter, path: str) -> None:
    """An async save through ``w`` completes and loads back with the stock reader."""
    sd = {"x": torch.arange(1000, dtype=torch.float32), "step": 7}
    dcp.async_save(sd, storage_writer=w, checkpoint_id=path).result(timeout=T)
    out = {"x": torch.zeros(1000), "step": 0}
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["x"], sd["x"]) and out["step"] == 7


class ExplodingPlanner(DefaultSavePlanner):
    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        raise RuntimeError("set_up_planner exploded")


def _failing_save(kind: str, w: DataStatesWriter, path: str) -> concurrent.futures.Future[Any]:
    if kind == "duplicated-key":
        sd: dict[str, Any] = {"a.b": torch.ones(4), "a": {"b": torch.ones(4)}}
        return dcp.async_save(sd, storage_writer=w, checkpoint_id=path)
    if kind == "planner-raises":
        return dcp.async_save({"x": torch.ones(4)}, storage_writer=w, checkpoint_id=path,
                              planner=ExplodingPlanner())
    assert kind == "no-path"
    return dcp.async_save({"x": torch.ones(4)}, storage_writer=w)


FAILURES = {
    "duplicated-key": "duplicated flatten key",
    "planner-raises": "set_up_planner exploded",
    "no-path": "has no path",
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_save_failing_before_write_leaves_nothing_behind(
    tmp_path: Any, make_writer: Any, kind: str
) -> None:
    w: DataStatesWriter = make_writer(path="" if kind == "no-path" else None)
    fut = _failing_save(kind, w, str(tmp_path / "bad"))
    with pytest.raises(BaseException, match=FAILURES[kind]):
        fut.result(timeout=T)
    # The next save, wait() and the barrier neither hang nor re-raise what the future reported.
    healthy_save(w, str(tmp_path / "good"))
    assert w.wait(timeout=T)
    assert w.wait_captured(timeout=T)
    c = w.engine_counters()
    assert c["jobs"] == 0 and c["cache_used_bytes"] == 0, c
    assert not os.path.exists(tmp_path / "bad" / ".metadata")


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_one_process_gathers_and_pickles_while_its_data_flushes(
    tmp_path: Any, make_writer: Any, mode: str
) -> None:
    # One process, async_save: write_data hands DCP the results at placement, so DCP's gather
    # and the .metadata pickle overlap the flush; finish() waits for the data before the commit.
    # dcp.save keeps the results until the data is durable (nothing would end its job should
    # DCP stop in between).
    w: DataStatesWriter = make_writer(chunk_size="64KiB")
    w.engine.set_delays(0, 20_000, 3)  # up to 20 ms per write: the flush is still busy
    seen: list[bool] = []
    real_finish = w.finish

    def finish(metadata: Any, results: Any) -> None:
        job = w._context().job
        assert job is not None
        seen.append(job.finished or w.engine.is_done(job.engine_job))  # finished: durable
        real_finish(metadata, results)

    w.finish = finish  # type: ignore[method-assign]
    sd = {f"t{i}": torch.randn(20_000) for i in range(16)}
    want = {k: v.clone() for k, v in sd.items()}
    path = str(tmp_path / mode)
    if mode == "save":
        dcp.save(sd, storage_writer=w, checkpoint_id=path)
    else:
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=path)
        for v in sd.values():  # training goes on: the checkpoint keeps the state at the call
            v.add_(1)
        fut.result(timeout=T)
    assert seen == [mode == "save"], seen
    st = w.save_stats()[-1]
    assert st["t_done"] <= st["t_committed"]  # committed after the data was durable
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(out, checkpoint_id=path)
    assert all(torch.equal(out[k], want[k]) for k in want)


def test_a_flush_failing_after_the_results_commits_nothing(
    tmp_path: Any, make_writer: Any
) -> None:
    from dcp_datastates import _core

    w: DataStatesWriter = make_writer(chunk_size="64KiB")
    w.engine.set_delays(0, 20_000, 5)
    path = str(tmp_path / "late-eio")
    _core.set_write_fault("late-eio/__0_1", errno.EIO)  # the second data file only
    try:
        sd = {f"t{i}": torch.randn(20_000) for i in range(16)}
        with pytest.raises(BaseException, match="Input/output error"):
            dcp.async_save(sd, storage_writer=w, checkpoint_id=path).result(timeout=T)
    finally:
        _core.set_write_fault("", 0)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    healthy_save(w, path)  # the path is free again, and the writer keeps working


def test_a_retry_right_after_a_failed_async_save_finds_the_path_free(
    tmp_path: Any, make_writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The failed save's future completes before its thread lets go of the path's claim (the
    # release runs as that thread ends). Here that release is slowed down: a retry made as soon
    # as the caller saw the failure must wait for it, not fail with CheckpointBusyError.
    from dcp_datastates.save import contexts

    real_end = contexts.SaveContexts._end_context

    def slow_end(self: Any, ctx: Any) -> None:
        time.sleep(0.5)
        real_end(self, ctx)

    monkeypatch.setattr(contexts.SaveContexts, "_end_context", slow_end)
    w: DataStatesWriter = make_writer()
    path = str(tmp_path / "retried")
    with results_gather_lost():
        fut = dcp.async_save({"x": torch.randn(50_000)}, storage_writer=w, checkpoint_id=path)
        with pytest.raises(BaseException, match="gather of the write results was lost"):
            fut.result(timeout=T)
    healthy_save(w, path)  # at once


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_dcp_stopping_between_write_and_finish_releases_the_save(
    tmp_path: Any, make_writer: Any, mode: str
) -> None:
    # DCP fails after write_data returned (here: its gather of the results) and never calls
    # finish(): the save fails, nothing is committed, the path and the cache are free again.
    w: DataStatesWriter = make_writer()
    path = str(tmp_path / "lost")
    with results_gather_lost() as calls:
        with pytest.raises(BaseException, match="gather of the write results was lost"):
            if mode == "save":
                dcp.save({"x": torch.randn(50_000)}, storage_writer=w, checkpoint_id=path)
            else:
                dcp.async_save({"x": torch.randn(50_000)}, storage_writer=w,
                               checkpoint_id=path).result(timeout=T)
    assert calls["n"] == 1
    assert not os.path.exists(os.path.join(path, ".metadata"))
    if mode == "save":  # a retry from the same thread (the failed save's context ends there)
        dcp.save({"x": torch.ones(3)}, storage_writer=w, checkpoint_id=path)
        out = {"x": torch.zeros(3)}
        dcp.load(out, checkpoint_id=path)
        assert torch.equal(out["x"], torch.ones(3))
    else:
        healthy_save(w, path)
    assert w.wait(timeout=T)
    c = w.engine_counters()
    assert c["jobs"] == 0 and c["cache_used_bytes"] == 0, c


def test_unread_error_is_raised_once_at_the_barrier_and_next_save_kept(
    tmp_path: Any, make_writer: Any
) -> None:
    w: DataStatesWriter = make_writer()
    fut = _failing_save("planner-raises", w, str(tmp_path / "bad"))
    concurrent.futures.wait([fut], timeout=T)  # done, but its error is never read
    assert fut.done()
    # A later save is not refused because of the earlier failure ...
    healthy_save(w, str(tmp_path / "good"))
    # ... and the unread error comes out once, at the barrier, with its cause.
    with pytest.raises(CheckpointSaveError, match="before its data was written.*exploded"):
        w.wait_captured(timeout=T)
    assert w.wait_captured(timeout=T)
    assert w.wait(timeout=T)  # already reported: wait() does not raise it again


def test_unread_error_is_raised_once_by_wait(tmp_path: Any, make_writer: Any) -> None:
    # The plain call: nobody reads the futures and no explicit barrier runs; wait() tells.
    w: DataStatesWriter = make_writer()
    fut = _failing_save("planner-raises", w, str(tmp_path / "bad"))
    concurrent.futures.wait([fut], timeout=T)
    with pytest.raises(CheckpointSaveError, match="before its data was written.*exploded"):
        w.wait(timeout=T)
    assert w.wait(timeout=T)


def test_wait_raises_each_unseen_failure_once_whatever_failed(
    tmp_path: Any, make_writer: Any, monkeypatch: Any
) -> None:
    """wait()'s contract: every failed save whose error the caller has not seen (not read from
    its future, not raised by a barrier or an earlier wait) is raised once, one per call,
    oldest first, whatever failed: here a commit (.metadata: ENOSPC) after the data was
    durable, then a planner. One read from the future (exception() or result()) is not raised
    again. The future always carries it."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/.metadata.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    w: DataStatesWriter = make_writer()

    def commit_fails(name: str) -> concurrent.futures.Future[Any]:
        return dcp.async_save({"x": torch.ones(64)}, storage_writer=w,
                              checkpoint_id=str(tmp_path / name))

    unread = [commit_fails("commit"), _failing_save("planner-raises", w, str(tmp_path / "plan"))]
    concurrent.futures.wait(unread, timeout=T)
    assert all(f.done() for f in unread)
    with pytest.raises(CheckpointSaveError, match="commit failed on rank 0 after its data was "
                       "written: .*No space left on device.*metadata"):
        w.wait(timeout=T)
    with pytest.raises(CheckpointSaveError, match="before its data was written.*exploded"):
        w.wait(timeout=T)
    assert w.wait(timeout=T)  # each once
    assert w.wait_captured(timeout=T)  # nor again at the barrier
    with pytest.raises(BaseException, match="No space left on device"):
        unread[0].result(timeout=0)  # the future still carries it
    stats = [s for s in w.save_stats() if s["checkpoint_id"].endswith("commit")]
    assert stats and "No space left on device" in (stats[-1]["error"] or "")

    read = commit_fails("read-exception")
    concurrent.futures.wait([read], timeout=T)  # (an exception() already waiting when the save
    assert read.exception(timeout=0) is not None  # thread starts goes unnoticed: see wait())
    assert w.wait(timeout=T)
    read = commit_fails("read-result")
    with pytest.raises(BaseException, match="No space left on device"):
        read.result(timeout=T)
    assert w.wait(timeout=T)
    assert not any((tmp_path / n / ".metadata").exists()
                   for n in ("commit", "read-exception", "read-result"))
    monkeypatch.setattr(os, "fsync", real_fsync)
    healthy_save(w, str(tmp_path / "good"))  # the writer keeps working
    assert w.wait_captured(timeout=T)
    healthy_save(w, str(tmp_path / "good"))


def test_error_read_with_exception_is_not_raised_again(tmp_path: Any, make_writer: Any) -> None:
    w: DataStatesWriter = make_writer()
    fut = _failing_save("duplicated-key", w, str(tmp_path / "bad"))
    concurrent.futures.wait([fut], timeout=T)
    assert fut.exception(timeout=T) is not None
    assert w.wait(timeout=T)
    assert w.wait_captured(timeout=T)


def test_discarded_staged_dict_releases_its_job(make_writer: Any) -> None:
    w: DataStatesWriter = make_writer()
    staged = w.stage({"x": torch.ones(1000)})
    assert w.engine_counters()["jobs"] == 1
    del staged  # no save will ever run it
    gc.collect()
    assert w.wait(timeout=T)
    assert w.engine_counters()["jobs"] == 0
    assert w.wait_captured(timeout=T)  # nobody saved it: nothing to report


def test_process_executor_is_refused_clearly(tmp_path: Any, make_writer: Any) -> None:
    w: DataStatesWriter = make_writer()
    with pytest.raises(ValueError, match="AsyncCheckpointerType.PROCESS"):
        dcp.async_save({"x": torch.ones(4)}, storage_writer=w, checkpoint_id=str(tmp_path / "p"),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    assert w.engine_counters()["jobs"] == 0
    healthy_save(w, str(tmp_path / "good"))


def test_sync_save_without_tensors_does_not_hang(tmp_path: Any, make_writer: Any) -> None:
    w: DataStatesWriter = make_writer()
    path = str(tmp_path / "no-tensors")
    in_thread(lambda: dcp.save({"step": 1, "name": "x"}, storage_writer=w, checkpoint_id=path))
    out = {"step": 0, "name": ""}
    dcp.load(out, checkpoint_id=path)
    assert out == {"step": 1, "name": "x"}


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path: Any, make_writer: Any) -> None:
    path = str(tmp_path / "c")
    first: DataStatesWriter = make_writer()
    in_thread(lambda: dcp.save({"x": torch.ones(8)}, storage_writer=first, checkpoint_id=path))
    w: DataStatesWriter = make_writer(overwrite=False)
    with pytest.raises(BaseException, match="already exists and .*overwrite=False"):
        in_thread(lambda: dcp.save({"x": torch.zeros(8)}, storage_writer=w, checkpoint_id=path))
    with pytest.raises(BaseException, match="overwrite=False"):
        dcp.async_save({"x": torch.zeros(8)}, storage_writer=w, checkpoint_id=path).result(
            timeout=T
        )
    out = {"x": torch.zeros(8)}
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["x"], torch.ones(8))  # the old checkpoint is untouched
    healthy_save(w, str(tmp_path / "fresh"))  # a new path is fine


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _save_three_ways(w: DataStatesWriter, root: str) -> None:
    in_thread(lambda: dcp.save({"x": torch.ones(16)}, storage_writer=w))  # another thread
    dcp.save({"x": torch.ones(16)}, storage_writer=w, checkpoint_id=f"{root}/m")  # this thread
    dcp.async_save({"x": torch.ones(16)}, storage_writer=w,
                   checkpoint_id=f"{root}/a").result(timeout=T)


def test_dropped_writer_is_collected_and_its_engine_closed(tmp_path: Any) -> None:
    before = _native_threads()
    w = DataStatesWriter(str(tmp_path / "c"), host_cache_size="4MiB", prefault=False,
                         copy_threads=2, flush_threads=2)
    engine = w.engine
    assert _native_threads() >= before + 4
    _save_three_ways(w, str(tmp_path))
    # DCP's executor thread holds the writer (its work item's arguments) until it ends, which
    # is after the save's future completed: the writer is ours to drop once DCP let go of it.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        t.name.startswith("AsyncCheckpointExecutor") for t in threading.enumerate()
    ):
        time.sleep(0.01)
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())
    assert engine.closed
    # DCP's executor thread (and its pool) end on their own schedule after the future is done:
    # what must not stay is a thread of ours.
    deadline = time.monotonic() + 10
    while _native_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _native_threads() <= before


# --------------------------------------------------------------------------------------------
# Two ranks


def _two_rank_body(rank: int, world_size: int, root: str) -> dict[str, int]:
    w = DataStatesWriter(os.path.join(root, "default"), host_cache_size="4MiB", prefault=False)
    # use_collectives=False on 2 ranks is refused on every rank; nothing is left behind.
    fut = dcp.async_save({"x": torch.ones(4)}, storage_writer=w,
                         checkpoint_id=os.path.join(root, "nc"), use_collectives=False)
    try:
        fut.result(timeout=T)
        raise AssertionError("use_collectives=False on 2 ranks was accepted")
    except BaseException as e:  # noqa: BLE001
        if "use_collectives=False" not in str(e):
            raise
    # One replicated tensor: DCP's dedup gives it to one rank; the other plans no tensor item.
    sd = {"replicated": torch.arange(64, dtype=torch.float32), "step": 3}
    dcp.save(sd, storage_writer=w, checkpoint_id=os.path.join(root, "rep"))
    dcp.async_save(sd, storage_writer=w, checkpoint_id=os.path.join(root, "rep2")).result(
        timeout=T
    )
    assert w.wait(timeout=T)
    out = {"replicated": torch.zeros(64), "step": 0}
    dcp.load(out, checkpoint_id=os.path.join(root, "rep2"))
    assert torch.equal(out["replicated"], sd["replicated"]) and out["step"] == 3
    c = w.engine_counters()
    w.close()
    dist.barrier()
    return {"jobs": c["jobs"], "cache_used_bytes": c["cache_used_bytes"]}


def test_two_ranks_refusal_and_replicated_only_state(tmp_path: Any) -> None:
    results = run_ranks(_two_rank_body, str(tmp_path), tmp_path=tmp_path, timeout_s=120)
    assert results == [{"jobs": 0, "cache_used_bytes": 0}] * 2


# --------------------------------------------------------------------------------------------
# fork


def run_script(code: str, timeout: float = 120) -> str:
    """Runs ``code`` in a fresh interpreter; fails on a non-zero exit or a hang."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, cwd=os.path.dirname(__file__))
    assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout


def test_child_cannot_use_an_inherited_writer_and_exits_cleanly(tmp_path: Any) -> None:
    out = run_script(f"""
        import os, sys, time, torch, torch.distributed.checkpoint as dcp, warnings
        warnings.simplefilter("ignore")
        from dcp_datastates import DataStatesWriter
        root = {str(tmp_path)!r}
        w = DataStatesWriter(root, host_cache_size="4MiB", prefault=False, capture="lazy")
        idle = DataStatesWriter(root, host_cache_size="1MiB", prefault=False)
        sd = {{"x": torch.arange(300_000, dtype=torch.float32)}}
        w.engine.pause_copies(True)   # a save in flight at the fork
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=root + "/inflight")
        time.sleep(0.3)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                idle.close()   # an idle writer: no crash, nothing joined
                w.close()      # a busy one: no hang
                calls = (lambda: dcp.async_save(sd, storage_writer=w, checkpoint_id=root + "/c"),
                         lambda: w.wait_captured(), lambda: w.engine.counters())
                for call in calls:
                    try:
                        call()
                        code = 3
                    except BaseException as e:
                        if str(os.getppid()) not in str(e):
                            print("unclear:", e); code = 4
            except BaseException as e:
                print("child failed:", repr(e)); code = 5
            sys.stdout.flush()
            sys.exit(code)     # a normal exit: finalizers and atexit run in the child
        deadline = time.time() + 60
        while time.time() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9); print("child hung"); sys.exit(1)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        w.engine.pause_copies(False)
        fut.result(timeout=60)    # the parent is unaffected
        out = {{"x": torch.zeros(300_000)}}
        dcp.load(out, checkpoint_id=root + "/inflight")
        assert torch.equal(out["x"], sd["x"])
        w.close(); idle.close()
        print("OK")
    """)
    assert "OK" in out, out


def test_dataloader_fork_loop_during_async_saves(tmp_path: Any) -> None:
    out = run_script(f"""
        import os, torch, torch.distributed.checkpoint as dcp, warnings
        warnings.simplefilter("ignore")
        from torch.utils.data import DataLoader, TensorDataset
        from dcp_datastates import DataStatesWriter
        root = {str(tmp_path)!r}
        w = DataStatesWriter(root, host_cache_size="2MiB", chunk_size="256KiB", prefault=False)
        w.engine.set_delays(2000, 2000, seed=1)  # keep saves in flight while workers fork
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w.protect(opt)
        data = TensorDataset(torch.randn(64, 256))
        parent = os.getpid()

        def worker_init(_: int) -> None:
            # Code in a worker touching the inherited writer (a `with writer:` block, an atexit
            # hook) must neither hang nor act on the parent's saves.
            w.close()
            try:
                w.wait_captured()
            except RuntimeError as e:
                assert str(parent) in str(e), e
            else:
                raise AssertionError("a forked worker used the parent's writer")

        futs = []
        for epoch in range(4):
            futs.append(dcp.async_save({{"model": model.state_dict(), "epoch": epoch}},
                                       storage_writer=w, checkpoint_id=f"{{root}}/e{{epoch}}"))
            loader = DataLoader(data, batch_size=16, num_workers=2, worker_init_fn=worker_init,
                                multiprocessing_context="fork", timeout=60)
            for (x,) in loader:
                model(x).sum().backward()
                opt.step(); opt.zero_grad()
        for f in futs:
            f.result(timeout=60)
        assert w.wait(timeout=60)
        w.close()
        print("OK")
    """, timeout=240)
    assert "OK" in out, out
