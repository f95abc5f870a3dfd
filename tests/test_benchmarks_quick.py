"""Keep the benchmark harness from rotting: run `benchmarks.run --quick`, check its outputs.

No timing is asserted. What is checked: the run succeeds; results.json and raw.json are strict
JSON with every scenario and contender present; results.md holds a table per scenario; each PNG
is a decodable image under 300 KB; every contender that ran loaded its checkpoint back
bit-exactly with the stock loader of its format (dcp.load for DCP checkpoints); contenders that
cannot run here (torchsnapshot not installed, dcp_datastates not importable) are reported as
skipped with a reason instead of failing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CONTENDERS = {
    "torch_save",
    "dcp_fs_t1",
    "dcp_fs_tN",
    "dcp_async",
    "dcp_async_stager",
    "torchsnapshot",
    "ds_save",
    "ds_async",
    "ds_async_lazy",
    "ds_plain",
}
MLP_CONTENDERS = {"ds_plain", "ds_plain_eager", "dcp_fs_t2", "dcp_default_stager"}
DS_NAMES = ("ds_save", "ds_async", "ds_async_lazy", "ds_plain", "ds_plain_eager")


def _strict_json(path: Path) -> Any:
    def no_constants(name: str) -> None:
        raise ValueError(f"{path.name}: non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=no_constants)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("matplotlib")
    pytest.importorskip("psutil")
    base = tmp_path_factory.mktemp("bench")
    out = base / "out"
    # run as a script from outside the repository: the script appends the repository to
    # sys.path, so the installed dcp_datastates (with its compiled engine) is the one imported
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "run.py"),
        "--quick",
        "--out",
        str(out),
        "--dir",
        str(base / "ckpt"),
    ]
    proc = subprocess.run(cmd, cwd=base, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (base / "stdout.txt").write_text(proc.stdout)
    return base


def test_outputs_well_formed(quick_run: Path) -> None:
    out = quick_run / "out"
    results = _strict_json(out / "results.json")
    raw = _strict_json(out / "raw.json")
    md = (out / "results.md").read_text()
    assert results["meta"]["machine"]["torch"]
    names = [s["name"] for s in results["scenarios"]]
    kinds = {s["kind"] for s in results["scenarios"]}
    assert kinds == {"synthetic", "training", "mlp", "memory"}
    assert any(s["scenario"]["world_size"] == 2 for s in results["scenarios"])
    assert any(s["scenario"]["cache_fraction"] for s in results["scenarios"])
    assert any(
        s["kind"] == "training" and s["scenario"]["ckpt_every"] == 1 for s in results["scenarios"]
    )
    for scn in results["scenarios"]:
        assert "error" not in scn["summary"], f"{scn['name']}: {scn['summary'].get('error')}"
        assert scn["name"] in raw
        assert f"## {scn['name']}" in md
        section = md.split(f"## {scn['name']}", 1)[1]
        assert ("| mode |" if scn["kind"] == "memory" else "| contender |") in section
    assert len(names) == len(set(names))


def test_plots_are_pngs(quick_run: Path) -> None:
    import matplotlib.image as mpimg

    out = quick_run / "out"
    results = _strict_json(out / "results.json")
    pngs = [p for group in results["meta"]["plots"].values() for p in group]
    assert "blocked.png" in pngs and "slowdown.png" in pngs and "mlp_cost.png" in pngs
    assert any(p.startswith("timeline_") for p in pngs)
    for name in pngs:
        path = out / name
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) < 300_000, f"{name} is {len(data)} bytes"
        img = mpimg.imread(path)
        assert img.shape[0] > 100 and img.shape[1] > 100, name
        assert f"]({name})" in (out / "results.md").read_text()


def test_every_contender_loads_back_bit_exact(quick_run: Path) -> None:
    results = _strict_json(quick_run / "out" / "results.json")
    seen: set[str] = set()
    for scn in results["scenarios"]:
        if scn["kind"] == "memory":
            continue  # rows, not contenders: see test_memory_scenario_table
        contenders = scn["summary"]["contenders"]
        assert set(scn["scenario"]["contenders"]) <= set(contenders)
        for name, c in contenders.items():
            seen.add(name)
            assert c["status"] in ("ok", "skipped"), f"{scn['name']}/{name}: {c['errors']}"
            if c["status"] == "skipped":
                assert c["skip_reason"], f"{scn['name']}/{name} skipped without a reason"
                assert name == "torchsnapshot" or name in DS_NAMES, name
                continue
            assert c["verified"] and c["verify_runs"] >= 1, f"{scn['name']}/{name}"
            assert c["blocked_s"] is not None and c["durable_s"] is not None
            if c["format"] == "dcp":
                assert c["loader"] == "dcp.load"
            if scn["kind"] == "training":
                assert c["slowdown_pct"] is not None
                assert c["slowdown_until_durable_pct"] is not None  # end to end
    assert seen >= CONTENDERS | MLP_CONTENDERS


def _scenario(results: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in results["scenarios"] if s["name"] == name)


def test_gpt_k1_runs_the_plain_call(quick_run: Path) -> None:
    results = _strict_json(quick_run / "out" / "results.json")
    scn = next(
        s
        for s in results["scenarios"]
        if s["kind"] == "training" and s["scenario"]["ckpt_every"] == 1
    )
    assert "ds_plain" in scn["summary"]["contenders"]
    assert "ds_async" in scn["summary"]["contenders"]  # the explicit-protect variant stays


def test_mlp_loop_reports_cost_per_checkpoint(quick_run: Path) -> None:
    out = quick_run / "out"
    results = _strict_json(out / "results.json")
    scn = _scenario(results, "mlp-loop")
    s = scn["summary"]
    assert s["baseline_loop_s"] is not None and not s["baseline_errors"]
    n_ckpt = scn["scenario"]["iters"] // scn["scenario"]["ckpt_every"]
    assert set(s["contenders"]) == MLP_CONTENDERS
    for name, c in s["contenders"].items():
        if c["status"] == "skipped":
            assert name in DS_NAMES, name
            continue
        assert c["status"] == "ok", (name, c["errors"])
        assert c["checkpoints"] == n_ckpt, name
        for key in (
            "cost_per_ckpt_s",
            "cost_per_ckpt_no_drain_s",
            "blocked_s",
            "durable_s",
            "fwd_after_save_s",
            "bwd_after_save_s",
            "step_after_save_s",
            "vmhwm_gb",
        ):
            assert c[key] is not None, (name, key)
        assert c["verified"] and c["verified_first_by_replay"], name
    assert s["write_tax_s"] is not None and s["write_tax_s"]["n"] == scn["scenario"]["repeats"]
    if s["contenders"]["ds_plain"]["status"] == "ok":
        # the plain call's wait inside optimizer.step() is part of its blocked time
        raw = _strict_json(out / "raw.json")
        plain_runs = raw["mlp-loop"][0]["contenders"]["ds_plain"]["runs"]
        assert plain_runs
        for run in plain_runs:
            for save in run["saves"]:
                assert save["barrier_s"] >= 0 and save["blocked_s"] >= save["barrier_s"]
        assert set(s["ratios"]) == {"ds_plain/dcp_fs_t2", "ds_plain/dcp_default_stager"}
        assert all(v is not None for v in s["ratios"].values())
        assert "ds_plain/dcp_fs_t2 = " in (out / "results.md").read_text()
    assert "cost per checkpoint ds_plain/dcp_fs_t2" in (quick_run / "stdout.txt").read_text()


def test_memory_scenario_table(quick_run: Path) -> None:
    results = _strict_json(quick_run / "out" / "results.json")
    s = _scenario(results, "memory")["summary"]
    rows = s["rows"]
    # every mode, first and later save (the quick run measures the mixed state only)
    got = {(r["mode"], r["save"]) for r in rows}
    assert got == {
        (m, v) for m in ("dcp.save", "auto", "lazy", "eager") for v in ("first", "later")
    }
    for r in rows:
        assert "growth_bytes" in r, r
        assert r["bound_bytes"] == r["cache_bytes"] + s["slack_bytes"]
        assert r["within_bound"] == (r["growth_bytes"] <= r["bound_bytes"])
        assert r["error"] is None and r["bit_exact"], r
    md = (quick_run / "out" / "results.md").read_text()
    assert "| `lazy` | mixed | later |" in md


def test_checkpoints_are_cleaned_up(quick_run: Path) -> None:
    leftovers = list((quick_run / "ckpt").rglob(".metadata"))
    assert not leftovers, leftovers[:5]


@pytest.mark.parametrize(
    ("module", "contender"),
    [
        ("dcp_datastates", "ds_save"),
        ("dcp_datastates", "ds_async"),
        ("dcp_datastates", "ds_async_lazy"),
        ("torchsnapshot", "torchsnapshot"),
    ],
)
def test_unimportable_contender_is_skipped_with_reason(
    monkeypatch: pytest.MonkeyPatch, module: str, contender: str
) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.contenders import make_contender
    finally:
        sys.path.remove(str(ROOT))
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    reason = make_contender(contender).skip_reason(torch.device("cpu"))
    assert reason is not None and module in reason


@pytest.mark.parametrize("state,contenders,owned", [
    ("plain", ("ours", "ours_plan_cache", "stock"), False),
    ("dtensor", ("ours", "ours_late", "stock"), True),
])
def test_scale_out_quick(
    tmp_path: Path, state: str, contenders: tuple[str, ...], owned: bool
) -> None:
    """benchmarks.scale_out --quick: 1 and 2 ranks, each contender, JSON and PNG written."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "so"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale_out.py"), "--quick", "--out", str(out),
         "--dir", str(tmp_path), "--state", state, "--contenders", ",".join(contenders)]
        + (["--owned"] if owned else []),
        cwd=tmp_path, capture_output=True, text=True, timeout=300,  # the installed package
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = _strict_json(out / "scale_out.json")
    assert (out / "scale_out.png").stat().st_size > 0
    assert res["worlds"] == [1, 2]
    assert res["config"]["state"] == state and res["config"]["owned"] is owned
    for w in ("1", "2"):
        assert set(res["by_world"][w]) == set(contenders)
        for name in contenders:
            c = res["by_world"][w][name]
            assert len(c["saves"]) == res["config"]["saves"]
            assert 0 <= c["call_s"] <= c["durable_s"] and c["plan_s"] >= 0 and c["step_s"] >= 0
            assert 0 <= c["plan_cpu_s"]


