"""PNG plots (matplotlib, Agg): a Figure-1 style timeline and bar charts.

The timeline follows the DataStates-LLM paper's Figure 1: the training thread's forward,
backward and update phases on one lane, and checkpoint activity on the lanes below: *capture*
from the save request until the method no longer needs the live tensors, *flush* from then
until the checkpoint is durable. For DataStatesWriter the end of capture is ``t_captured`` from
its own per-save telemetry (``save_stats()``); for ``DefaultStager`` it is the completion of the
staging future; for the other methods, which expose nothing finer, it is the return of the save
call (synchronous methods capture and flush inside the call, so their flush lane stays empty).
"""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "step": "#8172b3",
    "blocked": "#c44e52",
    "statedict": "#937860",
    "capture": "#dd8452",
    "flush": "#64b5cd",
    "dd": "#333333",
}
DPI = 90


def _bars(ax: Axes, y: float, spans: list[tuple[float, float]], color: str, h: float = 0.8) -> None:
    spans = [(a, b - a) for a, b in spans if b > a]
    if spans:
        ax.broken_barh(spans, (y - h / 2, h), facecolors=color, edgecolor="none")


def _window(tl: dict[str, Any], k: int) -> float:
    iters = tl["iters"]
    if not iters:
        return 1.0
    n = min(len(iters), max(6, 3 * k))
    return float(iters[n - 1][6])


def timeline(scn_name: str, summary: dict[str, Any], k: int, path: str) -> str | None:
    """Training-thread phases against checkpoint capture/flush, one panel per contender."""
    tls = summary.get("timeline") or {}
    if not tls:
        return None
    names = sorted(tls, key=lambda n: n != "baseline")  # the no-checkpoint loop first
    end = max(_window(tls[n], k) for n in names)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(11, 0.95 * len(names) + 1.2), sharex=True, squeeze=False
    )
    for ax, name in zip(axes[:, 0], names, strict=True):
        tl = tls[name]
        label = summary["contenders"].get(name, {}).get("label", "no checkpointing")
        it = tl["iters"]
        # lane 2: training thread
        _bars(ax, 2, [(i[0], i[1]) for i in it], COLORS["forward"])
        _bars(ax, 2, [(i[1], i[2]) for i in it], COLORS["backward"])
        _bars(ax, 2, [(i[3], i[4]) for i in it], COLORS["blocked"])
        _bars(ax, 2, [(i[4], i[5]) for i in it], COLORS["step"])
        _bars(ax, 2, [(i[5], i[6]) for i in it], COLORS["statedict"])
        saves = tl["saves"]
        _bars(ax, 2, [(s["call"][0], s["call"][1]) for s in saves], COLORS["blocked"])
        # capture: call -> live tensors no longer needed (DataStates: its telemetry's
        # t_captured; DefaultStager: staging future done; others: when the call returned)
        caps = [(s["call"][0], s["captured"] or s["call"][1]) for s in saves]
        fl = [
            (s["captured"] or s["call"][1], s["durable"]) for s in saves if s["durable"] is not None
        ]
        lanes = ("capture", "flush")
        _bars(ax, 1, caps, COLORS["capture"], 0.6)
        _bars(ax, 0, fl, COLORS["flush"], 0.6)
        ax.set_yticks([0, 1, 2], [lanes[1], lanes[0], "train"], fontsize=7)
        ax.set_ylim(-0.6, 2.6)
        ax.set_title(label, fontsize=8, loc="left", pad=2)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlim(0, end * 1.02)
    axes[-1, 0].set_xlabel("seconds since loop start", fontsize=8)
    handles = [
        Patch(color=COLORS[c], label=lbl)
        for c, lbl in (
            ("forward", "forward"),
            ("backward", "backward"),
            ("step", "optimizer step"),
            ("statedict", "get_state_dict"),
            ("blocked", "blocked by checkpoint"),
            ("capture", "capture (copy)"),
            ("flush", "flush until durable"),
        )
    ]
    top = 1.0 - 0.45 / fig.get_figheight()
    fig.suptitle(f"timeline: {scn_name}", fontsize=9, y=0.998, x=0.01, ha="left", va="top")
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 1.0 - 0.22 / fig.get_figheight()),
        ncol=7,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _ok(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, c) for n, c in summary.get("contenders", {}).items() if c["status"] == "ok"]


def _grid(n: int) -> tuple[int, int]:
    cols = 1 if n == 1 else 2
    return (n + cols - 1) // cols, cols


def _err(s: dict[str, Any] | None) -> tuple[float, float, float]:
    if not s:
        return 0.0, 0.0, 0.0
    return s["median"], s["median"] - s["min"], s["max"] - s["median"]


def _panels(scenarios: list[dict[str, Any]], kind: str | None = None) -> list[dict[str, Any]]:
    """Scenarios (of ``kind``, if given) that have at least one successful contender."""
    return [
        s
        for s in scenarios
        if (kind is None or s["kind"] == kind)
        and "contenders" in s["summary"]
        and _ok(s["summary"])
    ]


