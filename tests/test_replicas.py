"""Peer replicas and the restore after a node is lost (dcp_datastates.lifecycle.replicas,
replica_restore): ranks given distinct node-local roots are distinct nodes (two simulated nodes
of two ranks each on this machine), a node's directory is deleted after the saves, and a restart
with another number of ranks rebuilds the newest checkpoint from the surviving replicas, bit for
bit, without any persistent tier."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks

from dcp_datastates import resume_path

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def full_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {
        "w": torch.randn(64, 24, generator=g),  # Shard(0): every rank writes a part
        "b": torch.randn(40, generator=g).to(torch.bfloat16),
        "norm": torch.randn(24, generator=g),  # replicated: one rank writes it
        "step": torch.tensor(step, dtype=torch.int64),
    }


def _layout(full: dict[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
            "norm": distribute_tensor(full["norm"], mesh, [Replicate()]),
        },
        "step": full["step"].clone(),
    }


def _node_root(base: str, rank: int, per_node: int) -> str:
    root = os.path.join(base, f"node{rank // per_node}")
    os.makedirs(root, exist_ok=True)
    return root


def _save(rank: int, world: int, base: str, steps: list[int], names: list[str]) -> list[Any]:
    """Saves ``steps`` (as ``names``) with replicas=1 from 2 ranks per node; the round records."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates import DataStatesWriter

    mesh = init_device_mesh("cpu", (world,))
    pg = dist.new_group(backend="gloo")
    root = _node_root(base, rank, 2)
    with DataStatesWriter(
        os.path.join(root, names[0]), host_cache_size="4MiB", replicas=1, replica_timeout=60
    ) as w:
        for step, name in zip(steps, names, strict=True):
            sd = _layout(full_state(step), mesh)
            dcp.async_save(
                sd, storage_writer=w, checkpoint_id=os.path.join(root, name), process_group=pg
            ).result(120)
        assert w.wait_replicated(120)
        return w.replica_stats()


def _restore(rank: int, world: int, base: str, expect_step: int | None) -> str | None:
    """A restarted job of ``world`` ranks, one per node: rebuild, resume, load, compare."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates import recover_from_replicas, verify_checkpoint

    root = _node_root(base, rank, 1)
    path = recover_from_replicas(root, timeout_s=60)
    if expect_step is None:
        assert path is None
        return None
    assert path is not None and path == os.path.join(root, f"step-{expect_step}") or (
        path is not None and path.startswith(root))
    assert verify_checkpoint(path).fully_verified
    mesh = init_device_mesh("cpu", (world,))
    full = full_state(expect_step)
    target = _layout({k: torch.zeros_like(v) for k, v in full.items()}, mesh)
    dcp.load(target, checkpoint_id=path, process_group=dist.new_group(backend="gloo"))
    for k in ("w", "b", "norm"):
        assert torch.equal(target["model"][k].full_tensor(), full[k]), k
    assert int(target["step"]) == expect_step
    return os.path.basename(path)


def _replica_sets(root: Path) -> list[str]:
    area = root / ".datastates-replicas"
    return sorted(p.name for p in area.iterdir()) if area.exists() else []


@pytest.fixture(scope="module")
def saved_two_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """Steps 1 and 2 saved by 4 ranks as 2 nodes, replicated (copied by each test that uses it:
    one 4-rank launch for the module)."""
    tmp = tmp_path_factory.mktemp("replicas")
    stats = run_ranks(_save, str(tmp / "fast"), [1, 2], ["step-1", "step-2"],
                      tmp_path=tmp / "w4", world_size=4)
    return tmp / "fast", stats


def _copy_of(saved: Path, tmp_path: Path) -> str:
    shutil.copytree(saved, tmp_path / "fast")
    return str(tmp_path / "fast")


def _lose_node1(saved: Path, tmp_path: Path) -> tuple[str, Path]:
    """A copy of the saved tree with node1 lost; its base, and node0's replica of step-2."""
    base = _copy_of(saved, tmp_path)
    shutil.rmtree(tmp_path / "fast" / "node1")
    area = tmp_path / "fast" / "node0" / ".datastates-replicas"
    return base, next(p for p in area.iterdir() if p.name.startswith("step-2."))


def test_node_loss_restores_newest_step_from_replica(
    tmp_path: Path, saved_two_steps: tuple[Path, list[Any]]
) -> None:
    saved, stats = saved_two_steps
    for per_rank in stats:
        assert len(per_rank) == 2, per_rank
        assert [r["error"] for r in per_rank] == [None, None]
        assert all(r["sent"] > 0 and r["received"] > 0 for r in per_rank)
    base = _copy_of(saved, tmp_path)
    # node0 holds node1's part (ring of two), and the other way round
    for node in ("node0", "node1"):
        sets = _replica_sets(tmp_path / "fast" / node)
        assert [s.split(".")[0] for s in sets] == ["step-1", "step-2"], sets
    assert not (tmp_path / "fast" / "node0" / "step-2" / "__2_0.distcp").exists()
    shutil.rmtree(tmp_path / "fast" / "node1")  # the node is lost
    got = run_ranks(_restore, base, 2, tmp_path=tmp_path / "w2")
    assert got == ["step-2", "step-2"]
    # the replacement node's directory is a complete checkpoint, loadable by the stock reader
    md = tmp_path / "fast" / "node1" / "step-2" / ".metadata"
    assert md.exists() and not (md.parent / ".datastates.incomplete").exists()
    for node in ("node0", "node1"):  # resume_path now finds it on either node's fast tier
        root = tmp_path / "fast" / node
        assert resume_path(root, None) == str(root / "step-2")


