"""The scale simulator (benchmarks/scale_sim.py): its synthetic plans are DCP's, its quick run
works, and its durability step really goes through a c10d TCPStore.

* The synthetic plans: for ranks of small worlds, the plan :class:`PlanBuilder` builds from ints
  equals, field by field (and in pickled size), the plan DCP's ``DefaultSavePlanner`` makes for
  a real tiny Llama-like model put on that layout with torch's own ``fully_shard`` (FSDP2, HSDP)
  and ``parallelize_module`` (TP), with an AdamW that stepped, through
  ``get_state_dict``, under torch's ``fake`` process group (one process plays any rank); ZeRO-1
  has no torch module API, so its builder is checked against DCP's planner on the DTensor state
  dict it describes.
* The quick run writes strict JSON with every step for both contenders, and a PNG.
* Durability: N simulated ranks report through a real TCPStore; one that never reports is named
  by ``rank_commit.wait_for_ranks`` within its timeout.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: an installed dcp_datastates wins over the source tree

from benchmarks.scale_layouts import (  # noqa: E402
    MODELS,
    PlanBuilder,
    device_mesh,
    fake_world,
    in_fresh_thread,
    make_layout,
)


class _Attention(nn.Module):
    def __init__(self, h: int, kv: int) -> None:
        super().__init__()
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, kv, bias=False)
        self.wv = nn.Linear(h, kv, bias=False)
        self.wo = nn.Linear(h, h, bias=False)


class _FeedForward(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)
        self.w3 = nn.Linear(h, f, bias=False)


class _Block(nn.Module):
    def __init__(self, h: int, f: int, kv: int) -> None:
        super().__init__()
        self.attention = _Attention(h, kv)
        self.feed_forward = _FeedForward(h, f)
        self.attention_norm = nn.RMSNorm(h)
        self.ffn_norm = nn.RMSNorm(h)


class _Llama(nn.Module):
    """torchtitan's Llama module tree (names and shapes), tiny."""

    def __init__(self, m: Any) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleDict(
            {str(i): _Block(m.hidden, m.ffn, m.kv) for i in range(m.layers)}
        )
        self.norm = nn.RMSNorm(m.hidden)
        self.output = nn.Linear(m.hidden, m.vocab, bias=False)


def _tp(model: _Llama, mesh: Any) -> None:
    """torchtitan's tensor-parallel plan for Llama (weights only: the layouts of inputs and
    outputs do not change what is saved)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {"tok_embeddings": RowwiseParallel(),
                                     "norm": SequenceParallel(), "output": ColwiseParallel()})
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        })


def _real_state(kind: str, world: int, mesh: Any) -> dict[str, Any]:
    """A real tiny model on ``kind`` (FSDP2 / HSDP / TP+FSDP2), an AdamW stepped once, and
    ``get_state_dict``'s model and optimizer state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Llama(MODELS["tiny"])
    dp = mesh
    if kind == "tp-fsdp":
        _tp(model, mesh["tp"])
        dp = mesh["dp"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _dcp_plan(state: dict[str, Any], rank: int) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=rank == 0)
    return planner.create_local_plan()


def _real_plan(kind: str, world: int, rank: int, layout: Any) -> Any:
    def run() -> Any:
        with fake_world(rank, world):
            return _dcp_plan(_real_state(kind, world, device_mesh(layout)), rank)

    return in_fresh_thread(run)  # DTensor's caches are per thread (see in_fresh_thread)


def _builder_state_plan(builder: PlanBuilder, world: int, rank: int) -> Any:
    def run() -> Any:
        with fake_world(rank, world):
            return _dcp_plan(builder.state_dict(device_mesh(builder.layout)), rank)

    return in_fresh_thread(run)


def _pickled(plan: Any) -> int:
    return len(pickle.dumps(plan))


