"""Recovery time: a training job SIGKILLed and restarted, from the restart to its first step.

Each trial runs an MLP training loop (AdamW; ``--width``/``--depth`` size its state) in a child
process that checkpoints every ``--every`` steps with ``DataStatesWriter`` on a fast tier in
``/dev/shm`` with ``persist_to`` a directory on disk (the persistence agent copies each
checkpoint there). Once ``--min-ckpts`` checkpoints are committed the child's process group is
SIGKILLed at a random time within the next checkpoint interval; the agent (its own process
group) finishes promoting what was committed. Then the job is restarted once per mode, the
modes' order rotated trial by trial, each restart loading the newest complete checkpoint and
running one training step:

- ``ours_fast``: ``resume_path(fast, slow)`` (the fast tier's copy) + ``DataStatesReader``;
- ``ours_disk``: the persistent tier's newest (``resume_path(None, slow)``) + ``DataStatesReader``;
- ``stock_disk``: the same checkpoint with the stock ``dcp.load(state, checkpoint_id=path)``.

Before every restart the page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``; where that
is not permitted, the persistent tier's files are evicted with ``posix_fadvise(DONTNEED)``, said
in the JSON as ``cache``), then ``import torch`` runs once in a throwaway process, so that the
libraries are cached as on a node that just ran the job while the checkpoint on disk is cold. A
``/dev/shm`` checkpoint is memory: no cache to drop. The restart time is measured from just
before the parent starts the child process to the end of its first training step (a wall clock
both read); its parts: process start + imports, model and optimizer build (the optimizer's
state allocated), finding and loading the checkpoint, the first step. No writer is built before
the first step in any mode. Writes one JSON object and a PNG (``--out``).

    python -m benchmarks.recovery --trials 5 --out benchmarks/results/recovery/recovery.json
    python -m benchmarks.recovery --quick --out /tmp/recovery.json        # CI: tiny, ~30 s
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MODES = ("ours_fast", "ours_disk", "stock_disk")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the training job (child) ----------------------------------------------------------------
def _build(width: int, depth: int, batch: int, lean: bool = False) -> tuple[Any, Any, Any]:
    """The model, AdamW and the batch. ``lean``: the weights are left uninitialised (built on
    the meta device, then given CPU memory), as a restart that loads them anyway can do."""
    import torch

    from benchmarks.mlp_loop import MLPConfig, make_mlp

    cfg = MLPConfig(width=width, depth=depth, batch=batch)
    if lean:
        with torch.device("meta"):
            model, _ = make_mlp(cfg, seed=0)
        model.to_empty(device="cpu")
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        model, opt = make_mlp(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    batch_xy = (torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen))
    return model, opt, batch_xy


def _state(model: Any, opt: Any, step: int) -> dict[str, Any]:
    from benchmarks.mlp_loop import mlp_state

    return {**mlp_state(model, opt), "step": step}


def child_train(a: argparse.Namespace) -> None:
    """Trains forever, a checkpoint every ``a.every`` steps; each commit is appended to
    ``a.progress`` (the parent kills it)."""
    import torch.distributed.checkpoint as dcp

    from benchmarks.mlp_loop import train_step
    from dcp_datastates import DataStatesWriter

    model, opt, (x, y) = _build(a.width, a.depth, a.batch)
    w = DataStatesWriter(a.fast, host_cache_size=a.cache, persist_to=a.slow,
                         fast_retention=1, persist_retention=2)
    fut = None
    step = 0

    def committed(f: Any, step: int) -> None:
        if f.exception() is None:
            with open(a.progress, "a") as out:
                out.write(f"{step} {time.time()}\n")

    while True:
        train_step(model, opt, x, y)
        step += 1
        if step % a.every == 0:
            if fut is not None:
                fut.result()
            fut = dcp.async_save(_state(model, opt, step), storage_writer=w,
                                 checkpoint_id=os.path.join(a.fast, f"step-{step}"))
            fut.add_done_callback(lambda f, s=step: committed(f, s))


def child_resume(a: argparse.Namespace) -> None:
    """Restores the newest checkpoint (per ``a.mode``), runs one step, writes timestamps."""
    t: dict[str, float] = {}
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from benchmarks.mlp_loop import train_step
    from dcp_datastates import DataStatesReader, resume_path

    t["imported"] = time.time()
    model, opt, (x, y) = _build(a.width, a.depth, a.batch, lean=a.lean_build)
    state = _state(model, opt, 0)  # get_state_dict allocates AdamW's state (a zero step)
    t["built"] = time.time()
    path = resume_path(a.fast if a.mode == "ours_fast" else None, a.slow)
    if path is None:
        listing = {r: sorted(os.listdir(r)) if os.path.isdir(r) else None
                   for r in (a.fast, a.slow)}
        raise SystemExit(f"nothing to resume from: {listing}")
    reader = None if a.mode == "stock_disk" else DataStatesReader(path)
    dcp.load(state, storage_reader=reader, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    t["loaded"] = time.time()
    train_step(model, opt, x, y)
    t["first_step"] = time.time()
    loss = float(torch.nn.functional.mse_loss(model(x), y))
    doc = {"times": t, "path": path, "resumed_step": int(state["step"]), "loss": loss,
           "last_read": getattr(reader, "last_read", None)}
    with open(a.result, "w") as f:
        json.dump(doc, f)


# -- the harness (parent) --------------------------------------------------------------------
def _child_cmd(a: argparse.Namespace, role: str, **extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.recovery", "--child", role, "--fast", a.fast,
           "--slow", a.slow, "--width", str(a.width), "--depth", str(a.depth),
           "--batch", str(a.batch), "--every", str(a.every), "--cache", a.cache]
    if a.lean_build:
        cmd.append("--lean-build")
    for k, v in extra.items():
        cmd += [f"--{k}", v]
    return cmd


def _env() -> dict[str, str]:
    # the dcp_datastates this process imported (an installed one, with its compiled engine)
    # before the repository, which provides benchmarks.*
    import dcp_datastates

    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(dcp_datastates.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (pkg_parent, ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _commits(progress: str) -> list[tuple[int, float]]:
    try:
        with open(progress) as f:
            return [(int(s), float(ts)) for s, ts in (ln.split() for ln in f if ln.strip())]
    except FileNotFoundError:
        return []


def _drop_caches(slow: str, allow: bool) -> str:
    """Empties the page cache (root) or evicts the persistent tier's files; says which."""
    if allow:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "dropped (echo 3 > /proc/sys/vm/drop_caches)"
        except OSError:
            pass
    from benchmarks.restore import evict

    evict(slow)
    return "persistent tier evicted (posix_fadvise DONTNEED); libraries warm"


