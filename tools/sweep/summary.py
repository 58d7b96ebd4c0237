"""The sweep's summary: one row per point (CSV), the markdown table, the printed table and the chart.

Every point shows the same figures, planned and measured alike (:func:`telemetry.memory_timeline.memory_figures`): the
wake-window, rollout and train peaks and the KV cache. A point that ran has its own plan (made before its
engine started) and its measurements (summary.json); a point that did not run has the launch-time check's
plan only, and an infeasible point is drawn as such, with its reason.
"""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path
from typing import Any

from telemetry.memory_timeline import FIGURES, PEAK_METHODS, memory_figures
from tools.sweep.grid import short_key
from tools.sweep.points import Point

FIGURE_TITLES = {
    "wake_window_peak": "wake-window peak",
    "rollout_peak": "rollout peak",
    "train_peak": "train peak",
    "kv_cache": "KV cache",
}


def table_rows(points: list[Point]) -> list[dict[str, Any]]:
    """One flat row per point (the CSV's columns); byte figures are ints, missing ones None."""

    rows = []
    for p in points:
        figures = dict(p.result.get("figures") or {})
        planned_by = p.result.get("planned_by", "")
        if not planned_by and p.plan is not None:  # not run, or stopped before its summary: the launch-time plan
            launch = memory_figures(p.plan, [])
            figures.update({k: v for k, v in launch.items() if k.startswith("planned_") and v is not None})
            planned_by = "launch check"
        row: dict[str, Any] = {"index": p.index, "point": p.name, **p.params, "status": p.status}
        for figure in FIGURES:
            row[f"planned_{figure}_bytes"] = figures.get(f"planned_{figure}_bytes")
            row[f"measured_{figure}_bytes"] = figures.get(f"measured_{figure}_bytes")
        row["planned_by"] = planned_by
        row["peak_method"] = p.result.get("peak_method") or _device_peak_method(p)
        row["step_seconds"] = p.result.get("step_seconds")
        row["reward"] = p.result.get("reward")
        row["reason"] = p.reason or ""
        row["run_dir"] = p.result.get("run_dir", "")
        rows.append(row)
    return rows


def _device_peak_method(point: Point) -> str:
    """How a run of ``point`` measures its peaks (telemetry.memory_timeline.PEAK_METHODS), from the device it is planned on."""
    if point.plan is None:
        return ""
    return "cuda_allocator_peak" if point.plan.inputs.device.kind == "cuda" else "rss_high_water_mark"


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)


def _unit(rows: list[dict[str, Any]]) -> tuple[str, int]:
    """GiB when any figure reaches 10 GiB, else MiB (CPU runs of tiny models)."""
    figures = [v for r in rows for k, v in r.items() if k.endswith("_bytes") and isinstance(v, int)]
    return ("GiB", 2**30) if figures and max(figures) >= 10 * 2**30 else ("MiB", 2**20)


def _fmt(value: Any, scale: int | None = None) -> str:
    if value is None or value == "":
        return "-"
    if scale is not None:
        return f"{value / scale:.2f}" if scale == 2**30 else f"{value / scale:.1f}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _table(header: list[str], body: list[list[str]]) -> str:
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in body)]
    )


def format_table(rows: list[dict[str, Any]], params: list[str]) -> str:
    """The table printed and written: per point each figure as ``planned / measured``, step time, reward."""

    unit, scale = _unit(rows)
    header = [
        "#",
        *(short_key(k) for k in params),
        "status",
        *(f"{FIGURE_TITLES[f]} {unit} plan / meas." for f in FIGURES),
        "step s",
        "reward",
    ]
    body = [
        [
            str(r["index"]),
            *(_fmt(r[k]) for k in params),
            r["status"],
            *(f"{_fmt(r[f'planned_{f}_bytes'], scale)} / {_fmt(r[f'measured_{f}_bytes'], scale)}" for f in FIGURES),
            _fmt(r["step_seconds"]),
            _fmt(r["reward"]),
        ]
        for r in rows
    ]
    return _table(header, body)


def measured_legend(rows: list[dict[str, Any]]) -> str:
    """What "measured" is in this sweep: the peak method(s) its runs used (telemetry.memory_timeline.PEAK_METHODS)."""

    methods = sorted({r["peak_method"] for r in rows if r["peak_method"]})
    return "; ".join(PEAK_METHODS[m] for m in methods) or "nothing measured"


