"""The plain call (``dcp.async_save(state, storage_writer=writer)``, nothing else) keeps its
promises: exact snapshots, bounded memory, clear errors instead of crashes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, in_thread, zeros_like_state

from dcp_datastates import DataStatesWriter
from dcp_datastates.save import barrier

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_optimizers_are_known_from_their_first_step() -> None:
    model, opt = _mlp()
    _step(model, opt)
    assert opt in barrier.known_optimizers()
    owners = barrier.owned_storages([opt])
    for p in model.parameters():
        assert owners[p.untyped_storage().data_ptr()] == id(opt)


def test_step_barrier_opt_out_takes_everything_at_the_call(
    tmp_path: Any, writer_factory: Any
) -> None:
    model, opt = _mlp()
    _step(model, opt)
    w: DataStatesWriter = writer_factory(capture="owned", step_barrier=False)
    w.engine.pause_copies(True)  # nothing may depend on the copy threads
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    ref = copy.deepcopy(sd)
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=str(tmp_path / "c"))
    _step(model, opt)  # not held back: nothing is lazy without the barrier
    w.engine.pause_copies(False)
    fut.result(timeout=60)
    assert w.save_stats()[-1]["lazy_bytes"] == 0
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert_state_equal(ref, out)


def _save_then_change_outside_step(
    w: DataStatesWriter, path: str, key: str = "model", after_step: Any = None
) -> tuple[torch.nn.Module, Any]:
    """An owned parameter changed in place outside step() before its lazy copy: the automatic
    barrier of the next step fails that save (training goes on). Returns the model and the
    save's future; ``after_step`` runs right after that step."""
    model, opt = _mlp()
    _step(model, opt)
    w.engine.pause_copies(True)
    fut = dcp.async_save({key: model.state_dict()}, storage_writer=w, checkpoint_id=path)
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # an in-place change outside step(), before the copy
    w.engine.pause_copies(False)
    _step(model, opt)  # the automatic barrier finds the change: the save fails, step() goes on
    if after_step is not None:
        after_step()
    return model, fut


def test_parameter_changed_outside_step_fails_the_save_not_training(
    tmp_path: Any, writer_factory: Any
) -> None:
    w: DataStatesWriter = writer_factory(capture="owned")
    path = str(tmp_path / "c")
    model, fut = _save_then_change_outside_step(w, path)
    with pytest.raises(BaseException, match=r"0\.weight.*modified in place"):
        fut.result(timeout=60)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    # The writer stays usable and the next save is exact.
    ref = copy.deepcopy({"model": model.state_dict()})
    dcp.async_save({"model": model.state_dict()}, storage_writer=w, checkpoint_id=path).result(60)
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(ref, out)


def test_a_save_failed_before_its_thread_started_ends_instead_of_hanging(
    tmp_path: Any, writer_factory: Any, monkeypatch: Any
) -> None:
    # A race CI hit: the step barrier failed the staged job before DCP's save thread first
    # iterated the staged dict. That thread then found no job of its own and waited, in
    # set_up_storage_writer, for every staged save -- its own included -- forever.
    from dcp_datastates.save import jobs

    failed = threading.Event()
    real_items = jobs.StagedStateDict.items

    def late_items(self: Any) -> Any:
        if threading.get_ident() != self._stage_thread:
            assert failed.wait(60)  # the save thread starts only after the job failed
        return real_items(self)

    monkeypatch.setattr(jobs.StagedStateDict, "items", late_items)
    w: DataStatesWriter = writer_factory(capture="owned")
    path = str(tmp_path / "c")
    model, fut = _save_then_change_outside_step(w, path, after_step=failed.set)
    with pytest.raises(BaseException, match=r"0\.weight.*modified in place"):
        fut.result(timeout=60)
    assert not os.path.exists(os.path.join(path, ".metadata"))
    ref = copy.deepcopy({"model": model.state_dict()})
    dcp.async_save({"model": model.state_dict()}, storage_writer=w, checkpoint_id=path).result(60)
    assert w.wait(timeout=60)
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(ref, out)


def test_a_failed_save_keeps_nothing_alive(tmp_path: Any, writer_factory: Any) -> None:
    # A failed save's error refers (through its traceback) to the staged dict; the staged
    # dict's finalizer used to hold the job strongly, so the cycle never died: every failed
    # save kept its records, staged dict and error forever.
    import gc

    from dcp_datastates.save.capture import CapturedTensor

    w: DataStatesWriter = writer_factory(capture="owned")
    _model, fut = _save_then_change_outside_step(w, str(tmp_path / "c"), key="leakprobe")
    with pytest.raises(BaseException, match="modified in place"):
        fut.result(timeout=60)
    assert w.wait(timeout=60)
    del fut
    gc.collect()
    alive = [o for o in gc.get_objects()
             if isinstance(o, CapturedTensor) and o.name.startswith("leakprobe")]
    assert not alive, f"{len(alive)} records of the failed save are still alive"


