"""Incremental saves (DataStatesWriter(incremental=...)): unchanged frozen tensors are referenced.

A LoRA-like model (a frozen base, trainable adapters with AdamW): the second save writes only the
adapters and the optimizer state, ``.metadata`` points at the first checkpoint's bytes, the stock
``dcp.load`` loads it bit-exactly, verify follows the references, retention keeps the owners, and
an overwrite of a referenced checkpoint is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from conftest import results_gather_lost
from dist_utils import run_ranks

from dcp_datastates import DataStatesWriter
from dcp_datastates.format.verify import verify_checkpoint
from dcp_datastates.lifecycle.checkpoints import RetentionPolicy, cleanup_incomplete, prune

TIMEOUT_S = 60


class Lora(nn.Module):
    """A frozen base of ``layers`` linear layers, each with a trainable rank-``r`` adapter."""

    def __init__(self, width: int = 256, layers: int = 3, r: int = 4) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.base.requires_grad_(False)
        self.a = nn.ParameterList(nn.Parameter(torch.randn(r, width) * 0.1) for _ in range(layers))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(width, r)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, a, b in zip(self.base, self.a, self.b, strict=True):
            x = torch.tanh(lin(x) + x @ a.t() @ b.t())
        return x


def _train(model: Lora, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(8, model.base[0].in_features)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def _make(seed: int = 0) -> tuple[Lora, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _save(writer: DataStatesWriter, state: dict[str, Any], path: Path) -> None:
    dcp.async_save(state, storage_writer=writer, checkpoint_id=str(path)).result(timeout=TIMEOUT_S)


def _data_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".distcp"))


def _refs(path: Path) -> set[str]:
    out: set[str] = set()
    for m in path.glob("__datastates_manifest_*.json"):
        out |= {it["ref"] for it in json.loads(m.read_text())["items"] if "ref" in it}
    return out


def _base_bytes(model: Lora) -> int:
    return sum(t.numel() * t.element_size() for t in model.base.state_dict().values())


def _assert_loads_exactly(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Stock dcp.load into zeroed copies; every tensor bit-equal to the live state."""
    want = _state(model, opt, 0)
    got = {
        "model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
    }
    dcp.load(got, checkpoint_id=str(path))
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k


@pytest.fixture
def writer_factory(tmp_path: Path):
    writers: list[DataStatesWriter] = []

    def make(**kw: Any) -> DataStatesWriter:
        kw.setdefault("incremental", True)
        w = DataStatesWriter(str(tmp_path), "64MiB", copy_threads=1, flush_threads=1, **kw)
        writers.append(w)
        return w

    yield make
    for w in writers:
        w.close()


@pytest.mark.parametrize("mode", [True, "verify"])
def test_inference_tensors_are_written_at_every_save(tmp_path: Path, writer_factory, mode):
    """An inference tensor has no version counter: an in-place change under inference_mode
    between two saves is invisible to the identity check, so such tensors are never
    referenced (both modes) and the second save holds the changed bytes. A plain frozen tensor
    next to it is still referenced."""
    w = writer_factory(incremental=mode)
    frozen = torch.randn(256)
    with torch.inference_mode():
        inf = torch.randn(256)
    state = {"frozen": frozen, "inf": inf}
    _save(w, state, tmp_path / "step-1")
    with torch.inference_mode():
        inf.add_(1.0)
    want = {k: v.clone() for k, v in state.items()}
    _save(w, state, tmp_path / "step-2")
    assert w._incremental is not None
    assert w._incremental.last_referenced_bytes == frozen.nbytes  # frozen only, not inf
    got = {k: torch.zeros(256) for k in state}
    dcp.load(got, checkpoint_id=str(tmp_path / "step-2"))
    for k in state:
        assert torch.equal(got[k], want[k]), k


