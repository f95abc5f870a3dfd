"""Real ranks under torchrun: 4 gloo ranks save FSDP2 + AdamW state with DataStatesWriter and
with DCP's stock writer, 2 ranks and 1 rank load each checkpoint resharded with the stock
``dcp.load``; every value bit for bit against the seeded state, both checkpoints committed, and
ours equal to stock's value for value. The small form of ``python -m benchmarks.reshard``
(benchmarks/reshard.py), ~45 s on 2 cores: three torchrun launches of 4, 2 and 1 processes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: an installed dcp_datastates wins over the source tree

from benchmarks import reshard, reshard_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("torchrun-reshard")
    args = reshard.parse(["--ranks", "4", "--load-ranks", "2,1", "--tiny", "--rounds", "1",
                          "--contenders", "ours,stock", "--timeout", "300", "--keep",
                          "--dir", str(base)])
    return reshard.benchmark(args)


def _log(doc: dict[str, Any]) -> str:
    return "\n".join(f"{x['mode']} x{x['ranks']}: rc {x['rc']}\n{x['log_tail']}"
                     for x in doc["launches"])


def test_saved_committed_and_loaded_bit_exact(run: dict[str, Any]) -> None:
    assert [(x["mode"], x["ranks"], x["rc"]) for x in run["launches"]] == [
        ("save", 4, 0), ("load", 2, 0), ("load", 1, 0)], _log(run)
    assert run["problems"] == [], run["problems"]
    save = run["save"]
    assert save["source_mismatches"] == 0
    for name in ("ours", "stock"):
        assert save[name]["committed"], name
        assert save[name]["call_s"] <= save[name]["committed_s"]
        root = Path(run["config"]["root"]) / name / "r0"
        assert (root / ".metadata").is_file(), name
        for world in ("2", "1"):
            load = run["load"][world][name]
            assert load["bit_exact"], (name, world, load["rounds"])
            assert load["bytes_checked"] == save["state_bytes"], (name, world)  # every value


def _load_whole(path: Path) -> dict[str, Any]:
    """One process, no process group: the checkpoint into plain tensors of the same model."""
    model, opt = reshard_state.build(reshard_state.TINY, 1)
    reshard_state.scramble(model, opt)
    state = reshard_state.app_state(model, opt)
    dcp.load(state, checkpoint_id=str(path))
    return state


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}{i}.").items()}
    return {prefix: tree}


def test_ours_equals_stock_value_for_value(run: dict[str, Any]) -> None:
    root = Path(run["config"]["root"])
    ours, stock = (_flat(_load_whole(root / n / "r0")) for n in ("ours", "stock"))
    assert ours.keys() == stock.keys()
    tensors = [k for k, v in ours.items() if isinstance(v, torch.Tensor)]
    assert len(tensors) > 3 * 10
    for k, v in ours.items():
        if isinstance(v, torch.Tensor):
            assert reshard_state.bit_equal(v, stock[k]), k
        else:
            assert v == stock[k], k
