"""Per-item cost: many tiny tensors, DataStatesWriter against the stock FileSystemWriter.

Each measurement runs in a fresh process (so VmHWM is that contender's peak), contenders
interleaved, one JSON object printed (or written with --out):

* ``save``: ``dcp.save`` of N tensors of 4 floats, wall time and VmHWM;
* ``async``: time ``dcp.async_save`` blocked the caller (median of --saves saves), split into
  torch's own per-element work (``_stateful_to_state_dict``, timed alone on the same state; with
  a DataStatesWriter in the process that is our equivalent of it, dcp_datastates/dcplog.py) and
  the rest (our ``stage()``, or the stock stager's copy), for three shapes of state: ``flat``
  (N top-level keys), ``nested`` (under one top-level key, which removes torch's per-element
  part) and ``owned`` (nested, and owned by an optimizer that has stepped, as a model's
  parameters are in training: the plain call copies them lazily; each save is followed by that
  optimizer's ``step()``, whose wait for the copies is reported as ``barrier_s``).

    python -m benchmarks.small_tensors --n 100000 --out small.json
    python -m benchmarks.small_tensors --n 300 --n-async 200 --saves 2 --parallel 2  # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: see benchmarks/_as_script.py
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_script.py"))


def _vmhwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def _child(
    kind: str, contender: str, n: int, saves: int, shape: str, root: str
) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, state_dict_saver

    from dcp_datastates import DataStatesWriter

    tensors = {f"t{i}": torch.randn(4) for i in range(n)}
    sd: dict[str, Any] = tensors if shape == "flat" else {"model": tensors}
    opt = None
    if shape == "owned":
        params = [torch.nn.Parameter(t) for t in tensors.values()]
        tensors.update({k: p.detach() for k, p in zip(tensors, params, strict=True)})
        opt = torch.optim.SGD(params, lr=0.0)
        opt.step()  # known to the step hook from now on: its tensors may be copied lazily
    base_hwm = _vmhwm_kib()
    out: dict[str, Any] = {"kind": kind, "contender": contender, "n": n, "shape": shape,
                           "nested": shape != "flat"}
    w = DataStatesWriter(root, host_cache_size="1GiB") if contender == "datastates" else None
    try:
        if kind == "save":
            t0 = time.perf_counter()
            writer = w if w is not None else FileSystemWriter(root)
            dcp.save(sd, storage_writer=writer, checkpoint_id=root)
            out["save_s"] = time.perf_counter() - t0
        else:
            blocked, torch_part, barrier = [], [], []
            for k in range(saves):
                t0 = time.perf_counter()
                state_dict_saver._stateful_to_state_dict(sd)  # as DCP will call it
                torch_part.append(time.perf_counter() - t0)
                cid = os.path.join(root, f"s{k}")
                writer = w if w is not None else FileSystemWriter(cid)
                t0 = time.perf_counter()
                fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=cid)
                blocked.append(time.perf_counter() - t0)
                if opt is not None:
                    time.sleep(0.05)  # forward and backward would run here
                    opt.step()
                fut.result()
                if opt is not None and w is not None:
                    st = w.save_stats()[-1]
                    barrier.append(st["blocked_s"] - st["stage_s"])
            out["blocked_s"] = statistics.median(blocked)
            out["torch_part_s"] = statistics.median(torch_part)
            out["ours_or_stager_s"] = out["blocked_s"] - out["torch_part_s"]
            out["blocked_all_s"] = blocked
            if barrier:
                out["barrier_s"] = statistics.median(barrier)
    finally:
        if w is not None:
            w.close()
    out["vmhwm_mib"] = _vmhwm_kib() / 1024
    out["vmhwm_over_state_mib"] = (_vmhwm_kib() - base_hwm) / 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="tensors in the dcp.save case")
    ap.add_argument("--n-async", type=int, default=20_000, help="tensors in the async_save case")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--parallel", type=int, default=1,
                    help="measurements run at once (above 1: a smoke run, times not comparable)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        kind, contender, n, shape, root = a.child
        print(json.dumps(_child(kind, contender, int(n), a.saves, shape, root)))
        return 0
    results: list[dict[str, Any]] = []
    runs = [("save", c, a.n, "flat") for c in ("stock", "datastates")]
    runs += [("async", c, a.n_async, shape) for shape in ("flat", "nested", "owned")
             for c in ("stock", "datastates")]

    def one(run: tuple[str, str, int, str]) -> dict[str, Any]:
        kind, contender, n, shape = run
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
            cmd = [sys.executable, os.path.abspath(__file__), "--saves", str(a.saves),
                   "--child", kind, contender, str(n), shape, d]
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
            res: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
            print(json.dumps(res), file=sys.stderr)
            return res

    with concurrent.futures.ThreadPoolExecutor(max(1, a.parallel)) as pool:
        results += pool.map(one, runs)
    s = {r["contender"]: r for r in results if r["kind"] == "save"}
    summary = {
        "save_time_ratio": s["datastates"]["save_s"] / s["stock"]["save_s"],
        "save_vmhwm_ratio": s["datastates"]["vmhwm_mib"] / s["stock"]["vmhwm_mib"],
    }
    doc = {"command": " ".join(sys.argv), "results": results, "summary": summary}
    from benchmarks.report import emit_json

    emit_json(doc, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
