"""Resume-correctness of real training loops: DDP, FSDP2 and ZeRO-1 on 2 gloo ranks.

Each case trains a few steps, saves twice with the writer under test (reusing one
writer), builds a fresh model and optimizer, loads with *stock* ``dcp.load`` (no plugin
code on the read side), trains on, and checks bit-identity:

1. the loaded state equals a clone taken at the save call (in the async variant training
   continues while the save is in flight, so this is the lazy-capture check), and
2. after two more steps the resumed run equals the run that never stopped.

Writers: ``FileSystemWriter`` (validates the harness itself) and ``DataStatesWriter``
with a cache that holds the whole checkpoint ("64MiB") and one far smaller than a rank's
share of it ("256KiB", forcing backpressure). The model's state is ~1.5 MB (params +
Adam moments) and no single tensor exceeds 256 KiB.

Also here: two async saves in flight on one writer; FSDP2 shards loaded into a plain
single-process model (resharding); a negative control proving the snapshot comparison
catches a writer that reads tensors late; and the harness's own failure reporting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from dist_utils import RankFailure, run_ranks  # tests/ is on sys.path (pytest rootdir insertion)
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.tensor import DTensor

SAVE_A = 3  # first checkpoint after this many steps
SAVE_B = 5  # second checkpoint (same writer) after this many steps
EXTRA = 2  # steps trained after the second save
TOTAL = SAVE_B + EXTRA


# --------------------------------------------------------------------------- fixtures


def _require_datastates() -> None:
    mod = pytest.importorskip("dcp_datastates", reason="dcp_datastates core not importable")
    if not hasattr(mod, "DataStatesWriter"):
        pytest.skip("dcp_datastates.DataStatesWriter not available yet")


# --------------------------------------------------------------------------- model and data


class Net(nn.Module):
    """A 5-layer MLP: 123,680 fp32 params (~0.5 MB; ~1.5 MB with Adam state)."""

    def __init__(self) -> None:
        super().__init__()
        dims = [32, 192, 192, 192, 192, 32]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        out: torch.Tensor = self.layers[-1](x)
        return out


def new_net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, rank) data, independent of any global RNG."""
    g = torch.Generator().manual_seed(10_000 + 97 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, torch.sin(3 * x)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    opt.step()


# --------------------------------------------------------------------------- tree helpers


def clone_tree(obj: Any) -> Any:
    """Deep copy of a state dict whose tensors are fresh clones (DTensors stay DTensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_tree(v) for v in obj)
    return obj


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _iter_tensors(v)


def assert_tree_equal(actual: Any, expected: Any, where: str = "") -> None:
    """Bit-exact comparison of nested dicts/lists of tensors and plain values."""
    if isinstance(expected, DTensor):
        assert isinstance(actual, DTensor), f"{where}: expected DTensor, got {type(actual)}"
        assert actual.placements == expected.placements, f"{where}: placements differ"
        assert actual.shape == expected.shape, f"{where}: global shape differs"
        actual, expected = actual.to_local(), expected.to_local()
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected tensor, got {type(actual)}"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        if not torch.equal(actual, expected):
            diff = (actual.double() - expected.double()).abs().max().item()
            raise AssertionError(f"{where}: tensors differ (max abs diff {diff:.3g})")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected dict, got {type(actual)}"
        assert set(actual) == set(expected), (
            f"{where}: keys differ: missing {set(expected) - set(actual)}, "
            f"extra {set(actual) - set(expected)}"
        )
        for k in expected:
            assert_tree_equal(actual[k], expected[k], f"{where}.{k}" if where else str(k))
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple), f"{where}: expected sequence, got {type(actual)}"
        assert len(actual) == len(expected), f"{where}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_tree_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def tree_differs(a: Any, b: Any) -> bool:
    try:
        assert_tree_equal(a, b)
    except AssertionError:
        return True
    return False


# --------------------------------------------------------------------------- writers


class UnprotectedLazyWriter(dcp.FileSystemWriter):
    """Negative control: captures nothing at the save call and reads the live tensors
    half a second later, so training steps taken meanwhile leak into the checkpoint."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(0.5)
        return super().write_data(plan, planner)


def make_writer(kind: str, path: Path) -> StorageWriter:
    if kind == "fs":
        return dcp.FileSystemWriter(path)
    if kind == "unprotected-lazy":
        return UnprotectedLazyWriter(path)
    from dcp_datastates import DataStatesWriter  # type: ignore[attr-defined,unused-ignore]

    size = kind.split("-", 1)[1]
    writer: StorageWriter = DataStatesWriter(path, host_cache_size=size)
    return writer


def protect(writer: StorageWriter, opt: torch.optim.Optimizer) -> None:
    """Make opt.step wait for in-flight captures (DataStatesWriter only)."""
    hook = getattr(writer, "protect", None)
    if hook is not None:
        hook(opt)


def close_writer(writer: StorageWriter) -> None:
    close = getattr(writer, "close", None)
    if callable(close):
        close()


def upload_future(resp: Any) -> Future[Any]:
    """dcp.async_save returns a Future, or an AsyncSaveResponse when the stager is async."""
    fut = getattr(resp, "upload_completion", resp)
    assert isinstance(fut, Future), f"unexpected async_save result {type(resp)}"
    return fut


# --------------------------------------------------------------------------- the generic loop


class Loop:
    """One parallelism: how to build model+optimizer and get/put their state dict."""

    def build(self, seed: int, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def get_state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    def empty_state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """A state dict of the right structure to load into (fresh model/optimizer)."""
        return self.get_state(model, opt)

    def set_state(self, model: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class DDPLoop(Loop):
    def build(self, seed: int, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(new_net(seed))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)


class FSDP2Loop(Loop):
    def build(self, seed: int, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.fsdp import fully_shard

        model = new_net(seed)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)


class ZeRO1Loop(Loop):
    """DDP model (params replicated) + ZeroRedundancyOptimizer.

    Each rank saves only the optimizer state of the parameters it owns, keyed by FQN, so
    no rank ever gathers the optimizer state (no ``consolidate_state_dict``). The
    learning rate is constant, so param_groups are not saved.
    """

    def build(self, seed: int, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(new_net(seed))
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
        return model, opt

    @staticmethod
    def inner(model: nn.Module) -> nn.Module:
        """The module DDP wraps."""
        inner = model.module
        assert isinstance(inner, nn.Module)
        return inner

    @staticmethod
    def _owned(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, nn.Parameter]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        assert isinstance(opt, ZeroRedundancyOptimizer)
        names = {p: n for n, p in ZeRO1Loop.inner(model).named_parameters()}
        return {names[p]: p for group in opt.optim.param_groups for p in group["params"]}

    def get_state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        owned = self._owned(model, opt)
        local_state = opt.optim.state  # type: ignore[attr-defined]
        optim = {fqn: dict(local_state[p]) for fqn, p in owned.items() if p in local_state}
        return {"model": self.inner(model).state_dict(), "optim": optim}

    def empty_state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        owned = self._owned(model, opt)
        optim = {
            fqn: {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            for fqn, p in owned.items()
        }
        return {"model": self.inner(model).state_dict(), "optim": optim}

    def set_state(self, model: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        self.inner(model).load_state_dict(sd["model"])
        owned = self._owned(model, opt)
        for fqn, st in sd["optim"].items():
            opt.optim.state[owned[fqn]] = dict(st)  # type: ignore[attr-defined]


LOOPS: dict[str, Callable[[], Loop]] = {"ddp": DDPLoop, "fsdp2": FSDP2Loop, "zero1": ZeRO1Loop}


def _save(
    mode: str,
    writer: StorageWriter,
    state: dict[str, Any],
    ckpt: Path,
    pg: dist.ProcessGroup,
) -> Future[Any] | None:
    if mode == "sync":
        dcp.save(state, storage_writer=writer, checkpoint_id=ckpt, process_group=pg)
        return None
    # "async" and "async-overlap"
    return upload_future(
        dcp.async_save(state, storage_writer=writer, checkpoint_id=ckpt, process_group=pg)
    )


def _fresh_load(
    loop: Loop, rank: int, ckpt: Path, pg: dist.ProcessGroup
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Fresh model/optimizer (different init), state loaded with stock dcp.load."""
    model, opt = loop.build(seed=1234, rank=rank)
    target = loop.empty_state(model, opt)
    dcp.load(target, checkpoint_id=ckpt, process_group=pg)
    loop.set_state(model, opt, target)
    return model, opt


def _resume_body(
    rank: int, world_size: int, loop_name: str, kind: str, mode: str, root: str
) -> dict[str, Any]:
    loop = LOOPS[loop_name]()
    ckpt_root = Path(root)
    pg = dist.new_group(backend="gloo")  # checkpoint collectives off the training group
    overlap = mode == "async-overlap"
    # Two saves in flight at once each need their own group: DCP runs each async save's
    # collectives in its own thread, and two threads sharing one group could interleave
    # their collectives differently on different ranks.
    save_pgs = [pg, dist.new_group(backend="gloo")] if overlap else [pg, pg]

    model, opt = loop.build(seed=0, rank=rank)
    writer = make_writer(kind, ckpt_root)
    if mode != "sync":
        protect(writer, opt)

    ckpt_a, ckpt_b = ckpt_root / f"step-{SAVE_A}", ckpt_root / f"step-{SAVE_B}"
    snap_a = snap_b = None
    futures: list[Future[Any]] = []
    t_blocked = 0.0
    for step in range(TOTAL):
        train_step(model, opt, step, rank)
        done = step + 1
        if done in (SAVE_A, SAVE_B):
            if futures and not overlap:
                futures[-1].result()  # previous save durable before the next one starts
            state = loop.get_state(model, opt)
            snap = clone_tree(state)
            t0 = time.perf_counter()
            which = 0 if done == SAVE_A else 1
            fut = _save(mode, writer, state, (ckpt_a, ckpt_b)[which], save_pgs[which])
            t_blocked += time.perf_counter() - t0
            if fut is not None:
                futures.append(fut)
            if done == SAVE_A:
                snap_a = snap
            else:
                snap_b = snap
    # training went on while the saves were in flight; now make them durable
    for fut in futures:
        fut.result()
    stats = writer.save_stats() if hasattr(writer, "save_stats") else None  # type: ignore[attr-defined]
    close_writer(writer)
    final = clone_tree(loop.get_state(model, opt))
    assert tree_differs(final, snap_b), "training after the save did not change the state"
    assert tree_differs(snap_a, snap_b)

    # each checkpoint holds the state as of its save call
    for ckpt, snap in ((ckpt_a, snap_a), (ckpt_b, snap_b)):
        assert (ckpt / ".metadata").is_file()
        assert not (ckpt / ".datastates.incomplete").exists(), "marker left after commit"
        fresh_model, fresh_opt = _fresh_load(loop, rank, ckpt, pg)
        assert_tree_equal(loop.get_state(fresh_model, fresh_opt), snap, f"rank{rank}:{ckpt.name}")

    # resume from B, train the same steps, compare with the run that never stopped
    fresh_model, fresh_opt = _fresh_load(loop, rank, ckpt_b, pg)
    for step in range(SAVE_B, TOTAL):
        train_step(fresh_model, fresh_opt, step, rank)
    assert_tree_equal(loop.get_state(fresh_model, fresh_opt), final, f"rank{rank}:resumed")

    if loop_name == "zero1":
        # each rank saved only what it owns; together they cover every parameter
        owned = sorted(ZeRO1Loop._owned(model, opt))
        all_owned: list[list[str]] = [[] for _ in range(world_size)]
        dist.all_gather_object(all_owned, owned)
        flat = [n for names in all_owned for n in names]
        assert len(flat) == len(set(flat)), "a parameter is owned twice"
        assert set(flat) == {n for n, _ in ZeRO1Loop.inner(model).named_parameters()}
        assert all(all_owned), "a rank owns nothing: the test would not exercise sharding"
    dist.barrier()
    return {"blocked_s": t_blocked, "stats": stats}


def _check_results(root: Path, writer_kind: str, results: list[dict[str, Any]]) -> None:
    assert len(results) == 2
    # stock reader view: both checkpoints complete and loadable by metadata alone
    for name in (f"step-{SAVE_A}", f"step-{SAVE_B}"):
        md = dcp.FileSystemReader(root / name).read_metadata()
        assert any(k.startswith("model.") for k in md.state_dict_metadata)
        assert any(k.startswith("optim.") for k in md.state_dict_metadata)
    if writer_kind.startswith("ds-"):
        for res in results:
            stats = res["stats"]
            assert stats is not None
            assert len(stats) == 2
            for s in stats:
                assert s["error"] is None
                assert s["bytes"] > 0
                assert s["t_stage"] <= s["t_captured"] <= s["t_done"]


# (writer, mode) combinations: the stock writer once per loop (it validates the harness), our
# writer with a cache that holds the checkpoint in both modes, and with a cache far smaller
# than it (every save streams through the cache) asynchronously, the harder case.
RESUME_CASES = [("fs", "sync"), ("ds-64MiB", "sync"), ("ds-64MiB", "async"), ("ds-256KiB", "async")]


@pytest.mark.parametrize("loop_name", list(LOOPS))
@pytest.mark.parametrize(("writer_kind", "mode"), RESUME_CASES)
def test_resume_bit_identical(loop_name: str, writer_kind: str, mode: str, tmp_path: Path) -> None:
    if writer_kind.startswith("ds-"):
        _require_datastates()
    root = tmp_path / "ckpt"
    results = run_ranks(
        _resume_body, loop_name, writer_kind, mode, str(root), tmp_path=tmp_path, timeout_s=90
    )
    _check_results(root, writer_kind, results)


@pytest.mark.parametrize("loop_name", list(LOOPS))
@pytest.mark.parametrize("writer_kind", ["ds-64MiB", "ds-256KiB"])
def test_two_saves_in_flight(loop_name: str, writer_kind: str, tmp_path: Path) -> None:
    """One writer, the second async_save issued before the first is durable."""
    _require_datastates()
    root = tmp_path / "ckpt"
    results = run_ranks(
        _resume_body,
        loop_name,
        writer_kind,
        "async-overlap",
        str(root),
        tmp_path=tmp_path,
        timeout_s=90,
    )
    _check_results(root, writer_kind, results)


def test_lazy_capture_check_catches_unprotected_writer(tmp_path: Path) -> None:
    """The snapshot comparison must fail for a writer that reads tensors late."""
    with pytest.raises(RankFailure, match="tensors differ"):
        run_ranks(
            _resume_body,
            "ddp",
            "unprotected-lazy",
            "async",
            str(tmp_path / "ckpt"),
            tmp_path=tmp_path,
            timeout_s=90,
        )


# --------------------------------------------------------------------------- FSDP2 -> 1 process


def _fsdp2_save_body(rank: int, world_size: int, kind: str, root: str) -> dict[str, Any] | None:
    loop = FSDP2Loop()
    pg = dist.new_group(backend="gloo")
    model, opt = loop.build(seed=0, rank=rank)
    for step in range(SAVE_A):
        train_step(model, opt, step, rank)
    writer = make_writer(kind, Path(root))
    dcp.save(
        loop.get_state(model, opt),
        storage_writer=writer,
        checkpoint_id=Path(root) / "full",
        process_group=pg,
    )
    close_writer(writer)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }
    dist.barrier()
    return clone_tree(full) if rank == 0 else None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", ["fs", "ds-64MiB"])
def test_fsdp2_checkpoint_loads_into_single_process(kind: str, tmp_path: Path) -> None:
    if kind.startswith("ds-"):
        _require_datastates()
    root = tmp_path / "ckpt"
    gathered = run_ranks(_fsdp2_save_body, kind, str(root), tmp_path=tmp_path, timeout_s=90)[0]
    assert gathered is not None

    # resharding: 2 FSDP2 shards -> plain tensors in this (non-distributed) process
    model = new_net(seed=4321)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / "full", no_dist=True)
    assert_tree_equal(model_sd, gathered["model"], "model")
    assert_tree_equal(optim_sd, gathered["optim"], "optim")
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), gathered["model"][name]), name


# --------------------------------------------------------------------------- the harness itself


def _failing_body(rank: int, world_size: int, how: str) -> None:
    if rank == 1:
        if how == "exception":
            raise ValueError("boom on purpose")
        if how == "base-exception":  # like DCP's CheckpointException
            raise CheckpointException("boom on purpose", {})
        time.sleep(600)  # how == "hang"
        return
    if how != "hang":
        dist.barrier()  # rank 0 is stuck here until the harness terminates it


@pytest.mark.parametrize("how", ["exception", "base-exception"])
def test_harness_reports_failing_rank(tmp_path: Path, how: str) -> None:
    with pytest.raises(RankFailure, match=r"rank 1 raised") as info:
        run_ranks(_failing_body, how, tmp_path=tmp_path, timeout_s=60)
    assert "boom on purpose" in str(info.value)
    assert "_failing_body" in str(info.value)  # the traceback came along
    text = str(info.value)
    # the root cause comes first; rank 0 then fails in its barrier or is terminated
    assert text.index("rank 1 raised") < text.find("rank 0") or "rank 0" not in text


def test_harness_times_out_a_hung_rank(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 still running after 5s"):
        run_ranks(_failing_body, "hang", tmp_path=tmp_path, timeout_s=5)
    assert time.monotonic() - t0 < 30