@pytest.mark.parametrize(
    ("kind", "world"), [("fsdp", 4), ("fsdp", 6), ("hsdp", 8), ("tp-fsdp", 8)]
)
def test_builder_matches_fsdp2_modules(kind: str, world: int) -> None:
    """Every rank's synthetic plan equals DCP's for a real FSDP2 (+TP) module and AdamW."""
    layout = make_layout(kind, world, tp=2, shard_group=4)
    builder = PlanBuilder(MODELS["tiny"], layout)
    for rank in range(world):
        real = _real_plan(kind, world, rank, layout)
        ours = builder.local_plan(rank)
        assert len(real.items) == builder.items_per_rank
        for a, b in zip(real.items, ours.items, strict=True):
            assert a == b, (rank, a, b)
        assert real.planner_data == ours.planner_data
        assert real == ours
        assert _pickled(real) == _pickled(ours), rank


@pytest.mark.parametrize(("kind", "world"), [("zero1", 4), ("fsdp", 512), ("tp-fsdp", 64)])
def test_builder_matches_dcp_on_dtensor_state(kind: str, world: int) -> None:
    """The synthetic plan equals DCP's on the builder's own DTensor state dict, at sizes where
    shards come out uneven or empty (70b rows over 512 ranks)."""
    model = MODELS["tiny"] if kind == "zero1" else MODELS["70b"]
    layout = make_layout(kind, world)
    builder = PlanBuilder(model, layout)
    for rank in (0, 1, world // 2 + 1, world - 1):
        real = _builder_state_plan(builder, world, rank)
        ours = builder.local_plan(rank)
        assert real == ours, rank
        assert _pickled(real) == _pickled(ours), rank


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        ((128256, 8192), (8192,), "S0"),
        ((1024, 8192), (4096,), "S0"),
        ((8192,), (3, 5), "R,S0"),
        ((28672, 8192), (16, 8), "S0,S1"),
        ((8192,), (16, 8), "S0,R"),
        ((70, 30), (4, 3), "S0,S0"),
        ((5, 7), (4, 4), "S0,S0"),
        ((100,), (7,), "S0"),
    ],
)
def test_local_shard_is_torchs(shape: tuple[int, ...], mesh: tuple[int, ...],
                               placements: str) -> None:
    """The builder's int arithmetic equals DTensor's compute_local_shape_and_global_offset at
    every coordinate (uneven and empty shards included)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from benchmarks.scale_layouts import local_shard

    pl = tuple(Replicate() if p == "R" else Shard(int(p[1])) for p in placements.split(","))
    world = 1
    for d in mesh:
        world *= d
    layout = make_layout("fsdp", world)
    for rank in sorted({0, 1, world // 3, world // 2, world - 2, world - 1} & set(range(world))):
        coord = []
        rest = rank
        for size in reversed(mesh):
            coord.append(rest % size)
            rest //= size
        coord.reverse()
        want = _compute_local_shape_and_global_offset(shape, mesh, coord, pl)
        assert local_shard(shape, mesh, tuple(coord), pl) == want, (rank, coord)
    assert layout.coordinate(world - 1) == (world - 1,)


def _strict_json(path: Path) -> Any:
    def no_constants(name: str) -> None:
        raise ValueError(f"{path.name}: non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=no_constants)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("scalesim") / "out"
    # by path, from outside the repository: the script appends the repository to sys.path, so
    # an installed dcp_datastates (with its compiled engine, in CI) is the one imported
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scale_sim.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, (
        f"scale_sim failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return out


def test_quick_run_has_every_step(quick_run: Path) -> None:
    """The quick run measures every step of every phase, for both contenders, at every
    layout and N; it says it is simulated; the plan builder matched DCP at every point."""
    from benchmarks.scale_sim import LOAD_STEPS, SAVE_STEPS

    res = _strict_json(quick_run / "scale_sim.json")
    assert res["meta"]["simulated"] is True
    assert set(res["config"]["layouts"]) == {"fsdp", "hsdp", "tp-fsdp", "zero1"}
    assert res["config"]["contenders"] == ["stock", "ours"]
    for key, point in res["points"].items():
        assert point["status"] == "measured", (key, point.get("error"))
        assert point["info"]["builder_check"].startswith("equal"), key
        assert point["info"]["tracemalloc_pass"].startswith("measured"), key
    by = {(x["layout"], x["ranks"], x["contender"], x["phase"], x["step"]): x
          for x in res["records"]}
    for layout in res["config"]["layouts"]:
        for n in res["config"]["ranks"]:
            for c in ("stock", "ours"):
                for phase, steps in (("save", SAVE_STEPS), ("load", LOAD_STEPS),
                                     ("save_repeat", SAVE_STEPS)):
                    for step, _role in steps:
                        if phase == "save_repeat" and step.startswith(
                                ("durability", "create_global_plan.")):
                            continue
                        x = by.get((layout, n, c, phase, step))
                        if c == "ours" and step.startswith("create_global_plan."):
                            continue  # DCP's parts: our planner's one linear pass has none
                        if c == "stock" and step in ("finish.share_metadata_values",):
                            assert x is None
                            continue
                        assert x is not None, (layout, n, c, phase, step)
                        if c == "stock" and step.startswith("durability"):
                            assert x["status"] == "n/a"
                        elif c == "ours" and phase == "save_repeat" and step.startswith(
                                "finish."):  # results by reference, .metadata reused
                            assert x["status"] == "reused", x
                        elif (c == "stock" and step == "gather_results_send"
                              and phase == "save_repeat"):
                            assert x["status"] == "same"
                        else:
                            assert x["status"] == "measured", x
                            assert x["wall_s"] >= 0 and x["cpu_s"] >= 0
                            if "." not in step:
                                assert x["tracemalloc_peak_bytes"] is not None, x
    gathers = [x for x in res["records"] if x["step"] == "gather_plans" and x["phase"] == "save"]
    for x in gathers:  # N plans gathered, padded as torch's gather_object pads them
        assert x["wire_objects"] == x["ranks"]
        assert x["wire_padded_bytes"] == x["ranks"] * x["wire_max_bytes"] >= x["wire_bytes"]


def test_quick_run_writes_plot_and_table(quick_run: Path) -> None:
    png = (quick_run / "scale_sim.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 600_000
    md = (quick_run / "scale_sim.md").read_text()
    assert md.startswith("SIMULATED")
    assert "| save | gather_plans | coordinator |" in md
    assert "durability reports through a real TCPStore" in md


def test_durability_round_trips_a_real_store() -> None:
    """Ranks report through a TCPStore; the coordinator's wait returns once all did."""
    from benchmarks.scale_sim import Meter, durability_round

    m = Meter({"model": "-", "layout": "-", "ranks": 64, "contender": "ours"}, trace=False)
    out = durability_round(64, 3, meter=m)
    assert out == {"threads": 3, "reports": 63}
    steps = {x["step"]: x for x in m.records}
    assert set(steps) == {"durability_report", "durability_wait", "durability_concurrent"}
    assert steps["durability_report"]["wire_objects"] == 63


def _dropped_rank_error(n: int, dropped: int) -> tuple[str, float]:
    from benchmarks.scale_sim import durability_round
    from dcp_datastates.errors import CheckpointSaveError

    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveError) as info:
        durability_round(n, 2, drop=frozenset({dropped}), timeout_s=1.0)
    return str(info.value), time.monotonic() - t0


def test_durability_names_a_rank_that_never_reports() -> None:
    """One simulated rank's report is dropped: wait_for_ranks fails the save naming it, within
    its timeout (1 s here) and a bounded overhead."""
    msg, took = _dropped_rank_error(16, 7)
    late = msg.split("rank(s) [", 1)[1].split("]", 1)[0]
    assert "7" in late.split(", "), msg
    assert "did not report their data durable within 1 s" in msg
    assert took < 10.0


def test_durability_names_only_the_rank_that_never_reports() -> None:
    msg, _ = _dropped_rank_error(16, 7)
    assert "rank(s) [7] did not report" in msg, msg
