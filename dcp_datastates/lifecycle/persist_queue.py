"""The persistence agent's on-disk protocol: a directory under the fast tier's root.

A writer with ``persist_to`` (agent mode, the default) and the node's persistence agent
(:mod:`dcp_datastates.lifecycle.persist_agent`) talk only through files under
``<fast root>/.datastates-agent/``, so that whatever a writer handed over survives its process::

    agent.lock                       flock'ed (exclusive) by the running agent for its whole life
    agent.json                       the running agent's pid and start time (for people only)
    agent.log                        the agent's log (stdout and stderr of a spawned agent)
    config.json                      the configuration a writer starts an agent with (mode 0600)
    trainers/<pid>-<start>-<n>.json  one per live writer: the trainers the agent waits for
    queue/<seq>-<pid>-<rank>-<key>.json  one request: one rank's part of one checkpoint
    done/<same name>                 its result, written by the agent before it drops the request
    cancel/<key>-<nonce>.json        "a new save of this checkpoint begins": stop its copies

Every file is written whole or not at all: to a temporary name in the same directory, fsynced,
renamed, and the directory fsynced (:meth:`AgentDir.write_json`). A request is therefore durable
before ``submit`` returns, i.e. before the save that produced it is reported done. ``<key>`` is a
hash of the checkpoint's name relative to the fast root (a supersede finds its requests without
reading them). The directory's name does not parse as a step, so the fast tier's retention,
``cleanup`` and ``list_checkpoints`` never see it.

Liveness: the agent is alive iff ``agent.lock`` is locked (the kernel drops the lock when the
process dies, however it dies); a trainer is alive iff its pid exists, is not a zombie and has the
start time recorded in its file's name (a reused pid is not mistaken for it).

Security: requests and ``config.json`` carry the persistent tier's fsspec options (credentials
possibly); the directory is created 0700 and the files 0600.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .checkpoints import RetentionPolicy

logger = logging.getLogger(__name__)

AGENT_DIR = ".datastates-agent"
_seq = itertools.count()
_seq_lock = threading.Lock()


def _policy_json(policy: RetentionPolicy | None) -> dict[str, int | None] | None:
    return None if policy is None else {"keep_last": policy.keep_last,
                                        "keep_every": policy.keep_every}


def _policy_of(raw: Any) -> RetentionPolicy | None:
    if raw is None:
        return None
    return RetentionPolicy(keep_last=raw.get("keep_last"), keep_every=raw.get("keep_every"))


@dataclass(frozen=True)
class AgentConfig:
    """How the agent promotes one writer's checkpoints (the writer's ``persist_*`` options).

    ``storage_options`` must be JSON-serializable (it travels through files): options holding
    objects need ``persist_agent=False``, or fsspec's own configuration (``FSSPEC_S3=...``).
    """

    slow_root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    durable: bool = True
    fast_retention: RetentionPolicy | None = None
    persist_retention: RetentionPolicy | None = None
    verify: bool = True  # verify the fast checkpoint (checksums) before committing its copy

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; ValueError if ``storage_options`` is not JSON-serializable."""
        d = asdict(self)
        d["fast_retention"] = _policy_json(self.fast_retention)
        d["persist_retention"] = _policy_json(self.persist_retention)
        try:
            json.dumps(d)
        except (TypeError, ValueError) as e:
            raise ValueError(
                "persist_storage_options must be JSON-serializable to reach the persistence "
                f"agent ({e}); pass persist_agent=False to copy in the trainer instead"
            ) from None
        return d

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> AgentConfig:
        """The inverse of :meth:`to_json`; ValueError/TypeError/KeyError for a malformed one."""
        return cls(
            slow_root=str(raw["slow_root"]),
            storage_options=dict(raw.get("storage_options") or {}),
            timeout_s=float(raw.get("timeout_s", 600.0)),
            durable=bool(raw.get("durable", True)),
            fast_retention=_policy_of(raw.get("fast_retention")),
            persist_retention=_policy_of(raw.get("persist_retention")),
            verify=bool(raw.get("verify", True)),
        )

    def key(self) -> str:
        """Identifies the configuration (the agent keeps one promoter per key and rank)."""
        return json.dumps(self.to_json(), sort_keys=True)


@dataclass(frozen=True)
class Request:
    """One rank's part of one committed (coordinator) or durable (other ranks) checkpoint."""

    name: str  # the file name under queue/ (and done/)
    rel: str  # the checkpoint relative to the fast root, "/"-separated
    rank: int
    world_size: int
    coordinator: bool
    t_submit: float  # time.perf_counter() of the submitter (CLOCK_MONOTONIC: system-wide)
    config: AgentConfig
    trainer: str  # "<pid>-<start>" of the submitter, or "scan" (found by the agent's scan)

    def to_json(self) -> dict[str, Any]:
        return {
            "rel": self.rel, "rank": self.rank, "world_size": self.world_size,
            "coordinator": self.coordinator, "t_submit": self.t_submit,
            "config": self.config.to_json(), "trainer": self.trainer,
        }

    @classmethod
    def from_json(cls, name: str, raw: dict[str, Any]) -> Request:
        return cls(
            name=name, rel=str(raw["rel"]), rank=int(raw["rank"]),
            world_size=int(raw["world_size"]), coordinator=bool(raw["coordinator"]),
            t_submit=float(raw["t_submit"]), config=AgentConfig.from_json(raw["config"]),
            trainer=str(raw.get("trainer", "")),
        )


