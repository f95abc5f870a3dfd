#!/usr/bin/env python
"""Train a small GPT on synthetic data with asynchronous checkpoints.

The training loop every user of dcp_datastates writes, end to end:

- a GPT-style model (token + position embeddings, pre-norm transformer blocks, causal
  self-attention) trained with AdamW on a deterministic synthetic task (each sequence
  is an arithmetic progression of tokens modulo the vocabulary, so the loss falls);
- one ``DataStatesWriter`` created once, with a host cache sized to one checkpoint, and
  reused for every save;
- a checkpoint every ``--ckpt-every`` steps with the plain call
  ``dcp.async_save(state, storage_writer=writer, checkpoint_id=<ckpt-dir>/step-<N>)``
  and nothing else to call; when a save is durable (its future is done) the ``latest``
  pointer is moved to it and old checkpoints are pruned (``--keep-last``);
- on start, partial checkpoints left by a crash are removed and training resumes from
  ``latest_complete(<ckpt-dir>)`` with *stock* ``dcp.load`` (model, optimizer, step
  counter and the data generator's RNG state), so a resumed run is bit-identical to
  one that was never interrupted.

Per checkpoint it prints one line: its size, how long training was blocked, and how long
until it was durable. ``--report PATH`` writes the run's timings as JSON (step times,
checkpoints, final hashes) for ``examples/main_job.py``, which compares runs.

Single process by default; under ``torchrun --nproc-per-node N`` the model is wrapped
in DDP (gloo on CPU, NCCL on CUDA) and checkpoint collectives use a dedicated gloo group.

Run ``python examples/train_gpt.py --help`` for the options and examples/README.md for
the resume demo.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The example needs no numpy (setup_env.sh does not install it): silence torch's import-time
# warning about its absence.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse  # noqa: E402
from torch.distributed.checkpoint.storage import StorageWriter  # noqa: E402

import dcp_datastates  # noqa: E402
from dcp_datastates.lifecycle.checkpoints import (  # noqa: E402
    RetentionPolicy,
    cleanup_incomplete,
    latest_complete,
    prune,
    update_latest,
)

# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    """Model shape, per-rank batch and the default peak learning rate."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    batch_size: int
    lr: float = 3e-3


SIZES: dict[str, GPTConfig] = {
    # ~0.1 M parameters, ~1.3 MB checkpoint with AdamW state: tests and quick demos.
    "tiny": GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=64, batch_size=8),
    # ~3.3 M parameters, ~40 MB checkpoint.
    "small": GPTConfig(
        vocab_size=512, seq_len=128, n_layer=4, n_head=8, d_model=256, batch_size=16
    ),
    # ~35.9 M parameters, ~431 MB checkpoint: the README's main job. Few tokens per step
    # (4 x 64) keep a step short on 2 CPU cores while the checkpoint has a realistic size;
    # the loss falls from about 5.7 to 2.2 in 65 steps.
    "medium": GPTConfig(
        vocab_size=256, seq_len=64, n_layer=5, n_head=12, d_model=768, batch_size=4, lr=1e-3
    ),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Decoder-only transformer returning the next-token cross-entropy loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------- data