def test_lora_second_save_writes_only_adapters_and_optimizer(tmp_path: Path, writer_factory):
    model, opt = _make()
    w = writer_factory()
    _train(model, opt)
    _save(w, _state(model, opt, 1), tmp_path / "step-1")
    full = _data_bytes(tmp_path / "step-1")
    assert full > _base_bytes(model)
    for step in (2, 3):
        _train(model, opt)
        _save(w, _state(model, opt, step), tmp_path / f"step-{step}")
        d = tmp_path / f"step-{step}"
        # Only adapters + optimizer state (+ archive framing) were written: not the base.
        assert _data_bytes(d) < full - _base_bytes(model)
        assert w._incremental is not None
        assert w._incremental.last_referenced_bytes == _base_bytes(model)
        # References point straight at the owner of the bytes (no chain through step-2).
        assert _refs(d) == {"step-1"}
        md = dcp.FileSystemReader(str(d)).read_metadata()
        rels = {info.relative_path for info in md.storage_data.values()}
        assert any(r.startswith("../step-1/") for r in rels)
        _assert_loads_exactly(d, model, opt)
        rep = verify_checkpoint(d)
        assert rep.fully_verified, rep.summary()
    # The optimizer state also loads bit-exactly (it was written, not referenced).
    live = opt.state_dict()
    zeroed = {
        k: {n: torch.zeros_like(t) if torch.is_tensor(t) else t for n, t in v.items()}
        for k, v in live["state"].items()
    }
    got = {"optim": {"state": zeroed, "param_groups": live["param_groups"]}}
    dcp.load(got, checkpoint_id=str(tmp_path / "step-3"))
    for k, v in opt.state_dict()["state"].items():
        for n, t in v.items():
            assert torch.equal(got["optim"]["state"][k][n], t), (k, n)


def test_frozen_tensor_modified_in_place_is_written_again(tmp_path: Path, writer_factory):
    model, opt = _make()
    _train(model, opt)  # the adapters are owned by the optimizer from now on: always written
    w = writer_factory()
    _save(w, _state(model, opt, 1), tmp_path / "step-1")
    with torch.no_grad():
        model.base[1].weight.mul_(2.0)  # bumps the version counter the state dict shares
    _save(w, _state(model, opt, 2), tmp_path / "step-2")
    assert w._incremental is not None
    changed = model.base[1].weight.numel() * 4
    assert w._incremental.last_referenced_bytes == _base_bytes(model) - changed
    _assert_loads_exactly(tmp_path / "step-2", model, opt)
    # A replaced storage (p.data = other) is not the same tensor either.
    model.base[2].weight.data = model.base[2].weight.detach() + 1.0
    _save(w, _state(model, opt, 3), tmp_path / "step-3")
    _assert_loads_exactly(tmp_path / "step-3", model, opt)
    assert verify_checkpoint(tmp_path / "step-3").fully_verified


def test_data_write_is_caught_in_verify_mode(tmp_path: Path, writer_factory):
    model, opt = _make()
    _train(model, opt)
    # incremental=True trusts the version counter: a write through .data is not seen (the
    # documented hole); "verify" compares the CRC-32C of the source with the owner's bytes.
    w = writer_factory(incremental="verify")
    _save(w, _state(model, opt, 1), tmp_path / "step-1")
    _save(w, _state(model, opt, 2), tmp_path / "step-2")
    assert w._incremental is not None
    assert w._incremental.last_referenced_bytes == _base_bytes(model)  # unchanged: referenced
    model.base[0].weight.data.add_(1.0)  # .data has its own version counter
    _save(w, _state(model, opt, 3), tmp_path / "step-3")
    assert w._incremental.last_referenced_bytes == (
        _base_bytes(model) - model.base[0].weight.numel() * 4
    )
    _assert_loads_exactly(tmp_path / "step-3", model, opt)

    trusting = writer_factory(incremental=True)
    _save(trusting, _state(model, opt, 4), tmp_path / "step-4")
    model.base[0].weight.data.add_(1.0)
    _save(trusting, _state(model, opt, 5), tmp_path / "step-5")
    assert trusting._incremental is not None
    assert trusting._incremental.last_referenced_bytes == _base_bytes(model)  # the hole


def test_verify_follows_references_and_names_a_deleted_owner(tmp_path: Path, writer_factory):
    model, opt = _make()
    w = writer_factory()
    _save(w, _state(model, opt, 1), tmp_path / "step-1")
    _train(model, opt)
    _save(w, _state(model, opt, 2), tmp_path / "step-2")
    rep = verify_checkpoint(tmp_path / "step-2")
    assert rep.fully_verified, rep.summary()
    assert rep.bytes_checked >= _base_bytes(model)  # the owner's bytes were read and checked
    # Damage in the owner's bytes is found through the reference, naming the owner's file.
    (owner_file,) = (tmp_path / "step-1").glob("__0_0.*.distcp")  # named after its save
    raw = bytearray(owner_file.read_bytes())
    raw[8192] ^= 0xFF
    owner_file.write_bytes(bytes(raw))
    rep = verify_checkpoint(tmp_path / "step-2")
    assert rep.exit_code == 1
    assert any(f"../step-1/{owner_file.name}" in p and "checksum" in p for p in rep.problems), (
        rep.summary()
    )
    shutil.rmtree(tmp_path / "step-1")
    rep = verify_checkpoint(tmp_path / "step-2")
    assert rep.exit_code == 1
    assert any("step-1" in p and "missing" in p for p in rep.problems), rep.summary()


