"""DeepSpeed: ``"datastates_ckpt"`` in the ds_config saves through dcp_datastates' native engine.

Usage (the one line is the import; the config is DataStates-LLM's)::

    import dcp_datastates.integrations.deepspeed  # routes "datastates_ckpt" to dcp_datastates
    ds_config = {..., "zero_optimization": {"stage": 1}, "datastates_ckpt": {"host_cache_size": 16}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=..., config=ds_config)
    engine.save_checkpoint(save_dir)      # returns once the state is planned (see below)
    engine.load_checkpoint(save_dir)      # waits for saves in flight, then reads 'latest'

or, for an engine that already exists, ``enable(engine, host_cache_size=16)`` (on every rank).

**How the config key finds this code.** DeepSpeed 0.19.8 builds its checkpoint engine with
``create_checkpoint_engine``, which ``deepspeed.runtime.engine`` imported by name; for a config
with ``"datastates_ckpt"`` (and no ``"checkpoint": {"writer": ...}``, which keeps precedence)
it does ``from datastates import CheckpointEngine`` (DataStates-LLM). Importing this module (or
:func:`enable`) rebinds that name in ``deepspeed.runtime.engine`` to a wrapper that builds
:class:`DataStatesCheckpointEngine` instead, and wraps ``DeepSpeedEngine.save_checkpoint`` /
``load_checkpoint`` (see below). We ship no top-level ``datastates`` package, so DataStates-LLM
is never shadowed: without the import, DeepSpeed uses DataStates-LLM if it is installed. With
it, ours is used, and when the engine is built rank 0 says so through DeepSpeed's own logger
(``[Rank 0] [DataStatesCheckpointEngine] 'datastates_ckpt' is served by dcp_datastates ...``,
at WARNING so that DeepSpeed's default level shows it; the line also says whether an installed
DataStates-LLM is being bypassed). :func:`disable` restores DeepSpeed's functions.

**What a save does** (:meth:`DataStatesCheckpointEngine.save`, per file DeepSpeed saves):

* plans the file as a ``torch.save`` archive (:mod:`.torch_archive`): same pickle, so
  ``torch.load(path, weights_only=True/False)``, ``zero_to_fp32`` and universal-checkpoint
  conversion read it; every tensor is its own storage sized to the tensor;
* registers every tensor with the native engine: tensors of the optimizer (ZeRO's fp32 master
  partitions, Adam moments) and the model's parameters are copied into the host cache in the
  background, everything else (buffers, counters) is copied by the call; host memory stays
  within ``host_cache_size``;
* the engine's flush threads write the payloads from the cache at their planned offsets of
  ``<path>.dsds-tmp``; the archive's few KiB of headers and pickle are written beside them;
* returns. Nothing waits for the copies until the next ``engine.step()``: DeepSpeed calls
  :meth:`~DataStatesCheckpointEngine.commit` there, before the optimizer step (this engine is
  *decoupled*), and the commit waits until every tensor is in the host cache (not for disk).
  The pipeline engine skips that call; the process-wide optimizer step pre-hook of
  :mod:`dcp_datastates.save.barrier` makes DeepSpeed's inner torch optimizer wait instead;
* a committer thread waits until the files are durable (fdatasync), renames them into place,
  and, for saves with ``save_latest``, rank 0 writes ``latest`` (atomically) once **every**
  rank's files of that tag are durable. The ranks agree over a gloo group made for this when
  the engine is built (never the training process group); a rank whose save failed vetoes it.

**Loading**: ``load_checkpoint`` first waits for every save in flight (so ``latest`` is current)
and :meth:`~DataStatesCheckpointEngine.load` is ``torch.load``.

Failures: an error at the call (a value that cannot be saved) raises from ``save_checkpoint``
naming the key. A failure after the call (I/O error, a tensor modified outside the optimizer
step) fails that tag: its files are not renamed into place, ``latest`` is not moved to it, the
error is logged with the path and rank and raised once by :meth:`wait`. Training goes on.

Threads and lifetimes: ``create``/``save``/``commit``/``load``/``wait`` run in the training
thread; one committer thread per engine (daemon) finishes saves in the order they were made
and is the only user of the gloo group. ``cleanup()`` (DeepSpeed's ``destroy()``) drains and
frees the host cache; so does interpreter exit. Multi-rank: drain (``engine.destroy()`` or
``engine.checkpoint_engine.wait()``) before destroying the process groups, or the last tag's
``latest`` cannot be agreed on. Fork: a forked child cannot use the parent's engine (errors
name the owner pid).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from ..errors import CheckpointSaveError
from ..format.commit import fsync_dir
from ..save import barrier
from ..save.capture import SaveJob, Stager, raise_if_modified
from ..save.parts import spill_dirs
from ..save.writer import DataStatesWriter
from .config import writer_kwargs
from .torch_archive import ArchivePlan, plan_archive

logger = logging.getLogger(__name__)

#: Suffix of a file while it is being written; renamed to its name once durable.
TMP_SUFFIX = ".dsds-tmp"
#: Seconds the ranks wait for each other to agree on a tag (the gloo group's timeout).
DEFAULT_AGREE_TIMEOUT_S = 1800.0


@dataclasses.dataclass
class _Save:
    path: str
    job: SaveJob
    nbytes: int


@dataclasses.dataclass
class _Epoch:
    """The saves of one ``save_checkpoint`` call (one tag), finished together."""

    info: CheckpointCommitInfo
    saves: list[_Save] = dataclasses.field(default_factory=list)
    closed: bool = False
    committed: bool = False  # DeepSpeed called commit() for it
    error: str | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


def _section(config_params: Any) -> Mapping[str, Any] | None:
    ds = getattr(config_params, "datastates_config", None)
    cfg = getattr(ds, "config", None) if ds is not None else None
    return cfg if isinstance(cfg, Mapping) else None


class DataStatesCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """A decoupled DeepSpeed ``CheckpointEngine`` on dcp_datastates' native engine.

    See the module docstring for the protocol. Built by DeepSpeed for configs with
    ``"datastates_ckpt"`` once this module is imported, or by :func:`enable`. Every rank must
    build it (it creates a gloo group when more than one rank exists).

    Args:
        config_params: DeepSpeed's ``DeepSpeedConfig`` (its ``datastates_ckpt`` section is read).
        agree_timeout_s: how long ranks wait for each other before giving up a tag's ``latest``.
        **overrides: DataStates keys or DataStatesWriter arguments, over the config section.

    Raises:
        ValueError / TypeError: an unknown or invalid setting, naming it.
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        agree_timeout_s: float = DEFAULT_AGREE_TIMEOUT_S,
        **overrides: Any,
    ) -> None:
        super().__init__(config_params)
        self.name = "DataStatesCheckpointEngine(dcp_datastates)"
        kwargs = writer_kwargs(_section(config_params), where="ds_config['datastates_ckpt']")
        kwargs.update(writer_kwargs(overrides, where="DataStatesCheckpointEngine arguments"))
        kwargs.setdefault("files_per_rank", 1)
        self._writer_kwargs = kwargs
        self._writer: DataStatesWriter | None = None
        self._stager: Stager | None = None
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._open: _Epoch | None = None  # the tag being saved (until commit or the next step)
        self._epochs: collections.deque[_Epoch] = collections.deque()  # not yet finished
        self._errors: collections.deque[str] = collections.deque()  # not yet raised by wait()
        self._queue: queue.SimpleQueue[_Epoch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ds_engine: Callable[[], Any] | None = None  # weakref to the DeepSpeedEngine
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = (
            dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        )
        self._group: Any = None
        if self.world_size > 1:
            # Collective on every rank, in the training thread (DeepSpeed builds the engine on
            # every rank in the same order). Used only by the committer thread.
            self._group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=agree_timeout_s)
            )
        self.stats: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)
        _LIVE.add(self)
        barrier.register_writer(self)

    # -- DeepSpeed's CheckpointEngine API --------------------------------------------------------
    def is_decoupled(self) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # every tensor is saved as its own storage: DeepSpeed need not clone

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def create(self, info: CheckpointCommitInfo) -> None:
        """Opens the epoch of a tag (every rank, at the start of ``save_checkpoint``)."""
        self._check_owner()
        with self._lock:
            self._close_open_locked()
            self._open = _Epoch(info)
            self._epochs.append(self._open)

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        """Snapshots ``state_dict`` for ``path`` and returns (see the module docstring).

        Raises:
            TypeError: a value that cannot be saved, naming its key.
            CheckpointSaveError: the engine refused the save (names the path and rank).
        """
        self._check_owner()
        t0 = time.perf_counter()
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            if self._open is None or self._open.closed:  # save() without create()
                self._open = _Epoch(CheckpointCommitInfo(tag="", save_dir="", save_latest=False))
                self._epochs.append(self._open)
            epoch = self._open
        try:
            plan = plan_archive(state_dict)
            job = self._submit(plan, path)
        except BaseException as e:
            with self._lock:
                epoch.error = epoch.error or f"save of {path} (rank {self.rank}) failed: {e}"
            raise
        with self._lock:
            epoch.saves.append(_Save(path, job, sum(t.nbytes for t in plan.tensors)))
        self.stats.append({"path": path, "call_s": time.perf_counter() - t0,
                           "bytes": plan.total_bytes, "lazy_bytes": job.lazy_bytes})

    def load(self, path: str, map_location: Any = None) -> Any:
        """Waits for every save in flight, then ``torch.load`` (the files are torch.save files)."""
        self._drain(log=True)
        return torch.load(path, map_location=map_location, weights_only=False)

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The open tag, so that DeepSpeed calls :meth:`commit` before the next optimizer step.

        ``save_latest`` is cleared: ``latest`` is written by this engine once every rank's
        files are durable, not by DeepSpeed at the commit.
        """
        with self._lock:
            e = self._open
            if e is None or e.closed or e.committed:
                return None
            return dataclasses.replace(e.info, save_latest=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Waits until every tensor of the open tag is in the host cache (not until durable).

        Returns False (and logs why) if a save of the tag failed; training goes on.
        """
        self._check_owner()
        with self._lock:
            epoch = self._open
            if epoch is not None:
                epoch.committed = True
            saves = list(epoch.saves) if epoch is not None else []
        ok = True
        for s in saves:
            ok = self._verify(s, epoch) and ok  # type: ignore[arg-type]
        with self._lock:
            self._close_open_locked()
        return ok

    def cleanup(self) -> None:
        """Waits for every save (logging failures) and frees the host cache and threads."""
        if os.getpid() != self._pid:
            return
        self._drain(log=True)
        self._shutdown()

    # -- beyond DeepSpeed's API ------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every save made so far is durable and its ``latest`` written (or the
        tag failed). Returns False on timeout; raises the first failure not raised before
        (CheckpointSaveError naming the path and rank), once."""
        if not self._drain(timeout=timeout, log=False):
            return False
        with self._lock:
            err = self._errors.popleft() if self._errors else None
            self._errors.clear()
        if err is not None:
            raise CheckpointSaveError(err)
        return True

    def attach(self, ds_engine: Any) -> None:
        """Tells the engine which DeepSpeedEngine it serves (for the ownership of parameters:
        the model's parameters change only in the step, so they are copied lazily too)."""
        self._ds_engine = weakref.ref(ds_engine)

    @property
    def native(self) -> Any:
        """The native engine facade (:class:`dcp_datastates.engine.Engine`), created on demand;
        for telemetry and test hooks (``set_delays``)."""
        return self._ensure_writer().engine

    # -- internals -------------------------------------------------------------------------------
    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise CheckpointSaveError(
                f"this DataStatesCheckpointEngine belongs to process {self._pid}; a forked "
                f"child ({os.getpid()}) cannot use it"
            )

    def _ensure_writer(self) -> DataStatesWriter:
        with self._lock:
            if self._writer is None or self._writer.closed:
                self._writer = DataStatesWriter("", **self._writer_kwargs)
                self._stager = Stager(self._writer.engine, self._writer.config.capture,
                                      spill_dirs(""))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._committer, name="dcp_datastates-ds-commit", daemon=True
                )
                self._thread.start()
            return self._writer

    def _owners(self) -> dict[int, int]:
        optimizers = barrier.known_optimizers()
        owners = barrier.owned_storages(optimizers)
        ds = self._ds_engine() if self._ds_engine is not None else None
        if ds is None:
            return owners
        opt = getattr(ds, "optimizer", None)
        inner = getattr(opt, "optimizer", opt)  # ZeRO wraps the torch optimizer
        stage = ds.zero_optimization_stage() if hasattr(ds, "zero_optimization_stage") else 0
        if isinstance(inner, torch.optim.Optimizer) and inner in optimizers and stage < 3:
            # The model's parameters are written only after the inner optimizer's step
            # (ZeRO copies the master weights back), which waits for their copies.
            barrier.remember_optimizer(inner)
            for p in ds.module.parameters():
                if p.numel() > 0 and p.device.type != "meta":
                    owners.setdefault(p.untyped_storage().data_ptr(), id(inner))
        return owners

    def _submit(self, plan: ArchivePlan, path: str) -> SaveJob:
        writer = self._ensure_writer()
        eng = writer.engine
        assert self._stager is not None
        tmp = path + TMP_SUFFIX
        flat: dict[str, torch.Tensor] = {t.name: t.tensor for t in plan.tensors}
        staged, job = self._stager.stage(flat, self._owners())
        job.checkpoint_id = path
        job.rank = self.rank
        try:
            fid = eng.open_file(job.engine_job, tmp)
            for off, data in plan.segments:
                eng.write_bytes(job.engine_job, fid, off, data)
            spilled = []
            for t in plan.tensors:
                cap = job.lookup(staged[t.name])
                if cap is None:  # pragma: no cover - the stager captures every tensor leaf
                    raise CheckpointSaveError(f"'{t.name}' of {path} was not captured")
                if cap.nbytes == 0:
                    eng.skip(job.engine_job, cap.entry)
                elif cap.spill is not None:
                    spilled.append((cap, t.payload_offset))
                else:
                    eng.place(job.engine_job, cap.entry, fid, t.payload_offset, b"", b"")
            if spilled:  # state larger than the cache, written at the call to a spill file
                fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    for cap, off in spilled:
                        assert cap.spill is not None
                        cap.spill.copy_to(fd, off)
                finally:
                    os.close(fd)
            eng.seal(job.engine_job)
        except BaseException as e:
            eng.abort(job.engine_job, f"save of {path} failed: {e}")
            eng.forget(job.engine_job)
            job.release_sources(done=True)
            raise
        return job

    def _verify(self, s: _Save, epoch: _Epoch) -> bool:
        """Waits until ``s`` is in the host cache and checks its lazy tensors did not change."""
        job = s.job
        eng = self._ensure_writer().engine
        with job.lock:
            if job.verified or job.finished:
                return job.error is None
            t0 = time.perf_counter()
            try:
                eng.wait_captured(job.engine_job)
                raise_if_modified(job, f"{s.path} (rank {self.rank})")
            except CheckpointSaveError as e:
                job.error = e
                eng.abort(job.engine_job, str(e))
                msg = f"{e}"
                with self._lock:
                    epoch.error = epoch.error or msg
                logger.error("%s", msg)
                return False
            finally:
                job.blocked_s += time.perf_counter() - t0
                job.verified = True
                job.release_sources()
        return True

    def _step_barrier(self, optimizer: torch.optim.Optimizer) -> None:
        """Runs before every torch optimizer step (dcp_datastates.save.barrier): the tag being saved
        is complete (save_checkpoint returned); its copies of this optimizer's tensors must be
        in the cache before the step changes them. Covers the pipeline engine, which never
        calls commit()."""
        if os.getpid() != self._pid:
            return
        ids = barrier.owner_ids(optimizer)
        with self._lock:
            todo = [(s, e) for e in self._epochs for s in e.saves
                    if not s.job.verified and s.job.waits_for(ids)]
        for s, e in todo:
            self._verify(s, e)
        with self._lock:
            if self._open is not None and not self._open.committed:
                self._close_open_locked()

    def _close_open_locked(self) -> None:
        e = self._open
        if e is not None and not e.closed:
            e.closed = True
            self._open = None
            if self._thread is None or not self._thread.is_alive():
                self._ensure_writer()
            self._queue.put(e)
        elif e is not None:
            self._open = None

    def _drain(self, timeout: float | None = None, log: bool = False) -> bool:
        """Closes the open tag, verifies every capture and waits until all tags are finished."""
        if os.getpid() != self._pid:
            return True
        with self._lock:
            pending = [(s, e) for e in self._epochs for s in e.saves if not s.job.verified]
        for s, e in pending:
            self._verify(s, e)
        with self._lock:
            self._close_open_locked()
            epochs = list(self._epochs)
        deadline = None if timeout is None else time.monotonic() + timeout
        for e in epochs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not e.done.wait(left):
                return False
        if log:
            with self._lock:
                errs = list(self._errors)
                self._errors.clear()
            for err in errs:
                logger.error("an earlier DeepSpeed checkpoint failed: %s", str(err))
        return True

    def _committer(self) -> None:
        """Finishes tags in order: durable -> renamed -> agreed -> ``latest`` (rank 0)."""
        while True:
            epoch = self._queue.get()
            if epoch is None:
                return
            try:
                self._finish(epoch)
            except BaseException as e:  # never let the thread die silently
                epoch.error = epoch.error or f"rank {self.rank}: {e}"
                logger.exception("finishing checkpoint tag %r failed", epoch.info.tag)
            finally:
                with self._lock:
                    if epoch.error:
                        self._errors.append(epoch.error)
                    if epoch in self._epochs:
                        self._epochs.remove(epoch)
                epoch.done.set()

    def _finish(self, epoch: _Epoch) -> None:
        writer = self._writer
        dirs: set[str] = set()
        for s in epoch.saves:
            job = s.job
            try:
                if writer is None:
                    raise CheckpointSaveError("the engine was closed")
                if job.error is not None:
                    raise job.error
                writer.engine.wait_done(job.engine_job)
                os.replace(s.path + TMP_SUFFIX, s.path)
                dirs.add(os.path.dirname(s.path))
            except BaseException as e:
                epoch.error = epoch.error or (
                    f"checkpoint file {s.path} (rank {self.rank}) failed: {e}"
                )
                if writer is not None and not writer.closed:
                    writer.engine.abort(job.engine_job, str(e))
                with contextlib.suppress(OSError):
                    os.unlink(s.path + TMP_SUFFIX)  # never leave a torn file behind
            finally:
                if writer is not None and not writer.closed:
                    writer.engine.forget(job.engine_job)
                job.finished = True
                job.release_sources(done=True)
        for d in dirs:
            fsync_dir(d)
        if epoch.error:
            logger.error("checkpoint tag %r: %s", epoch.info.tag, epoch.error)
        if not epoch.info.save_latest:
            return
        ok = epoch.error is None
        if self._group is not None:
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
            if ok and int(flag.item()) == 0:
                epoch.error = (f"checkpoint tag {epoch.info.tag!r}: another rank failed to "
                               "save its files; 'latest' was not updated")
                ok = False
        err: BaseException | None = None
        if ok and self.rank == 0:
            try:
                write_latest(epoch.info.save_dir, epoch.info.tag)
            except OSError as e:
                err = e
        if self._group is not None:
            # Second round: a tag is finished on a rank only once rank 0 has written 'latest',
            # so a rank's load_checkpoint() after draining reads the new 'latest'.
            dist.barrier(group=self._group)
        if err is not None:
            raise err

    def _shutdown(self) -> None:
        with self._lock:
            t, self._thread = self._thread, None
            w, self._writer = self._writer, None
        if t is not None and t.is_alive():
            self._queue.put(None)
            t.join(timeout=60)
        if w is not None:
            w.close()