def test_freed_storage_of_a_lazy_tensor_is_an_error_not_a_crash(tmp_path: Any) -> None:
    # In a child process: before the fix the copy thread read freed memory (SIGSEGV).
    code = textwrap.dedent(
        f"""
        import warnings; warnings.simplefilter("ignore")
        import torch, torch.distributed.checkpoint as dcp
        from dcp_datastates import DataStatesWriter
        w = DataStatesWriter({str(tmp_path)!r}, host_cache_size="256MiB", capture="lazy")
        t = torch.randn(16 * 1024 * 1024)  # 64 MiB: its own mapping, unmapped when freed
        w.engine.pause_copies(True)
        fut = dcp.async_save({{"t": t}}, storage_writer=w, checkpoint_id={str(tmp_path / "c")!r})
        t.untyped_storage().resize_(0)  # FSDP-style: the storage is released after the save
        w.engine.pause_copies(False)
        try:
            fut.result(timeout=60)
        except BaseException as e:
            msg = str(e)
            assert "'t'" in msg and ("freed" in msg or "no longer readable" in msg), msg
            print("SAVE FAILED CLEANLY")
        w.close()
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SAVE FAILED CLEANLY" in r.stdout
    assert not os.path.exists(tmp_path / "c" / ".metadata")


@pytest.mark.parametrize("url", [False, True], ids=["local", "fsspec"])
def test_tensor_larger_than_the_cache_is_spilled_not_cloned(
    tmp_path: Any, writer_factory: Any, url: bool
) -> None:
    # Taken at the call (eager), 3x the cache: spilled to an anonymous file, exact afterwards.
    w: DataStatesWriter = writer_factory(
        capture="eager", host_cache_size="1MiB", chunk_size="256KiB"
    )
    sd = {"big": torch.randn(3 * 1024 * 1024 // 4), "small": torch.arange(10)}
    ref = copy.deepcopy(sd)
    path = f"file://{tmp_path / 'c'}" if url else str(tmp_path / "c")
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=path)
    sd["big"].fill_(-1)  # the save call returned: the caller may change everything
    fut.result(timeout=60)
    st = w.save_stats()[-1]
    assert st["lazy_bytes"] == 0 and st["error"] is None
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert_state_equal(ref, out)
    from dcp_datastates import verify_checkpoint

    assert verify_checkpoint(str(tmp_path / "c")).ok


def test_spill_through_a_sequential_fsspec_store(writer_factory: Any) -> None:
    w: DataStatesWriter = writer_factory(
        capture="eager", host_cache_size="1MiB", chunk_size="256KiB"
    )
    sd = {"big": torch.randn(3 * 1024 * 1024 // 4), "n": 3}
    ref = copy.deepcopy(sd)
    fut = dcp.async_save(sd, storage_writer=w, checkpoint_id="memory://plain-call/spill")
    sd["big"].zero_()
    fut.result(timeout=60)
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id="memory://plain-call/spill")
    assert_state_equal(ref, out)


def test_a_stored_error_raised_again_stays_detached_from_the_raising_frames() -> None:
    """reraisable: what the save thread raises when a barrier failed the save first is a copy
    (same type, message, attributes), so the stored error never picks up that thread's frames
    (whose locals are the save's records) as its traceback or context."""
    from dcp_datastates.errors import CaptureError, CheckpointSaveError, reraisable

    stored = CaptureError("save to /c failed: tensor 'w' modified in place")
    stored.rank = 3  # type: ignore[attr-defined]
    records = ["a record"]
    try:
        try:
            raise CheckpointSaveError("cannot place an entry")
        except CheckpointSaveError:
            raise reraisable(stored) from None
    except CaptureError as got:
        assert got is not stored and str(got) == str(stored) and got.rank == 3
    assert stored.__traceback__ is None and stored.__context__ is None
    del records

    class Odd(CheckpointSaveError):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    odd = Odd(1, 2)
    copy_ = reraisable(odd)  # args ("1/2",) do not fit its constructor: the message is kept
    assert isinstance(copy_, CheckpointSaveError) and str(copy_) == "1/2"


def _inference_state() -> dict[str, Any]:
    """Tensors made under ``torch.inference_mode()``: they have no version counter, and
    ``_version`` on them raises outside that mode."""
    torch.manual_seed(0)
    with torch.inference_mode():
        return {
            "w": torch.randn(64, 16),
            "view": torch.arange(48, dtype=torch.float32).reshape(6, 8).t(),  # non-contiguous
            "ids": torch.arange(10),
            "half": torch.randn(33).to(torch.bfloat16),
            "empty": torch.empty(0, 3),
            "model": torch.nn.Linear(8, 4).state_dict(),
        }


@pytest.mark.parametrize("capture", ["auto", "eager", "lazy"])
@pytest.mark.parametrize("call", ["save", "async_save"])
def test_inference_tensors_save_exactly_in_every_path(
    tmp_path: Any, writer_factory: Any, capture: str, call: str
) -> None:
    """Inference tensors save and load bit for bit through dcp.save (planned tensors written
    from where they are) and async_save in every capture mode. They are never copied lazily
    (a change under inference_mode would go unseen: no version counter): a change right
    after the call, with the copy threads held, stays out of the checkpoint."""
    sd = _inference_state()
    ref = copy.deepcopy(sd)
    w: DataStatesWriter = writer_factory(capture=capture)
    path = str(tmp_path / "c")
    if call == "save":
        in_thread(lambda: dcp.save(sd, storage_writer=w, checkpoint_id=path))
    else:
        w.engine.pause_copies(True)
        fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=path)
        with torch.inference_mode():
            sd["w"].add_(1.0)
            sd["model"]["weight"].zero_()
        w.engine.pause_copies(False)
        fut.result(timeout=60)
    out = zeros_like_state(ref)
    dcp.load(out, checkpoint_id=path)
    assert_state_equal(ref, out)