def test_prune_keeps_referenced_owners(tmp_path: Path, writer_factory):
    model, opt = _make()
    w = writer_factory()
    for step in (1, 2, 3):
        _train(model, opt)
        _save(w, _state(model, opt, step), tmp_path / f"step-{step}")
    kept: dict[Path, str] = {}
    removed = prune(tmp_path, RetentionPolicy(keep_last=1), kept=kept)
    assert removed == [tmp_path / "step-2"]
    assert list(kept) == [tmp_path / "step-1"] and "step-3" in kept[tmp_path / "step-1"]
    _assert_loads_exactly(tmp_path / "step-3", model, opt)
    assert verify_checkpoint(tmp_path / "step-3").fully_verified
    assert cleanup_incomplete(tmp_path) == []
    # A full save (a new writer has no records) releases the owner: both old ones go, newest
    # first, in one call.
    full = writer_factory(incremental=False)
    _save(full, _state(model, opt, 4), tmp_path / "step-4")
    assert prune(tmp_path, RetentionPolicy(keep_last=1)) == [
        tmp_path / "step-1",
        tmp_path / "step-3",
    ]
    _assert_loads_exactly(tmp_path / "step-4", model, opt)


def test_overwriting_a_referenced_checkpoint_is_refused(tmp_path: Path, writer_factory):
    model, opt = _make()
    w = writer_factory()
    _save(w, _state(model, opt, 1), tmp_path / "step-1")
    _train(model, opt)
    _save(w, _state(model, opt, 2), tmp_path / "step-2")
    other = writer_factory(incremental=False)
    with pytest.raises(BaseException, match="refusing to overwrite .*step-1.*step-2"):
        _save(other, _state(model, opt, 9), tmp_path / "step-1")
    # Nothing was removed: both checkpoints still load and verify.
    _assert_loads_exactly(tmp_path / "step-2", model, opt)
    assert verify_checkpoint(tmp_path / "step-1").fully_verified
    assert verify_checkpoint(tmp_path / "step-2").fully_verified
    # An unreferenced checkpoint may be overwritten (step-2 references step-1 only).
    _save(w, _state(model, opt, 2), tmp_path / "step-2")
    _assert_loads_exactly(tmp_path / "step-2", model, opt)


def test_owner_outside_the_root_means_a_full_write(tmp_path: Path, writer_factory):
    # The reference would not be a sibling: the tensors referenced at the call are written
    # from their source at placement instead (and checked unchanged after the write).
    model, opt = _make()
    w = writer_factory()
    _save(w, _state(model, opt, 1), tmp_path / "a" / "step-1")
    _save(w, _state(model, opt, 2), tmp_path / "b" / "step-2")
    assert _refs(tmp_path / "b" / "step-2") == set()
    assert _data_bytes(tmp_path / "b" / "step-2") > _base_bytes(model)
    _assert_loads_exactly(tmp_path / "b" / "step-2", model, opt)
    shutil.rmtree(tmp_path / "a")
    assert verify_checkpoint(tmp_path / "b" / "step-2").fully_verified


def test_owner_locked_by_a_deletion_means_a_full_write(
    tmp_path: Path, writer_factory, monkeypatch: pytest.MonkeyPatch
):
    # A prune or overwrite holds the owner's exclusive lock while it deletes: a save that
    # referenced it at the call cannot wait for it, so it writes those tensors from the source.
    from dcp_datastates.format import commit, refs

    monkeypatch.setattr(refs, "_LOCK_WAIT_S", 0.2)
    model, opt = _make()
    _train(model, opt)
    w = writer_factory()
    _save(w, _state(model, opt, 1), tmp_path / "step-1")
    fd = commit.lock_marker(str(tmp_path / "step-1"), create=True, purpose="a test deletion")
    assert fd is not None
    try:
        _save(w, _state(model, opt, 2), tmp_path / "step-2")
    finally:
        commit.unlock_marker(fd)
    assert _refs(tmp_path / "step-2") == set()
    assert w._incremental is not None and w._incremental.last_referenced_bytes == 0
    shutil.rmtree(tmp_path / "step-1")
    _assert_loads_exactly(tmp_path / "step-2", model, opt)
    assert verify_checkpoint(tmp_path / "step-2").fully_verified


