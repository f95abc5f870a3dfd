"""Scale simulator: what DCP's coordinator and one ordinary rank spend per save and load at N ranks.

SIMULATED, not run on N processes. For a model shape and a parallelism (benchmarks/scale_layouts.py)
it runs, in one process per (layout, N, contender) point, the code of one save's protocol as DCP
drives it, with the real planner and storage writer objects, on synthetic inputs:

* one ordinary rank (rank N/2): DCP's ``create_local_plan`` on that rank's real state dict
  (DTensors with zero-byte local tensors, under torch's ``fake`` process group, which lets one
  process be any rank of any world), the writer's ``prepare_local_plan``, the pickling of its
  plan for the gather, then its side of the scatter, ``finish_plan`` and the broadcast of the
  result;
* the other N-1 local plans come from :class:`~benchmarks.scale_layouts.PlanBuilder` (the same
  plan, built from ints: checked equal to DCP's for the measured rank at every point, and in
  tests/test_scale_sim.py against real FSDP2/TP modules), prepared by the same writer call and
  pickled as ``dist.gather_object`` pickles them: that work is each rank's own and is not
  timed here;
* the coordinator: unpickling the N gathered plans, ``planner.create_global_plan`` (dedup,
  metadata, validation, each also timed apart), the writer's ``prepare_global_plan`` (the real
  call: ours claims the path in a temp directory), pickling the N global plans for the scatter,
  unpickling N ranks' write results (synthesized: ``WriteResult(index, size, _StorageInfo(file,
  offset, length))`` per item of each rank's global plan, in each writer's wire form: ours sends
  ``CompactWriteResults`` marked as handed over before durable, as in ``async_save``), the
  writer's real ``finish`` (``.metadata`` written, fsynced, in a temp directory; its parts timed
  apart too) and the pickling of the metadata for DCP's broadcast of the result;
* durability (ours): N-1 simulated ranks report through a real ``torch.distributed.TCPStore`` on
  127.0.0.1 (``rank_commit.report``, from ``--store-threads`` client connections, one thread
  each), and the coordinator's ``rank_commit.wait_for_ranks`` is timed over them;
* load, resharded to N/2 ranks: ``FileSystemReader.read_metadata`` of the ``.metadata`` the save
  wrote, one rank's ``DefaultLoadPlanner`` set-up and ``create_local_plan``, the gather and
  scatter of N/2 load plans (N/2 copies of the measured rank's plan: the others are not built);
* repeated save with ``enable_plan_caching=True`` on both planners: the second save of the same
  structure (a first one fills DCP's caches, untimed).

Contenders: ``stock`` (DefaultSavePlanner + torch's FileSystemWriter) and ``ours``
(DataStatesSavePlanner + DataStatesWriter). Per step: wall and CPU time (``thread_time``), time in
Python's garbage collector, resident-memory growth (peak VmHWM during the step minus RSS at its
start), tracemalloc peak (for N <= ``--tracemalloc-ranks``: a second pass under tracemalloc), and
bytes on the wire: pickled sizes of what the collective carries (``wire_bytes``, summed over
ranks; ``wire_padded_bytes``: what torch's gather/scatter of objects allocates, every object
padded to the largest). No network is simulated: a collective's transfer time is not included.

The garbage collector runs as each contender's code leaves it: the stock path never pauses it;
ours pauses it from ``set_up_storage_writer`` on (its real call), as in ``async_save``, within
the limits its pauses have (dcp_datastates/runtime/gcpause.py); ``gc_enabled`` says per step.

A point that exceeds ``--timeout`` is recorded as timed out and larger N of that layout and
contender are skipped; so is one whose resident memory would exceed ``--mem-budget``: the point
is killed when it does, and a point is skipped beforehand when the bytes per rank-item measured
at a smaller N put it over the budget (a projection, used to skip, never reported as a result).

    python -m benchmarks.scale_sim --quick --out /tmp/ss                  # seconds
    python -m benchmarks.scale_sim --model 70b --layouts fsdp --ranks 256,1024,2048 \\
        --out benchmarks/results/scale-sim

Writes scale_sim.json (one record per layout x N x contender x step), scale_sim.png and
scale_sim.md (the tables it prints). docs/scale.md has results.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import io
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

from benchmarks.metrics import PeakRSS, rss_bytes  # noqa: E402
from benchmarks.scale_layouts import (  # noqa: E402
    LAYOUTS,
    MODELS,
    PlanBuilder,
    device_mesh,
    fake_world,
    in_fresh_thread,
    make_layout,
)

CONTENDERS = ("stock", "ours")
GIB = 1 << 30
MEM_FLOOR = GIB  # a point is stopped when the machine has less available than this
# Steps in the order a save runs them ("." marks a part of the step before it).
SAVE_STEPS = (
    ("create_local_plan", "rank"),
    ("prepare_local_plan", "rank"),
    ("gather_send", "rank"),
    ("gather_plans", "coordinator"),
    ("create_global_plan", "coordinator"),
    ("create_global_plan.dedup", "coordinator"),
    ("create_global_plan.build_metadata", "coordinator"),
    ("create_global_plan.validate", "coordinator"),
    ("prepare_global_plan", "coordinator"),
    ("scatter_plans", "coordinator"),
    ("scatter_recv", "rank"),
    ("finish_plan", "rank"),
    ("gather_results_send", "rank"),
    ("gather_results", "coordinator"),
    ("finish.merge_storage_data", "coordinator"),
    ("finish.share_metadata_values", "coordinator"),
    ("finish.pickle_metadata", "coordinator"),
    ("finish", "coordinator"),
    ("broadcast_metadata", "coordinator"),
    ("broadcast_recv", "rank"),
    ("durability_report", "ranks"),
    ("durability_wait", "coordinator"),
    ("durability_concurrent", "coordinator"),
)
LOAD_STEPS = (
    ("read_metadata", "rank"),
    ("load_local_plan", "rank"),
    ("gather_send", "rank"),
    ("gather_plans", "coordinator"),
    ("create_global_plan", "coordinator"),
    ("scatter_plans", "coordinator"),
    ("scatter_recv", "rank"),
)
# Steps left out of a phase's total: parts of other steps, and what ranks do in the background.
NOT_IN_TOTAL = ("durability_report", "durability_concurrent")


def _dumps(obj: Any) -> bytes:
    """Pickles ``obj`` as torch's object collectives do (``distributed_c10d._pickler``)."""
    from torch.distributed import distributed_c10d

    f = io.BytesIO()
    distributed_c10d._pickler(f).dump(obj)
    return f.getvalue()


def _loads(blob: bytes) -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._unpickler(io.BytesIO(blob)).load()