def write_markdown(rows: list[dict[str, Any]], params: list[str], path: Path, title: str) -> None:
    """The table with what each figure is; the reasons of the points not run or failed below it."""
    unit = _unit(rows)[0]
    notes = [f"- {r['point']}: {r['status']}: {r['reason']}" for r in rows if r["reason"]]
    text = [
        f"# Sweep {title}",
        "",
        f"Each figure in {unit}, planned / measured (telemetry.memory_timeline.memory_figures). Planned: the plan the run made "
        "before its engine started (points not run: the launch-time check on the experiment's device), plus its "
        "runtime overhead. Measured peaks: the max over ranks of the median over the steady steps of the phases' "
        f"peak ({measured_legend(rows)}); the wake window is wake_weights..wake_kv_cache. KV cache: the plan's "
        "against the engine's ledger. Step time: the median over steps of the phases' seconds. Reward: mean of the "
        "last 5 steps.",
        "",
        format_table(rows, params),
        *(["", "Not run or failed:", "", *notes] if notes else []),
        "",
    ]
    path.write_text("\n".join(text))


def plot_figures(rows: list[dict[str, Any]], params: list[str], path: Path, title: str) -> None:
    """One panel per figure (wake window, rollout, train, KV cache): planned and measured bars per point;
    infeasible points drawn grey and cross-hatched, with their reasons under the panels."""
    # optional: matplotlib is imported where it is used, not every install has it
    import matplotlib

    matplotlib.use("Agg")
    # optional: matplotlib is imported where it is used, not every install has it
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    unit, scale = _unit(rows)
    # tick labels: the index, then each swept value by its last key part (params=True, util=0.5, wake=staged)
    labels = [f"{r['index']}\n" + "\n".join(f"{short_key(k).rsplit('.', 1)[-1]}={r[k]}" for k in params) for r in rows]
    width_inches = min(48.0, max(9.0, 1.3 * len(rows) + 2))
    chars = int(width_inches * 15)  # monospace characters of 7 pt across the figure at 110 dpi, with a margin
    notes = [
        textwrap.fill(f"#{r['index']} {r['status']}: {r['reason']}", chars, subsequent_indent="    ")
        for r in rows
        if r["status"] != "ok"
    ]
    notes_inches = 0.14 * sum(n.count("\n") + 1 for n in notes) + 0.15 if notes else 0.0
    legend_inches = 0.9
    height = 2.2 * len(FIGURES) + 0.6 + legend_inches + notes_inches
    width, x = 0.4, list(range(len(rows)))
    fig, axes = plt.subplots(len(FIGURES), 1, sharex=True, figsize=(width_inches, height))
    infeasible = [r["status"] == "infeasible" for r in rows]
    for ax, figure in zip(axes, FIGURES):
        planned = [(r[f"planned_{figure}_bytes"] or 0) / scale for r in rows]
        measured = [(r[f"measured_{figure}_bytes"] or 0) / scale for r in rows]
        ax.bar(
            [i - width / 2 for i in x],
            planned,
            width,
            color=["lightgrey" if bad else "tab:blue" for bad in infeasible],
            edgecolor=["dimgrey" if bad else "tab:blue" for bad in infeasible],
            hatch=["xx" if bad else "//" for bad in infeasible],
            alpha=0.7,
        )
        ax.bar([i + width / 2 for i in x], measured, width, color="tab:orange")
        top = max([*planned, *measured, 1e-9])
        for i, r in enumerate(rows):
            if r["status"] != "ok":  # infeasible / failed / not run: no measurement to draw
                ax.text(i + width / 2, 0.02 * top, r["status"], ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_ylim(0, 1.15 * top)
        ax.set_ylabel(unit)
        ax.set_title(f"{FIGURE_TITLES[figure]} per rank", fontsize=9, loc="left")
    axes[-1].set_xticks(x, labels, fontsize=7)
    handles = [
        Patch(
            facecolor="tab:blue",
            alpha=0.7,
            hatch="//",
            label="planned: the run's own plan (not run: the launch-time check) + its runtime overhead",
        ),
        Patch(
            facecolor="lightgrey", edgecolor="dimgrey", hatch="xx", label="planned, infeasible: not run (reason below)"
        ),
        Patch(
            facecolor="tab:orange",
            label=textwrap.fill(
                f"measured (max over ranks, median over steady steps): "
                f"{measured_legend(rows)}; KV cache: the engine's ledger",
                chars - 10,
            ),
        ),
    ]
    fig.suptitle(title, fontsize=10, y=1 - 0.08 / height, va="top")
    legend_at = (0.01, 1 - 0.3 / height)
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=legend_at, ncols=1, fontsize=7, frameon=False)
    if notes:
        fig.text(0.01, 0.05 / height, "\n".join(notes), fontsize=7, va="bottom", ha="left", family="monospace")
    # room above the panels for the title and legend, below them for the notes
    fig.tight_layout(rect=(0, notes_inches / height, 1, 1 - legend_inches / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