def test_incomplete_replica_is_never_used(
    tmp_path: Path, saved_two_steps: tuple[Path, list[Any]]
) -> None:
    base, newest = _lose_node1(saved_two_steps[0], tmp_path)
    (newest / ".done-3").unlink()  # rank 3's copy never completed: step-2 cannot be rebuilt
    assert run_ranks(_restore, base, 1, tmp_path=tmp_path / "w2") == ["step-1", "step-1"]
    # step-2 on the replacement node was never made to look complete
    assert not (tmp_path / "fast" / "node1" / "step-2" / ".metadata").exists()


def test_resaved_name_restores_the_last_commit(tmp_path: Path) -> None:
    """The same name saved twice: the replicas of the first commit are dropped, the restore
    gives the second save's bytes, never a mix of the two."""
    base = str(tmp_path / "fast")
    run_ranks(_save, base, [1, 5], ["ckpt-a", "ckpt-a"], tmp_path=tmp_path / "w4", world_size=4)
    sets = _replica_sets(tmp_path / "fast" / "node0")
    assert len(sets) == 1 and sets[0].startswith("ckpt-a."), sets
    doc = json.loads(
        (tmp_path / "fast" / "node0" / ".datastates-replicas" / sets[0] / "round.json").read_text()
    )
    assert doc["commit_id"] == sets[0].split(".", 1)[1]
    shutil.rmtree(tmp_path / "fast" / "node1")
    assert run_ranks(_restore, base, 5, tmp_path=tmp_path / "w2") == ["ckpt-a", "ckpt-a"]


def _nothing(rank: int, world: int, base: str) -> str | None:
    return _restore(rank, world, base, None)


def test_no_replicas_gives_none(tmp_path: Path) -> None:
    assert run_ranks(_nothing, str(tmp_path / "fast"), tmp_path=tmp_path / "w") == [None, None]


def test_replicas_option_is_checked(tmp_path: Path) -> None:
    from dcp_datastates import DataStatesWriter

    with pytest.raises(ValueError, match="replicas need"):
        DataStatesWriter(str(tmp_path / "c"), host_cache_size="4MiB", replicas=1, incremental=True)
    with pytest.raises(ValueError, match="non-negative"):
        DataStatesWriter(str(tmp_path / "c"), host_cache_size="4MiB", replicas=-1)
    with pytest.raises(ValueError, match="init"):  # no process group in this process
        DataStatesWriter(str(tmp_path / "c"), host_cache_size="4MiB", replicas=1)


def _peer_silent(rank: int, world: int, base: str) -> Any:
    """Rank 3 never replicates (its rounds are dropped): the others' round fails within the
    replica timeout, their saves stay committed, nothing hangs, the next save still works."""
    import time

    from torch.distributed.device_mesh import init_device_mesh

    from dcp_datastates import DataStatesWriter

    mesh = init_device_mesh("cpu", (world,))
    pg = dist.new_group(backend="gloo")
    root = _node_root(base, rank, 2)
    w = DataStatesWriter(os.path.join(root, "step-1"), host_cache_size="4MiB", replicas=1,
                         replica_timeout=5)
    if rank == 3:
        from dcp_datastates.lifecycle import replicas

        rep = replicas.current()
        assert rep is not None
        rep.submit = lambda request: None  # type: ignore[method-assign]
    for step in (1, 2):
        dcp.async_save(_layout(full_state(step), mesh), storage_writer=w, process_group=pg,
                       checkpoint_id=os.path.join(root, f"step-{step}")).result(120)
    if rank == 3:
        while not all(os.path.exists(os.path.join(base, f"errors-{r}.json")) for r in range(3)):
            time.sleep(0.1)
        w.close()
        return None
    assert w.wait_replicated(60)
    errors = [r["error"] for r in w.replica_stats()]
    w.close()
    with open(os.path.join(base, f"errors-{rank}.json"), "w") as f:
        json.dump(errors, f)
    return errors


def test_silent_peer_fails_the_round_not_the_save(tmp_path: Path) -> None:
    got = run_ranks(_peer_silent, str(tmp_path / "fast"), tmp_path=tmp_path / "w4", world_size=4,
                    timeout_s=120)
    for rank in range(3):
        errors = got[rank]
        assert len(errors) == 2 and all(errors), (rank, errors)
        assert "replication is off" in errors[1], errors  # the group is not used again
    # both saves are committed; no replica is marked complete anywhere
    for step in (1, 2):
        assert (tmp_path / "fast" / "node0" / f"step-{step}" / ".metadata").exists()
    for node in ("node0", "node1"):
        for s in _replica_sets(tmp_path / "fast" / node):
            assert not list((tmp_path / "fast" / node / ".datastates-replicas" / s).glob(
                ".done-*")), s