def source_key(rel: str) -> str:
    """A short hash of a checkpoint's relative name (in request and cancel file names)."""
    return hashlib.sha1(rel.encode()).hexdigest()[:16]


def proc_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None


def this_trainer() -> str:
    """``<pid>-<start>`` of the calling process."""
    pid = os.getpid()
    return f"{pid}-{proc_start(pid)}"


def trainer_alive(token: str) -> bool:
    """True while the process named by ``<pid>-<start>`` runs (not a zombie, pid not reused)."""
    pid, _, start = token.partition("-")
    return pid.isdigit() and start != "None" and proc_start(int(pid)) == start


class AgentDir:
    """The protocol directory of one fast-tier root (see the module docstring).

    Thread-safe: every operation is a file-system operation on names nobody else writes.
    """

    def __init__(self, fast_root: str) -> None:
        self.fast_root = os.path.abspath(fast_root)
        self.root = os.path.join(self.fast_root, AGENT_DIR)
        self.lock_path = os.path.join(self.root, "agent.lock")
        self.log_path = os.path.join(self.root, "agent.log")
        self.config_path = os.path.join(self.root, "config.json")

    def sub(self, what: str, name: str = "") -> str:
        return os.path.join(self.root, what, name) if name else os.path.join(self.root, what)

    def ensure(self) -> None:
        """Creates the directory tree (0700)."""
        for what in ("", "trainers", "queue", "done", "cancel"):
            os.makedirs(self.sub(what) if what else self.root, mode=0o700, exist_ok=True)

    # -- whole-file JSON -------------------------------------------------------------------------
    def write_json(self, path: str, obj: Any, durable: bool = True) -> None:
        """Writes ``obj`` to ``path`` whole or not at all (0600); fsynced when ``durable``."""
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, json.dumps(obj).encode())
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if durable:
            _fsync_dir(os.path.dirname(path))

    @staticmethod
    def read_json(path: str) -> Any | None:
        """The file's JSON value; None if it is missing; ValueError if it is malformed."""
        try:
            with open(path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def names(self, what: str, suffix: str = ".json") -> list[str]:
        """The sorted file names of ``what`` (temporary files left out)."""
        try:
            return sorted(n for n in os.listdir(self.sub(what)) if n.endswith(suffix))
        except FileNotFoundError:
            return []

    def remove(self, what: str, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sub(what, name))

    # -- requests, results, cancels --------------------------------------------------------------
    def put_request(self, rel: str, rank: int, world_size: int, coordinator: bool,
                    t_submit: float, config: AgentConfig, trainer: str) -> Request:
        """Queues a request durably; returns it (its ``name`` names its result later)."""
        with _seq_lock:
            seq = next(_seq)
        name = f"{time.time_ns():020d}{seq:06d}-{os.getpid()}-{rank}-{source_key(rel)}.json"
        req = Request(name, rel, rank, world_size, coordinator, t_submit, config, trainer)
        self.write_json(self.sub("queue", name), req.to_json())
        return req

    def requests_of(self, rel: str) -> list[str]:
        """Names of the queued requests for checkpoint ``rel``."""
        key = source_key(rel)
        return [n for n in self.names("queue") if n[:-5].endswith(f"-{key}")]

    def put_cancel(self, rel: str) -> str:
        """Asks the agent to stop every copy of ``rel``; returns the cancel file's name."""
        name = f"{source_key(rel)}-{os.getpid()}-{time.time_ns()}.json"
        self.write_json(self.sub("cancel", name), {"rel": rel})
        return name

    # -- trainers --------------------------------------------------------------------------------
    def register_trainer(self) -> str:
        """Registers the calling process as a live trainer; returns its file's path."""
        with _seq_lock:
            seq = next(_seq)
        path = self.sub("trainers", f"{this_trainer()}-{seq}.json")
        self.write_json(path, {"pid": os.getpid(), "since": time.time()})
        return path

    def live_trainers(self) -> list[str]:
        """The registered trainers still running; the files of dead ones are removed."""
        alive = []
        for n in self.names("trainers"):
            token = "-".join(n[:-5].split("-")[:2])
            if trainer_alive(token):
                alive.append(token)
            else:
                self.remove("trainers", n)
        return alive

    # -- the agent's lock ------------------------------------------------------------------------
    def try_lock(self) -> int | None:
        """Takes ``agent.lock`` (exclusive, not blocking): the descriptor, or None if an agent
        holds it."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        return fd

    def agent_alive(self) -> bool:
        """True if an agent holds ``agent.lock`` now."""
        fd = self.try_lock()
        if fd is None:
            return True
        os.close(fd)  # closing drops the lock
        return False


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "AGENT_DIR", "AgentConfig", "AgentDir", "Request", "proc_start", "source_key",
    "this_trainer", "trainer_alive",
]