def write_latest(save_dir: str, tag: str) -> None:
    """Writes DeepSpeed's ``latest`` file atomically (temp file, fsync, rename, fsync dir)."""
    tmp = os.path.join(save_dir, f".latest.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, "latest"))
    fsync_dir(save_dir)


_LIVE: weakref.WeakSet[DataStatesCheckpointEngine] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    for eng in list(_LIVE):
        try:
            eng.cleanup()
        except Exception:  # pragma: no cover - best effort at exit
            logger.exception("draining a DeepSpeed checkpoint engine at exit failed")


# -- routing ---------------------------------------------------------------------------------------
_routing_lock = threading.Lock()
_originals: dict[str, Any] = {}


def _datastates_llm_installed() -> bool:
    try:
        return importlib.util.find_spec("datastates") is not None
    except (ImportError, ValueError):
        return False


def _report_engine_choice() -> None:
    """Says on rank 0, through DeepSpeed's logger, which engine serves ``datastates_ckpt``.

    The key is DataStates-LLM's, so serving it with another engine is worth seeing: DeepSpeed's
    own logger (stdout, ``[Rank 0]`` prefix) drops INFO by default (level WARNING), so the line
    is logged at WARNING there, as DeepSpeed reports other substitutions; ``"log_level":
    "error"`` in the ds_config (or ``deepspeed --quiet``) silences it.
    """
    from deepspeed.utils import log_dist

    if _datastates_llm_installed():
        llm = (
            "the installed DataStates-LLM package 'datastates' is NOT used "
            "(call dcp_datastates.integrations.deepspeed.disable() before "
            "deepspeed.initialize to use it)"
        )
    else:
        llm = "DataStates-LLM ('datastates') is not installed"
    msg = (
        "[DataStatesCheckpointEngine] 'datastates_ckpt' is served by dcp_datastates "
        f"(imported dcp_datastates.integrations.deepspeed); {llm}"
    )
    log_dist(msg, ranks=[0], level=logging.WARNING)
    logger.info("%s", msg)


def _routed_create(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def create_checkpoint_engine(config_params: Any, *args: Any, **kwargs: Any) -> Any:
        ds_cfg = getattr(config_params, "datastates_config", None)
        writer_cfg = getattr(config_params, "checkpoint_config", {}) or {}
        if (
            ds_cfg is not None
            and getattr(ds_cfg, "enabled", False)
            and writer_cfg.get("writer") is None
        ):
            engine = DataStatesCheckpointEngine(config_params)
            _report_engine_choice()
            return engine
        return orig(config_params, *args, **kwargs)

    create_checkpoint_engine.__dcp_datastates__ = True  # type: ignore[attr-defined]
    return create_checkpoint_engine


def _ours(ds_engine: Any) -> DataStatesCheckpointEngine | None:
    ce = getattr(ds_engine, "checkpoint_engine", None)
    return ce if isinstance(ce, DataStatesCheckpointEngine) else None


def _wrap_save(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        ce = _ours(self)
        if ce is not None:
            ce.attach(self)
        return orig(self, *args, **kwargs)

    return save_checkpoint


def _wrap_load(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        ce = _ours(self)
        if ce is not None:  # 'latest' must be current before DeepSpeed reads it
            ce._drain(log=True)
        return orig(self, *args, **kwargs)

    return load_checkpoint


def _install_routing() -> None:
    import deepspeed.runtime.engine as ds_engine_mod

    with _routing_lock:
        if _originals:
            return
        cls = ds_engine_mod.DeepSpeedEngine
        _originals["create"] = ds_engine_mod.create_checkpoint_engine
        _originals["save"] = cls.save_checkpoint
        _originals["load"] = cls.load_checkpoint
        ds_engine_mod.create_checkpoint_engine = _routed_create(_originals["create"])
        cls.save_checkpoint = _wrap_save(_originals["save"])
        cls.load_checkpoint = _wrap_load(_originals["load"])


def disable() -> None:
    """Restores DeepSpeed's own engine factory and methods (engines already built keep theirs)."""
    import deepspeed.runtime.engine as ds_engine_mod

    with _routing_lock:
        if not _originals:
            return
        cls = ds_engine_mod.DeepSpeedEngine
        ds_engine_mod.create_checkpoint_engine = _originals.pop("create")
        cls.save_checkpoint = _originals.pop("save")
        cls.load_checkpoint = _originals.pop("load")


def enable(engine: Any = None, **settings: Any) -> DataStatesCheckpointEngine | None:
    """Routes ``"datastates_ckpt"`` configs to dcp_datastates (importing this module does it).

    With ``engine`` (an initialized DeepSpeedEngine; call on every rank), its checkpoint engine
    is replaced by a :class:`DataStatesCheckpointEngine` built from its config's
    ``datastates_ckpt`` section and ``settings`` (DataStates keys or DataStatesWriter
    arguments), whether or not the config has that section; the previous engine's pending
    saves are committed first. Returns the new engine (None without ``engine``).
    """
    _install_routing()
    if engine is None:
        return None
    old = engine.checkpoint_engine
    ours = DataStatesCheckpointEngine(engine._config, **settings)
    if old is not None and old.is_decoupled():
        old.cleanup()
    engine.checkpoint_engine = ours
    ours.attach(engine)
    return ours


_install_routing()

__all__ = ["DataStatesCheckpointEngine", "disable", "enable", "write_latest"]