def _wire(blobs: list[bytes]) -> dict[str, int]:
    """Sizes of a gather/scatter of pickled objects: total, largest, and what torch allocates
    (every object padded to the largest)."""
    top = max((len(b) for b in blobs), default=0)
    return {"wire_bytes": sum(len(b) for b in blobs), "wire_max_bytes": top,
            "wire_padded_bytes": top * len(blobs), "wire_objects": len(blobs)}


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """The simulator's own work (standing in for other ranks): no collections meanwhile, with
    the writer's own re-entrant pause mechanism (so it composes with the writer's pauses)."""
    from dcp_datastates.runtime.gcpause import gc_paused

    with gc_paused():
        yield


class _GcClock:
    """Time spent in, and number of, garbage collections (``gc.callbacks``), any thread."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._t0: float | None = None
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1
            self._t0 = None

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._cb)


class Meter:
    """Runs and measures the simulator's steps; collects one record per step."""

    def __init__(self, point: dict[str, Any], trace: bool) -> None:
        self.point = point
        self.trace = trace
        self.records: list[dict[str, Any]] = []
        self.gc = _GcClock()
        self.peak = PeakRSS()

    def step(self, phase: str, step: str, role: str, fn: Callable[[], Any],
             wire: Callable[[Any], dict[str, int]] | None = None, note: str = "") -> Any:
        """Runs ``fn`` as one measured step and returns its result."""
        gc_s0, gc_n0, enabled = self.gc.seconds, self.gc.count, gc.isenabled()
        tm0 = 0
        if self.trace:
            tracemalloc.reset_peak()
            tm0 = tracemalloc.get_traced_memory()[0]
        self.peak.reset()
        rss0 = rss_bytes()
        w0, c0 = time.perf_counter(), time.thread_time()
        out = fn()
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
        peak = self.peak.peak()
        rec: dict[str, Any] = {
            **self.point, "phase": phase, "step": step, "role": role, "status": "measured",
            "wall_s": wall, "cpu_s": cpu, "gc_s": self.gc.seconds - gc_s0,
            "gc_collections": self.gc.count - gc_n0, "gc_enabled": enabled,
            "rss_peak_bytes": peak, "rss_peak_delta_bytes": max(0, peak - rss0),
            "tracemalloc_peak_bytes": (tracemalloc.get_traced_memory()[1] - tm0
                                       if self.trace else None),
        }
        if wire is not None:
            rec.update(wire(out))
        if note:
            rec["note"] = note
        self.records.append(rec)
        return out

    @contextlib.contextmanager
    def parts(self, phase: str, role: str, probes: dict[str, tuple[Any, str]]) -> Iterator[None]:
        """Times calls of module functions while the block runs (``probes``: step name ->
        (module, attribute)), one record per call, wall and CPU time only: the parts of a step
        whose code calls them by their module-global names."""
        saved = {name: getattr(mod, attr) for name, (mod, attr) in probes.items()}

        def probe(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*a: Any, **k: Any) -> Any:
                gc_s0, w0, c0 = self.gc.seconds, time.perf_counter(), time.thread_time()
                try:
                    return fn(*a, **k)
                finally:
                    self.records.append({
                        **self.point, "phase": phase, "step": name, "role": role,
                        "status": "measured", "wall_s": time.perf_counter() - w0,
                        "cpu_s": time.thread_time() - c0, "gc_s": self.gc.seconds - gc_s0,
                        "gc_enabled": gc.isenabled(),
                    })
            return timed

        for name, (mod, attr) in probes.items():
            setattr(mod, attr, probe(name, saved[name]))
        try:
            yield
        finally:
            for name, (mod, attr) in probes.items():
                setattr(mod, attr, saved[name])

    def skip(self, phase: str, step: str, role: str, why: str, status: str = "skipped") -> None:
        self.records.append({**self.point, "phase": phase, "step": step, "role": role,
                             "status": status, "note": why})

    def close(self) -> None:
        self.gc.close()
        self.peak.close()


@dataclass
class PointConfig:
    """One point: a layout of a model over ``ranks`` ranks, one contender."""

    model: str
    layout: str
    ranks: int
    contender: str
    tp: int = 8
    shard_group: int = 8
    repeat: bool = True
    store_threads: int = 4
    trace: bool = False
    root: str = ""
    max_index_bytes: int = 2 * GIB
    durability_only: bool = False