def _run_training(a: argparse.Namespace, rng: random.Random, timeout_s: float) -> dict[str, Any]:
    """Starts the job, waits for ``min_ckpts`` commits, SIGKILLs it at a random point of the
    next interval, waits for the agent to finish promoting; returns what happened."""
    from dcp_datastates.lifecycle.persist_client import persisted_by_agent

    progress = os.path.join(a.work, "progress.txt")
    if os.path.exists(progress):  # the previous trial's
        os.unlink(progress)
    proc = subprocess.Popen(_child_cmd(a, "train", progress=progress), env=_env(),
                            start_new_session=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    while len(_commits(progress)) < a.min_ckpts:
        if proc.poll() is not None:
            raise SystemExit(f"training child exited: {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit("training child made no progress")
        time.sleep(0.05)
    c = _commits(progress)
    interval = max(0.2, c[-1][1] - c[-2][1]) if len(c) >= 2 else 1.0
    delay = rng.uniform(0.0, interval)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.stderr is not None
    proc.stderr.close()
    killed_after = _commits(progress)
    t_kill = time.monotonic()
    ok = persisted_by_agent(a.fast, timeout_s=timeout_s)
    # The agent may have been starting (importing torch) when the trainer died and then found
    # nothing to do; finish by hand as docs/configuration.md says (persist-agent --once).
    once = _newest(a.slow) < _newest(a.fast)
    if once:
        subprocess.run([sys.executable, "-m", "dcp_datastates", "persist-agent", a.fast,
                        "--once"], env=_env(), check=False, capture_output=True)
    deadline = t_kill + timeout_s
    while _newest(a.slow) < _newest(a.fast):
        if time.monotonic() > deadline:
            raise SystemExit(f"the persistent tier never got step {_newest(a.fast)}")
        time.sleep(0.2)
    return {"kill_delay_s": delay, "interval_s": interval,
            "committed_steps_before_kill": [s for s, _ in killed_after],
            "agent_done": ok, "persist_agent_once": once,
            "persisted_s_after_kill": time.monotonic() - t_kill}


def _newest(root: str) -> int:
    from dcp_datastates.lifecycle.checkpoints import list_checkpoints

    if not os.path.isdir(root):
        return -1
    return max((i.step for i in list_checkpoints(root) if i.complete and i.step is not None),
               default=-1)


def _restart(a: argparse.Namespace, mode: str, allow_drop: bool) -> dict[str, Any]:
    cache = _drop_caches(a.slow, allow_drop)
    if cache.startswith("dropped"):  # the libraries back in the cache, as on a used node
        subprocess.run([sys.executable, "-c", "import torch, torch.distributed.checkpoint"],
                       env=_env(), check=True)
    result = os.path.join(a.work, f"resume-{mode}.json")
    t0 = time.time()
    subprocess.run(_child_cmd(a, "resume", mode=mode, result=result), env=_env(), check=True)
    with open(result) as f:
        doc: dict[str, Any] = json.load(f)
    os.unlink(result)
    t = doc.pop("times")
    doc.update({
        "mode": mode,
        "cache": cache,
        "restart_to_first_step_s": t["first_step"] - t0,
        "start_and_import_s": t["imported"] - t0,
        "build_s": t["built"] - t["imported"],
        "load_s": t["loaded"] - t["built"],
        "first_step_s": t["first_step"] - t["loaded"],
    })
    return doc


def _summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = ("restart_to_first_step_s", "start_and_import_s", "build_s", "load_s", "first_step_s")
    for mode in MODES:
        rs = [r for tr in trials for r in tr["restarts"] if r["mode"] == mode]
        out[mode] = {k: statistics.median(r[k] for r in rs) for k in keys}
        out[mode]["n"] = len(rs)
    fast, stock = out["ours_fast"], out["stock_disk"]
    out["ratio_ours_fast_over_stock_disk"] = (
        fast["restart_to_first_step_s"] / stock["restart_to_first_step_s"])
    out["ratio_excluding_start_and_import"] = (
        (fast["restart_to_first_step_s"] - fast["start_and_import_s"])
        / (stock["restart_to_first_step_s"] - stock["start_and_import_s"]))
    return out


def _plot(doc: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = doc["summary"]
    parts = [("start_and_import_s", "process start + imports", "#cccccc"),
             ("build_s", "model + optimizer build", "#9ecae1"),
             ("load_s", "find + load checkpoint", "#d62728"),
             ("first_step_s", "first step", "#2ca02c")]
    labels = {"ours_fast": "ours, fast tier (/dev/shm)", "ours_disk": "ours, disk (cold)",
              "stock_disk": "stock dcp.load, disk (cold)"}
    fig, ax = plt.subplots(figsize=(8, 3.3))
    for i, mode in enumerate(MODES):
        left = 0.0
        for key, name, color in parts:
            v = s[mode][key]
            ax.barh(i, v, left=left, color=color, edgecolor="#444444",
                    label=name if i == 0 else None)
            left += v
        ax.text(left, i, f" {s[mode]['restart_to_first_step_s']:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(MODES)), [labels[m] for m in MODES])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from restart to the first completed step (medians of trials)")
    ax.set_xlim(0, max(s[m]["restart_to_first_step_s"] for m in MODES) * 1.15)
    gb = doc["state_bytes"] / 1e9
    ax.set_title(f"Recovery after SIGKILL: {gb:.2f} GB of state (MLP + AdamW)", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.45, -0.3), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def parent(a: argparse.Namespace, argv: list[str]) -> int:
    from benchmarks.mlp_loop import MLPConfig
    from benchmarks.report import emit_json

    rng = random.Random(a.seed)
    base = tempfile.mkdtemp(prefix="recovery-", dir=a.shm)
    disk = tempfile.mkdtemp(prefix="recovery-", dir=a.dir)
    trials: list[dict[str, Any]] = []
    try:
        for trial in range(a.trials):
            a.fast, a.slow = os.path.join(base, "fast"), os.path.join(disk, "slow")
            a.work = base
            for d in (a.fast, a.slow):
                shutil.rmtree(d, ignore_errors=True)
            run = _run_training(a, rng, timeout_s=a.timeout)
            order = MODES[trial % 3:] + MODES[:trial % 3]
            restarts = [_restart(a, mode, not a.no_drop_caches) for mode in order]
            # A commit between the last record and the kill may be newer than the records.
            newest = max(run["committed_steps_before_kill"])
            steps = {r["resumed_step"] for r in restarts}
            if len(steps) != 1 or min(steps) < newest:
                raise SystemExit(f"trial {trial}: resumed from {steps}, newest commit {newest}")
            trials.append({**run, "restarts": restarts})
            print(f"trial {trial}: " + ", ".join(
                f"{r['mode']} {r['restart_to_first_step_s']:.2f} s" for r in restarts),
                file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    cfg = MLPConfig(width=a.width, depth=a.depth, batch=a.batch)
    doc: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.recovery", *argv]),
        "model": {"width": a.width, "depth": a.depth, "batch": a.batch,
                  "params": cfg.param_count()},
        "state_bytes": cfg.state_bytes(),
        "checkpoint_every_steps": a.every,
        "lean_build": a.lean_build,
        "fast_tier": a.shm,
        "persistent_tier": a.dir,
        "trials": trials,
        "summary": _summary(trials),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
    }
    if a.out:
        png = _plot(doc, os.path.splitext(a.out)[0] + ".png")
        doc["png"] = os.path.basename(png) if png else None
    emit_json(doc, a.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=8, help="4096 x 8: 134 M params, 1.6 GB state")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--every", type=int, default=3, help="steps between checkpoints")
    ap.add_argument("--min-ckpts", type=int, default=2, help="commits before the kill window")
    ap.add_argument("--cache", default="2GiB", help="the writer's host cache")
    ap.add_argument("--shm", default="/dev/shm", help="where the fast tier goes")
    ap.add_argument("--dir", default=os.environ.get("BENCH_DIR", "/var/tmp"),
                    help="where the persistent tier goes (a disk)")
    ap.add_argument("--no-drop-caches", action="store_true",
                    help="evict the persistent tier's files instead of dropping all caches")
    ap.add_argument("--lean-build", action="store_true",
                    help="restarts build the model without initialising its weights (meta)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one trial (CI)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", choices=("train", "resume"), help=argparse.SUPPRESS)
    for name in ("fast", "slow", "progress", "mode", "result"):
        ap.add_argument(f"--{name}", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child == "train":
        child_train(a)
        return 0
    if a.child == "resume":
        child_resume(a)
        return 0
    if a.quick:
        a.trials, a.width, a.depth, a.batch, a.every, a.cache = 1, 256, 2, 8, 2, "16MiB"
        a.min_ckpts = 1
        a.no_drop_caches = True
    if not re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]?i?B?", a.cache):
        raise SystemExit(f"--cache: not a size: {a.cache!r}")
    return parent(a, argv)


if __name__ == "__main__":
    raise SystemExit(main())