def test_d2h_runs_every_contender_on_cpu(tmp_path: Path) -> None:
    """benchmarks.d2h (the GPU capture-speed benchmark) on a CPU state: every contender timed,
    the reference ratio of pinned_copy is 1, no contender failed."""
    out = tmp_path / "d2h.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "d2h.py"), "--device", "cpu", "--state",
         "8MB:mixed", "--rounds", "2", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,  # the installed package
        env={**os.environ, "BENCH_DIR": str(tmp_path)},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = _strict_json(out)
    assert res["errors"] == {}
    assert set(res["times_s"]) == {"pinned_copy", "default_stager", "datastates",
                                   "datastates_owned", "datastates_owned_unbatched"}
    assert all(len(v) == 2 and min(v) > 0 for v in res["times_s"].values())
    assert set(res["call_s"]) == {"datastates", "datastates_owned", "datastates_owned_unbatched"}
    assert set(res["engine"]) == {"batched", "unbatched"}
    assert res["x_pinned_copy"]["pinned_copy"] == 1.0
    assert res["bytes"] >= 8 * 10**6 * 0.99


def test_h2d_restore_runs_every_contender_on_cpu(tmp_path: Path) -> None:
    """benchmarks.h2d_restore (the GPU restore benchmark of scripts/gpu_check.sh) dry-run on
    CPU targets: every contender timed and checked bit for bit, ratios to pinned_h2d."""
    out = tmp_path / "h2d.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "h2d_restore.py"), "--device", "cpu",
         "--state", "8MB:mixed", "--rounds", "2", "--dir", str(tmp_path), "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,  # the installed package
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = _strict_json(out)
    assert res["errors"] == {}
    assert set(res["times_s"]) == {"pinned_h2d", "datastates", "datastates_temporaries", "stock"}
    assert all(len(v) == 2 and min(v) > 0 for v in res["times_s"].values())
    assert res["x_pinned_h2d"]["pinned_h2d"] == 1.0
    assert res["last_read"]["datastates"]["native_bytes"] == res["bytes"]
    assert set(res["data_x_pinned_h2d"]) == {"datastates", "datastates_temporaries"}


