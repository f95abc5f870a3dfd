"""Turn per-rank raw measurements into per-contender summaries (medians with min/max).

Across ranks, a save blocks training for as long as its slowest rank (max), is durable when its
last rank is (max), and holds the memory of all ranks together (sum). Across saves, the first
save of a run is reported apart ("cold": the writer/stager allocates its buffers then); the
headline numbers are over the later, steady-state saves whenever a run has more than one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from benchmarks.metrics import GB, gbps, median_or_none, summarize
from benchmarks.scenarios import BASELINE


def _merge_saves(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Zip the saves of one run across ranks (by position)."""
    merged: list[dict[str, Any]] = []
    for saves in zip(*per_rank, strict=False):
        durable = [s["durable_s"] for s in saves]
        capture = [s.get("capture_s") for s in saves]
        peaks = [s.get("peak_rss") for s in saves]
        extras = [
            (s["peak_rss"] - s["rss_before"])
            for s in saves
            if s.get("peak_rss") is not None and s.get("rss_before") is not None
        ]
        merged.append(
            {
                "index": saves[0]["index"],
                "bytes": sum(s["bytes"] for s in saves),
                "call_s": max(s["call_s"] for s in saves),
                "wait_s": max(s["wait_s"] for s in saves),
                "blocked_s": max(s["blocked_s"] for s in saves),
                "durable_s": None if None in durable else max(durable),
                "capture_s": None if None in capture else max(capture),
                "peak_rss": sum(p for p in peaks if p is not None) if None not in peaks else None,
                "peak_extra": sum(extras) if len(extras) == len(saves) else None,
                "error": next((s["error"] for s in saves if s.get("error")), None),
            }
        )
    return merged


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _warm(saves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    warm = [s for s in saves if s["index"] >= 1]
    return warm or saves


def _telemetry_stats(runs_per_rank: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    keys = ("stage_s", "blocked_s", "captured_s", "done_s")
    vals: dict[str, list[float]] = {k: [] for k in keys}
    found = False
    for runs in runs_per_rank:
        for run in runs:
            for t in run.get("telemetry") or []:
                found = True
                for k in keys:
                    v = t.get(k)
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        vals[k].append(float(v))
    if not found:
        return None
    return {k: summarize(v) for k, v in vals.items()}


def _runs_by_rep(per_rank: list[dict[str, Any]], name: str) -> list[list[dict[str, Any]]]:
    """[rep][rank] -> run."""
    runs = [r["contenders"][name]["runs"] for r in per_rank]
    return [list(rr) for rr in zip(*runs, strict=False)]


def _status(per_rank: list[dict[str, Any]], name: str) -> tuple[str, str | None, list[str]]:
    entries = [r["contenders"][name] for r in per_rank]
    errors = [run["error"] for e in entries for run in e["runs"] if run.get("error")]
    if any(e["status"] == "skipped" for e in entries):
        return "skipped", entries[0]["skip_reason"], errors
    return ("error" if errors else "ok"), None, errors


def _head(per_rank: list[dict[str, Any]], name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """What every contender's summary starts with: what it is, whether it ran, first errors."""
    status, reason, errors = _status(per_rank, name)
    return {
        "label": entry["label"],
        "format": entry["format"],
        "loader": entry["loader"],
        "asynchronous": entry["asynchronous"],
        "status": status,
        "skip_reason": reason,
        "errors": errors[:3],
    }


def _save_times(saves: list[dict[str, Any]]) -> dict[str, Any]:
    """Blocked, call, wait, capture and until-durable seconds of ``saves``, each summarized."""
    return {
        "blocked_s": summarize(s["blocked_s"] for s in saves),
        "call_s": summarize(s["call_s"] for s in saves),
        "wait_s": summarize(s["wait_s"] for s in saves),
        "capture_s": summarize(s.get("capture_s") for s in saves),
        "durable_s": summarize(s["durable_s"] for s in saves),
    }


def _add_timeline(out: dict[str, Any], name: str, runs: Iterable[dict[str, Any]]) -> None:
    """``out["timeline"][name]``: the spans of the first of ``runs`` that ran its loop."""
    first = next((run for run in runs if "t_loop0" in run), None)
    if first is not None:
        out["timeline"][name] = _timeline(first)


def summarize_synthetic(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    disk = [d["gbps"] for d in r0.get("disk", [])]
    out: dict[str, Any] = {
        "bytes": sum(r["bytes"] for r in per_rank),
        "tensors_per_rank": r0["tensors"],
        "host_cache_bytes_per_rank": r0["host_cache_bytes"],
        "disk_gbps": summarize(disk),
        "disk_method": r0["disk"][0]["method"] if r0.get("disk") else None,
        "contenders": {},
    }
    dd = median_or_none(disk)
    for name, entry in r0["contenders"].items():
        summary = _head(per_rank, name, entry)
        reps = _runs_by_rep(per_rank, name)
        all_saves: list[dict[str, Any]] = []
        held: list[float] = []
        loads: list[float] = []
        verified: list[bool] = []
        for runs in reps:
            saves = _merge_saves([run["saves"] for run in runs])
            all_saves.extend(saves)
            if all(run.get("held_bytes") is not None for run in runs):
                held.append(sum(run["held_bytes"] for run in runs) / GB)
            if all("load_s" in run for run in runs):
                loads.append(max(run["load_s"] for run in runs))
                verified.append(all(run["verify"]["ok"] for run in runs))
            elif any(run.get("error") for run in runs):
                verified.append(False)
        warm = _warm(all_saves)
        cold = [s for s in all_saves if s["index"] == 0]
        flush = [gbps(s["bytes"], s["durable_s"]) for s in warm]
        summary.update(
            {
                "saves_measured": len(warm),
                **_save_times(warm),
                "first_save_blocked_s": summarize(s["blocked_s"] for s in cold),
                "flush_gbps": summarize(flush),
                "flush_vs_dd": _ratio(median_or_none(flush), dd),
                "peak_rss_gb": summarize(
                    s["peak_rss"] / GB if s["peak_rss"] is not None else None for s in all_saves
                ),
                "peak_extra_gb": summarize(
                    s["peak_extra"] / GB if s["peak_extra"] is not None else None for s in all_saves
                ),
                "held_gb": summarize(held),
                "load_s": summarize(loads),
                "verified": bool(verified) and all(verified),
                "verify_runs": len(verified),
                "telemetry": _telemetry_stats([r["contenders"][name]["runs"] for r in per_rank]),
            }
        )
        out["contenders"][name] = summary
    return out


def summarize_training(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    base_loops = [run["loop_s"] for run in r0["contenders"][BASELINE]["runs"] if "loop_s" in run]
    # slowdowns are taken against the median baseline loop: with the contender order rotating,
    # one disturbed baseline run would otherwise skew every contender of its repeat
    base = median_or_none(base_loops)
    base_iter = [
        it[6] - it[0] for run in r0["contenders"][BASELINE]["runs"] for it in run.get("iters", [])
    ]
    out: dict[str, Any] = {
        "params": r0["params"],
        "gpt": r0["gpt"],
        "host_cache_bytes_per_rank": r0["host_cache_bytes"],
        "baseline_loop_s": summarize(base_loops),
        "baseline_iter_s": summarize(base_iter),
        "contenders": {},
        "timeline": {},
    }
    for name, entry in r0["contenders"].items():
        if name == BASELINE:
            continue
        runs = [run for run in entry["runs"]]
        summary = _head(per_rank, name, entry)
        saves = [s for run in runs for s in run.get("saves", [])]
        warm = _warm(saves)
        slow = [100.0 * (run["loop_s"] / base - 1.0) for run in runs if "loop_s" in run and base]
        slow_e2e = [
            100.0 * (run["until_durable_s"] / base - 1.0)
            for run in runs
            if "until_durable_s" in run and base
        ]
        iter_s = [it[6] - it[0] for run in runs for it in run.get("iters", [])]
        verified = [run["verify"]["ok"] for run in runs if "verify" in run]
        if any(run.get("error") for run in runs):
            verified.append(False)
        summary.update(
            {
                "bytes": runs[0].get("bytes") if runs else None,
                "saves_measured": len(warm),
                **_save_times(warm),
                "first_save_blocked_s": summarize(s["blocked_s"] for s in saves if s["index"] == 0),
                "flush_gbps": summarize(gbps(s["bytes"], s["durable_s"]) for s in warm),
                "slowdown_pct": summarize(slow),
                "slowdown_until_durable_pct": summarize(slow_e2e),
                "iter_s": summarize(iter_s),
                "statedict_s": summarize(v for run in runs for v in run.get("statedict_s", [])),
                "peak_rss_gb": summarize(
                    run["peak_rss"] / GB for run in runs if run.get("peak_rss") is not None
                ),
                "held_gb": summarize(
                    run["held_bytes"] / GB for run in runs if run.get("held_bytes") is not None
                ),
                "load_s": summarize(run["load_s"] for run in runs if "load_s" in run),
                "verified": bool(verified) and all(verified),
                "verify_runs": len(verified),
                "telemetry": _telemetry_stats([runs]),
            }
        )
        out["contenders"][name] = summary
        _add_timeline(out, name, runs)
    _add_timeline(out, BASELINE, r0["contenders"][BASELINE]["runs"])
    return out


def _timeline(run: dict[str, Any]) -> dict[str, Any]:
    """Spans relative to the loop start, for the Figure-1 style plot."""
    t0 = run["t_loop0"]

    def rel(v: float | None) -> float | None:
        return None if v is None else v - t0

    iters = [[v - t0 for v in it] for it in run.get("iters", [])]
    saves = [
        {
            "call": [rel(s["t_call"]), rel(s["t_return"])],
            "wait": [rel(s["t_wait0"]), rel(s["t_wait1"])],
            "captured": rel(s.get("t_captured")),
            "durable": rel(s["t_durable"]),
        }
        for s in run.get("saves", [])
    ]
    telemetry = []
    for t in run.get("telemetry") or []:
        ts = {k: t.get(k) for k in ("t_stage", "t_captured", "t_done")}
        if all(isinstance(v, (int, float)) and math.isfinite(v) for v in ts.values()):
            telemetry.append({k: rel(v) for k, v in ts.items()})
    return {"iters": iters, "saves": saves, "telemetry": telemetry}


def _after_save_times(
    run: dict[str, Any], k: int
) -> tuple[list[float], list[float], list[float]]:
    """(forward, backward, optimizer step) seconds of the iterations right after a save
    (it % k == 0, it > 0). The step is timed after any explicit wait before it, so it holds the
    automatic step barrier of the plain call (a wait inside ``optimizer.step()``)."""
    fwd: list[float] = []
    bwd: list[float] = []
    step: list[float] = []
    for i, it in enumerate(run.get("iters", [])):
        if i > 0 and i % k == 0:
            fwd.append(it[1] - it[0])
            bwd.append(it[2] - it[1])
            step.append(it[5] - it[4])
    return fwd, bwd, step


def summarize_mlp(per_rank: list[dict[str, Any]], ckpt_every: int) -> dict[str, Any]:
    """Cost per checkpoint, paired with the `none` run of the same round, medians over rounds."""
    from benchmarks.mlp_loop import NONE

    r0 = per_rank[0]
    base_runs = {run["rep"]: run for run in r0["contenders"][NONE]["runs"] if "loop_s" in run}
    base_iter_fb = [it[2] - it[0] for run in base_runs.values() for it in run.get("iters", [])]
    base_step = [it[5] - it[4] for run in base_runs.values() for it in run.get("iters", [])]
    out: dict[str, Any] = {
        "mlp": r0["mlp"],
        "params": r0["params"],
        "threads": r0["threads"],
        "ckpt_every": ckpt_every,
        "baseline_loop_s": summarize(run["loop_s"] for run in base_runs.values()),
        "baseline_fwd_bwd_s": summarize(base_iter_fb),
        "baseline_step_s": summarize(base_step),
        "baseline_vmhwm_gb": summarize(
            run["vmhwm"] / GB for run in base_runs.values() if run.get("vmhwm") is not None
        ),
        "baseline_errors": [
            run["error"] for run in r0["contenders"][NONE]["runs"] if run.get("error")
        ],
        "contenders": {},
        "timeline": {},
        "write_tax_s": summarize(
            t["lost_s"] for t in r0.get("write_tax", []) if math.isfinite(t.get("lost_s", math.nan))
        ),
    }
    for name, entry in r0["contenders"].items():
        if name == NONE:
            continue
        runs = [run for run in entry["runs"]]
        saves = [s for run in runs for s in run.get("saves", [])]
        costs = []
        costs_no_drain = []
        for run in runs:
            base = base_runs.get(run["rep"])
            n = len(run.get("saves", []))
            if base is not None and "loop_s" in run and n:
                costs.append((run["loop_s"] - base["loop_s"]) / n)
                if "loop_no_drain_s" in run and "loop_no_drain_s" in base:
                    costs_no_drain.append((run["loop_no_drain_s"] - base["loop_no_drain_s"]) / n)
        fwd: list[float] = []
        bwd: list[float] = []
        steps: list[float] = []
        for run in runs:
            f, b, st = _after_save_times(run, ckpt_every)
            fwd += f
            bwd += b
            steps += st
        verified = [v["ok"] for run in runs for v in run.get("verify", [])]
        if any(run.get("error") for run in runs):
            verified.append(False)
        out["contenders"][name] = {
            **_head(per_rank, name, entry),
            "bytes": next((run["bytes"] for run in runs if run.get("bytes")), None),
            "checkpoints": max((len(run.get("saves", [])) for run in runs), default=0),
            "cost_per_ckpt_s": summarize(costs),
            "cost_per_ckpt_no_drain_s": summarize(costs_no_drain),
            "loop_s": summarize(run["loop_s"] for run in runs if "loop_s" in run),
            "drain_s": summarize(run["drain_s"] for run in runs if "drain_s" in run),
            **_save_times(saves),
            "fwd_after_save_s": summarize(fwd),
            "bwd_after_save_s": summarize(bwd),
            "step_after_save_s": summarize(steps),
            "fwd_bwd_after_save_s": summarize(f + b for f, b in zip(fwd, bwd, strict=True)),
            "vmhwm_gb": summarize(
                run["vmhwm"] / GB for run in runs if run.get("vmhwm") is not None
            ),
            "vmhwm_extra_gb": summarize(
                (run["vmhwm"] - run["rss_before_loop"]) / GB
                for run in runs
                if run.get("vmhwm") is not None and run.get("rss_before_loop") is not None
            ),
            "host_cache_bytes": next(
                (run["host_cache_bytes"] for run in runs if run.get("host_cache_bytes")), None
            ),
            "verified": bool(verified) and all(verified),
            "verify_runs": len(verified),
            "verified_first_by_replay": any(
                v.get("replayed") and v["ok"] for run in runs for v in run.get("verify", [])
            ),
        }
        _add_timeline(out, name, runs)
    _add_timeline(out, NONE, base_runs.values())
    ours = out["contenders"].get("ds_plain", {}).get("cost_per_ckpt_s")
    out["ratios"] = {
        f"ds_plain/{other}": _ratio(
            ours["median"] if ours else None,
            (out["contenders"].get(other, {}).get("cost_per_ckpt_s") or {}).get("median"),
        )
        for other in ("dcp_fs_t2", "dcp_default_stager", "dcp_async")
        if other in out["contenders"]
    }
    return out


def summarize_memory(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row per (mode, state, save): growth against the bound, bit-exactness."""
    r0 = per_rank[0]
    rows: list[dict[str, Any]] = []
    for res in r0["rows"]:
        row = res["row"]
        if not res.get("saves"):
            rows.append(
                {"mode": row["mode"], "state": row["state"], "save": "-", "error": res["error"]}
            )
            continue
        for s in res["saves"]:
            v = s.get("verify")
            rows.append(
                {
                    "mode": row["mode"],
                    "state": row["state"],
                    "save": s["save"],
                    "state_bytes": res.get("state_bytes"),
                    "cache_bytes": res["cache_bytes"],
                    "bound_bytes": res["bound_bytes"],
                    "growth_bytes": s["growth"],
                    "growth_vs_save_bytes": s["growth_vs_save"],
                    "within_bound": s["within_bound"],
                    "call_s": s.get("call_s"),
                    "durable_s": s.get("durable_s"),
                    "bit_exact": None if v is None else v["ok"],
                    "error": s.get("error") or res.get("error"),
                }
            )
    return {
        "slack_bytes": r0["slack_bytes"],
        "rows": rows,
        "all_within_bound": bool(rows) and all(r.get("within_bound") for r in rows),
    }


def summarize_scenario(
    kind: str, per_rank: list[dict[str, Any]], scenario: dict[str, Any] | None = None
) -> dict[str, Any]:
    errors = [r["error"] for r in per_rank if "error" in r and "contenders" not in r]
    if errors:
        return {"error": errors[0]}
    if kind == "synthetic":
        return summarize_synthetic(per_rank)
    if kind == "mlp":
        return summarize_mlp(per_rank, int((scenario or {}).get("ckpt_every", 1)))
    if kind == "memory":
        return summarize_memory(per_rank)
    return summarize_training(per_rank)
