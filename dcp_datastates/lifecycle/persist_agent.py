"""The persistence agent: promotion to the persistent tier in a process of its own.

One agent serves one fast-tier root (one per node when the node's ranks share it). Writers with
``persist_to`` (agent mode, the default) start it on construction if none runs
(:class:`dcp_datastates.lifecycle.persist_client.AgentPromoter`); a launcher may instead start it
itself, ``python -m dcp_datastates persist-agent FAST_ROOT --persist-to URL``, and supervise it.
Writers and agent meet only in ``FAST_ROOT/.datastates-agent/``
(:mod:`dcp_datastates.lifecycle.persist_queue`), so a SIGKILL of the trainer at any moment loses
nothing it committed on the fast tier.

Life of an agent (:func:`run_agent`):

1. take ``agent.lock`` (exclusive ``flock``); if another agent holds it, exit 0 at once (so two
   writers racing to start one end up with one);
2. *scan*: every complete fast checkpoint (``.metadata``) that is not complete on the persistent
   tier, not queued, and not dropped there by ``persist_retention``, is queued (a request per
   rank whose manifest the directory holds; the coordinator is rank 0; the world size is read
   from ``.metadata``). This recovers the request of a trainer killed between its commit and its
   request, and the copies of an agent killed mid-copy (their requests are still queued);
3. serve: each request in ``queue/`` (oldest first) goes to a :class:`~.tiers.Promoter` of this
   process (one per configuration and rank, each with its own thread, so the coordinator's wait
   for the other ranks' files never blocks them), which copies with ``.metadata`` last, fsynced,
   then moves ``latest`` on the persistent tier, then applies both tiers' retention. Its result
   is written to ``done/`` and only then the request removed: an agent killed mid-copy leaves the
   request, and the next agent redoes the copy from the start (a half-copied destination has no
   ``.metadata``: partial, never picked). A cancel file stops the copies of its checkpoint;
4. exit when nothing is queued or copying, no registered trainer is alive (after ``linger_s``
   since the start; at once with ``once``), and a last scan finds nothing: then release the lock,
   and look once more at the queue (a request written while the agent was deciding to exit is
   served by this agent again, or by the one its writer started).

Each request is attempted once per agent life: a failed copy (persistent tier down) is retried by
the next agent's scan, not in a loop. The fast checkpoint is verified (checksums) before its copy
when ``verify`` is set (the default): a damaged or partial one is never committed there.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from .checkpoints import list_checkpoints
from .persist_queue import AgentConfig, AgentDir, Request, proc_start, source_key
from .tiers import Promoter, Promotion

logger = logging.getLogger(__name__)

_BUSY_POLL_S = 0.02
_IDLE_POLL_S = 0.2
_MANIFEST_RE = re.compile(r"^__datastates_manifest_(\d+)\.json$")
_DATA_RANK_RE = re.compile(r"^(?:__(\d+)_\d+|shard-(\d{5})-model-)")


class Agent:
    """The serving state of one agent process (used by :func:`run_agent`'s thread only)."""

    def __init__(self, qdir: AgentDir, config: AgentConfig | None) -> None:
        self.q = qdir
        self.config = config
        self._promoters: dict[tuple[str, int], Promoter] = {}
        self._open: dict[str, tuple[Request, Promotion]] = {}  # request name -> its promotion
        self._attempted: set[str] = set()  # checkpoints (rel) this agent promoted or tried
        self.done = 0
        self.failed = 0

    def _promoter(self, cfg: AgentConfig, rank: int) -> Promoter:
        key = (cfg.key(), rank)
        if key not in self._promoters:
            self._promoters[key] = Promoter(
                self.q.fast_root, cfg.slow_root, cfg.storage_options or None, cfg.timeout_s,
                durable=cfg.durable, fast_retention=cfg.fast_retention,
                persist_retention=cfg.persist_retention, verify=cfg.verify,
            )
        return self._promoters[key]

    def busy(self) -> bool:
        """True while a request is queued or copying."""
        return bool(self._open) or bool(self.q.names("queue"))

    def step(self) -> None:
        """Takes new requests, applies cancels, records finished promotions."""
        self._take()
        cancels = self._cancels()
        for rel in cancels.values():
            for req, p in self._open.values():
                if req.rel == rel:
                    p.cancel.set()
        self._finish()
        busy = {req.rel for req, _ in self._open.values()}
        for name, rel in cancels.items():
            if rel not in busy:
                self.q.remove("cancel", name)

    def _take(self) -> None:
        for name in self.q.names("queue"):
            if name in self._open:
                continue
            if os.path.exists(self.q.sub("done", name)):  # finished by an agent killed after
                self.q.remove("queue", name)  # writing its result
                continue
            try:
                raw = self.q.read_json(self.q.sub("queue", name))
                if raw is None:
                    continue
                req = Request.from_json(name, raw)
            except (ValueError, TypeError, KeyError) as e:
                logger.error("unreadable request %s (%s): set aside", name, e)
                os.replace(self.q.sub("queue", name), self.q.sub("queue", name + ".bad"))
                continue
            source = os.path.join(self.q.fast_root, *req.rel.split("/"))
            try:
                p = self._promoter(req.config, req.rank).submit(
                    source, req.rank, req.world_size, req.coordinator, t_submit=req.t_submit,
                    recovered=req.trainer == "scan",
                )
            except (RuntimeError, ValueError) as e:  # e.g. a bad persist_to in the request
                self._result(req, {"error": f"{type(e).__name__}: {e}", "bytes": 0})
                continue
            self._open[name] = (req, p)
            self._attempted.add(req.rel)
            logger.info("promoting %s (rank %d) to %s", req.rel, req.rank, p.target)

    def _cancels(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name in self.q.names("cancel"):
            try:
                raw = self.q.read_json(self.q.sub("cancel", name))
            except ValueError:
                raw = None
            if isinstance(raw, dict) and isinstance(raw.get("rel"), str):
                out[name] = raw["rel"]
            else:
                self.q.remove("cancel", name)
        return out

    def _finish(self) -> None:
        for name, (req, p) in list(self._open.items()):
            if not p.done.is_set():
                continue
            del self._open[name]
            rec = p.as_dict()
            self._result(req, {k: rec[k] for k in (
                "bytes", "error", "pruned", "retention_error", "superseded", "t_done")})
            if p.error:
                logger.error("promotion of %s (rank %d) failed: %s", req.rel, req.rank, p.error)
            else:
                logger.info("%s %s (rank %d) in %.2f s", "stopped" if p.superseded else
                            "promoted", req.rel, req.rank, rec["persist_s"])

    def _result(self, req: Request, result: dict[str, Any]) -> None:
        """Writes the result, then drops the request (in that order: see the module doc)."""
        result.setdefault("t_done", time.perf_counter())
        if result.get("error"):
            self.failed += 1
        else:
            self.done += 1
        self.q.write_json(self.q.sub("done", req.name), result, durable=req.config.durable)
        self.q.remove("queue", req.name)

    # -- the scan --------------------------------------------------------------------------------
    def scan(self) -> int:
        """Queues the complete fast checkpoints missing on the persistent tier (see the module
        docstring); returns how many requests it queued."""
        cfg = self.config
        if cfg is None:
            return 0
        slow = self._promoter(cfg, 0).slow
        try:
            on_slow = slow.complete_steps()
        except Exception as e:  # noqa: BLE001 - the tier is down: the requests will say so
            logger.warning("cannot list %s for the scan: %s", slow.root, e)
            return 0
        slow_steps = {int(m.group(1)) for n, ok in on_slow.items() if ok
                      and (m := re.match(r"^(?:step[-_])?(\d+)$", n))}
        queued = {n[:-5].rsplit("-", 1)[-1] for n in self.q.names("queue")}
        queued |= {source_key(req.rel) for req, _ in self._open.values()}
        n = 0
        for info in list_checkpoints(self.q.fast_root):
            rel = info.name
            if not info.complete or on_slow.get(rel) is True or rel in self._attempted:
                continue
            if source_key(rel) in queued:
                continue
            policy = cfg.persist_retention
            if (policy is not None and slow_steps and max(slow_steps) > info.step
                    and info.step not in policy.kept_steps(slow_steps | {info.step})):
                continue  # dropped there by persist_retention
            n += self._queue_found(str(info.path), rel, cfg)
        return n

    def _queue_found(self, path: str, rel: str, cfg: AgentConfig) -> int:
        """Queues one request per rank whose manifest ``path`` holds; 0 if it holds rank 0's
        none or its ``.metadata`` cannot be read (damaged: never promoted)."""
        self._attempted.add(rel)
        try:
            names = os.listdir(path)
            ranks = {int(m.group(1)) for x in names if (m := _MANIFEST_RE.match(x))}
            world = _metadata_ranks(os.path.join(path, ".metadata")) | ranks
        except (OSError, ValueError) as e:
            logger.error("%s: cannot read it (%s): not promoted", path, e)
            return 0
        if 0 not in ranks:
            return 0
        t = time.perf_counter()
        for r in sorted(ranks):
            self.q.put_request(rel, r, max(world) + 1, r == 0, t, cfg, "scan")
        logger.info("found %s committed on the fast tier but not on %s: queued", rel,
                    cfg.slow_root)
        return len(ranks)

    def close(self) -> None:
        for p in self._promoters.values():
            p.close()


def _metadata_ranks(path: str) -> set[int]:
    """The ranks whose data files ``.metadata`` references (ValueError if it is unreadable)."""
    from ..format.verify import load_metadata

    with open(path, "rb") as f:
        md = load_metadata(f.read())
    out: set[int] = set()
    for info in (md.storage_data or {}).values():
        m = _DATA_RANK_RE.match(os.path.basename(str(getattr(info, "relative_path", ""))))
        if m:
            out.add(int(m.group(1)) if m.group(1) is not None else int(m.group(2)) - 1)
    return out


def _serve(agent: Agent, linger_s: float, once: bool) -> None:
    """Serves until the exit condition of the module docstring (step 4) holds."""
    started = time.monotonic()
    while True:
        agent.step()
        if agent.busy():
            time.sleep(_BUSY_POLL_S)
            continue
        if not once and (agent.q.live_trainers() or time.monotonic() - started < linger_s):
            time.sleep(_IDLE_POLL_S)
            continue
        if agent.scan():  # a trainer died between its commit and its request
            continue
        return


def run_agent(
    fast_root: str, config: AgentConfig | None = None, *, linger_s: float = 0.0,
    once: bool = False,
) -> tuple[int, int]:
    """Runs the agent of ``fast_root`` until it may exit (module docstring); returns (promotions
    done, promotions failed). Returns (0, 0) at once when another agent serves the root.

    Args:
        fast_root: the fast tier's root (the writers' ``path``).
        config: the configuration of the scan (the persistent tier to compare with); requests
            carry their own. None: ``config.json`` of the protocol directory, if any.
        linger_s: stay at least this long for a trainer to register (a launcher starting the
            agent before its trainers).
        once: do not wait for trainers: serve what is queued and found, then exit (recovery
            after a job ended).
    """
    q = AgentDir(fast_root)
    q.ensure()
    if config is None:
        raw = q.read_json(q.config_path)
        config = AgentConfig.from_json(raw) if raw is not None else None
    done = failed = 0
    while True:
        fd = q.try_lock()
        if fd is None:
            logger.info("another agent serves %s", q.fast_root)
            return done, failed
        agent = Agent(q, config)
        try:
            q.write_json(os.path.join(q.root, "agent.json"), {
                "pid": os.getpid(), "start": proc_start(os.getpid()), "since": time.time()
            }, durable=False)
            logger.info("persistence agent of %s (pid %d) started", q.fast_root, os.getpid())
            agent.scan()
            _serve(agent, linger_s, once)
        finally:
            agent.close()
            os.close(fd)  # releases the lock
        done, failed = done + agent.done, failed + agent.failed
        if not q.live_trainers():  # nobody is left to read the results
            for name in q.names("done"):
                q.remove("done", name)
        if not q.names("queue"):  # a request written while deciding to exit: serve it
            logger.info("persistence agent of %s exits: %d promoted, %d failed",
                        q.fast_root, done, failed)
            return done, failed
        linger_s = 0.0


def agent_summary(fast_root: str) -> dict[str, Any]:
    """What the protocol directory of ``fast_root`` holds now (for ``persist-agent --status``)."""
    q = AgentDir(fast_root)
    try:
        info = q.read_json(os.path.join(q.root, "agent.json"))
    except ValueError:
        info = None
    return {
        "agent_alive": os.path.isdir(q.root) and q.agent_alive(),
        "agent": info,
        "queued": q.names("queue"),
        "trainers": q.live_trainers() if os.path.isdir(q.root) else [],
    }


__all__ = ["Agent", "agent_summary", "run_agent"]
