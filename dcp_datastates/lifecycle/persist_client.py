"""The writer's side of agent-mode promotion: hands checkpoints to the node's persistence agent.

:class:`AgentPromoter` has the interface of :class:`~dcp_datastates.lifecycle.tiers.Promoter`
(the save path cannot tell them apart) but copies nothing itself: ``submit`` writes a durable
request into ``<fast root>/.datastates-agent/queue/`` (before the save is reported done) and the
agent (:mod:`dcp_datastates.lifecycle.persist_agent`), a process of its own, copies it.

Contracts:

* Construction registers the calling process as a trainer of the fast root and makes sure an
  agent runs: if ``agent.lock`` is free it starts one (``python -m dcp_datastates persist-agent``,
  ``setsid`` through ``subprocess``: its own process group, so a signal to the trainer's
  group does not reach it); if an agent holds the lock (a restarted trainer finding the agent of
  its previous life, or one a launcher started) it is *adopted*: no second agent is started.
  ``submit`` and the waits check again (an agent that died is replaced).
* ``wait``/``records``/``unpersisted``/``close`` read the agent's results (``done/``); records
  look like the in-process ones (``t_submit``/``t_done`` are ``time.perf_counter()`` values, a
  system-wide clock on Linux).
* ``supersede`` (a new save of a checkpoint begins) writes a cancel file when a request for that
  checkpoint is queued, and waits until the agent stopped every copy of it.
* ``close`` waits for this writer's copies within ``persist_timeout`` (the agent goes on with any
  left after it: they are not failed), then unregisters the trainer. A writer dropped without
  ``close`` is unregistered when collected; a trainer killed is noticed by the agent (its pid).
* Fork: the promoter belongs to the process that created it; a forked child cannot submit and
  its exit unregisters nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from ..errors import CheckpointBusyError
from .checkpoints import RetentionPolicy
from .persist_queue import AgentConfig, AgentDir, this_trainer
from .tiers import Promoter, Promotion

logger = logging.getLogger(__name__)

_POLL_S = 0.02
_CHECK_AGENT_S = 1.0  # how often a wait makes sure an agent runs
_LOG_MAX_BYTES = 16 * 1024**2  # agent.log beyond this is moved to agent.log.1 at a start
_children: list[subprocess.Popen[bytes]] = []  # spawned agents, reaped when they exit
_children_lock = threading.Lock()


def _package_parent() -> str:
    """The directory the running ``dcp_datastates`` package was imported from."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_agent(qdir: AgentDir) -> subprocess.Popen[bytes]:
    """Starts an agent for ``qdir``'s fast root with ``qdir``'s ``config.json``: the same Python,
    the same package (its folder first on ``PYTHONPATH``), its own process group (``setsid``),
    stdin closed, output appended to ``agent.log``, working directory ``/``."""
    with contextlib.suppress(OSError):
        if os.path.getsize(qdir.log_path) > _LOG_MAX_BYTES:
            os.replace(qdir.log_path, qdir.log_path + ".1")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in (_package_parent(), env.get("PYTHONPATH", "")) if x
    )
    cmd = [sys.executable, "-m", "dcp_datastates", "persist-agent", qdir.fast_root,
           "--config", qdir.config_path]
    with open(qdir.log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/",
            env=env, start_new_session=True, close_fds=True,
        )
    with _children_lock:
        _children[:] = [c for c in _children if c.poll() is None]
        _children.append(proc)
    logger.info("started the persistence agent of %s (pid %d)", qdir.fast_root, proc.pid)
    return proc


def _unregister(path: str, pid: int) -> None:
    if os.getpid() == pid:
        with contextlib.suppress(OSError):
            os.unlink(path)


