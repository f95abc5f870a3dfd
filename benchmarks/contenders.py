"""The checkpointing methods compared, behind one small interface.

Every contender is driven the same way by the scenarios::

    c.setup(ctx, run_dir, optimizer)     # once per run; writers/stagers are reused across saves
    rec = c.begin(state, ckpt_dir, i)    # the save call (training blocked for rec.call_s)
    c.barrier(rec)                       # wait at the optimizer step (rec.wait_s)
    ...                                  # compute continues; durability is observed via a
    c.drain()                            #   done-callback (rec.t_durable), drain waits for all
    c.teardown()
    c.load(ckpt_dir, target)             # read back with the format's stock loader

Stock asynchronous contenders keep at most ``max_in_flight`` saves pending (default 1): a new
save first waits for the oldest to be durable, as torchtitan waits on the previous upload before
it starts the next one (torch's ``DefaultStager`` reuses its staging buffers, so it needs this
for correctness). That wait is part of the save call, hence of the time training is blocked.
DataStatesWriter bounds its memory by its host cache instead, so by default it gets no such
limit (``ds_max_in_flight`` = 0); set it to 1 to hold it to the same rule.

Sync contenders are durable when the call returns: ``torch.save`` is followed by ``fsync``, and
``FileSystemWriter`` fsyncs by default. torchsnapshot does not fsync, so its completion thread
fsyncs the snapshot's files before it counts as durable.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import math
import os
import threading
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.metrics import fsync_tree, now

STATE = dict[str, Any]


@dataclass
class SaveContext:
    """What a contender needs to know about the run it is part of."""

    rank: int
    world_size: int
    device: torch.device
    pg: dist.ProcessGroup | None  # process group for checkpoint collectives (gloo)
    fs_threads: int  # thread_count of the multi-threaded FileSystemWriter
    host_cache_bytes: int  # DataStatesWriter host cache
    max_in_flight: int = 1  # stock async methods; a new save waits for the oldest beyond this
    ds_max_in_flight: int = 0  # DataStatesWriter; 0 = unbounded (its host cache is the bound)
    ds_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class SaveRecord:
    """Timestamps (time.perf_counter) of one save, as seen by the training thread."""

    index: int
    ckpt_dir: str
    nbytes: int
    t_call: float = 0.0
    t_return: float = 0.0
    t_wait0: float | None = None
    t_wait1: float | None = None
    t_captured: float | None = None  # when the method no longer needs the live tensors, if known
    barrier_s: float = 0.0  # wait inside the optimizer step (the plain call's automatic barrier)
    t_durable: float | None = None
    error: str | None = None
    peak_rss: int | None = None
    rss_before: int | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def call_s(self) -> float:
        return self.t_return - self.t_call

    @property
    def wait_s(self) -> float:
        if self.t_wait0 is None or self.t_wait1 is None:
            return 0.0
        return self.t_wait1 - self.t_wait0

    @property
    def blocked_s(self) -> float:
        return self.call_s + self.wait_s + self.barrier_s

    @property
    def capture_s(self) -> float | None:
        """From the save call until the live tensors were no longer needed (if known)."""
        return None if self.t_captured is None else self.t_captured - self.t_call

    @property
    def durable_s(self) -> float | None:
        return None if self.t_durable is None else self.t_durable - self.t_call

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "bytes": self.nbytes,
            "t_call": self.t_call,
            "t_return": self.t_return,
            "t_wait0": self.t_wait0,
            "t_wait1": self.t_wait1,
            "t_captured": self.t_captured,
            "t_durable": self.t_durable,
            "call_s": self.call_s,
            "wait_s": self.wait_s,
            "barrier_s": self.barrier_s,
            "blocked_s": self.blocked_s,
            "capture_s": self.capture_s,
            "durable_s": self.durable_s,
            "peak_rss": self.peak_rss,
            "rss_before": self.rss_before,
            "error": self.error,
        }


class Contender(ABC):
    """One checkpointing method. Subclasses implement :meth:`_start` (and maybe more)."""

    name: str = ""
    label: str = ""
    fmt: str = "dcp"  # checkpoint format: dcp | torch.save | torchsnapshot
    loader: str = "dcp.load"
    asynchronous: bool = False
    captured_on_return: bool = True  # the call returns only once the live tensors were copied

    def __init__(self) -> None:
        self.ctx: SaveContext | None = None
        self._current: SaveRecord | None = None
        self._pending: collections.deque[tuple[SaveRecord, concurrent.futures.Future[Any]]] = (
            collections.deque()
        )

    # -- availability ---------------------------------------------------------------
    def skip_reason(self, device: torch.device) -> str | None:
        """Why this contender cannot run here (None: it can)."""
        return None

    # -- lifecycle ------------------------------------------------------------------
    def setup(
        self, ctx: SaveContext, run_dir: str, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        self.ctx = ctx

    def teardown(self) -> None:
        self.drain()

    def telemetry(self) -> list[dict[str, Any]]:
        """Per-save telemetry exposed by the method itself (DataStatesWriter only)."""
        return []

    def annotate(self, records: list[SaveRecord]) -> None:  # noqa: B027 - optional hook
        """Fill in what only the method's own telemetry knows (after the saves are durable)."""

    @property
    def max_in_flight(self) -> int:
        assert self.ctx is not None
        return max(1, self.ctx.max_in_flight)

    # -- one save -------------------------------------------------------------------
    @abstractmethod
    def _start(self, state: STATE, ckpt_dir: str) -> concurrent.futures.Future[Any] | None:
        """Issue the save; return a future that completes when durable, or None if it is."""

    def _wait_staged(self) -> None:  # noqa: B027 - a no-op is right for most contenders
        """Block until the in-flight saves no longer need the live tensors."""

    def begin(self, state: STATE, ckpt_dir: str, index: int, nbytes: int) -> SaveRecord:
        rec = SaveRecord(index=index, ckpt_dir=ckpt_dir, nbytes=nbytes)
        rec.t_call = now()
        if self.asynchronous:
            while len(self._pending) >= self.max_in_flight:
                old, _fut = self._pending.popleft()
                old.done.wait()
        self._current = rec
        fut = self._start(state, ckpt_dir)
        rec.t_return = now()
        if self.captured_on_return and rec.t_captured is None:
            rec.t_captured = rec.t_return
        if fut is None:
            rec.t_durable = rec.t_return
            rec.done.set()
        else:
            fut.add_done_callback(functools.partial(_mark_durable, rec))
            self._pending.append((rec, fut))
        return rec

    def barrier(self, rec: SaveRecord) -> None:
        rec.t_wait0 = now()
        self._wait_staged()
        rec.t_wait1 = now()

    def drain(self) -> None:
        while self._pending:
            rec, _fut = self._pending.popleft()
            rec.done.wait()

    # -- reading back -----------------------------------------------------------------
    def load(self, ckpt_dir: str, target: STATE) -> STATE:
        """Read ``ckpt_dir`` into ``target`` (same structure, CPU tensors); return the result."""
        import torch.distributed.checkpoint as dcp

        assert self.ctx is not None
        dcp.load(target, checkpoint_id=ckpt_dir, process_group=self.ctx.pg)
        return target