def _results_for(plan: Any, rank: int, builder: PlanBuilder, contender: str) -> list[Any]:
    """The write results a rank's ``write_data`` returns for ``plan``: each item's bytes placed
    one after the other in the rank's data files (stock: FileSystemWriter's one file per rank;
    ours: two, its default ``files_per_rank``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    nfiles = 1 if contender == "stock" else 2
    offsets = [0] * nfiles
    out = []
    for k, item in enumerate(plan.items):
        f = k % nfiles
        length = builder.nbytes(item)
        out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(
            relative_path=f"__{rank}_{f}.distcp", offset=offsets[f], length=length)))
        offsets[f] += length
    return out


class Simulation:
    """One point's save, durability, load and repeated save (see the module docstring)."""

    def __init__(self, cfg: PointConfig, meter: Meter, tag: str) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        from dcp_datastates import DataStatesSavePlanner

        self.cfg = cfg
        self.meter = meter
        self.tag = tag  # distinguishes DCP's class-level plan caches between passes
        self.n = cfg.ranks
        self.rank = cfg.ranks // 2  # the measured ordinary rank
        self.layout = make_layout(cfg.layout, cfg.ranks, tp=cfg.tp, shard_group=cfg.shard_group)
        self.builder = PlanBuilder(MODELS[cfg.model], self.layout)
        self.ours = cfg.contender == "ours"
        self.planner_cls = DataStatesSavePlanner if self.ours else DefaultSavePlanner
        self.writers: list[Any] = []
        self.info: dict[str, Any] = {"items_per_rank": self.builder.items_per_rank,
                                     "measured_rank": self.rank,
                                     "mesh": list(self.layout.mesh_shape)}
        self.result_blobs: list[bytes] = []
        self.ckpt = ""

    # --------------------------------------------------------------------------------------
    # helpers
    def _writer(self, path: str, rank: int, coordinator: bool) -> Any:
        """A storage writer set up as DCP sets it up for ``rank`` of a save to ``path``."""
        if self.ours:
            from dcp_datastates import DataStatesWriter

            w = DataStatesWriter(os.path.dirname(path), host_cache_size="64MiB",
                                 pin_memory=False)
            self.writers.append(w)
        else:
            from torch.distributed.checkpoint import FileSystemWriter

            w = FileSystemWriter(path)
        w.reset(path)
        w.storage_meta()
        w.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        return w

    def _planner(self, caching: bool, role: str) -> Any:
        p = self.planner_cls(enable_plan_caching=caching)
        p._cached_plans_key = f"{type(p).__name__}@{role}#{self.tag}"  # one process, two roles
        return p

    @staticmethod
    def _index_bytes(builder: PlanBuilder, rank: int) -> int:
        """The largest index tensor torch's ``compute_local_shape_and_global_offset`` allocates
        for one of ``rank``'s shards: 8 bytes per element along a sharded dim (DCP's planners
        call it per DTensor)."""
        return max((8 * max(builder.shard(e, rank)[0], default=0)
                    for e in builder.entries if e.kind == "dtensor"), default=0)

    def _rank_local_plan(self, phase: str, planner: Any) -> Any:
        """The measured rank's ``create_local_plan``: DCP's planner on its real (fake-world)
        DTensor state dict; the builder's plan is checked equal to it."""
        want = self.builder.local_plan(self.rank)
        need = self._index_bytes(self.builder, self.rank)
        if need > self.cfg.max_index_bytes:
            self.meter.skip(phase, "create_local_plan", "rank",
                            f"not run: DCP's planner would allocate a {need / GIB:.1f} GiB index "
                            "tensor for one shard (torch's compute_local_shape_and_global_offset)"
                            "; the builder's plan stands in")
            self.info["builder_check"] = "skipped (index tensor too large)"
            return want

        def run() -> Any:
            with fake_world(self.rank, self.n):
                state = self.builder.state_dict(device_mesh(self.layout))

                def plan() -> Any:
                    planner.set_up_planner(state, is_coordinator=False)
                    return planner.create_local_plan()

                return self.meter.step(phase, "create_local_plan", "rank", plan)

        got = in_fresh_thread(run)
        if phase == "save":
            if got != want:
                raise AssertionError(f"rank {self.rank}: the builder's plan differs from DCP's")
            self.info["builder_check"] = "equal to DCP's plan for the measured rank"
        return got

    # --------------------------------------------------------------------------------------
    # save
    def save(self) -> None:
        """The first save (see the module docstring)."""
        m, r = self.meter, self.rank
        root = tempfile.mkdtemp(prefix="save-", dir=self.cfg.root)
        path = self.ckpt = os.path.join(root, "step-1")
        rank_planner = self._planner(False, "rank")
        # DCP sets the writer up before create_local_plan (ours: its collector pause begins)
        rank_w = self._writer(path, r, False)
        plan_r = self._rank_local_plan("save", rank_planner)
        plan_r = m.step("save", "prepare_local_plan", "rank",
                        lambda: rank_w.prepare_local_plan(plan_r))
        blob_r = m.step("save", "gather_send", "rank", lambda: _dumps(plan_r),
                        wire=lambda b: _wire([b]))
        blobs = self._other_plans(rank_w, {r: blob_r})
        coord_w = self._writer(path, 0, True)  # ours: its collector pause begins here
        blobs[0] = _dumps(coord_w.prepare_local_plan(self._raw0))
        del self._raw0
        plans = m.step("save", "gather_plans", "coordinator",
                       lambda: [_loads(b) for b in blobs], wire=lambda _: _wire(blobs))
        blobs.clear()
        coord_p = self._planner(False, "coordinator")
        coord_p.set_up_planner({}, is_coordinator=True)  # its global step reads only the plans
        global_plans, metadata = self._global_plan("save", coord_p, plans)
        global_plans = m.step("save", "prepare_global_plan", "coordinator",
                              lambda: coord_w.prepare_global_plan(global_plans))
        scattered = m.step("save", "scatter_plans", "coordinator",
                           lambda: [_dumps(p) for p in global_plans], wire=_wire)
        del plans  # DCP's reduce_scatter holds the gathered plans until the scatter is done
        got = m.step("save", "scatter_recv", "rank", lambda: _loads(scattered[r]))
        scattered.clear()
        m.step("save", "finish_plan", "rank", lambda: rank_planner.finish_plan(got))
        self.result_blobs = self._results(global_plans)
        self._finish("save", coord_w, metadata)

    def _other_plans(self, writer: Any, done: dict[int, bytes]) -> list[bytes]:
        """The pickled local plans of the ranks not measured (each rank's own work: untimed);
        rank 0's raw plan is kept for the coordinator's writer."""
        blobs: list[bytes] = [b""] * self.n
        mappings = self.builder.mappings()
        with untimed():
            for q in range(self.n):
                if q in done:
                    blobs[q] = done[q]
                    continue
                plan = self.builder.local_plan(q, mappings)
                if q == 0:
                    self._raw0 = plan
                    continue
                blobs[q] = _dumps(writer.prepare_local_plan(plan))
        return blobs

    def _global_plan(self, phase: str, planner: Any, plans: list[Any]) -> tuple[Any, Any]:
        from torch.distributed.checkpoint import default_planner as dp

        probes = {
            "create_global_plan.dedup": (dp, "dedup_save_plans"),
            "create_global_plan.build_metadata": (dp, "create_default_global_save_plan"),
            "create_global_plan.validate": (dp, "_validate_global_plan"),
        }
        with self.meter.parts(phase, "coordinator", probes):
            return self.meter.step(phase, "create_global_plan", "coordinator",
                                   lambda: planner.create_global_plan(plans))

    def _wire_results(self, plan: Any, q: int, by_reference: bool = False) -> Any:
        """Rank ``q``'s write results as its writer hands them to DCP's gather (ours: compact,
        with their digest, by reference when the coordinator holds them)."""
        from dcp_datastates.save.rank_commit import Ticket
        from dcp_datastates.save.wire import CompactWriteResults

        res = _results_for(plan, q, self.builder, self.cfg.contender)
        if not self.ours:
            return res
        res = CompactWriteResults(res)
        res.with_digest = True
        res.by_reference = by_reference
        if q != 0:  # async_save: handed over before durable, reported through the store
            res.awaited = Ticket(q, uuid.uuid4().hex, "0-simulated00")
        return res

    def _results(self, global_plans: list[Any], phase: str = "save",
                 by_reference: bool = False) -> list[bytes]:
        """Every rank's pickled write results (each rank's own work: untimed, but for the
        measured rank's pickling)."""
        blobs: list[bytes] = []
        with untimed():
            for q in range(self.n):
                if q != self.rank:
                    blobs.append(_dumps(self._wire_results(global_plans[q], q, by_reference)))
                    continue
                res = self._wire_results(global_plans[q], q, by_reference)
                blobs.append(b"")
        blobs[self.rank] = self.meter.step(phase, "gather_results_send", "rank",
                                           lambda: _dumps(res), wire=lambda b: _wire([b]))
        return blobs

    def _finish(self, phase: str, writer: Any, metadata: Any, reused: bool = False) -> None:
        """The results gather, the writer's finish (and its parts) and the broadcast.
        ``reused``: ours, a repeated save whose results came by reference: finish() reuses the
        last commit's (result_cache.py), so its parts are not timed apart."""
        from dcp_datastates.save.planner import share_metadata_values

        m, blobs = self.meter, self.result_blobs
        results = m.step(phase, "gather_results", "coordinator",
                         lambda: [_loads(b) for b in blobs], wire=lambda _: _wire(blobs))
        if reused:
            for part in ("finish.merge_storage_data", "finish.share_metadata_values",
                         "finish.pickle_metadata"):
                m.skip(phase, part, "coordinator", "not run: every rank's results came by "
                       "reference and the last commit's .metadata is reused (result_cache.py)",
                       status="reused")
            m.step(phase, "finish", "coordinator", lambda: writer.finish(metadata, results),
                   note="the writer's real finish(): the last commit's .metadata restamped, "
                   "written and fsynced in a temp dir")
            self._broadcast(phase, metadata, results)
            return

        def merge() -> None:  # both writers' finish() begin with this loop
            storage_md = {}
            for wr_list in results:
                storage_md.update({wr.index: wr.storage_data for wr in wr_list})
            metadata.storage_data = storage_md

        m.step(phase, "finish.merge_storage_data", "coordinator", merge)
        if self.ours:
            m.step(phase, "finish.share_metadata_values", "coordinator",
                   lambda: share_metadata_values(metadata))
        m.step(phase, "finish.pickle_metadata", "coordinator", lambda: pickle.dumps(metadata),
               wire=lambda b: {"wire_bytes": len(b)}, note="the .metadata file's bytes")
        m.step(phase, "finish", "coordinator", lambda: writer.finish(metadata, results),
               note="the writer's real finish(): .metadata written and fsynced in a temp dir")
        self._broadcast(phase, metadata, results)

    def _broadcast(self, phase: str, metadata: Any, results: list[Any]) -> None:
        """DCP's broadcast of the save's result (ours, an async_save of several ranks: the
        committed metadata goes as a reference, lazy_metadata.py)."""
        from dcp_datastates.save.lazy_metadata import broadcast_as_reference

        m = self.meter
        if self.ours:
            broadcast_as_reference(metadata, self.cfg.root, None)
        blob = m.step(phase, "broadcast_metadata", "coordinator", lambda: _dumps(metadata),
                      wire=lambda b: {"wire_bytes": len(b), "wire_objects": 1})
        results.clear()  # DCP's all_reduce holds the gathered results until its broadcast
        m.step(phase, "broadcast_recv", "rank", lambda: _loads(blob))

    # --------------------------------------------------------------------------------------
    # durability (ours)
    def durability(self) -> None:
        if not self.ours:
            for step, role in (("durability_report", "ranks"), ("durability_wait", "coordinator"),
                               ("durability_concurrent", "coordinator")):
                self.meter.skip("save", step, role, "stock: no durability reports (ranks return "
                                "their results once durable)", status="n/a")
            return
        out = durability_round(self.n, self.cfg.store_threads, meter=self.meter)
        self.info["durability"] = out

    # --------------------------------------------------------------------------------------
    # load
    def load(self) -> None:
        """One rank's share of a load resharded to N/2 ranks (see the module docstring), in a
        forked child: a load runs in a fresh process, with the collector on (the child starts
        without the writer's pauses, dcp_datastates/runtime/gcpause.py) and without the save's
        objects to scan (frozen before the fork)."""
        from benchmarks.metrics import release_memory

        release_memory()
        gc.freeze()
        try:
            self.meter.records += in_child(self._load, self.meter)
        finally:
            gc.unfreeze()

    def _load(self, m: Meter) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        reader = FileSystemReader(self.ckpt)
        md = m.step("load", "read_metadata", "rank", reader.read_metadata,
                    wire=lambda _: {"wire_bytes": os.path.getsize(
                        os.path.join(self.ckpt, ".metadata"))},
                    note="FileSystemReader.read_metadata of the .metadata the save wrote")
        n2 = max(1, self.n // 2)
        target = make_layout(self.cfg.layout, n2, tp=self.cfg.tp,
                             shard_group=self.cfg.shard_group)
        tb = PlanBuilder(MODELS[self.cfg.model], target)
        r2 = n2 // 2
        need = self._index_bytes(tb, r2)
        if need > self.cfg.max_index_bytes:
            for step, role in LOAD_STEPS[1:]:
                m.skip("load", step, role, f"not run: DCP's load planner would allocate a "
                       f"{need / GIB:.1f} GiB index tensor for one shard")
            return

        def run() -> Any:
            with fake_world(r2, n2):
                state = tb.state_dict(device_mesh(target))

                def plan() -> Any:
                    planner = DefaultLoadPlanner()
                    planner.set_up_planner(state, md, is_coordinator=False)
                    return planner.create_local_plan()

                return m.step("load", "load_local_plan", "rank", plan,
                              note=f"rank {r2} of {n2}: resharded from {self.n} ranks")

        lp = in_fresh_thread(run)
        blob = m.step("load", "gather_send", "rank", lambda: _dumps(lp),
                      wire=lambda b: _wire([b]))
        blobs = [blob] * n2
        note = f"{n2} copies of the measured rank's load plan (the others are not built)"
        plans = m.step("load", "gather_plans", "coordinator", lambda: [_loads(b) for b in blobs],
                       wire=lambda _: _wire(blobs), note=note)
        planner = DefaultLoadPlanner()
        plans = m.step("load", "create_global_plan", "coordinator",
                       lambda: reader.prepare_global_plan(planner.create_global_plan(plans)))
        out = m.step("load", "scatter_plans", "coordinator", lambda: [_dumps(p) for p in plans],
                     wire=_wire, note=note)
        m.step("load", "scatter_recv", "rank", lambda: _loads(out[0]))

    # --------------------------------------------------------------------------------------
    # repeated save with plan caching
    def save_repeat(self) -> None:
        """A first save with ``enable_plan_caching=True`` (untimed: it fills DCP's caches), then
        the second save of the same structure, timed."""

        m, n, r = self.meter, self.n, self.rank
        root = tempfile.mkdtemp(prefix="repeat-", dir=self.cfg.root)
        self._warm_cache(root)
        path = os.path.join(root, "step-3")
        rank_p = self._planner(True, "rank")
        rank_w = self._writer(path, r, False)
        plan_r = self._rank_local_plan("save_repeat", rank_p)
        if plan_r.usable or plan_r.items:
            raise AssertionError("the cached local plan was not reused")
        plan_r = m.step("save_repeat", "prepare_local_plan", "rank",
                        lambda: rank_w.prepare_local_plan(plan_r))
        blob_r = m.step("save_repeat", "gather_send", "rank", lambda: _dumps(plan_r),
                        wire=lambda b: _wire([b]))
        with untimed():  # every other rank's plan is unchanged: the same empty plan (ours: a
            blobs = [_dumps(rank_w.prepare_local_plan(self._unchanged_plan(q)))  # reference)
                     if q != r else blob_r for q in range(n)]
        coord_w = self._writer(path, 0, True)
        plans = m.step("save_repeat", "gather_plans", "coordinator",
                       lambda: [_loads(b) for b in blobs], wire=lambda _: _wire(blobs))
        coord_p = self._planner(True, "coordinator")
        coord_p.set_up_planner({}, is_coordinator=True)
        delta, metadata = m.step("save_repeat", "create_global_plan", "coordinator",
                                 lambda: coord_p.create_global_plan(plans))
        delta = m.step("save_repeat", "prepare_global_plan", "coordinator",
                       lambda: coord_w.prepare_global_plan(delta))
        scattered = m.step("save_repeat", "scatter_plans", "coordinator",
                           lambda: [_dumps(p) for p in delta], wire=_wire)
        got = m.step("save_repeat", "scatter_recv", "rank", lambda: _loads(scattered[r]))
        final = m.step("save_repeat", "finish_plan", "rank", lambda: rank_p.finish_plan(got))
        if len(final.items) != len(self._cached_rank_plan.items):
            raise AssertionError("finish_plan did not return the cached final plan")
        if self.ours:
            with untimed():
                coord_p.finish_plan(delta[0])  # the coordinator's own end of the planning
        if self.ours:  # every rank's results are those of the warm save: by reference
            self.result_blobs = self._results(self._warm_plans, "save_repeat", True)
            del self._warm_plans
            self._finish("save_repeat", coord_w, metadata, reused=True)
            return
        m.skip("save_repeat", "gather_results_send", "rank",
               "as in the first save: the results are not cached by DCP", status="same")
        self._finish("save_repeat", coord_w, metadata)

    def _warm_cache(self, root: str) -> None:
        """A first save with plan caching: fills DCP's caches (the coordinator's gathered
        plans, global plans and metadata; the measured rank's local and final plans)."""
        from torch.distributed.checkpoint.planner import SavePlanner

        path = os.path.join(root, "step-2")
        rank_p = self._planner(True, "rank")
        self._rank_local_plan("warm", rank_p)
        self.meter.records = [x for x in self.meter.records if x["phase"] != "warm"]
        rank_w = self._writer(path, self.rank, False)
        with untimed():
            mappings = self.builder.mappings()
            plans = [rank_w.prepare_local_plan(self.builder.local_plan(q, mappings))
                     for q in range(self.n)]
            if self.ours:  # each rank's plan carries its structure key (plan_cache.py)
                plans = [self._keyed(p, rank_p) for p in plans]
        coord_w = self._writer(path, 0, True)
        coord_p = self._planner(True, "coordinator")
        coord_p.set_up_planner({}, is_coordinator=True)
        with untimed():
            global_plans, metadata = coord_p.create_global_plan(plans)
            global_plans = coord_w.prepare_global_plan(global_plans)
            del plans
            if self.ours:  # what every rank will send next time: its key, its plan's token
                pending = coord_p._pending
                self._refs = list(zip(pending.resolved.keys, pending.entry.tokens, strict=True))
                coord_p.finish_plan(global_plans[0])  # the coordinator's cache is filled here
            self._cached_rank_plan = rank_p.finish_plan(global_plans[self.rank])
            # as the coordinator receives them (ours: with their digests, kept on commit)
            results = [_loads(_dumps(self._wire_results(global_plans[q], q)))
                       for q in range(self.n)]
            if self.ours:
                self._warm_plans = global_plans
        coord_w.finish(metadata, results)  # the cached metadata now holds its storage data
        if not self.ours:
            assert rank_p._cached_plans_key in SavePlanner._cached_save_plan

    @staticmethod
    def _keyed(plan: Any, planner: Any) -> Any:
        """``plan`` as our planner's ``create_local_plan`` sends it on a first save: with the
        key of its structure."""
        import dataclasses

        from dcp_datastates.save import plan_cache

        if isinstance(plan.planner_data, plan_cache.KeyedPlannerData):
            return plan
        key = plan_cache.structure_key(plan, planner._config())
        return dataclasses.replace(
            plan, planner_data=plan_cache.KeyedPlannerData(plan.planner_data, key))

    def _unchanged_plan(self, q: int) -> Any:
        """What rank ``q`` sends on a repeated save of its structure: DCP's empty plan (stock)
        or a reference to its cached global plan (ours)."""
        from torch.distributed.checkpoint.planner import SavePlan

        if not self.ours:
            return SavePlan([], usable=False)
        from dcp_datastates.save.plan_cache import CachedPlanRef

        key, token = self._refs[q]
        return SavePlan([], usable=False, planner_data=CachedPlanRef(key, token))

    # --------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from benchmarks.metrics import release_memory

        try:
            self.save()
            release_memory()  # between phases, untimed: what the save freed goes back
            self.durability()
            self.load()
            if self.cfg.repeat:
                release_memory()
                self.save_repeat()
        finally:
            for w in self.writers:
                w.close()
        return self.info


def in_child(fn: Callable[[Meter], None], meter: Meter) -> list[dict[str, Any]]:
    """Runs ``fn(meter')`` in a forked child with a meter of its own; returns its records
    (raises its error)."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            m = Meter(meter.point, meter.trace)
            fn(m)
            send.send((True, m.records))
        except BaseException as e:  # noqa: BLE001 - re-raised in the parent
            import traceback

            send.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        finally:
            send.close()

    p = ctx.Process(target=child, daemon=True)
    p.start()
    send.close()
    try:
        ok, payload = recv.recv()
    except EOFError:
        ok, payload = False, "the child died"
    p.join()
    if not ok:
        raise RuntimeError(f"forked step failed: {payload}")
    return payload


def durability_round(n: int, threads: int, meter: Meter | None = None,
                     drop: frozenset[int] = frozenset(), timeout_s: float = 600.0
                     ) -> dict[str, Any]:
    """Ranks 1..n-1 report through a real TCPStore on 127.0.0.1 (``rank_commit.report``, from
    ``threads`` client connections, one thread each; ranks in ``drop`` never report); the
    coordinator waits for them (``rank_commit.wait_for_ranks``, on the server's own store
    object, as rank 0 holds it): first with every report in, then with reports arriving while
    it waits. Raises what ``wait_for_ranks`` raises (with ``drop``: the missing ranks)."""
    import torch.distributed as dist

    from dcp_datastates.save import rank_commit

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False)
               for _ in range(max(1, threads))]
    where = "simulated"

    def report_all(ids: list[Any]) -> None:
        def worker(k: int) -> None:
            for t in ids[k::len(clients)]:
                if t.rank not in drop:
                    rank_commit.report(clients[k], t, None)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(len(clients))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def ids() -> list[Any]:
        group = rank_commit.group_of(where)
        return [rank_commit.Ticket(q, uuid.uuid4().hex, group) for q in range(1, n)]

    def report_bytes(d: list[Any]) -> dict[str, int]:
        # per report: an append of "rank:save_id;" to the group's list, an add to its counter
        body = sum(len(rank_commit._who_key(t.group)) + len(t.entry())
                   + len(rank_commit._count_key(t.group)) + 8 for t in d)
        return {"wire_bytes": body, "wire_objects": len(d)}

    step = meter.step if meter is not None else (lambda *a, **k: a[3]())
    first = ids()
    step("save", "durability_report", "ranks", lambda: report_all(first),
         wire=lambda _: report_bytes(first),
         note=f"{n - 1} reports from {len(clients)} client threads (an append and an add each)")
    step("save", "durability_wait", "coordinator",
         lambda: rank_commit.wait_for_ranks(server, first, where, timeout_s),
         note="every report in before the wait")
    second = ids()

    def concurrent() -> None:
        t = threading.Thread(target=report_all, args=(second,))
        t.start()
        try:
            rank_commit.wait_for_ranks(server, second, where, timeout_s)
        finally:
            t.join()

    step("save", "durability_concurrent", "coordinator", concurrent,
         note="reports sent while the coordinator waits: until the last one is seen")
    return {"threads": len(clients), "reports": n - 1}


# ------------------------------------------------------------------------------------------
# the point process
def _point_main(cfg: PointConfig, conn: Any) -> None:
    """Child process: runs one pass of a point (``cfg.trace``: under tracemalloc; the
    durability round alone with ``cfg.durability_only``), sends its records."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    point = {"model": cfg.model, "layout": cfg.layout, "ranks": cfg.ranks,
             "contender": cfg.contender}
    start_rss = rss_bytes()
    try:
        if cfg.trace:
            tracemalloc.start()
        meter = Meter(point, trace=cfg.trace)
        if cfg.durability_only:
            info = {"durability": durability_round(cfg.ranks, cfg.store_threads, meter=meter)}
        else:
            info = Simulation(cfg, meter, "trace" if cfg.trace else "time").run()
        steps = [x.get("rss_peak_bytes") or 0 for x in meter.records]
        info["steps_peak_rss_bytes"] = max(steps, default=0)
        info["start_rss_bytes"] = start_rss
        conn.send({"ok": True, "records": meter.records, "info": info})
        meter.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        conn.send({"ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]})
    finally:
        conn.close()


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its children (a point forks its load step)."""
    total = _rss_of(pid)
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(_tree_rss(int(c)) for c in f.read().split())
    except OSError:
        pass
    return total


def _rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run_child(cfg: PointConfig, timeout_s: float, mem_budget: int) -> dict[str, Any]:
    """One pass of a point in a child process, killed past ``timeout_s`` or ``mem_budget``
    bytes of resident memory (sampled every 0.25 s)."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_point_main, args=(cfg, send))  # not daemonic: it forks itself
    t0 = time.monotonic()
    p.start()
    send.close()
    peak, status, msg = 0, "", None
    while True:
        if recv.poll(0.25):
            try:
                msg = recv.recv()
            except EOFError:
                msg = None
            break
        if not p.is_alive():
            break
        rss = _tree_rss(p.pid)
        peak = max(peak, rss)
        if rss > mem_budget:
            status = "out of memory budget"
            msg = {"ok": False, "error": f"resident memory passed {mem_budget / GIB:.1f} GiB"}
            break
        if _mem_available() < MEM_FLOOR:
            status = "out of memory"
            msg = {"ok": False, "error": f"the machine's available memory fell below "
                   f"{MEM_FLOOR / GIB:g} GiB with the point at {rss / GIB:.1f} GiB "
                   "(other processes share the machine)"}
            break
        if time.monotonic() - t0 > timeout_s:
            status = "timed out"
            msg = {"ok": False, "error": f"still running after {timeout_s:g} s"}
            break
    if p.is_alive() and status:
        p.kill()
    p.join(60)
    if p.is_alive():
        p.kill()
        p.join()
    out: dict[str, Any] = {"wall_s": time.monotonic() - t0, "peak_rss_bytes": peak}
    if msg is None:
        why = (" (SIGKILL: the kernel's out-of-memory killer, most likely)"
               if p.exitcode == -9 else "")
        msg = {"ok": False, "error": f"the point's process died, exit code {p.exitcode}{why}, "
               f"at {peak / GIB:.1f} GiB resident"}
        status = "out of memory" if p.exitcode == -9 else "crashed"
    if msg.get("ok"):
        out.update(status="measured", records=msg["records"], info=msg["info"])
    else:
        out.update(status=status or "error", error=msg["error"],
                   traceback=msg.get("traceback"))
    return out


def run_point(cfg: PointConfig, timeout_s: float, mem_budget: int) -> dict[str, Any]:
    """Runs a point: its timing pass, then (``cfg.trace``) its tracemalloc pass in a second
    process, whose per-step peaks are merged into the timing pass's records. Returns
    ``{"status", "records", "info", "peak_rss_bytes", "wall_s"}``."""
    timing = dataclasses.replace(cfg, trace=False)
    out = _run_child(timing, timeout_s, mem_budget)
    if out["status"] != "measured" or not cfg.trace:
        return out
    tm = _run_child(cfg, max(1.0, timeout_s - out["wall_s"]), mem_budget)
    if tm["status"] != "measured":
        out["info"]["tracemalloc_pass"] = f"{tm['status']}: {tm.get('error')}"
        return out
    peaks = {(x["phase"], x["step"]): x.get("tracemalloc_peak_bytes") for x in tm["records"]}
    for x in out["records"]:
        x["tracemalloc_peak_bytes"] = peaks.get((x["phase"], x["step"]))
    out["info"]["tracemalloc_pass"] = f"measured in {tm['wall_s']:.1f} s"
    out["wall_s"] += tm["wall_s"]
    return out


# ------------------------------------------------------------------------------------------
# summaries, table, plot
def phase_total(records: list[dict[str, Any]], phase: str) -> float | None:
    """Sum of the wall time of a phase's measured steps (parts, and ranks' background reports,
    left out): the CPU work on the save's critical path; None if a step of it was not run."""
    steps = [x for x in records if x["phase"] == phase and "." not in x["step"]
             and x["step"] not in NOT_IN_TOTAL]
    if not any(x["step"] == "gather_plans" and x["status"] == "measured" for x in steps):
        return None  # the point was not simulated (a durability round alone, at most)
    if any(x["status"] == "skipped" for x in steps):
        return None
    return sum(x["wall_s"] for x in steps if x["status"] == "measured")


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 10 else f"{v:.1f}"


def _fmt_b(v: int | None) -> str:
    if not v:
        return "-"
    for unit, k in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= k:
            return f"{v / k:.1f} {unit}"
    return f"{v} B"


def tables(res: dict[str, Any]) -> str:
    """Markdown: per layout and N, every step, stock against ours."""
    out: list[str] = []
    by = _index(res)
    for layout in res["config"]["layouts"]:
        for n in res["config"]["ranks"]:
            pts = {c: res["points"].get(f"{layout}/{n}/{c}") for c in res["config"]["contenders"]}
            if not any(pts.values()):
                continue
            out.append(f"\n#### {layout}, {n} ranks (simulated)\n")
            heads = []
            for c, p in pts.items():
                if p is None:
                    continue
                extra = "" if p["status"] == "measured" else f": {p['status']} ({p.get('error')})"
                heads.append(f"{c}{extra}")
            out.append("; ".join(heads) + "\n")
            cs = [c for c, p in pts.items() if p and p["status"] == "measured"]
            if not cs:
                continue
            out.append("| phase | step | role | " + " | ".join(
                f"{c} wall s | {c} cpu s | {c} gc s | {c} wire" for c in cs) + " |")
            out.append("|---|---|---|" + "---|" * (4 * len(cs)))
            for phase, step, role in _step_rows(by, layout, n, cs):
                cells = []
                for c in cs:
                    x = by.get((layout, n, c, phase, step))
                    if x is None or x["status"] != "measured":
                        cells += [x["status"] if x else "-", "", "", ""]
                        continue
                    cells += [_fmt_s(x["wall_s"]), _fmt_s(x["cpu_s"]), _fmt_s(x.get("gc_s")),
                              _fmt_b(x.get("wire_bytes"))]
                out.append(f"| {phase} | {step} | {role} | " + " | ".join(cells) + " |")
            for phase in ("save", "load", "save_repeat"):
                tot = [phase_total([x for x in res["records"] if x["layout"] == layout
                                    and x["ranks"] == n and x["contender"] == c], phase)
                       for c in cs]
                out.append(f"| **{phase}** | **total** | | " + " | ".join(
                    f"**{_fmt_s(t)}** | | | " for t in tot) + " |")
    out.append(_durability_table(res))
    return "\n".join(out) + "\n"


def _durability_table(res: dict[str, Any]) -> str:
    """Ours' durability round (a real TCPStore) at every N it ran, simulated point or not."""
    recs = [x for x in res["records"] if x["contender"] == "ours"
            and x["step"].startswith("durability_") and x["status"] == "measured"]
    if not recs:
        return ""
    rows = ["\n#### durability reports through a real TCPStore (ours)\n",
            "| layout | ranks | reports (N-1) | report, all ranks s | wait, all in s "
            "| wait, concurrent s |", "|---|---|---|---|---|---|"]
    keys = sorted({(x["layout"], x["ranks"]) for x in recs})
    for layout, n in keys:
        got = {x["step"]: x["wall_s"] for x in recs if x["layout"] == layout and x["ranks"] == n}
        rows.append(f"| {layout} | {n} | {n - 1} | {_fmt_s(got.get('durability_report'))} | "
                    f"{_fmt_s(got.get('durability_wait'))} | "
                    f"{_fmt_s(got.get('durability_concurrent'))} |")
    return "\n".join(rows)


def _index(res: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(x["layout"], x["ranks"], x["contender"], x["phase"], x["step"]): x
            for x in res["records"]}


def _step_rows(by: dict[tuple[Any, ...], Any], layout: str, n: int,
               cs: list[str]) -> list[tuple[str, str, str]]:
    rows = []
    for phase, steps in (("save", SAVE_STEPS), ("load", LOAD_STEPS), ("save_repeat", SAVE_STEPS)):
        for step, role in steps:
            if any((layout, n, c, phase, step) in by for c in cs):
                rows.append((phase, step, role))
    return rows


def plot(res: dict[str, Any], path: str) -> None:
    """Log-log: the coordinator's time per step against N (stock dashed, ours solid), and the
    total per save, per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = res["config"]["layouts"]
    fig, axes = plt.subplots(len(layouts), 2, figsize=(13, 4.2 * len(layouts)), squeeze=False)
    steps = [s for s, role in SAVE_STEPS if role == "coordinator" and "." not in s]
    colors = plt.get_cmap("tab10")
    styles = {"stock": "--", "ours": "-"}
    for row, layout in zip(axes, layouts, strict=True):
        for c in res["config"]["contenders"]:
            recs = [x for x in res["records"] if x["layout"] == layout and x["contender"] == c]
            ns = sorted({x["ranks"] for x in recs})
            for k, step in enumerate(steps):
                pts = [(x["ranks"], x["wall_s"]) for x in recs if x["phase"] == "save"
                       and x["step"] == step and x["status"] == "measured"]
                if pts:
                    row[0].plot(*zip(*sorted(pts), strict=True), styles.get(c, ":"),
                                color=colors(k), marker="o", ms=3,
                                label=f"{step} ({c})")
            for k, phase in enumerate(("save", "save_repeat", "load")):
                pts = [(n, t) for n in ns if (t := phase_total(
                    [x for x in recs if x["ranks"] == n], phase)) is not None]
                if pts:
                    row[1].plot(*zip(*pts, strict=True), styles.get(c, ":"), color=colors(k),
                                marker="o", label=f"{phase} ({c})")
        for ax, title in zip(row, ("coordinator, per step (first save)",
                                   "total per save / load (critical path, CPU work)"),
                             strict=True):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks (simulated)")
            ax.set_ylabel("wall s")
            ax.set_title(f"{layout}: {title}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"SIMULATED: DCP save/load planning of model {res['config']['model']} at N "
                 "ranks, stock (dashed) vs ours (solid); no network, one process per point",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# CLI
def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * GIB


def _projected(done: dict[str, Any] | None, n: int, items: int) -> float | None:
    """Resident bytes a point of ``n`` ranks would need, from a smaller measured point's bytes
    per rank-item (a projection to decide whether to skip; never reported as a result)."""
    if not done:
        return None
    base = done["base_rss"]
    per = max(0.0, done["peak"] - base) / (done["ranks"] * done["items"])
    return base + per * n * items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scale_sim",
        description="SIMULATED scale of DCP's save/load planning at N ranks (see the module "
        "docstring): stock DCP vs DataStatesWriter, per step",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="70b", choices=sorted(MODELS))
    p.add_argument("--layouts", default="fsdp,hsdp,tp-fsdp,zero1",
                   help=f"comma list of {','.join(LAYOUTS)}")
    p.add_argument("--ranks", default="8,64,512,1024,4096,8192", help="comma list of N")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--tp", type=int, default=8, help="tp-fsdp: tensor-parallel degree")
    p.add_argument("--shard-group", type=int, default=8, help="hsdp: ranks per replica")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    p.add_argument("--mem-budget", type=float, default=0.0,
                   help="GiB of resident memory per point (default: 85%% of MemAvailable)")
    p.add_argument("--tracemalloc-ranks", type=int, default=256,
                   help="tracemalloc pass for N up to this (it triples a point's time)")
    p.add_argument("--no-repeat", action="store_true", help="skip the plan-caching save")
    p.add_argument("--store-threads", type=int, default=4, help="durability: client threads")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 8 and 16 ranks, every layout (seconds)")
    p.add_argument("--dir", default="", help="where checkpoints go (default: a temp dir)")
    p.add_argument("--out", help="output directory (default benchmarks/results/tmp/<time>)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.model, a.ranks, a.timeout = "tiny", "8,16", 300.0
    layouts = [x for x in a.layouts.split(",") if x]
    contenders = [x for x in a.contenders.split(",") if x]
    ranks = sorted({int(x) for x in a.ranks.split(",") if x})
    bad = [x for x in layouts if x not in LAYOUTS] + [x for x in contenders if x not in CONTENDERS]
    if bad or not layouts or not contenders or min(ranks, default=0) < 2:
        build_parser().error(f"bad --layouts/--contenders/--ranks ({bad}); N >= 2")
    budget = int(a.mem_budget * GIB) if a.mem_budget else int(0.85 * _mem_available())
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tmp",
                                _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    base = tempfile.mkdtemp(prefix="dcpds-scalesim-", dir=a.dir or None)
    res = _run_all(a, layouts, contenders, ranks, budget, base)
    shutil.rmtree(base, ignore_errors=True)
    from benchmarks.report import write_json

    write_json(os.path.join(out, "scale_sim.json"), res)
    plot(res, os.path.join(out, "scale_sim.png"))
    text = tables(res)
    with open(os.path.join(out, "scale_sim.md"), "w") as f:
        f.write(f"SIMULATED ({res['meta']['what']})\n\n`{res['meta']['command']}`\n{text}")
    print(text)
    print(f"wrote {out}/scale_sim.json, scale_sim.png, scale_sim.md")
    return 0 if all(p["status"] != "error" for p in res["points"].values()) else 1


def _one_point(a: argparse.Namespace, res: dict[str, Any], layout: str, n: int, c: str,
               budget: int, base: str, stopped: dict[tuple[str, str], str],
               done: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Runs (or skips) one point; a skipped point of ours still gets the durability round
    (a real TCPStore, nothing else: cheap at any N)."""
    key = f"{layout}/{n}/{c}"
    items = PlanBuilder(MODELS[a.model], make_layout(
        layout, n, tp=a.tp, shard_group=a.shard_group)).items_per_rank
    why = stopped.get((layout, c))
    proj = _projected(done.get((layout, c)), n, items)
    if why is None and proj is not None and proj > budget:
        why = (f"projected {proj / GIB:.1f} GiB resident (bytes per rank-item measured at "
               f"{done[(layout, c)]['ranks']} ranks) > budget {budget / GIB:.1f} GiB")
    root = tempfile.mkdtemp(prefix=f"{layout}-{n}-{c}-", dir=base)
    cfg = PointConfig(a.model, layout, n, c, tp=a.tp, shard_group=a.shard_group,
                      repeat=not a.no_repeat, store_threads=a.store_threads,
                      trace=n <= a.tracemalloc_ranks, root=root)
    try:
        _run_or_skip(a, res, key, cfg, items, why, budget, stopped, done)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # its checkpoints


def _run_or_skip(a: argparse.Namespace, res: dict[str, Any], key: str, cfg: PointConfig,
                 items: int, why: str | None, budget: int, stopped: dict[tuple[str, str], str],
                 done: dict[tuple[str, str], dict[str, Any]]) -> None:
    layout, n, c = cfg.layout, cfg.ranks, cfg.contender
    if why is not None:
        pt: dict[str, Any] = {"status": "skipped", "error": why}
        print(f"   {key}: skipped ({why})", flush=True)
    else:
        print(f"   {key} ...", flush=True)
        pt = run_point(cfg, a.timeout, budget)
        res["records"] += pt.pop("records", [])
        print(f"   {key}: {pt['status']} in {pt['wall_s']:.1f} s, peak "
              f"{pt['peak_rss_bytes'] / GIB:.2f} GiB"
              + (f" ({pt.get('error')})" if pt["status"] != "measured" else ""), flush=True)
    pt["items_per_rank"] = items
    res["points"][key] = pt
    if pt["status"] == "measured":
        info = pt["info"]
        if n >= 64:  # below, fixed costs dominate: no projection from there
            done[(layout, c)] = {"ranks": n, "items": items, "base_rss": info["start_rss_bytes"],
                                 "peak": info["steps_peak_rss_bytes"]}
        return
    stopped.setdefault((layout, c), f"a smaller N was {pt['status']}")
    if c == "ours":  # the durability round alone: a real TCPStore, cheap at any N
        d = _run_child(dataclasses.replace(cfg, durability_only=True), a.timeout, budget)
        res["records"] += d.pop("records", [])
        pt["durability_only"] = d["status"]


def _warm_up() -> None:
    """Imports (and the AdamW template) done once here, inherited by every forked point."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.default_planner  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401

    import dcp_datastates  # noqa: F401
    import dcp_datastates.save.rank_commit  # noqa: F401
    from benchmarks.scale_layouts import adamw_template

    adamw_template()


def _run_all(a: argparse.Namespace, layouts: list[str], contenders: list[str],
             ranks: list[int], budget: int, base: str) -> dict[str, Any]:
    from benchmarks.report import machine_info, now_iso

    res: dict[str, Any] = {
        "meta": {
            "simulated": True,
            "what": "one process per point runs DCP's and the writers' real planning code for "
                    "one ordinary rank and the coordinator; the other ranks' plans are "
                    "synthetic (equal to DCP's); no network",
            "command": " ".join(["python -m benchmarks.scale_sim", *sys.argv[1:]]),
            "started": now_iso(),
            "machine": machine_info(base, "cpu"),
            "mem_budget_bytes": budget,
        },
        "config": {"model": a.model, "layouts": layouts, "ranks": ranks,
                   "contenders": contenders, "tp": a.tp, "shard_group": a.shard_group,
                   "timeout_s": a.timeout, "tracemalloc_ranks": a.tracemalloc_ranks,
                   "repeat": not a.no_repeat, "store_threads": a.store_threads},
        "points": {}, "records": [],
    }
    _warm_up()
    stopped: dict[tuple[str, str], str] = {}
    done: dict[tuple[str, str], dict[str, Any]] = {}
    for layout in layouts:
        for n in ranks:
            for c in contenders:
                _one_point(a, res, layout, n, c, budget, base, stopped, done)
    res["meta"]["finished"] = now_iso()
    return res


if __name__ == "__main__":
    sys.exit(main())