def test_fsdp2_train_runs_every_contender_on_cpu(tmp_path: Path) -> None:
    """benchmarks.fsdp2_train (the GPU FSDP2 loop of scripts/gpu_check.sh) on a tiny CPU model
    over gloo: every contender ran, the figures are ratios to the run without checkpoints, the
    plain call's last checkpoint reads back bit for bit."""
    out = tmp_path / "fsdp2.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fsdp2_train.py"), "--device", "cpu",
         "--layers", "3", "--width", "128", "--batch", "16", "--iters", "2", "--ckpt-every", "1",
         "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "BENCH_DIR": str(tmp_path)},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = _strict_json(out)
    assert res["errors"] == {} and res["verify"] == {"ds_plain": "exact"}
    summary = res["summary"]
    assert set(summary) == {"none", "ds_plain", "dcp_async_stager", "dcp_fs_tN"}
    assert summary["none"]["x_step"] == 1.0
    for name in ("ds_plain", "dcp_async_stager", "dcp_fs_tN"):
        row = summary[name]
        assert row["x_step"] > 0 and row["blocked_x_step"] >= 0 and row["durable_x_best"] >= 1.0
    assert res["state_bytes"] == 3 * 128 * 128 * 12 + 3 * 4  # weights, two moments, steps


def _bench_module(name: str) -> Any:
    """A module of the repository's benchmarks package (not installed: imported from ROOT)."""
    import importlib

    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT))


