"""Rebuild the newest checkpoint on every node from the peer replicas that survived.

A restarted job calls, on every rank, after ``init_process_group`` and before it resumes::

    path = recover_from_replicas("/dev/shm/run1")      # this rank's node-local fast root
    path = resume_path("/dev/shm/run1", persist_root)  # picks it when it is the newest

Each node (ranks grouped by host and fast root, as :mod:`dcp_datastates.lifecycle.replicas`
groups them; the node's lowest rank acts for it) lists what its fast root holds: its own
checkpoint directories (each file with the save id of its rank's manifest, and the commit id of
``.metadata``) and the replicas it received (``.datastates-replicas/<name>.<commit id>``, only the
ranks whose ``.done-<rank>`` marker is there). From every node's list, every rank computes the same
choice: the newest checkpoint (step, then commit time) whose every file (every saving rank's data
files and manifest, and ``.metadata``) exists somewhere *of that commit*: a file in a node's own
directory counts only when its rank's manifest has the save id the round recorded, and
``.metadata`` only with that commit id. Files of an older or a failed save of the same name are
never mixed in.

Then every node gets the whole checkpoint in ``<root>/<name>``: files it already holds stay,
replicas it holds are hard-linked in, the rest come from a node holding them, over the process
group (:mod:`dcp_datastates.lifecycle.peer_transfer`; files spread over their holders). The
directory is marked partial (``.datastates.incomplete``) first and any ``.metadata`` of another
commit removed; ``.metadata`` is put in place last, after every file is fsynced; then ``latest``.
Checksums: load the result with :class:`~dcp_datastates.DataStatesReader`, which verifies every
byte it reads in the same pass; with ``verify=True`` each node also verifies the whole result
(:func:`dcp_datastates.format.verify.verify_checkpoint`, one more read of every byte) before
``.metadata`` goes in place, for a load by the stock reader. The
restarted job may have any number of ranks and nodes (the load reshards as usual).

Failure semantics: every rank returns the same result: the path on this rank's node, or None
when no checkpoint can be rebuilt from the replicas (then use the persistent tier); if some node
fails to rebuild it (a disk error, a peer not answering, damage found), every rank raises
:class:`~dcp_datastates.errors.DataStatesError` naming the node and the cause, and no node's
directory looks complete unless it is. Collective: call it on every rank; ``group`` defaults to a
gloo group over all ranks. Threads: the caller's.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..errors import DataStatesError
from ..format.commit import MANIFEST_PREFIX, fsync_dir
from ..format.verify import load_metadata, verify_checkpoint
from .checkpoints import INCOMPLETE_MARKER, METADATA_FILE, parse_step, update_latest
from .peer_transfer import Edge, FileSpan, exchange
from .replicas import DONE_PREFIX, REPLICA_DIR, ROUND_FILE, manifest_save_id, node_key

_META_IN = ".metadata.recovered"  # .metadata's name until every other file is in place


@dataclass
class _Own:
    """A node's own checkpoint directory: its files, the commit id of its ``.metadata`` and the
    save id of each rank's manifest."""

    files: dict[str, int]
    meta_id: str | None
    manifest_ids: dict[int, str | None]


@dataclass
class _Replica:
    """A round's replica on a node: its record, the ranks complete there, its files."""

    doc: dict[str, Any]
    done: set[int]
    files: dict[str, int]
    path: str


@dataclass
class _Node:
    leader: int
    root: str
    own: dict[str, _Own] = field(default_factory=dict)
    replicas: dict[tuple[str, str], _Replica] = field(default_factory=dict)


def _meta_id(path: str) -> str | None:
    """The commit id ``.metadata`` at ``path`` records; None if it cannot be read (a damaged
    ``.metadata`` belongs to no commit)."""
    try:
        with open(path, "rb") as f:
            md = load_metadata(f.read())
    except (OSError, ValueError):
        return None
    return getattr(getattr(md, "storage_meta", None), "save_id", None)


def _list_own(root: str) -> dict[str, _Own]:
    out: dict[str, _Own] = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        d = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(d):
            continue
        files = {f: os.stat(os.path.join(d, f)).st_size for f in os.listdir(d)
                 if os.path.isfile(os.path.join(d, f))}
        ids = {}
        for f in files:
            if f.startswith(MANIFEST_PREFIX) and f.endswith(".json"):
                with contextlib.suppress(ValueError):
                    ids[int(f[len(MANIFEST_PREFIX):-5])] = manifest_save_id(
                        os.path.join(d, f))
        if METADATA_FILE not in files and _META_IN in files:  # set aside by a failed rebuild
            files[METADATA_FILE] = files[_META_IN]
        meta_name = METADATA_FILE if os.path.exists(os.path.join(d, METADATA_FILE)) else _META_IN
        meta = _meta_id(os.path.join(d, meta_name)) if METADATA_FILE in files else None
        out[name] = _Own(files=files, meta_id=meta, manifest_ids=ids)
    return out