class AgentPromoter(Promoter):
    """A :class:`Promoter` whose copies run in the fast root's persistence agent (module doc).

    Args: those of :class:`Promoter`; ``storage_options`` must be JSON-serializable.
    """

    def __init__(
        self,
        fast_root: str,
        slow_root: str,
        storage_options: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
        durable: bool = True,
        fast_retention: RetentionPolicy | int | None = None,
        persist_retention: RetentionPolicy | int | None = None,
        verify: bool = True,
    ) -> None:
        super().__init__(
            fast_root, slow_root, storage_options, timeout_s, durable=durable,
            fast_retention=fast_retention, persist_retention=persist_retention, verify=verify,
        )
        self.config = AgentConfig(
            slow_root=self.slow.root, storage_options=dict(storage_options or {}),
            timeout_s=self.timeout_s, durable=durable, fast_retention=self.fast_policy,
            persist_retention=self.slow_policy, verify=verify,
        )
        cfg = self.config.to_json()  # refuses options that cannot travel, before any file
        self.dir = AgentDir(self.fast_root)
        self.dir.ensure()
        self.dir.write_json(self.dir.config_path, cfg)
        self._trainer_file = self.dir.register_trainer()
        self._trainer = this_trainer()
        self._names: dict[str, Promotion] = {}  # request name -> its record, until its result
        self._last_check = 0.0
        self._child: subprocess.Popen[bytes] | None = None  # the agent this writer started
        self._unregister = weakref.finalize(self, _unregister, self._trainer_file, self._pid)
        self.ensure_agent()

    def ensure_agent(self) -> bool:
        """Starts an agent unless one runs; True if it started one."""
        self._last_check = time.monotonic()
        if self._child is not None and self._child.poll() is None:
            return False  # started, maybe still importing (or exiting: checked again later)
        if self.dir.agent_alive():
            return False
        self._child = start_agent(self.dir)
        return True

    # -- submission (save threads) ---------------------------------------------------------------
    def submit(
        self, checkpoint_path: str, rank: int, world_size: int, coordinator: bool,
        t_submit: float | None = None, recovered: bool = False,
    ) -> Promotion:
        """Queues the request durably, then makes sure an agent runs; returns its record."""
        if os.getpid() != self._pid:
            raise RuntimeError("a forked child cannot promote its parent's checkpoints")
        rel = self.relative(checkpoint_path)
        t = time.perf_counter() if t_submit is None else t_submit
        p = Promotion(
            source=os.path.abspath(checkpoint_path), target=self.slow.url(rel), rank=rank,
            coordinator=coordinator, world_size=max(1, world_size), t_submit=t,
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("the writer is closed: nothing more is promoted")
            req = self.dir.put_request(
                rel, rank, p.world_size, coordinator, t, self.config, self._trainer
            )
            p.started = True
            self._open.append(p)
            self._records.append(p)
            self._names[req.name] = p
        self.ensure_agent()
        return p

    def supersede(self, checkpoint_path: str, timeout: float | None = None) -> None:
        """Stops the agent's copies of ``checkpoint_path`` (any rank's, queued or running) and
        waits until none runs, at most ``timeout`` (default ``persist_timeout``).

        Raises:
            CheckpointBusyError: the agent did not stop them in time.
        """
        rel = self.relative(checkpoint_path)
        if not self.dir.requests_of(rel):
            return
        name = self.dir.put_cancel(rel)
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        while os.path.exists(self.dir.sub("cancel", name)):
            if time.monotonic() >= deadline:
                self.dir.remove("cancel", name)
                raise CheckpointBusyError(
                    f"{checkpoint_path}: the persistence agent did not stop the copy of its "
                    "previous save in time; save again once it ended (wait_persisted())"
                )
            self._tick()
        self._collect()

    # -- results ---------------------------------------------------------------------------------
    def _tick(self) -> None:
        """One poll of a wait: sleeps, and now and then makes sure an agent runs."""
        time.sleep(_POLL_S)
        if time.monotonic() - self._last_check >= _CHECK_AGENT_S:
            self.ensure_agent()

    def _collect(self) -> None:
        """Reads the results the agent wrote for this writer's requests into their records."""
        with self._lock:
            waiting = list(self._names.items())
        for name, p in waiting:
            path = self.dir.sub("done", name)
            try:
                res = self.dir.read_json(path)
            except ValueError:
                res = {"error": f"unreadable result {path}"}
            if res is None:
                continue
            p.bytes = int(res.get("bytes") or 0)
            p.error = None if res.get("error") is None else str(res["error"])
            p.pruned = [str(x) for x in res.get("pruned") or []]
            p.retention_error = res.get("retention_error")
            p.superseded = bool(res.get("superseded"))
            t_done = res.get("t_done")
            p.t_done = float(t_done) if isinstance(t_done, (int, float)) else time.perf_counter()
            with self._lock:
                self._names.pop(name, None)
                if p in self._open:
                    self._open.remove(p)
            p.done.set()
            self.dir.remove("done", name)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the agent finished every request of this writer; False on timeout.
        Then raises :class:`~.tiers.PersistError` for failures not reported yet (once each)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._collect()
            with self._lock:
                if not self._names:
                    break
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._tick()
        self.raise_unreported()
        return True

    def records(self) -> list[dict[str, Any]]:
        self._collect()
        return super().records()

    def unpersisted(self) -> list[str]:
        self._collect()
        return super().unpersisted()

    def close(self, timeout: float | None = None) -> None:
        """Waits for this writer's requests (within ``persist_timeout``, or ``timeout`` if
        shorter; the agent goes on with those left), logs failures, unregisters the trainer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return
        limit = self.timeout_s if timeout is None else min(timeout, self.timeout_s)
        try:
            if not self.wait(limit):
                logger.warning(
                    "copies to %s not done %.0f s after close(): the persistence agent goes "
                    "on with them", self.slow.root, limit,
                )
        except Exception as e:  # noqa: BLE001 - close() logs failures, never raises them
            logger.error("%s", e)
        self._unregister()

    def _grace_s(self) -> float:
        return 0.0


def persisted_by_agent(fast_root: str, timeout_s: float = math.inf) -> bool:
    """Waits until no agent serves ``fast_root`` and nothing is queued there (an agent exits
    once its trainers are gone and its queue is empty); False on timeout (e.g. requests queued
    and no agent: start one). For launchers and tests."""
    qdir = AgentDir(fast_root)
    deadline = time.monotonic() + timeout_s
    while os.path.isdir(qdir.root) and (qdir.agent_alive() or qdir.names("queue")):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


__all__ = ["AgentPromoter", "persisted_by_agent", "start_agent"]