class SyntheticData:
    """Deterministic token sequences from a seeded CPU generator (no downloads).

    Sequence i is ``(start_i + stride_i * j) mod vocab`` for j = 0..seq_len, so the next
    token is predictable from the previous two. Every rank draws the same global batch
    and keeps its own slice, so the generator state is identical on all ranks (it is
    saved once, replicated) and independent of the world size.
    """

    def __init__(self, cfg: GPTConfig, seed: int, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, n = self.cfg, self.cfg.batch_size * self.world_size
        start = torch.randint(0, cfg.vocab_size, (n, 1), generator=self.generator)
        stride = torch.randint(1, 8, (n, 1), generator=self.generator)
        seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
        mine = seq[self.rank * cfg.batch_size : (self.rank + 1) * cfg.batch_size]
        return mine[:, :-1], mine[:, 1:]

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def lr_at(step: int, total: int, base_lr: float, warmup: int = 10) -> float:
    """Linear warmup then cosine decay: a pure function of the step (nothing to save)."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# --------------------------------------------------------------------------- checkpoint state


def app_state(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, data: SyntheticData
) -> dict[str, Any]:
    """Everything a bit-identical resume needs, as a DCP state dict.

    Model and optimizer tensors are the live ones (no copies): the writer snapshots them
    at the save call, and the state the checkpoint holds is the state at that call.
    """
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step, "rng": data.get_state()}


def _hash_tensor(h: Any, t: torch.Tensor) -> None:
    """Feed a tensor's raw bytes to ``h`` without numpy (the example must not need it)."""
    t = t.detach().cpu().contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes:
        # A zero-copy view of the tensor's memory; ``t`` stays alive until update returns.
        h.update((ctypes.c_char * nbytes).from_address(t.data_ptr()))


def tree_hash(tree: Any) -> str:
    """SHA-256 over the names and raw bytes of every tensor (and repr of other leaves)."""
    h = hashlib.sha256()

    def visit(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(f"{prefix}:{obj.dtype}:{tuple(obj.shape)}".encode())
            _hash_tensor(h, obj)
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                visit(f"{prefix}.{k}", obj[k])
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                visit(f"{prefix}[{i}]", v)
        else:
            h.update(f"{prefix}={obj!r}".encode())

    visit("", tree)
    return h.hexdigest()


# --------------------------------------------------------------------------- saving

MIB = 1 << 20


@dataclass
class PendingSave:
    """A save whose future has not been finalised yet."""

    step: int
    path: Path
    future: Future[Any] | None  # None for a --sync save (already durable)
    t_call: float  # perf_counter when the save call started
    call_s: float  # how long the save call itself took
    t_done: float | None = None  # set by a done-callback
    waited_s: float = 0.0  # training waited for this save before issuing the next one


@dataclass(frozen=True)
class SaveRecord:
    """One durable checkpoint as printed and reported (rank 0's view)."""

    step: int
    bytes: int  # on disk
    blocked_s: float  # save call + optimizer-step waits + waits before the next save
    durable_s: float  # from the save call until its future was done (.metadata committed)


def parse_cache_size(text: str) -> float | str:
    """``"4"`` or ``"0.5"`` -> GiB as a number; anything else goes to the writer as is."""
    return float(text) if re.fullmatch(r"\d+(\.\d+)?", text.strip()) else text.strip()


def checkpoint_bytes_estimate(model: nn.Module) -> int:
    """Tensor bytes of one checkpoint: the weights plus AdamW's two moments per weight.

    The optimizer state does not exist before the first step, so it is estimated from
    the parameters rather than measured.
    """
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def auto_cache_size(model: nn.Module) -> str:
    """A host cache that holds one whole checkpoint, plus slack for alignment, in MiB."""
    need = checkpoint_bytes_estimate(model) + 32 * MIB
    return f"{-(-need // MIB)}MiB"


def make_writer(args: argparse.Namespace, host_cache_size: str) -> StorageWriter:
    if args.writer == "filesystem":
        return dcp.FileSystemWriter(args.ckpt_dir)
    try:
        from dcp_datastates import DataStatesWriter  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        raise SystemExit(
            f"cannot import dcp_datastates.DataStatesWriter ({exc}); build and install the "
            "package (pip install .) or run with --writer filesystem"
        ) from exc
    writer: StorageWriter = DataStatesWriter(
        args.ckpt_dir, host_cache_size=parse_cache_size(host_cache_size)
    )
    return writer


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


MAX_IN_FLIGHT = 1  # the previous save is finalized (latest, prune) before the next


class Checkpointer:
    """Issues saves, finalises them (latest + prune) and prints one line per checkpoint.

    Runs on the training thread only. A save is *finalised* once its future is done:
    its error (if any) is raised here, rank 0 moves ``latest`` to it, prunes, and
    records and prints a :class:`SaveRecord`.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        writer: StorageWriter,
        pg: dist.ProcessGroup | None,
        rank: int,
    ) -> None:
        self.args = args
        self.root = Path(args.ckpt_dir)
        self.writer = writer
        self.pg = pg
        self.rank = rank
        self.no_dist = pg is None
        self.policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
        # Saves in flight, oldest first. The writer runs them one after another in the
        # background; a new save waits while MAX_IN_FLIGHT are queued.
        self.pending: collections.deque[PendingSave] = collections.deque()
        self.records: list[SaveRecord] = []
        self.issued: list[int] = []  # steps of every save issued, durable or not

    def save(self, state: dict[str, Any], step: int) -> None:
        self.poll()
        while len(self.pending) >= MAX_IN_FLIGHT:
            self.finalize(wait=True)  # bound the queue: wait for the oldest save
        path = self.root / f"step-{step}"
        t0 = CLOCK.now()
        fut: Future[Any] | None = None
        if self.args.sync:
            dcp.save(
                state,
                storage_writer=self.writer,
                checkpoint_id=path,
                process_group=self.pg,
                no_dist=self.no_dist,
                planner=dcp_datastates.planner(),
            )
        else:
            resp = dcp.async_save(
                state,
                storage_writer=self.writer,
                checkpoint_id=path,
                process_group=self.pg,
                no_dist=self.no_dist,
                planner=dcp_datastates.planner(),
            )
            # an async stager makes async_save return an AsyncSaveResponse
            fut = resp.upload_completion if isinstance(resp, AsyncSaveResponse) else resp
        t1 = CLOCK.now()
        pending = PendingSave(step=step, path=path, future=fut, t_call=t0, call_s=t1 - t0)
        if fut is None:
            pending.t_done = t1
        else:

            def mark_done(_fut: Future[Any], p: PendingSave = pending) -> None:
                p.t_done = CLOCK.now()

            fut.add_done_callback(mark_done)
        self.pending.append(pending)
        self.issued.append(step)
        if fut is None:
            self.finalize(wait=True)

    def poll(self) -> None:
        """Finalise the in-flight save if it is already durable (cheap, non-blocking)."""
        while self.pending and (self.pending[0].future is None or self.pending[0].future.done()):
            self.finalize(wait=True)

    def finalize(self, *, wait: bool, at_exit: bool = False) -> None:
        """Wait for the oldest pending save (re-raising its error), move latest, prune, report.

        A wait before the next save blocks training and is counted in that save's blocked
        time; the wait at exit (``at_exit``) is not.
        """
        if not self.pending:
            return
        p = self.pending[0]
        if p.future is not None:
            if not p.future.done():
                if not wait:
                    return
                t0 = CLOCK.now()
                p.future.result()
                if not at_exit:
                    p.waited_s += CLOCK.now() - t0
            p.future.result()
        self.pending.popleft()
        if self.rank == 0:
            nbytes = dir_bytes(p.path)
            update_latest(self.root, p.path.name)
            removed = prune(self.root, self.policy)
            self.report(p, nbytes, removed)

    def report(self, p: PendingSave, nbytes: int, removed: list[Path]) -> None:
        """Record and print one line per durable checkpoint (rank 0's view).

        blocked = the save call itself (DCP's own work plus the writer's ``stage``) + the
        time ``optimizer.step`` waited for this save's copies (the writer's ``blocked_s``
        minus its ``stage_s``, 0 for other writers) + the wait for it before the next save.
        durable = from the save call until its future was done.
        """
        stats = self._stats_for(p.path)
        step_waits = 0.0
        if stats is not None:
            blocked = _finite(stats.get("blocked_s"))
            staged = _finite(stats.get("stage_s"))
            step_waits = max(0.0, blocked - staged)
        t_done = p.t_done if p.t_done is not None else CLOCK.now()
        rec = SaveRecord(
            step=p.step,
            bytes=nbytes,
            blocked_s=p.call_s + step_waits + p.waited_s,
            durable_s=t_done - p.t_call,
        )
        self.records.append(rec)
        pruned = f", pruned {', '.join(r.name for r in removed)}" if removed else ""
        print(
            f"{LOG_PREFIX}[ckpt] step-{rec.step}: {rec.bytes / 1e6:.1f} MB, blocked "
            f"{rec.blocked_s * 1e3:.1f} ms, durable {rec.durable_s:.2f} s{pruned}",
            flush=True,
        )

    def _stats_for(self, path: Path) -> dict[str, Any] | None:
        save_stats = getattr(self.writer, "save_stats", None)
        if save_stats is None:
            return None
        entries: list[dict[str, Any]] = list(save_stats())
        for entry in reversed(entries):
            cid = entry.get("checkpoint_id")
            if cid is not None and os.fspath(cid) == os.fspath(path):
                return entry
        return None


def _finite(value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return 0.0
    return x if math.isfinite(x) else 0.0


def plain_dcp_save_baseline(
    state: dict[str, Any], root: Path, count: int, pg: dist.ProcessGroup | None, rank: int
) -> list[dict[str, float]]:
    """Times ``count`` plain ``dcp.save`` calls of ``state`` with torch's FileSystemWriter.

    The synchronous save is what most training jobs call: training waits for all of it,
    so its duration is both its blocked time and its cost. Each save goes to
    ``<root>/fs-baseline-<i>`` (a name the checkpoint helpers ignore) and is deleted.
    """
    out: list[dict[str, float]] = []
    for i in range(count):
        path = root / f"fs-baseline-{i}"
        t0 = CLOCK.now()
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(path),
            checkpoint_id=path,
            process_group=pg,
            no_dist=pg is None,
        )
        seconds = CLOCK.now() - t0
        if pg is not None:
            dist.barrier(group=pg)
        if rank == 0:
            nbytes = dir_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            out.append({"bytes": nbytes, "seconds": seconds})
            print(
                f"{LOG_PREFIX}[dcp.save] FileSystemWriter: {nbytes / 1e6:.1f} MB, "
                f"blocked = durable {seconds:.2f} s",
                flush=True,
            )
    return out


# --------------------------------------------------------------------------- report


@dataclass
class RunReport:
    """What ``--report`` writes (rank 0): the run's timings, checkpoints and final state.

    ``step_times`` holds ``[step, seconds]`` pairs: seconds since the loop started when
    that step was done, checkpoint work after it included (``[start_step, 0.0]`` first).
    """

    size: str
    params: int
    writer: str
    sync: bool
    start_step: int
    resumed_from: str | None = None
    load_s: float | None = None
    host_cache_size: str | None = None
    step_times: list[list[float]] = field(default_factory=list)
    saves_issued: list[int] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    crashed: bool = False
    exit_wait_s: float = 0.0
    final: dict[str, str] | None = None
    fs_saves: list[dict[str, float]] = field(default_factory=list)

    def write(self, path: str | None, rank: int) -> None:
        if path is None or rank != 0:
            return
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)


# --------------------------------------------------------------------------- main


class ActiveClock:
    """``time.perf_counter()`` less the time this process spent stopped for another's turn.

    With ``--turns N`` (examples/main_job.py interleaves two runs) the process stops itself
    with SIGSTOP after every N-th step, all its threads with it (the writer's background copies
    and flushes included), until the job continues it; durations measured with :meth:`now`
    leave those pauses out. Without ``--turns`` it is ``perf_counter``.
    """

    def __init__(self) -> None:
        self.stopped_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.stopped_s

    def yield_turn(self) -> None:
        """Stops this process until it is continued (SIGCONT); the pause is not counted."""
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.perf_counter()
        os.kill(os.getpid(), signal.SIGSTOP)
        self.stopped_s += time.perf_counter() - t0


CLOCK = ActiveClock()
LOG_PREFIX = ""


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"{LOG_PREFIX}{msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--ckpt-dir", default="./checkpoints", help="checkpoint root")
    ap.add_argument("--steps", type=int, default=100, help="train until this global step")
    ap.add_argument("--ckpt-every", type=int, default=10, help="save every N steps (0: never)")
    ap.add_argument(
        "--host-cache-size",
        default="auto",
        help="DataStatesWriter host cache: 'auto' (one checkpoint: weights + AdamW moments, "
        "+32 MiB), GiB as a number, or a string like 512MiB",
    )
    ap.add_argument(
        "--keep-last", type=int, default=3, help="keep the newest N checkpoints (0: keep all)"
    )
    ap.add_argument(
        "--keep-every", type=int, default=None, help="also keep checkpoints whose step %% N == 0"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="K",
        help="simulate a crash once global step K is done: exit at once, abandoning any "
        "save in flight (rerun without it to resume)",
    )
    ap.add_argument("--sync", action="store_true", help="dcp.save instead of dcp.async_save")
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (default: per --size)"
    )
    ap.add_argument(
        "--writer",
        choices=["datastates", "filesystem"],
        default="datastates",
        help="filesystem: torch's FileSystemWriter, as a baseline",
    )
    ap.add_argument(
        "--fs-baseline",
        type=int,
        default=0,
        metavar="N",
        help="after training, time N plain dcp.save calls of the final state with "
        "FileSystemWriter (into <ckpt-dir>/fs-baseline-i, deleted afterwards)",
    )
    ap.add_argument(
        "--fs-every",
        type=int,
        default=0,
        metavar="K",
        help="without checkpoints (--ckpt-every 0): after every K-th step, time a plain dcp.save "
        "of the state with FileSystemWriter (deleted afterwards); its time is left out of the "
        "step times",
    )
    ap.add_argument(
        "--turns",
        type=int,
        default=0,
        metavar="N",
        help="single process: stop (SIGSTOP) before the first step and after every N-th, for "
        "examples/main_job.py to interleave two runs; stopped time is left out of every timing",
    )
    ap.add_argument("--log-prefix", default="", help="prefix of every line this run prints")
    ap.add_argument(
        "--report", default=None, metavar="PATH", help="write the run's timings as JSON"
    )
    args = ap.parse_args(argv)
    if min(args.steps, args.ckpt_every, args.fs_baseline, args.fs_every, args.turns) < 0:
        ap.error("--steps, --ckpt-every, --fs-baseline, --fs-every and --turns must be >= 0")
    if args.fs_every and args.ckpt_every:
        ap.error("--fs-every times plain dcp.save in a run without checkpoints (--ckpt-every 0)")
    if args.keep_last is not None and args.keep_last <= 0:
        args.keep_last = None  # 0: keep everything
    if args.keep_every is not None and args.keep_every <= 0:
        ap.error("--keep-every must be positive")
    return args


def setup_distributed(device: str) -> tuple[int, int, dist.ProcessGroup | None]:
    """Initialise torch.distributed under torchrun; returns (rank, world, ckpt group)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1, None
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    # checkpoint collectives on their own gloo group, never queued behind training ones
    pg = dist.new_group(backend="gloo")
    return dist.get_rank(), world_size, pg


def main(argv: list[str] | None = None) -> int:
    global LOG_PREFIX
    args = parse_args(argv)
    LOG_PREFIX = args.log_prefix
    # single-process dcp.save/load warn on every call that they assume a single process
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    rank, world_size, pg = setup_distributed(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(args.device)
    cfg = SIZES[args.size]
    lr = args.lr if args.lr is not None else cfg.lr
    root = Path(args.ckpt_dir)

    torch.manual_seed(args.seed)
    net = GPT(cfg).to(device)
    model: nn.Module = net
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    data = SyntheticData(cfg, seed=args.seed + 1, rank=rank, world_size=world_size)
    n_params = sum(p.numel() for p in net.parameters())
    log(
        rank,
        f"GPT[{args.size}] {n_params / 1e6:.2f} M params, checkpoint ~"
        f"{checkpoint_bytes_estimate(net) / 1e6:.1f} MB with AdamW state, {device}, "
        f"world size {world_size}",
    )
    report = RunReport(
        size=args.size,
        params=n_params,
        writer=args.writer,
        sync=args.sync,
        start_step=0,
    )

    # ---- resume: drop what a crash left behind, then load the newest committed checkpoint
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for path in cleanup_incomplete(root):
            log(rank, f"removed partial checkpoint {path}")
    if pg is not None:
        dist.barrier(group=pg)
    start_step = 0
    resume = latest_complete(root)
    if resume is not None:
        state = app_state(model, opt, 0, data)
        t0 = CLOCK.now()
        dcp.load(state, checkpoint_id=resume, process_group=pg, no_dist=pg is None)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        data.set_state(state["rng"])
        start_step = int(state["step"])
        report.load_s = CLOCK.now() - t0
        report.resumed_from = os.fspath(resume)
        log(rank, f"resumed from {resume} at step {start_step} ({report.load_s:.2f}s, dcp.load)")
    report.start_step = start_step

    writer: StorageWriter | None = None
    ckpt: Checkpointer | None = None
    if args.ckpt_every:
        cache = auto_cache_size(net) if args.host_cache_size == "auto" else args.host_cache_size
        writer = make_writer(args, cache)
        ckpt = Checkpointer(args, writer, pg, rank)
        mode = "dcp.save" if args.sync else "dcp.async_save"
        if args.writer == "datastates":
            report.host_cache_size = cache
            log(rank, f"checkpoints: {mode} + DataStatesWriter(host_cache_size={cache!r})")
        else:
            log(rank, f"checkpoints: {mode} + FileSystemWriter")

    # ---- train
    if start_step >= args.steps:
        log(rank, f"checkpoint is at step {start_step} >= --steps {args.steps}: nothing to train")
    loss = torch.tensor(float("nan"))
    turns = args.turns if world_size == 1 else 0
    if turns:
        CLOCK.yield_turn()  # set-up (and the resume's load) done: wait for the first turn
    report.step_times.append([start_step, 0.0])
    t_loop = CLOCK.now()
    for step in range(start_step, args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, lr)
        x, y = data.next_batch()
        loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
        if done % 10 == 0 or done == args.steps:
            log(rank, f"step {done:5d}  loss {loss.item():.4f}")
        if ckpt is not None:
            ckpt.poll()
            if done % args.ckpt_every == 0:
                ckpt.save(app_state(model, opt, done, data), done)
        if args.fs_every and done % args.fs_every == 0:
            t_fs = CLOCK.now()
            report.fs_saves += plain_dcp_save_baseline(
                app_state(model, opt, done, data), root, 1, pg, rank
            )
            t_loop += CLOCK.now() - t_fs  # a plain save's cost is its duration: not a step's
        report.step_times.append([done, CLOCK.now() - t_loop])
        if args.stop_after is not None and done == args.stop_after:
            log(rank, f"simulated crash after step {done}: exiting without waiting for saves")
            if ckpt is not None:
                report.saves = [asdict(r) for r in ckpt.records]
                report.saves_issued = list(ckpt.issued)
            report.crashed = True
            report.write(args.report, rank)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if turns and done % turns == 0 and done < args.steps:
            CLOCK.yield_turn()
    t_wait = CLOCK.now()
    if ckpt is not None:
        while ckpt.pending:  # every save must be durable before we exit
            ckpt.finalize(wait=True, at_exit=True)
    report.exit_wait_s = CLOCK.now() - t_wait
    elapsed = CLOCK.now() - t_loop

    final_loss = loss.item()
    param_hash = tree_hash(dict(net.named_parameters()))
    optim_hash = tree_hash(get_state_dict(model, opt)[1])
    report.final = {"loss": repr(final_loss), "param_hash": param_hash, "optim_hash": optim_hash}
    if ckpt is not None:
        report.saves = [asdict(r) for r in ckpt.records]
        report.saves_issued = list(ckpt.issued)
        recs = ckpt.records
        if recs:
            blocked = sum(r.blocked_s for r in recs)
            log(
                rank,
                f"trained steps {start_step}..{args.steps} in {elapsed:.2f}s with "
                f"{len(recs)} checkpoints: blocked {blocked / len(recs) * 1e3:.1f} ms and "
                f"durable after {sum(r.durable_s for r in recs) / len(recs):.2f} s on average",
            )
    else:
        log(rank, f"trained steps {start_step}..{args.steps} in {elapsed:.2f}s, no checkpoints")
    log(rank, f"final_loss={final_loss!r} param_hash={param_hash} optim_hash={optim_hash}")
    if args.fs_baseline:
        state = app_state(model, opt, args.steps, data)
        report.fs_saves = plain_dcp_save_baseline(state, root, args.fs_baseline, pg, rank)
    report.write(args.report, rank)
    close = getattr(writer, "close", None)
    if callable(close):
        close()
    if pg is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