def _list_replicas(root: str) -> dict[tuple[str, str], _Replica]:
    area = os.path.join(root, REPLICA_DIR)
    out: dict[tuple[str, str], _Replica] = {}
    for entry in sorted(os.listdir(area)) if os.path.isdir(area) else []:
        d = os.path.join(area, entry)
        try:
            with open(os.path.join(d, ROUND_FILE)) as f:
                doc = json.load(f)
            names = os.listdir(d)
        except (OSError, ValueError):
            continue
        done = {int(n[len(DONE_PREFIX):]) for n in names
                if n.startswith(DONE_PREFIX) and n[len(DONE_PREFIX):].isdigit()}
        files = {n: os.stat(os.path.join(d, n)).st_size for n in names
                 if not n.startswith(".") and n != ROUND_FILE}
        if METADATA_FILE in names:
            files[METADATA_FILE] = os.stat(os.path.join(d, METADATA_FILE)).st_size
        out[(doc["name"], doc["commit_id"])] = _Replica(doc, done, files, d)
    return out


def _in_dir(root: str, name: str, f: str) -> str:
    """Where file ``f`` of checkpoint ``name`` is during a rebuild (``.metadata`` set aside)."""
    return os.path.join(root, name, _META_IN if f == METADATA_FILE else f)


def _holders(nodes: list[_Node], doc: dict[str, Any]) -> dict[str, list[tuple[int, str]]] | None:
    """For each file of the round ``doc``: the nodes (by index) holding it of that commit, and
    where; None if some file is held nowhere."""
    name, commit = doc["name"], doc["commit_id"]
    out: dict[str, list[tuple[int, str]]] = {}
    for r_str, info in doc["ranks"].items():
        r = int(r_str)
        for f, size in info["files"].items():
            where = []
            for j, node in enumerate(nodes):
                own = node.own.get(name)
                if own is None or own.files.get(f) != size:
                    valid = False
                elif f == METADATA_FILE:
                    valid = own.meta_id == commit
                else:
                    valid = info["manifest_id"] is not None and (
                        own.manifest_ids.get(r) == info["manifest_id"])
                if valid:
                    where.append((j, _in_dir(node.root, name, f)))
                    continue
                rep = node.replicas.get((name, commit))
                if rep is not None and r in rep.done and rep.files.get(f) == size:
                    where.append((j, os.path.join(rep.path, f)))
            if not where:
                return None
            out[f] = where
    return out


def _choose(nodes: list[_Node]) -> tuple[dict[str, Any], dict[str, list[tuple[int, str]]]] | None:
    """The newest round every file of which survives somewhere, and its holders."""
    rounds: dict[tuple[str, str], dict[str, Any]] = {}
    for node in nodes:
        for key, rep in node.replicas.items():
            rounds.setdefault(key, rep.doc)
    order = sorted(rounds.values(), reverse=True,
                   key=lambda d: (parse_step(d["name"]) or -1, d.get("time", 0.0)))
    for doc in order:
        holders = _holders(nodes, doc)
        if holders is not None:
            return doc, holders
    return None


def _plan(nodes: list[_Node], doc: dict[str, Any],
          holders: dict[str, list[tuple[int, str]]]) -> tuple[list[Edge], dict[int, list[str]]]:
    """Edges bringing each node what it lacks, and per node the files it links from itself."""
    pairs: dict[tuple[int, int], list[FileSpan]] = {}
    local: dict[int, list[str]] = {}
    for i, f in enumerate(sorted(holders)):
        size = next(int(inf["files"][f]) for inf in doc["ranks"].values() if f in inf["files"])
        for j, node in enumerate(nodes):
            mine = [p for h, p in holders[f] if h == j]
            if mine:
                if mine[0] != _in_dir(node.root, doc["name"], f):
                    local.setdefault(j, []).append(mine[0])
                continue
            h, src = holders[f][i % len(holders[f])]
            name = _META_IN if f == METADATA_FILE else f
            pairs.setdefault((h, j), []).append(FileSpan(name, size, src))
    edges = [
        Edge(src=nodes[h].leader, dst=nodes[j].leader, files=tuple(files),
             target=os.path.join(nodes[j].root, doc["name"]))
        for (h, j), files in sorted(pairs.items())
    ]
    return edges, local


def _prepare(node: _Node, doc: dict[str, Any], keep: set[str], links: list[str]) -> None:
    """Marks the node's directory partial (its ``.metadata`` set aside or dropped), removes the
    data files and manifests that are not the round's valid ones, links in the replicas the
    node holds itself. ``keep``: the files of the round already valid in the directory."""
    d = os.path.join(node.root, doc["name"])
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, INCOMPLETE_MARKER), "a"):
        pass
    fsync_dir(d)
    for f in sorted(os.listdir(d)):
        full = os.path.join(d, f)
        if f == METADATA_FILE:
            if f in keep:
                os.replace(full, os.path.join(d, _META_IN))  # in place again last
            else:
                os.unlink(full)
        elif f not in keep and (f.endswith(".distcp") or f.startswith(MANIFEST_PREFIX)):
            os.unlink(full)  # another save's, or the round's from a save that did not commit
    for src in links:
        f = os.path.basename(src)
        dst = os.path.join(d, _META_IN if f == METADATA_FILE else f)
        tmp = dst + ".link"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    fsync_dir(d)


