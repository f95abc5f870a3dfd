"""Outputs: results.json (summaries, machine), raw.json (per-rank samples), results.md."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.metrics import GB
from benchmarks.workloads import format_size


# ---------------------------------------------------------------------------------------
# machine description
# ---------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mount_of(path: str) -> dict[str, str]:
    """Device and filesystem type of the mount holding ``path`` (longest prefix match)."""
    best: dict[str, str] = {}
    path = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best.get("mount", "")
                ):
                    best = {"device": dev, "mount": mnt, "fstype": fstype}
    except OSError:
        pass
    return best


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def machine_info(ckpt_root: str, device: str) -> dict[str, Any]:
    import psutil
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gb": psutil.virtual_memory().total / GB,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchsnapshot": _version("torchsnapshot-nightly") or _version("torchsnapshot"),
        "dcp_datastates": _version("dcp_datastates"),
        "git_commit": _git_commit(),
        "checkpoint_fs": _mount_of(ckpt_root),
        "device": device,
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------
def finite(obj: Any) -> Any:
    """Replace NaN/inf floats by None so the output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: str, obj: Any, indent: int | None = 1) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(finite(obj), f, indent=indent, default=str, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def emit_json(doc: Any, out: str = "") -> None:
    """Prints ``doc`` as JSON; also writes it to ``out`` (atomically) when given."""
    if out:
        write_json(out, doc)
    print(json.dumps(finite(doc), indent=1, default=str, allow_nan=False))


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------------------
def _fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if abs(v) < 0.5 * 10**-digits:
        v = 0.0  # no "-0.00"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}f}"


def fmt_stat(s: dict[str, Any] | None, digits: int = 3) -> str:
    """``median [min, max]``, or ``-``."""
    if not s:
        return "-"
    if s["n"] == 1 or s["min"] == s["max"]:
        return _fmt(s["median"], digits)
    return f"{_fmt(s['median'], digits)} [{_fmt(s['min'], digits)}, {_fmt(s['max'], digits)}]"


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{100 * v:.0f}%"


def _loadavg(v: list[float] | None) -> str:
    return "/".join(f"{x:.2f}" for x in v) if v else "?"


def _med(s: dict[str, Any] | None) -> float | None:
    return None if not s else float(s["median"])


def _table(header: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _status_row(c: dict[str, Any], width: int) -> list[str] | None:
    if c["status"] == "skipped":
        reason = (c.get("skip_reason") or "").splitlines()[0][:120]
        return [c["label"], f"skipped: {reason}"] + [""] * (width - 2)
    if c["status"] == "error":
        err = (c.get("errors") or ["?"])[0].strip().splitlines()[-1][:160]
        return [c["label"], f"**error**: {err}"] + [""] * (width - 2)
    return None


def synthetic_table(summary: dict[str, Any]) -> str:
    header = [
        "contender",
        "blocked s",
        "1st save blocked s",
        "until durable s",
        "flush GB/s",
        "x dd",
        "peak RSS GB (+extra)",
        "held GB",
        "load s",
        "bit-exact",
    ]
    rows: list[list[str]] = []
    for c in summary["contenders"].values():
        bad = _status_row(c, len(header))
        if bad is not None:
            rows.append(bad)
            continue
        peak = _fmt(_med(c["peak_rss_gb"]), 2)
        extra = _med(c["peak_extra_gb"])
        rows.append(
            [
                c["label"],
                fmt_stat(c["blocked_s"]),
                fmt_stat(c["first_save_blocked_s"]),
                fmt_stat(c["durable_s"]),
                fmt_stat(c["flush_gbps"], 2),
                _fmt(c["flush_vs_dd"], 2),
                f"{peak} (+{_fmt(extra, 2)})" if extra is not None else peak,
                fmt_stat(c["held_gb"], 2),
                f"{fmt_stat(c['load_s'])} ({c['loader']})",
                "yes" if c["verified"] else "**NO**",
            ]
        )
    return _table(header, rows)


def training_table(summary: dict[str, Any]) -> str:
    header = [
        "contender",
        "blocked s / ckpt",
        "slowdown %",
        "slowdown incl. drain %",
        "until durable s",
        "flush GB/s",
        "peak RSS GB",
        "held GB",
        "load s",
        "bit-exact",
    ]
    rows: list[list[str]] = []
    for c in summary["contenders"].values():
        bad = _status_row(c, len(header))
        if bad is not None:
            rows.append(bad)
            continue
        rows.append(
            [
                c["label"],
                fmt_stat(c["blocked_s"]),
                fmt_stat(c["slowdown_pct"], 1),
                fmt_stat(c["slowdown_until_durable_pct"], 1),
                fmt_stat(c["durable_s"]),
                fmt_stat(c["flush_gbps"], 2),
                fmt_stat(c["peak_rss_gb"], 2),
                fmt_stat(c["held_gb"], 2),
                f"{fmt_stat(c['load_s'])} ({c['loader']})",
                "yes" if c["verified"] else "**NO**",
            ]
        )
    return _table(header, rows)


def mlp_table(summary: dict[str, Any]) -> str:
    header = [
        "contender",
        "cost s / ckpt",
        "cost without the final drain s / ckpt",
        "blocked s / ckpt",
        "fwd after save s",
        "bwd after save s",
        "step after save s",
        "until durable s",
        "final drain s",
        "VmHWM GB (+ over pre-loop RSS)",
        "bit-exact",
    ]
    base_fb = summary.get("baseline_fwd_bwd_s")
    base_step = summary.get("baseline_step_s")
    base_hwm = summary.get("baseline_vmhwm_gb")
    rows: list[list[str]] = [
        [
            "no checkpointing",
            "0",
            "0",
            "0",
            "",
            "",
            fmt_stat(base_step) if base_step is not None else "",
            "",
            "",
            fmt_stat(base_hwm, 2),
            f"(fwd+bwd {fmt_stat(base_fb)} s)",
        ]
    ]
    for c in summary["contenders"].values():
        bad = _status_row(c, len(header))
        if bad is not None:
            rows.append(bad)
            continue
        extra = _med(c["vmhwm_extra_gb"])
        hwm = fmt_stat(c["vmhwm_gb"], 2)
        exact = "yes" if c["verified"] else "**NO**"
        if c["verified"] and c.get("verified_first_by_replay"):
            exact += " (first ckpt by replay too)"
        rows.append(
            [
                c["label"],
                f"**{fmt_stat(c['cost_per_ckpt_s'])}**",
                fmt_stat(c.get("cost_per_ckpt_no_drain_s")),
                fmt_stat(c["blocked_s"]),
                fmt_stat(c["fwd_after_save_s"]),
                fmt_stat(c["bwd_after_save_s"]),
                fmt_stat(c.get("step_after_save_s")),
                fmt_stat(c["durable_s"]),
                fmt_stat(c["drain_s"]),
                f"{hwm} (+{_fmt(extra, 2)})" if extra is not None else hwm,
                exact,
            ]
        )
    return _table(header, rows)


def memory_table(summary: dict[str, Any]) -> str:
    mib = 1024 * 1024
    header = [
        "mode",
        "state",
        "save",
        "state MiB",
        "cache MiB",
        "growth MiB",
        "bound MiB",
        "within bound",
        "growth over RSS just before MiB",
        "call s",
        "durable s",
        "bit-exact",
    ]
    rows: list[list[str]] = []
    for r in summary["rows"]:
        if "growth_bytes" not in r:
            err = str(r.get("error") or "?").strip().splitlines()[-1][:160]
            rows.append([r["mode"], r["state"], "-", f"**failed**: {err}"] + [""] * 8)
            continue
        exact = {True: "yes", False: "**NO**", None: "-"}[r["bit_exact"]]
        if r.get("error"):
            exact = "save failed: " + r["error"].strip().splitlines()[-1][:120]
        rows.append(
            [
                f"`{r['mode']}`",
                r["state"],
                r["save"],
                _fmt((r.get("state_bytes") or 0) / mib, 1),
                _fmt(r["cache_bytes"] / mib, 1),
                _fmt(r["growth_bytes"] / mib, 1),
                _fmt(r["bound_bytes"] / mib, 1),
                "yes" if r["within_bound"] else "**NO**",
                _fmt(r["growth_vs_save_bytes"] / mib, 1),
                _fmt(r.get("call_s")),
                _fmt(r.get("durable_s")),
                exact,
            ]
        )
    return _table(header, rows)


def markdown(results: dict[str, Any], plots: dict[str, list[str]], out_dir: str) -> str:
    m = results["meta"]
    mach = m["machine"]
    fs = mach.get("checkpoint_fs", {})
    parts = [
        "# dcp_datastates benchmark results",
        "",
        f"- command: `{m['command']}`",
        f"- started {m['started']}, took {m['elapsed_s']:.0f} s",
        f"- machine: {mach['cpu']}, {mach['cores']} cores, {mach['ram_gb']:.0f} GB RAM, "
        f"device {mach['device']}; Python {mach['python']}, torch {mach['torch']}, "
        f"torchsnapshot {mach['torchsnapshot']}, dcp_datastates {mach['dcp_datastates']}",
        f"- checkpoint directory on {fs.get('device', '?')} ({fs.get('fstype', '?')})",
        f"- load average (1/5/15 min) at start {_loadavg(mach.get('loadavg_start'))}, "
        f"at end {_loadavg(m.get('loadavg_end'))}; other processes used "
        f"{_pct(m.get('other_cpu_frac'))} of the machine's CPU time during the run "
        "(other work on the machine skews timings)",
        "",
        "Medians over repeats with [min, max]. *blocked* = save call + wait at the optimizer "
        "step; *until durable* = from the save call until data and metadata are on disk "
        "(fsynced); *flush GB/s* = checkpoint bytes / until-durable time; *x dd* = that over "
        "the raw `dd` write bandwidth measured in the same scenario; *peak RSS* = process "
        "high-water mark during the save (+ growth over the RSS just before it); *held* = "
        "RSS growth kept after the run's saves are durable (buffers the method keeps); "
        "*load* = stock loader of the format after evicting the files from the page cache.",
        "",
    ]
    for scn in results["scenarios"]:
        s = scn["summary"]
        parts.append(f"## {scn['name']}")
        parts.append("")
        if scn.get("description"):
            parts.append(scn["description"])
            parts.append("")
        if "error" in s:
            parts.append(f"**scenario failed**: `{s['error'].strip().splitlines()[-1]}`")
            parts.append("")
            continue
        if scn["kind"] == "synthetic":
            disk = s.get("disk_gbps")
            parts.append(
                f"{format_size(s['bytes'])} in {s['tensors_per_rank']} tensors per rank, "
                f"{scn['scenario']['world_size']} rank(s); DataStates host cache "
                f"{format_size(s['host_cache_bytes_per_rank'])} per rank; raw disk "
                f"({s.get('disk_method')}): {fmt_stat(disk, 2)} GB/s."
            )
            parts.append("")
            parts.append(synthetic_table(s))
        elif scn["kind"] == "mlp":
            nbytes = next((c.get("bytes") for c in s["contenders"].values() if c.get("bytes")), 0)
            parts.append(
                f"{s['params'] / 1e6:.1f} M parameters, {format_size(nbytes or 0)} checkpoint, "
                f"torch on {s['threads']} thread(s); loop without checkpoints "
                f"{fmt_stat(s['baseline_loop_s'])} s. *cost / ckpt* = (loop time with "
                "checkpoints, final drain included - loop time of `none` in the same round) / "
                "checkpoints; *blocked* = get_state_dict + save call + any wait before the "
                "next step, including the plain call's wait inside `optimizer.step()` (the "
                "writer's own measure of its automatic barrier); *fwd/bwd/step after save* = "
                "the iteration right after each save (background work slowing compute shows "
                "there; *step* includes the plain call's automatic step barrier; the `no "
                "checkpointing` row gives the median step)."
            )
            parts.append("")
            parts.append(mlp_table(s))
            tax = s.get("write_tax_s")
            if tax:
                parts.append("")
                parts.append(
                    f"*Write tax*: while `dd oflag=direct` wrote the checkpoint's bytes, a "
                    f"{s['threads']}-thread matmul loop lost {fmt_stat(tax)} s of compute per "
                    "checkpoint (benchmarks.disk.measure_write_tax; on a virtual machine the "
                    "host's I/O work is charged to the vCPUs as steal time). Any method that "
                    "writes while training runs pays about this per checkpoint."
                )
            ratios = s.get("ratios") or {}
            if ratios:
                parts.append("")
                parts.append(
                    "Cost per checkpoint, ratios of medians: "
                    + ", ".join(f"{k} = {_fmt(v)}" for k, v in ratios.items())
                )
            if s.get("baseline_errors"):
                parts.append("")
                parts.append(f"**baseline errors**: `{s['baseline_errors'][0].splitlines()[-1]}`")
        elif scn["kind"] == "memory":
            verdict = "every row" if s["all_within_bound"] else "**not every row**"
            parts.append(
                f"Bound = host cache + {s['slack_bytes'] // (1024 * 1024)} MiB; "
                f"{verdict} stays within it."
            )
            parts.append("")
            parts.append(memory_table(s))
        else:
            nbytes = next((c.get("bytes") for c in s["contenders"].values() if c.get("bytes")), 0)
            parts.append(
                f"Tiny GPT `{scn['scenario']['gpt_preset']}` ({s['params'] / 1e6:.1f} M params, "
                f"{format_size(nbytes or 0)} checkpoint with AdamW state; DataStates host cache "
                f"{format_size(s['host_cache_bytes_per_rank'])}), "
                f"checkpoint every {scn['scenario']['ckpt_every']} "
                f"iteration(s), {scn['scenario']['iters']} iterations; baseline loop "
                f"{fmt_stat(s['baseline_loop_s'])} s, iteration {fmt_stat(s['baseline_iter_s'])} s."
            )
            parts.append("")
            parts.append(training_table(s))
        for png in plots.get(scn["name"], []):
            rel = os.path.relpath(png, out_dir)
            parts += ["", f"![{os.path.basename(png)}]({rel})"]
        parts.append("")
    for png in plots.get("", []):
        parts += [f"![{os.path.basename(png)}]({os.path.relpath(png, out_dir)})", ""]
    return "\n".join(parts)