def test_reusable_stager_replaces_a_spent_one() -> None:
    """torch 2.11's DefaultStager clears its copier table after each stage (a second stage then
    fails): the harness replaces such a stager and keeps one that is still usable."""
    reusable_stager = _bench_module("benchmarks.contenders").reusable_stager
    opts = {"use_pinned_memory": False, "use_shared_memory": False,
            "use_async_staging": False, "use_non_blocking_copy": False}
    first = reusable_stager(None, opts)
    try:
        first.stage({"a": torch.ones(3)})
        assert reusable_stager(first, opts) is first
        first._state_dict_stager._deepcopy_dispatch.clear()  # what torch 2.11 does
        second = reusable_stager(first, opts)
        assert second is not first
        staged = second.stage({"a": torch.ones(3), "n": 1})
        assert torch.equal(staged["a"], torch.ones(3)) and staged["n"] == 1
        second.close()
    finally:
        first.close()


def test_gpt_preset_with_a_batch() -> None:
    gpt_config = _bench_module("benchmarks.workloads").gpt_config
    assert gpt_config("large@b128").batch_size == 128
    assert gpt_config("large@b128").n_embd == gpt_config("large").n_embd
    for bad in ("large@128", "large@b0", "huge", "small@"):
        with pytest.raises(ValueError, match="GPT preset"):
            gpt_config(bad)


def test_small_tensors_runs_every_shape(tmp_path: Path) -> None:
    """benchmarks.small_tensors, tiny: dcp.save and async_save of flat, nested and
    optimizer-owned states, each contender in its own process; the owned shape reports the
    step's wait for the lazy copies."""
    out = tmp_path / "small.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "small_tensors.py"), "--n", "300",
         "--n-async", "200", "--saves", "2", "--parallel", "2", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,  # the installed package
        env={**os.environ, "BENCH_DIR": str(tmp_path)},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = _strict_json(out)
    shapes = {(x["kind"], x["contender"], x["shape"]) for x in res["results"]}
    assert shapes == {(k, c, s) for c in ("stock", "datastates")
                      for k, s in [("save", "flat"), ("async", "flat"), ("async", "nested"),
                                   ("async", "owned")]}
    owned = next(x for x in res["results"]
                 if x["contender"] == "datastates" and x["shape"] == "owned")
    assert owned["barrier_s"] >= 0 and owned["blocked_s"] > 0


def test_extensions_benchmark_quick(tmp_path: Path) -> None:
    """benchmarks.extensions, tiny: every contender saves through ZStandard (or, for the
    reference, without), writes a fraction of the state's bytes, and loads back bit-exactly
    with the stock reader."""
    pytest.importorskip("zstandard")
    out = tmp_path / "ext.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "extensions.py"), "--mb", "2",
         "--repeats", "1", "--out", str(out), "--dir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,  # the installed package
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = _strict_json(out)
    by = {x["contender"]: x for x in res["results"]}
    assert set(by) == {"fs_zstd", "fs_zstd_t2", "fs_zstd_async", "ds_zstd", "ds_zstd_async",
                       "ds_plain_async"}
    assert all(x["loads_bit_exact"] for x in by.values())
    assert by["ds_plain_async"]["median"]["bytes"] >= res["state_bytes"]
    for name in ("fs_zstd", "ds_zstd", "ds_zstd_async"):
        assert by[name]["ratio"] > 2, (name, by[name])
        assert by[name]["median"]["durable_s"] >= by[name]["median"]["blocked_s"] > 0