def _commit(node: _Node, doc: dict[str, Any], verify: bool) -> None:
    """Puts ``.metadata`` in place last (after the check), clears the marker, sets ``latest``."""
    d = os.path.join(node.root, doc["name"])
    wanted = {f for inf in doc["ranks"].values() for f in inf["files"]}
    missing = sorted(f for f in wanted - {METADATA_FILE} if not os.path.exists(os.path.join(d, f)))
    if missing or not os.path.exists(os.path.join(d, _META_IN)):
        raise DataStatesError(f"{d} still lacks {missing or [METADATA_FILE]}")
    os.replace(os.path.join(d, _META_IN), os.path.join(d, METADATA_FILE))
    fsync_dir(d)
    if verify:
        report = verify_checkpoint(d)
        if not report.ok:
            os.replace(os.path.join(d, METADATA_FILE), os.path.join(d, _META_IN))
            fsync_dir(d)
            raise DataStatesError(f"{d} rebuilt from replicas fails verification: "
                                  f"{report.summary()}")
    os.unlink(os.path.join(d, INCOMPLETE_MARKER))
    fsync_dir(d)
    update_latest(node.root, doc["name"])


@dataclass
class RecoveryStats:
    """What the last :func:`recover_from_replicas` of this process did on this rank
    (``last_recovery``): the checkpoint, bytes received and sent, files linked from this node's
    own replicas, and seconds spent listing, exchanging and committing (verification included)."""

    checkpoint: str | None = None
    received: int = 0
    sent: int = 0
    linked: int = 0
    list_s: float = 0.0
    exchange_s: float = 0.0
    commit_s: float = 0.0


last_recovery = RecoveryStats()


def _gather_nodes(root: str, rank: int, world: int, group: dist.ProcessGroup) -> list[_Node]:
    """Every node's listing (by its lowest rank), the same list on every rank."""
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, (rank, node_key(root)), group=group)
    leader: dict[Any, int] = {}
    for r, key in sorted(keys):
        leader.setdefault(key, r)
    node = None
    if leader[node_key(root)] == rank:
        node = _Node(leader=rank, root=root, own=_list_own(root), replicas=_list_replicas(root))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, node, group=group)
    return [n for n in gathered if n is not None]


def _agree(error: str | None, world: int, group: dist.ProcessGroup) -> list[str]:
    """Every rank's error of this stage (None: fine), on every rank."""
    status: list[Any] = [None] * world
    dist.all_gather_object(status, error, group=group)
    return [s for s in status if s]


def recover_from_replicas(
    root: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None = None,
    verify: bool = False,
    timeout_s: float = 600.0,
) -> str | None:
    """Rebuilds the newest checkpoint that the peer replicas can give on every node's ``root``
    (this rank's node-local fast root); see the module docstring. Returns its path on this
    rank's node, or None when the replicas cannot give one. Collective over ``group``.
    ``last_recovery`` holds what it did on this rank."""
    global last_recovery
    stats = last_recovery = RecoveryStats()
    t0 = time.perf_counter()
    root = os.path.abspath(os.fspath(root))
    if group is None:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size(group)
    nodes = _gather_nodes(root, rank, world, group)
    chosen = _choose(nodes)
    stats.list_s = time.perf_counter() - t0
    if chosen is None:
        return None
    doc, holders = chosen
    stats.checkpoint = os.path.join(root, doc["name"])
    edges, local = _plan(nodes, doc, holders)
    error = None
    mine = next((j for j, n in enumerate(nodes) if n.leader == rank), None)
    if mine is not None:
        keep = {f for f, where in holders.items()
                if (mine, _in_dir(root, doc["name"], f)) in where}
        stats.linked = len(local.get(mine, []))
        try:
            _prepare(nodes[mine], doc, keep, local.get(mine, []))
        except OSError as e:
            error = f"preparing {root}/{doc['name']} on rank {rank}: {e}"
    t1 = time.perf_counter()
    result = exchange(edges, group, timeout_s=timeout_s)
    stats.exchange_s = time.perf_counter() - t1
    stats.received = sum(edges[k].total for k in result.done if edges[k].dst == rank)
    stats.sent = sum(edges[k].total for k in result.done if edges[k].src == rank)
    if result.errors:
        error = "; ".join(result.errors.values())
    failed = _agree(error, world, group)
    if not failed:
        t2 = time.perf_counter()
        if mine is not None:
            try:
                _commit(nodes[mine], doc, verify)
            except (OSError, DataStatesError) as e:
                error = f"on rank {rank}: {e}"
        stats.commit_s = time.perf_counter() - t2
        failed = _agree(error, world, group)
    if failed:
        raise DataStatesError(f"rebuilding {doc['name']} from replicas failed: " +
                              "; ".join(failed))
    return stats.checkpoint


__all__ = ["RecoveryStats", "last_recovery", "recover_from_replicas"]