def _mark_durable(rec: SaveRecord, fut: concurrent.futures.Future[Any]) -> None:
    """Done-callback: stamp the durable time (runs in the thread that completed the save)."""
    rec.t_durable = now()
    exc = fut.exception()
    if exc is not None:
        rec.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    rec.done.set()


# ---------------------------------------------------------------------------------------
# torch.save
# ---------------------------------------------------------------------------------------
class TorchSave(Contender):
    name = "torch_save"
    label = "torch.save+fsync"
    fmt = "torch.save"
    loader = "torch.load"

    def _path(self, ckpt_dir: str) -> str:
        assert self.ctx is not None
        return os.path.join(ckpt_dir, f"rank{self.ctx.rank}.pt")

    def _start(self, state: STATE, ckpt_dir: str) -> None:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(self._path(ckpt_dir), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return None

    def load(self, ckpt_dir: str, target: STATE) -> STATE:
        loaded: STATE = torch.load(self._path(ckpt_dir), map_location="cpu", weights_only=True)
        return loaded


# ---------------------------------------------------------------------------------------
# dcp.save with FileSystemWriter
# ---------------------------------------------------------------------------------------
class DcpSave(Contender):
    def __init__(self, threads: int | None) -> None:
        """``threads=None``: use ``ctx.fs_threads`` (the "several threads" variant)."""
        super().__init__()
        self._threads = threads
        self.name = f"dcp_fs_t{threads}" if threads else "dcp_fs_tN"
        self.label = f"dcp.save FS t={threads or 'N'}"

    @property
    def threads(self) -> int:
        assert self.ctx is not None
        return self._threads or self.ctx.fs_threads

    def setup(
        self, ctx: SaveContext, run_dir: str, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        super().setup(ctx, run_dir, optimizer)
        self.label = f"dcp.save FS t={self.threads}"

    def _start(self, state: STATE, ckpt_dir: str) -> None:
        import torch.distributed.checkpoint as dcp

        assert self.ctx is not None
        writer = dcp.FileSystemWriter(ckpt_dir, thread_count=self.threads)
        dcp.save(state, storage_writer=writer, checkpoint_id=ckpt_dir, process_group=self.ctx.pg)
        return None


# ---------------------------------------------------------------------------------------
# dcp.async_save, default staging
# ---------------------------------------------------------------------------------------
class DcpAsyncDefault(Contender):
    name = "dcp_async"
    label = "dcp.async_save"
    asynchronous = True

    def _start(self, state: STATE, ckpt_dir: str) -> concurrent.futures.Future[Any]:
        import torch.distributed.checkpoint as dcp

        assert self.ctx is not None
        out = dcp.async_save(state, checkpoint_id=ckpt_dir, process_group=self.ctx.pg)
        return _upload_future(out)


def _upload_future(out: Any) -> concurrent.futures.Future[Any]:
    """The durability future of whatever ``dcp.async_save`` returned."""
    upload = getattr(out, "upload_completion", None)
    return upload if upload is not None else out  # type: ignore[no-any-return]


def reusable_stager(prev: Any, options: dict[str, bool]) -> Any:
    """torch's ``DefaultStager`` with ``options``, reused across saves where torch allows it.

    torch 2.11's stager closes its ``StateDictStager`` after every stage (its storage cache and
    its copier table are cleared: a second stage fails with ``KeyError: <class 'type'>``). There
    a spent stager is closed and replaced by a fresh one, which costs what that version's stager
    costs anyway (new staging buffers for every save). Later versions keep ``prev``."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if prev is not None:
        inner = getattr(prev, "_state_dict_stager", None)
        if inner is None or getattr(inner, "_deepcopy_dispatch", True):
            return prev
        prev.close()
    return DefaultStager(StagingOptions(**options))


# ---------------------------------------------------------------------------------------
# dcp.async_save + torch DefaultStager (torchtitan's pattern)
# ---------------------------------------------------------------------------------------
class DcpAsyncStager(Contender):
    name = "dcp_async_stager"
    label = "async_save+DefaultStager"
    asynchronous = True
    captured_on_return = False

    def __init__(self) -> None:
        super().__init__()
        self._stager: Any = None
        self._staging: list[concurrent.futures.Future[Any]] = []
        self.options: dict[str, bool] = {}

    @property
    def max_in_flight(self) -> int:
        return 1  # the stager reuses its buffers: a new save must wait for the previous one

    def setup(
        self, ctx: SaveContext, run_dir: str, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        super().setup(ctx, run_dir, optimizer)
        on_accel = ctx.device.type != "cpu"
        # pinned memory and non-blocking copies need an accelerator; shared + async always apply
        self.options = {
            "use_pinned_memory": on_accel,
            "use_shared_memory": True,
            "use_async_staging": True,
            "use_non_blocking_copy": on_accel,
        }
        self._stager = reusable_stager(None, self.options)
        self.label = f"async_save+DefaultStager t={ctx.fs_threads}"

    def _start(self, state: STATE, ckpt_dir: str) -> concurrent.futures.Future[Any]:
        import torch.distributed.checkpoint as dcp

        assert self.ctx is not None
        writer = dcp.FileSystemWriter(ckpt_dir, thread_count=self.ctx.fs_threads)
        self._stager = reusable_stager(self._stager, self.options)
        out = dcp.async_save(
            state,
            storage_writer=writer,
            checkpoint_id=ckpt_dir,
            process_group=self.ctx.pg,
            async_stager=self._stager,
        )
        staging = getattr(out, "staging_completion", None)
        if staging is not None:
            self._staging.append(staging)
            rec = self._current
            staging.add_done_callback(lambda _f: setattr(rec, "t_captured", now()))
        return _upload_future(out)

    def _wait_staged(self) -> None:
        while self._staging:
            self._staging.pop(0).result()

    def teardown(self) -> None:
        super().teardown()
        if self._stager is not None:
            self._stager.close()
            self._stager = None


# ---------------------------------------------------------------------------------------
# torchsnapshot
# ---------------------------------------------------------------------------------------
class TorchSnapshotAsync(Contender):
    name = "torchsnapshot"
    label = "torchsnapshot async_take"
    fmt = "torchsnapshot"
    loader = "Snapshot.restore"
    asynchronous = True

    def __init__(self) -> None:
        super().__init__()
        self._exec: concurrent.futures.ThreadPoolExecutor | None = None

    def skip_reason(self, device: torch.device) -> str | None:
        try:
            import torchsnapshot  # noqa: F401
        except Exception as e:  # ImportError or a broken dependency
            return f"{type(e).__name__}: {e}"
        return None

    def setup(
        self, ctx: SaveContext, run_dir: str, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        super().setup(ctx, run_dir, optimizer)
        self._exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tsnap-wait")

    def _start(self, state: STATE, ckpt_dir: str) -> concurrent.futures.Future[Any]:
        from torchsnapshot import Snapshot, StateDict

        assert self.ctx is not None and self._exec is not None
        pending = Snapshot.async_take(ckpt_dir, {"state": StateDict(**state)}, pg=self.ctx.pg)

        def finish() -> None:
            pending.wait()
            fsync_tree(ckpt_dir)  # torchsnapshot itself does not fsync

        return self._exec.submit(finish)

    def teardown(self) -> None:
        super().teardown()
        if self._exec is not None:
            self._exec.shutdown(wait=True)
            self._exec = None

    def load(self, ckpt_dir: str, target: STATE) -> STATE:
        from torchsnapshot import Snapshot, StateDict

        assert self.ctx is not None
        holder = StateDict(**target)
        Snapshot(ckpt_dir, pg=self.ctx.pg).restore({"state": holder})
        return dict(holder)


# ---------------------------------------------------------------------------------------
# DataStatesWriter (this project)
# ---------------------------------------------------------------------------------------
def datastates_import_error() -> str | None:
    try:
        import dcp_datastates

        dcp_datastates.DataStatesWriter  # noqa: B018
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


class _DataStates(Contender):
    writer_options: dict[str, Any] = {}  # forced DataStatesWriter options of this variant
    protect_optimizer = True  # asynchronous variants call writer.protect(optimizer)

    def __init__(self) -> None:
        super().__init__()
        self.writer: Any = None
        self._stats_at_close: list[dict[str, Any]] = []

    def skip_reason(self, device: torch.device) -> str | None:
        return datastates_import_error()

    def setup(
        self, ctx: SaveContext, run_dir: str, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        from dcp_datastates import DataStatesWriter

        super().setup(ctx, run_dir, optimizer)
        mib = max(1, -(-ctx.host_cache_bytes // (1024 * 1024)))
        options = {**ctx.ds_options, **self.writer_options}
        self.writer = DataStatesWriter(run_dir, host_cache_size=f"{mib}MiB", **options)
        if optimizer is not None and self.asynchronous and self.protect_optimizer:
            self.writer.protect(optimizer)

    @property
    def max_in_flight(self) -> int:
        assert self.ctx is not None
        return self.ctx.ds_max_in_flight if self.ctx.ds_max_in_flight > 0 else 1 << 30

    def telemetry(self) -> list[dict[str, Any]]:
        if self.writer is None:
            return self._stats_at_close
        return [dict(s) for s in self.writer.save_stats()]

    def annotate(self, records: list[SaveRecord]) -> None:  # noqa: B027 - optional hook
        by_id = {os.path.normpath(str(t.get("checkpoint_id"))): t for t in self.telemetry()}
        for rec in records:
            t = by_id.get(os.path.normpath(rec.ckpt_dir))
            cap = t.get("t_captured") if t else None
            if isinstance(cap, float) and math.isfinite(cap) and rec.t_captured is None:
                rec.t_captured = cap
            if t and not self.protect_optimizer and self.asynchronous:
                # The plain call waits inside optimizer.step() (the automatic barrier), which the
                # loop cannot time from outside: the writer's own blocked time minus its call.
                blocked, stage = float(t.get("blocked_s", 0.0)), float(t.get("stage_s", 0.0))
                rec.barrier_s = max(0.0, blocked - stage)

    def teardown(self) -> None:
        super().teardown()
        if self.writer is not None:
            self._stats_at_close = self.telemetry()
            self.writer.close()
            self.writer = None


class DataStatesSave(_DataStates):
    name = "ds_save"
    label = "DataStates dcp.save"

    def _start(self, state: STATE, ckpt_dir: str) -> None:
        import torch.distributed.checkpoint as dcp

        assert self.ctx is not None
        dcp.save(
            state, storage_writer=self.writer, checkpoint_id=ckpt_dir, process_group=self.ctx.pg
        )
        return None


class DataStatesAsync(_DataStates):
    name = "ds_async"
    label = "DataStates async_save"
    asynchronous = True
    captured_on_return = False  # lazy capture: its telemetry (t_captured) says when

    def _start(self, state: STATE, ckpt_dir: str) -> concurrent.futures.Future[Any]:
        import torch.distributed.checkpoint as dcp

        assert self.ctx is not None
        out = dcp.async_save(
            state, storage_writer=self.writer, checkpoint_id=ckpt_dir, process_group=self.ctx.pg
        )
        return _upload_future(out)

    def _wait_staged(self) -> None:
        self.writer.wait_captured()


class DataStatesAsyncEarly(DataStatesAsync):
    """``ds_async`` with ``early_flush=True`` forced (placed when the save thread begins,
    flushing while DCP plans; the writer's default again since the fork hang was explained)."""

    name = "ds_async_early"
    label = "DataStates async_save, early_flush=True"
    writer_options = {"early_flush": True}


class DataStatesAsyncLate(DataStatesAsync):
    """``ds_async`` with ``early_flush=False``: every item placed in ``write_data``, after DCP's
    planning, as before early placement (dcp_datastates.save.early). Run beside ``ds_async`` to see
    what flushing during the planning gains."""

    name = "ds_async_late"
    label = "DataStates async_save, early_flush=False"
    writer_options = {"early_flush": False}


class DataStatesAsyncLazy(DataStatesAsync):
    """``capture="lazy"`` for every tensor, not only for ``protect()``-ed optimizer state.

    Without an optimizer to protect, the default ``capture="auto"`` snapshots every tensor in
    the save call (a synchronous copy into the host cache if there is room, else a clone that is
    flushed directly, outside the cache). The synthetic
    scenarios mutate tensors only after the step barrier, the discipline ``protect()`` declares
    for optimizer state, so lazy capture is safe there and shows the DataStates design itself:
    copies into the host cache in the background, backpressure when the cache is small.
    """

    name = "ds_async_lazy"
    label = "DataStates async_save lazy"
    writer_options = {"capture": "lazy"}


class DataStatesPlain(DataStatesAsync):
    """The plain call the product promises is enough: ``dcp.async_save(state,
    storage_writer=writer, checkpoint_id=...)`` and nothing else.

    No ``protect()``, no ``wait_captured()`` before the optimizer step, the writer's default
    capture. Whatever the writer does to keep the snapshot exact happens inside its public API.
    """

    name = "ds_plain"
    label = "DataStates async_save (plain call)"
    protect_optimizer = False

    def _wait_staged(self) -> None:
        return None  # the plain call has no barrier


class DataStatesPlainEager(DataStatesPlain):
    """The plain call with ``capture="eager"``: every tensor copied into the cache inside the
    save call. Run beside ``ds_plain`` (default ``auto``: optimizer-owned tensors copied in the
    background, the step waits) so the capture policy is chosen by measurement."""

    name = "ds_plain_eager"
    label = "DataStates async_save (plain call, capture=eager)"
    writer_options = {"capture": "eager"}


class DataStatesPlainLate(DataStatesPlain):
    """The plain call with ``early_flush=False`` (every item placed after DCP's planning): run
    beside ``ds_plain`` to see what early placement costs or saves a training loop."""

    name = "ds_plain_late"
    label = "DataStates async_save (plain call, early_flush=False)"
    writer_options = {"early_flush": False}


class DataStatesPlainIdleFlush(DataStatesPlain):
    """The plain call with ``flush_idle=True``: flush threads under ``SCHED_IDLE`` as well as
    copy threads (the default before flushes took their checksums from the copy). Run beside
    ``ds_plain`` to see what a normal-priority flush costs or saves end to end."""

    name = "ds_plain_idleflush"
    label = "DataStates async_save (plain call, flush_idle)"
    writer_options = {"flush_idle": True}


class DataStatesPlainNoAdapt(DataStatesPlain):
    """The plain call with ``adapt_to_load=False``: lazy copies whatever the machine's load.
    Run beside ``ds_plain`` with ``--contend N`` to see what copying at the call on a busy
    machine saves."""

    name = "ds_plain_noadapt"
    label = "DataStates async_save (plain call, adapt_to_load=False)"
    writer_options = {"adapt_to_load": False}


ALL_NAMES: tuple[str, ...] = (
    "torch_save",
    "dcp_fs_t1",
    "dcp_fs_tN",
    "dcp_async",
    "dcp_async_stager",
    "torchsnapshot",
    "ds_save",
    "ds_async",
    "ds_async_lazy",
    "ds_plain",
)
DATASTATES_NAMES: tuple[str, ...] = (
    "ds_save", "ds_async", "ds_async_lazy", "ds_plain", "ds_async_late", "ds_async_early"
)
# variants run only when named (A/B comparisons of one option)
EXTRA_NAMES: tuple[str, ...] = ("ds_async_late", "ds_async_early")
# same as ds_async once protect(optimizer) marks all training state as lazily captured
TRAINING_EXCLUDED: tuple[str, ...] = ("ds_async_lazy",)
# the plain call is about training loops (no barrier: the synthetic scenarios' in-place change
# right after the barrier would race its copies by design of that scenario, not of the writer)
SYNTHETIC_EXCLUDED: tuple[str, ...] = ("ds_plain",)
# the mlp-loop contenders (the names the issue uses; "none" is the baseline, always run)
MLP_NAMES: tuple[str, ...] = (
    "ds_plain",
    "ds_plain_eager",
    "ds_plain_idleflush",
    "ds_plain_late",
    "ds_plain_noadapt",
    "dcp_fs_t2",
    "dcp_default_stager",
    "dcp_async",
)
MLP_DEFAULT: tuple[str, ...] = ("ds_plain", "ds_plain_eager", "dcp_fs_t2", "dcp_default_stager")


def make_contender(name: str) -> Contender:
    """A fresh contender instance by its short name (see :data:`ALL_NAMES`)."""
    factories: dict[str, Any] = {
        "torch_save": TorchSave,
        "dcp_fs_t1": lambda: DcpSave(1),
        "dcp_fs_tN": lambda: DcpSave(None),
        "dcp_async": DcpAsyncDefault,
        "dcp_async_stager": DcpAsyncStager,
        "torchsnapshot": TorchSnapshotAsync,
        "ds_save": DataStatesSave,
        "ds_async": DataStatesAsync,
        "ds_async_lazy": DataStatesAsyncLazy,
        "ds_async_late": DataStatesAsyncLate,
        "ds_async_early": DataStatesAsyncEarly,
        "ds_plain": DataStatesPlain,
        "ds_plain_eager": DataStatesPlainEager,
        "ds_plain_idleflush": DataStatesPlainIdleFlush,
        "ds_plain_late": DataStatesPlainLate,
        "ds_plain_noadapt": DataStatesPlainNoAdapt,
        # fixed-configuration names used by the mlp-loop scenario
        "dcp_fs_t2": lambda: DcpSave(2),
        "dcp_default_stager": DcpAsyncStager,
    }
    if name not in factories:
        names = ", ".join(dict.fromkeys(ALL_NAMES + MLP_NAMES + EXTRA_NAMES))
        raise ValueError(f"unknown contender {name!r}; choose from {names}")
    c: Contender = factories[name]()
    c.name = name
    return c
