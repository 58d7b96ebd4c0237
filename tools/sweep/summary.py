"""The sweep's summary: one row per point (CSV), the markdown table, the printed table and the peak plot."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from tools.sweep.grid import short_key
from tools.sweep.points import Point
from tools.sweep.trial import MEASURED_METRIC


def table_rows(points: list[Point]) -> list[dict[str, Any]]:
    """One flat row per point (the CSV's columns); byte figures are ints, missing ones None."""
    from planner import PHASES

    rows = []
    for p in points:
        measured = p.result.get("measured", {})
        row: dict[str, Any] = {"index": p.index, "point": p.name, **p.params, "status": p.status}
        predicted = {ph.name: ph.predicted_bytes for ph in p.plan.phases} if p.plan is not None else {}
        predicted = p.result.get("predicted") or predicted  # the run's own plan, when it ran
        row["predicted_peak_bytes"] = max(predicted.values()) if predicted else None
        row["predicted_peak_phase"] = max(predicted, key=predicted.get) if predicted else None
        row["measured_peak_bytes"] = max(measured.values()) if measured else None
        row["measured_peak_phase"] = max(measured, key=measured.get) if measured else None
        row["step_seconds"] = p.result.get("step_seconds")
        row["reward"] = p.result.get("reward")
        for phase in PHASES:
            row[f"measured_{phase}_bytes"] = measured.get(phase)
        for phase in PHASES:
            row[f"predicted_{phase}_bytes"] = predicted.get(phase)
        row["reason"] = p.reason or ""
        row["run_dir"] = p.result.get("run_dir", "")
        rows.append(row)
    return rows


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
        return f"{value / scale:.2f}" if scale == 2**30 else f"{value / scale:.0f}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _table(header: list[str], body: list[list[str]]) -> str:
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in body)]
    )


def write_markdown(rows: list[dict[str, Any]], params: list[str], path: Path, title: str) -> None:
    """Every phase's measured peak, the predicted peak, step time and reward; reasons listed below."""
    from planner import PHASES

    unit, scale = _unit(rows)
    short = [short_key(k) for k in params]
    header = ["#", *short, "status", f"predicted peak {unit}", f"measured peak {unit}", *PHASES, "step s", "reward"]
    body = [
        [
            str(r["index"]),
            *(_fmt(r[k]) for k in params),
            r["status"],
            f"{_fmt(r['predicted_peak_bytes'], scale)} ({r['predicted_peak_phase'] or '-'})",
            f"{_fmt(r['measured_peak_bytes'], scale)} ({r['measured_peak_phase'] or '-'})",
            *(_fmt(r[f"measured_{ph}_bytes"], scale) for ph in PHASES),
            _fmt(r["step_seconds"]),
            _fmt(r["reward"]),
        ]
        for r in rows
    ]
    notes = [f"- {r['point']}: {r['status']}: {r['reason']}" for r in rows if r["reason"]]
    text = [
        f"# Sweep {title}",
        "",
        f"Measured: the max over ranks of `{MEASURED_METRIC}` in each phase (CUDA: the allocator's peak plus what the device holds "
        f"outside it; CPU: the process's RSS high-water mark over its start), in {unit}. Predicted: the plan the run made before its engine started (summary.json memory_plan; for points not run, the launch-time check on the experiment's device). Step time: the median "
        "over steps of the phases' seconds. Reward: mean of the last 5 steps.",
        "",
        _table(header, body),
        *(["", "Not run or failed:", "", *notes] if notes else []),
        "",
    ]
    path.write_text("\n".join(text))


def format_compact(rows: list[dict[str, Any]], params: list[str]) -> str:
    """The printed table: the measured peaks of rollout, train and the wake window instead of every phase."""
    from colocation.phases import wake_window_phases

    unit, scale = _unit(rows)
    window = wake_window_phases()
    header = [
        "#",
        *(short_key(k) for k in params),
        "status",
        f"predicted {unit}",
        f"measured {unit}",
        "rollout",
        "train",
        "wake window",
        "step s",
        "reward",
    ]
    body = []
    for r in rows:
        wake = [r[f"measured_{ph}_bytes"] for ph in window if r[f"measured_{ph}_bytes"] is not None]
        body.append(
            [
                str(r["index"]),
                *(_fmt(r[k]) for k in params),
                r["status"],
                f"{_fmt(r['predicted_peak_bytes'], scale)} {r['predicted_peak_phase'] or ''}".strip(),
                f"{_fmt(r['measured_peak_bytes'], scale)} {r['measured_peak_phase'] or ''}".strip(),
                _fmt(r["measured_rollout_bytes"], scale),
                _fmt(r["measured_train_bytes"], scale),
                _fmt(max(wake) if wake else None, scale),
                _fmt(r["step_seconds"]),
                _fmt(r["reward"]),
            ]
        )
    return _table(header, body)


def plot_peaks(rows: list[dict[str, Any]], params: list[str], path: Path, title: str) -> None:
    """Peak memory per point (x: the swept utilization / offload / wake values): predicted and measured bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = _unit(rows)
    # tick labels: the index, then each swept value by its last key part (params=True, util=0.5, wake=staged)
    labels = [f"{r['index']}\n" + "\n".join(f"{short_key(k).rsplit('.', 1)[-1]}={r[k]}" for k in params) for r in rows]
    x = range(len(rows))
    width = 0.4
    fig, ax = plt.subplots(figsize=(min(48.0, max(7.0, 1.3 * len(rows) + 2)), 6.0))
    predicted = [(r["predicted_peak_bytes"] or 0) / scale for r in rows]
    measured = [(r["measured_peak_bytes"] or 0) / scale for r in rows]
    colors = ["tab:gray" if r["status"] == "infeasible" else "tab:blue" for r in rows]
    ax.bar(
        [i - width / 2 for i in x],
        predicted,
        width,
        color=colors,
        alpha=0.6,
        hatch="//",
        label="predicted peak (planner)",
    )
    ax.bar(
        [i + width / 2 for i in x],
        measured,
        width,
        color="tab:orange",
        label=f"measured peak ({MEASURED_METRIC}: NVML used on CUDA, RSS on CPU)",
    )
    for i, r in enumerate(rows):
        if r["status"] != "ok":
            ax.text(i, max(predicted[i], measured[i]), r["status"], ha="center", va="bottom", fontsize=8, rotation=90)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel(f"peak per rank ({unit})")
    ax.set_ylim(0, 1.25 * max([*predicted, *measured, 1e-9]))  # room above the bars for the legend and labels
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
