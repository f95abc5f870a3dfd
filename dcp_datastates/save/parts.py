"""The parts a DataStatesWriter is built of, and the checks of its options.

:func:`build_parts` validates a writer's options and builds, in order, its configuration, the
incremental tracker, the stream-transform extensions, the persistent-tier promoter, the native
engine (host cache and threads), the stager, the placer, the job table and the deferred release
of results; the writer keeps them as attributes (:class:`dcp_datastates.save.controls.
WriterControls`), under the same names as before the split (tests and benchmarks use some).

Threads: runs in the caller's thread, normally the training thread that later forks: the native
statics a background save would otherwise create are initialised here
(:mod:`dcp_datastates.save.forksafe`).
Failures: a bad option raises ``ValueError`` (or ``TypeError``) before the engine is allocated, so
a refused writer holds no host cache and starts no thread; a failure after the engine exists
(page-locking the cache without a CUDA runtime) closes the engine before it propagates.
Lifetime: the parts live as long as the writer; the engine is freed by ``close()`` or, when the
writer is collected, by :func:`close_engine` (a finalizer registered by the writer), never in a
forked child.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._extension import StreamTransformExtension

from ..config import CaptureMode, CheckpointFormat, WriterConfig, parse_size
from ..engine import Engine
from ..errors import CheckpointSaveError
from ..format.layout import TemplateCache
from ..lifecycle.checkpoints import RetentionPolicy
from ..lifecycle.persist_client import AgentPromoter
from ..lifecycle.replicas import replicator
from ..lifecycle.tiers import Promoter
from ..runtime.cpuload import CpuMeter
from ..runtime.dcplog import skip_unheard_debug_events
from . import forksafe
from .capture import Stager
from .extensions import check_extensions
from .incremental import IncrementalMode, Tracker, parse_mode
from .jobs import JobTable
from .placement import Placer
from .release import DeferredRelease


@dataclass
class WriterParts:
    """What :func:`build_parts` returns: a writer's options, checked, and the objects built from
    them (the writer's attribute of each is named in its comment)."""

    path: str  # path: the default checkpoint directory or URL
    overwrite: bool  # overwrite
    pid: int  # _pid: the process that owns the writer (and its engine)
    config: WriterConfig  # config
    storage_options: dict[str, Any]  # storage_options: fsspec options of every save's path
    incremental: Tracker | None  # _incremental: None unless incremental saves are on
    extensions: tuple[StreamTransformExtension, ...]  # _extensions: () without transforms
    promoter: Promoter | None  # _promoter: None without persist_to
    engine: Engine  # _engine: the host cache and the native copy/flush threads
    stager: Stager  # _stager: stage()'s capture of the state
    templates: TemplateCache  # _templates: archive templates per (dtype, shape)
    placer: Placer  # _placer: places a save's items in data files, writes them
    table: JobTable  # _table: jobs in flight, their order, failures, stats
    released: DeferredRelease  # _released: async_save results freed on a save thread


def build_parts(
    path: str | os.PathLike[str],
    host_cache_size: int | float | str,
    *,
    chunk_size: int | str,
    copy_threads: int,
    flush_threads: int,
    files_per_rank: int | None,
    o_direct: bool,
    early_flush: bool,
    capture: CaptureMode,
    checksums: bool,
    durable: bool,
    prefault: bool,
    flush_nice: int,
    idle_priority: bool,
    adapt_to_load: bool,
    flush_idle: bool,
    step_barrier: bool,
    pin_memory: bool | None,
    overwrite: bool,
    format: CheckpointFormat,  # noqa: A002 - the option's documented name
    storage_options: dict[str, Any] | None,
    upload_part_size: int | str,
    upload_concurrency: int,
    rank_timeout: float,
    rank_liveness: float,
    incremental: IncrementalMode,
    persist_to: str | os.PathLike[str] | None,
    persist_storage_options: dict[str, Any] | None,
    persist_timeout: float,
    persist_retention: RetentionPolicy | int | None,
    fast_retention: RetentionPolicy | int | None,
    persist_agent: bool,
    replicas: int,
    replica_timeout: float,
    _extensions: Sequence[StreamTransformExtension] | None,
) -> WriterParts:
    """Checks a DataStatesWriter's options and builds its parts (the options are documented on
    :class:`~dcp_datastates.DataStatesWriter`, which passes them all, its defaults applied)."""
    path = os.fspath(path)
    pid = os.getpid()
    skip_unheard_debug_events()  # DCP's per-key DEBUG records nobody receives (dcplog.py)
    forksafe.warm_up()  # native statics a background save would create (forksafe.py)
    config = WriterConfig(
        cache_bytes=parse_size(host_cache_size, what="host_cache_size"),
        chunk_bytes=parse_size(chunk_size, default_unit=1, what="chunk_size"),
        copy_threads=copy_threads,
        flush_threads=flush_threads,
        files_per_rank=files_per_rank if files_per_rank is not None else flush_threads,
        o_direct=o_direct,
        early_flush=early_flush,
        capture=capture,
        checksums=checksums,
        durable=durable,
        prefault=prefault,
        flush_nice=flush_nice,
        idle_priority=idle_priority,
        adapt_to_load=adapt_to_load,
        flush_idle=flush_idle,
        step_barrier=step_barrier,
        format=format,
        part_bytes=parse_size(upload_part_size, default_unit=1, what="upload_part_size"),
        upload_concurrency=upload_concurrency,
        rank_timeout_s=rank_timeout,
        rank_liveness_s=rank_liveness,
        replicas=replicas,
        replica_timeout_s=replica_timeout,
    )

    # before the engine: a bad value allocates nothing
    tracker, extensions, promoter = _save_features(
        path, config, incremental, _extensions, persist_to, persist_storage_options,
        persist_timeout, persist_retention, fast_retention, persist_agent,
    )
    if config.replicas:
        _check_replicas(path, config, incremental)
        replicator(config.replica_timeout_s)  # its gloo group: created on every rank, in order
    engine = _open_engine(config, pin_memory)
    meter = CpuMeter() if config.adapt_to_load and config.idle_priority else None
    stager = Stager(engine, config.capture, spill_dirs(path), tracker, meter)
    templates = TemplateCache()
    placer = Placer(engine, templates, stager, config, tracker, extensions)
    return WriterParts(
        path=path,
        overwrite=bool(overwrite),
        pid=pid,
        config=config,
        storage_options=dict(storage_options or {}),
        incremental=tracker,
        extensions=extensions,
        promoter=promoter,
        engine=engine,
        stager=stager,
        templates=templates,
        placer=placer,
        table=JobTable(engine),
        released=DeferredRelease(),
    )


def _check_replicas(path: str, config: WriterConfig, incremental: IncrementalMode) -> None:
    """Replicas copy a checkpoint's own files from a node-local directory: refused otherwise."""
    if "://" in path or config.format != "torch" or parse_mode(incremental) != "off":
        raise ValueError(
            "replicas need a local path, format='torch' and incremental=False (a replica "
            "copies each rank's own .distcp files, manifest and .metadata; an incremental "
            f"checkpoint points at other checkpoints' files), got path={path!r}, "
            f"format={config.format!r}, incremental={incremental!r}"
        )


def _save_features(
    path: str,
    config: WriterConfig,
    incremental: IncrementalMode,
    _extensions: Sequence[StreamTransformExtension] | None,
    persist_to: str | os.PathLike[str] | None,
    persist_storage_options: dict[str, Any] | None,
    persist_timeout: float,
    persist_retention: RetentionPolicy | int | None,
    fast_retention: RetentionPolicy | int | None,
    persist_agent: bool = True,
) -> tuple[Tracker | None, tuple[StreamTransformExtension, ...], Promoter | None]:
    """The optional features of the save path, checked against each other: the incremental
    tracker, the stream transforms and the persistent tier's promoter. Raises ValueError for a
    combination that cannot work."""
    mode = parse_mode(incremental)
    if mode != "off" and config.format != "torch":
        raise ValueError(
            f"incremental={incremental!r} needs format='torch': a {config.format} file "
            "cannot point at another checkpoint's bytes"
        )
    tracker = Tracker(mode, config.checksums) if mode != "off" else None
    extensions = check_extensions(_extensions)  # dcp_datastates.save.extensions
    if extensions and (config.format != "torch" or mode != "off"):
        raise ValueError(
            "_extensions needs format='torch' and incremental=False: a transformed item can "
            "be neither a safetensors tensor nor referenced by a later incremental save"
        )
    promoter: Promoter | None = None
    if persist_to is not None:  # multi-level flush (dcp_datastates.lifecycle.tiers)
        if mode != "off":
            raise ValueError(
                "persist_to cannot be combined with incremental saves: an incremental "
                "checkpoint points at earlier checkpoints' files, which the persistent tier "
                "would have to hold under the same names (save fully, or persist separately)"
            )
        # agent mode: copies in a process of its own (lifecycle.persist_client), else a thread
        cls = AgentPromoter if persist_agent else Promoter
        promoter = cls(
            path, os.fspath(persist_to), persist_storage_options, persist_timeout,
            durable=config.durable, fast_retention=fast_retention,
            persist_retention=persist_retention,
        )
    elif persist_retention is not None or fast_retention is not None:
        raise ValueError(
            "persist_retention and fast_retention need persist_to (without a persistent "
            "tier, prune with dcp_datastates.lifecycle.checkpoints.prune)"
        )
    return tracker, extensions, promoter


def _open_engine(config: WriterConfig, pin_memory: bool | None) -> Engine:
    """The native engine (host cache and threads), its cache page-locked for CUDA up front when
    asked or when CUDA is available."""
    engine = Engine(config)
    if pin_memory or (pin_memory is None and torch.cuda.is_available()):
        # Page-lock the cache now rather than on the first CUDA save (cudaHostRegister of a
        # large cache takes time). Without a CUDA runtime in the process this raises.
        try:
            engine.enable_cuda()
        except CheckpointSaveError:
            engine.close()
            raise
    return engine


def spill_dirs(path: str) -> list[str]:
    """Where at-call snapshots larger than the cache are spilled: beside the checkpoints (same
    file system, so the copy into the data file can be a reflink), else the temp directory."""
    dirs: list[str] = []
    if path and "://" not in path:
        base = os.path.abspath(path)
        dirs += [base, os.path.dirname(base)]
    dirs.append(tempfile.gettempdir())
    return dirs


def close_engine(engine: Engine, pid: int) -> None:
    """Finalizer of a DataStatesWriter: stops its threads and frees its cache (leaks in a child)."""
    if os.getpid() == pid:
        engine.close()


__all__ = ["WriterParts", "build_parts", "close_engine", "spill_dirs"]
