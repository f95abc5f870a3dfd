"""Capture speed from device tensors into host memory: the engine against torch's own copies.

For one state dict on ``--device`` (``cuda``, or ``cpu`` for a dry run), interleaved over
``--rounds``, each contender copies every tensor into host memory and waits for the last byte:

* ``pinned_copy``: ``dst.copy_(src, non_blocking=True)`` into preallocated pinned buffers, then one
  ``torch.cuda.synchronize()``: the peak torch reaches on this machine (no checkpoint at all);
* ``default_stager``: torch's ``DefaultStager`` (pinned memory, non-blocking copies, the staging
  buffers reused from the first round on where the torch version does; torch 2.11 allocates new
  ones at every stage, see ``contenders.reusable_stager``): ``stage()`` until its future is done;
* ``datastates``: ``dcp.async_save`` with ``DataStatesWriter`` (a cache that fits) until
  ``wait_captured()``: what the step barrier waits for (the flush to disk is waited for
  afterwards, outside the timing). No optimizer owns these tensors, so the plain call snapshots
  each one at the call (on a GPU: a device-side clone per tensor, then the DMA from the clone);
* ``datastates_owned``: the same with a copy of the state owned by an optimizer that has
  stepped, as a model's parameters and optimizer state are in training: copied lazily, straight
  from the tensors, no clones. ``call_s`` in the output is the ``async_save`` call alone (what
  training is blocked by when the copies finish under forward/backward).
* ``datastates_owned_unbatched``: ``datastates_owned`` through a writer whose engine issues one
  ``cudaMemcpyAsync`` per copy (``DCPDS_NO_CUDA_BATCH=1``), where the other batches them with
  ``cudaMemcpyBatchAsync`` (CUDA 12.8+): the batch call's gain, in the same run. The output's
  ``engine`` gives each writer's copy and batch call counts.

The state is the harness's synthetic one (``benchmarks.workloads``, e.g. ``2GB:mixed``: 5,732
tensors, per-tensor costs show; ``512MB:large``: 4 tensors, bandwidth shows). Prints (or writes
with --out) one JSON object with each contender's times, median GB/s and its ratio to
``pinned_copy``.

    python -m benchmarks.d2h --device cuda --state 2GB:mixed --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))

from benchmarks.contenders import reusable_stager  # noqa: E402

MiB = 1024 * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--state", default="2GB:mixed", help="synthetic state SIZE:MIX")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders",
                    default="pinned_copy,default_stager,datastates,datastates_owned,"
                            "datastates_owned_unbatched")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    from benchmarks.report import emit_json
    from benchmarks.workloads import SyntheticSpec, synthetic_state_dict
    from dcp_datastates import DataStatesWriter

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # nested under one key, as a model's state is: DCP's per-top-level-key work in async_save
    # (torch's _stateful_to_state_dict, ~40 us a key) is not what this benchmark measures
    flat = synthetic_state_dict(SyntheticSpec.parse(a.state), dev)
    state = {"model": flat}
    nbytes = sum(t.nbytes for t in flat.values())
    names = [c for c in a.contenders.split(",") if c]
    times: dict[str, list[float]] = {c: [] for c in names}
    errors: dict[str, str] = {}
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in flat.items()}
    owned_state: dict[str, Any] = {}
    owner: Any = None
    # its own tensors: ownership is per tensor, process-wide
    if any(n.startswith("datastates_owned") for n in names):
        owned = {k: v.clone() for k, v in flat.items()}
        owned_state = {"model": owned}
        floats = [v for v in owned.values() if v.is_floating_point()]
        owner = torch.optim.SGD(floats, lr=0.0)
        owner.step()  # the step hook now knows the optimizer: its tensors may be lazy
    call_s: dict[str, list[float]] = {c: [] for c in names if c.startswith("datastates")}
    stager: Any = None
    engine_counters: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        cache = f"{nbytes // MiB + 256}MiB"
        writer = DataStatesWriter(os.path.join(d, "w"), host_cache_size=cache)
        unbatched: Any = None
        if "datastates_owned_unbatched" in names:
            os.environ["DCPDS_NO_CUDA_BATCH"] = "1"  # read when the writer's engine enables CUDA
            try:
                unbatched = DataStatesWriter(os.path.join(d, "u"), host_cache_size=cache)
            finally:
                del os.environ["DCPDS_NO_CUDA_BATCH"]
        try:
            for r in range(a.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    if name in errors:
                        continue
                    sync()
                    t0 = time.perf_counter()
                    try:
                        if name == "pinned_copy":
                            for k, v in flat.items():
                                pinned[k].copy_(v, non_blocking=cuda)
                            sync()
                        elif name == "default_stager":
                            stager = reusable_stager(stager, {
                                "use_pinned_memory": cuda, "use_shared_memory": False,
                                "use_async_staging": True, "use_non_blocking_copy": cuda})
                            out = stager.stage(state)
                            if hasattr(out, "result"):
                                out.result()
                            sync()
                        elif name.startswith("datastates"):
                            w = unbatched if name.endswith("_unbatched") else writer
                            fut = dcp.async_save(
                                owned_state if name.startswith("datastates_owned") else state,
                                storage_writer=w, checkpoint_id=os.path.join(d, f"{name}-{r}"))
                            call_s[name].append(time.perf_counter() - t0)
                            w.wait_captured()
                        else:
                            raise ValueError(f"unknown contender {name!r}")
                        times[name].append(time.perf_counter() - t0)
                        if name.startswith("datastates"):
                            fut.result()
                    except Exception as e:  # noqa: BLE001 - a contender's failure is a result
                        errors[name] = f"{type(e).__name__}: {e}"[:500]
        finally:
            for label, w in (("batched", writer), ("unbatched", unbatched)):
                if w is not None:
                    engine_counters[label] = {
                        k: v for k, v in w.engine_counters().items() if k.startswith("cuda")}
                    engine_counters[label]["cuda_batch_error"] = getattr(
                        w.engine, "cuda_batch_error", "(an engine without batched copies)")
                    w.close()
            if stager is not None:
                stager.close()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    peak = med.get("pinned_copy")
    doc = {
        "command": " ".join(["python -m benchmarks.d2h", *(argv if argv is not None
                                                          else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "bytes": nbytes,
        "tensors": len(flat),
        "times_s": times,
        "median_s": med,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "x_pinned_copy": {k: peak / v for k, v in med.items()} if peak else {},
        "call_s": {k: statistics.median(v) for k, v in call_s.items() if v},
        "errors": errors,
        "engine": engine_counters,
    }
    emit_json(doc, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