def test_fsspec_file_url_reader_follows_references(tmp_path: Path, writer_factory):
    # checkpoint_id with "://" selects FsspecReader, which joins path and relative_path too.
    model, opt = _make()
    _train(model, opt)
    w = writer_factory()
    url = f"file://{tmp_path}"
    for step in (1, 2):
        state = _state(model, opt, step)
        dcp.async_save(state, storage_writer=w, checkpoint_id=f"{url}/step-{step}").result(
            timeout=TIMEOUT_S
        )
    assert _refs(tmp_path / "step-2") == {"step-1"}
    want = model.state_dict()
    got = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(got, checkpoint_id=f"{url}/step-2")
    assert all(torch.equal(got["model"][k], v) for k, v in want.items())


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="incremental must be"):
        DataStatesWriter("", "16MiB", incremental="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checksums=True"):
        DataStatesWriter("", "16MiB", incremental="verify", checksums=False)


# ------------------------------------------------------------------------------------------------
def _two_ranks(rank: int, world: int, root: str) -> list[int]:
    torch.manual_seed(rank)
    frozen = {"shared": torch.full((64, 64), 3.0), f"own{rank}": torch.randn(128, 128)}
    adapter = nn.Parameter(torch.randn(16, 16))
    opt = torch.optim.AdamW([adapter], lr=1e-2)
    sizes = []
    with DataStatesWriter(root, "32MiB", incremental=True, flush_threads=1) as w:
        for step in (1, 2):
            adapter.grad = torch.randn_like(adapter)
            opt.step()
            state = {"frozen": frozen, f"adapter{rank}": adapter.detach(),
                     f"optim{rank}": opt.state_dict()}
            path = os.path.join(root, f"step-{step}")
            dcp.async_save(state, storage_writer=w, checkpoint_id=path).result(timeout=TIMEOUT_S)
            dist.barrier()
            sizes.append(
                sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                    if n.startswith(f"__{rank}_"))
            )
        got = {"frozen": {k: torch.zeros_like(v) for k, v in frozen.items()},
               f"adapter{rank}": torch.zeros_like(adapter)}
        dcp.load(got, checkpoint_id=os.path.join(root, "step-2"))
        assert torch.equal(got[f"adapter{rank}"], adapter.detach())
        for k, v in frozen.items():
            assert torch.equal(got["frozen"][k], v), k
    return sizes


def test_two_ranks(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    sizes = run_ranks(_two_ranks, str(root), tmp_path=tmp_path, timeout_s=120)
    own = 128 * 128 * 4
    for first, second in sizes:
        assert first > own and second < own  # each rank referenced its own frozen tensor
    assert _refs(root / "step-2") == {"step-1"}
    rep = verify_checkpoint(root / "step-2")
    assert rep.fully_verified and rep.ranks == 2, rep.summary()


def test_incremental_with_safetensors_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format='torch'"):
        DataStatesWriter(str(tmp_path), host_cache_size="16MiB", incremental=True,
                         format="safetensors")


def test_a_save_dcp_abandons_after_its_results_releases_the_owners(
    tmp_path: Path, writer_factory
):
    # One process: write_data hands over the results before the data is durable, holding the
    # owners' shared locks until finish(). Should DCP stop in between (here its gather of the
    # results fails), the failed save's release lets the owners go: they can be deleted.
    import time

    from dcp_datastates.format import commit

    model, opt = _make()
    _train(model, opt)
    w = writer_factory()
    _save(w, _state(model, opt, 1), tmp_path / "step-1")
    _train(model, opt)
    with results_gather_lost():
        with pytest.raises(BaseException, match="gather of the write results was lost"):
            _save(w, _state(model, opt, 2), tmp_path / "step-2")
    assert not (tmp_path / "step-2" / ".metadata").exists()
    fd = None
    for _ in range(100):  # the release runs in the future's callbacks, just after result()
        fd = commit.lock_marker(str(tmp_path / "step-1"), create=True, purpose="a test deletion")
        if fd is not None:
            break
        time.sleep(0.02)
    assert fd is not None, "the abandoned save still holds the owner's shared lock"
    commit.unlock_marker(fd)
    _save(w, _state(model, opt, 3), tmp_path / "step-3")  # the writer goes on
    _assert_loads_exactly(tmp_path / "step-3", model, opt)