def _panel_figure(n: int) -> tuple[Any, Any]:
    """A figure with one panel per scenario on a grid; unused grid cells hidden."""
    rows, cols = _grid(n)
    fig, axes = plt.subplots(
        rows, cols, figsize=(6 * cols, 3.2 * rows + 0.4), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes


Items = list[tuple[str, dict[str, Any]]]  # (name, summary) of the contenders that ran


def _paired_barh(
    ax: Axes, items: Items, series: tuple[tuple[str, str, float, str], ...]
) -> list[int]:
    """Horizontal bars, one row per contender, one thin bar per ``(key, color, offset, label)``.

    Each bar is the median of ``c[key]`` with min/max error bars; returns the rows' y values.
    """
    ys = list(range(len(items)))
    for key, color, off, lbl in series:
        med, lo, hi = zip(*(_err(c[key]) for _, c in items), strict=True)
        ax.barh(
            [y + off for y in ys],
            med,
            height=0.36,
            xerr=[lo, hi],
            color=color,
            error_kw={"elinewidth": 0.8, "capsize": 2},
            label=lbl,
        )
    return ys


def _style_panel(ax: Axes, ys: list[int], items: Items, title: str, xlabel: str) -> None:
    """Contender labels top to bottom, a small left-aligned title, an x grid."""
    ax.set_yticks(ys, [c["label"] for _, c in items], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=8, loc="left")
    ax.set_xlabel(xlabel, fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", alpha=0.3)


def blocked_bars(scenarios: list[dict[str, Any]], path: str) -> str | None:
    """Per scenario: time blocked (dark) and until durable (light), median with min/max."""
    panels = _panels(scenarios)
    if not panels:
        return None
    rows, cols = _grid(len(panels))
    fig, axes = plt.subplots(
        rows, cols, figsize=(6 * cols, 0.35 * 9 * rows + 0.8), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, scn in zip(axes.flat, panels, strict=False):
        items = _ok(scn["summary"])
        ys = _paired_barh(
            ax,
            items,
            (
                ("durable_s", COLORS["flush"], 0.18, "until durable"),
                ("blocked_s", COLORS["blocked"], -0.18, "blocked"),
            ),
        )
        vals = [c[k]["median"] for _, c in items for k in ("blocked_s", "durable_s") if c[k]]
        if vals and min(vals) > 0 and max(vals) / min(vals) > 50:
            ax.set_xscale("log")
        _style_panel(ax, ys, items, scn["name"], "seconds per checkpoint")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _paired_panels(
    panels: list[dict[str, Any]],
    series: tuple[tuple[str, str, float, str], ...],
    title: str,
    xlabel: str,
    path: str,
) -> str:
    """One panel per scenario of :func:`_paired_barh` bars around a zero line; writes ``path``.

    ``title`` is formatted with the scenario's ``name``.
    """
    fig, axes = _panel_figure(len(panels))
    for ax, scn in zip(axes.flat, panels, strict=False):
        items = _ok(scn["summary"])
        ys = _paired_barh(ax, items, series)
        ax.axvline(0, color="black", lw=0.6)
        _style_panel(ax, ys, items, title.format(name=scn["name"]), xlabel)
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def slowdown_bars(scenarios: list[dict[str, Any]], path: str) -> str | None:
    """Per training scenario: iteration-time slowdown against the no-checkpoint loop."""
    panels = _panels(scenarios, "training")
    if not panels:
        return None
    series = (
        ("slowdown_until_durable_pct", COLORS["flush"], 0.18, "incl. drain to durable"),
        ("slowdown_pct", COLORS["blocked"], -0.18, "training loop"),
    )
    return _paired_panels(panels, series, "{name}", "slowdown vs. no checkpointing, %", path)


def throughput_bars(scenarios: list[dict[str, Any]], path: str) -> str | None:
    """Per synthetic scenario: flush GB/s per contender against the raw dd bandwidth."""
    panels = _panels(scenarios, "synthetic")
    if not panels:
        return None
    fig, axes = _panel_figure(len(panels))
    for ax, scn in zip(axes.flat, panels, strict=False):
        items = _ok(scn["summary"])
        ys = list(range(len(items)))
        med, lo, hi = zip(*(_err(c["flush_gbps"]) for _, c in items), strict=True)
        ax.barh(ys, med, xerr=[lo, hi], color=COLORS["flush"], error_kw={"capsize": 2})
        dd = scn["summary"].get("disk_gbps")
        if dd:
            method = scn["summary"].get("disk_method") or "dd"
            ax.axvline(dd["median"], color=COLORS["dd"], ls="--", lw=1, label=f"raw: {method}")
            ax.legend(fontsize=7, loc="lower right")
        _style_panel(ax, ys, items, scn["name"], "checkpoint bytes / time until durable, GB/s")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def mlp_cost_bars(scenarios: list[dict[str, Any]], path: str) -> str | None:
    """mlp-loop: cost per checkpoint (loop time over `none`, drain included) and blocked time."""
    panels = _panels(scenarios, "mlp")
    if not panels:
        return None
    series = (
        ("cost_per_ckpt_s", COLORS["blocked"], -0.18, "cost per checkpoint (loop time)"),
        ("blocked_s", COLORS["capture"], 0.18, "blocked (call + wait before step)"),
    )
    title = "{name}: seconds per checkpoint"
    return _paired_panels(panels, series, title, "seconds (median over rounds, min/max)", path)


def make_all(results: dict[str, Any], out_dir: str) -> dict[str, list[str]]:
    """Write every plot; returns {scenario name or "": [png paths]}."""
    os.makedirs(out_dir, exist_ok=True)
    made: dict[str, list[str]] = {}
    for scn in results["scenarios"]:
        if scn["kind"] in ("training", "mlp") and "contenders" in scn["summary"]:
            safe = scn["name"].replace("/", "_")
            p = timeline(
                scn["name"],
                scn["summary"],
                scn["scenario"]["ckpt_every"],
                os.path.join(out_dir, f"timeline_{safe}.png"),
            )
            if p:
                made.setdefault(scn["name"], []).append(p)
    for fn, fname in (
        (blocked_bars, "blocked.png"),
        (slowdown_bars, "slowdown.png"),
        (throughput_bars, "throughput.png"),
        (mlp_cost_bars, "mlp_cost.png"),
    ):
        p = fn(results["scenarios"], os.path.join(out_dir, fname))
        if p:
            made.setdefault("", []).append(p)
    return made