def _restore_verified(rank: int, world: int, base: str) -> str:
    from dcp_datastates import recover_from_replicas
    from dcp_datastates.errors import DataStatesError

    try:
        recover_from_replicas(_node_root(base, rank, 1), timeout_s=60, verify=True)
    except DataStatesError as e:
        return str(e)
    return "no error"


def test_damaged_replica_is_caught_by_verify(
    tmp_path: Path, saved_two_steps: tuple[Path, list[Any]]
) -> None:
    base, newest = _lose_node1(saved_two_steps[0], tmp_path)
    victim = next(newest.glob("__3_*.distcp"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in rank 3's data, as held by node0
    victim.write_bytes(bytes(raw))
    errors = run_ranks(_restore_verified, base, tmp_path=tmp_path / "w2")
    assert all("fails verification" in e and "step-2" in e for e in errors), errors
    for node in ("node0", "node1"):  # neither node's step-2 looks complete
        assert not (tmp_path / "fast" / node / "step-2" / ".metadata").exists()


def _restore_or_error(rank: int, world: int, base: str) -> str:
    from dcp_datastates import recover_from_replicas
    from dcp_datastates.errors import DataStatesError

    try:
        path = recover_from_replicas(_node_root(base, rank, 1), timeout_s=60)
    except DataStatesError as e:
        return f"error: {e}"
    return os.path.basename(str(path))


def test_failed_rebuild_can_be_retried(
    tmp_path: Path, saved_two_steps: tuple[Path, list[Any]]
) -> None:
    """The replacement node cannot create the checkpoint directory (a file is in the way): every
    rank gets the error naming it, nothing looks complete; once the file is gone, the same call
    rebuilds step-2 (the survivor's .metadata, set aside by the failed try, is found again)."""
    base = _copy_of(saved_two_steps[0], tmp_path)
    shutil.rmtree(tmp_path / "fast" / "node1")
    (tmp_path / "fast" / "node1").mkdir()
    (tmp_path / "fast" / "node1" / "step-2").write_text("in the way")
    first = run_ranks(_restore_or_error, base, tmp_path=tmp_path / "w2a")
    assert all(e.startswith("error:") and "node1/step-2" in e for e in first), first
    assert not (tmp_path / "fast" / "node0" / "step-2" / ".metadata").exists()
    (tmp_path / "fast" / "node1" / "step-2").unlink()
    assert run_ranks(_restore, base, 2, tmp_path=tmp_path / "w2b") == ["step-2", "step-2"]


def test_forked_child_does_not_replicate() -> None:
    """A DataLoader-style fork: the child's submit is a no-op (no thread, nothing pending), the
    parent's replicator is untouched."""
    from dcp_datastates.lifecycle.replicas import ReplicaRequest, Replicator

    rep = Replicator(group=None, timeout_s=1.0)  # type: ignore[arg-type]  # never used here
    pid = os.fork()
    if pid == 0:
        rep.submit(ReplicaRequest("/nowhere/step-1", 0, None, 1))
        os._exit(0 if rep._thread is None and rep.wait(0) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rep._thread is None and rep.wait(0)


def _restore_exit_child(rank: int, world: int, base: str, mib: int) -> str | None:
    """One rank per node after node 1 is lost: rebuild, then load both ranks' tensors."""
    from replica_exit_child import state

    from dcp_datastates import DataStatesReader, recover_from_replicas

    path = recover_from_replicas(_node_root(base, rank, 1), timeout_s=60)
    assert path is not None
    want = {"model": {**state(0, mib)["model"], **state(1, mib)["model"]}}
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
    pg = dist.new_group(backend="gloo")
    dcp.load(got, storage_reader=DataStatesReader(path), process_group=pg)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    return os.path.basename(path)


def test_writer_dropped_without_close_exits_cleanly_with_complete_replicas(
    tmp_path: Path
) -> None:
    """Under torchrun, a writer dropped without close() while its replica round runs (close()
    does not wait for the round either: the same exit path): the processes exit normally (no
    abort from gloo operations still in flight at interpreter exit), the round is finished
    first, and after node 1 is lost the checkpoint is rebuilt from its replica bit for bit."""
    mode = "drop"
    mib = 32
    base = tmp_path / "fast"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")) if p)}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).parent / "replica_exit_child.py"), str(base), str(mib), mode],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "terminate called" not in out, out[-4000:]
    assert "rank 0 saved" in out and "rank 1 saved" in out
    for node, peer in (("node0", 1), ("node1", 0)):
        sets = list((base / node / ".datastates-replicas").iterdir())
        assert len(sets) == 1 and (sets[0] / f".done-{peer}").exists(), (node, sets)
    shutil.rmtree(base / "node1")
    got = run_ranks(_restore_exit_child, str(base), mib, tmp_path=tmp_path / "w2")
    assert got == ["step-1", "step-1"]
