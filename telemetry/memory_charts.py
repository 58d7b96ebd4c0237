"""Charts and tables of a run's measured memory, from timeline rows alone (a live run or memory_timeline.csv).

- :func:`plot_stages`: the per-step stage chart. For one representative step (the last), per rank, a bar
  per phase: the measured memory after the phase (``device_used``), split into what the ledgers' tags
  explain and the untagged rest (activations, logits, buffers, allocator slack), the phase's measured
  peak as a tick above the bar, the step's peak phase marked.
- :func:`plot_timeline`: the whole run, x-axis in steps, each step split evenly among its phases (so a
  50 ms phase is as visible as a 20 s one); samples inside a phase sit at their time fraction of it.
- :func:`phase_table` / :func:`compare_table`: the same numbers as text (``make report``, ``make compare``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from telemetry.memory_timeline import (
    PEAK_METRIC,
    RELEASE_TAGS,
    TAGS,
    TIMELINE_PHASES,
    USED_METRIC,
    phase_after,
    phase_drift,
    phase_samples,
    released_bytes,
    steady_peak,
    steady_steps,
    wake_window_phases,
)

TAG_COLORS = {
    "weights": "#4C72B0",
    "kv_cache": "#55A868",
    "actor_params": "#C44E52",
    "actor_grads": "#DD8452",
    "optimizer": "#8172B3",
    "ref_params": "#937860",
}
UNTAGGED_COLOR = "#BBBBBB"


def _unit(max_bytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if max_bytes >= 4 * 2**30 else (2**20, "MiB")


def run_label(config: dict) -> str:
    """What moves memory in a run, in one line: experiment, wake strategy, what the actor offloads."""
    rollout, offload = config.get("rollout", {}), config.get("actor", {}).get("offload", {})
    offloaded = ",".join(k for k, v in offload.items() if v) or "nothing"
    return f"{config.get('exp', '?')}, wake_strategy={rollout.get('wake_strategy', '?')}, offloaded: {offloaded}"


def timeline_x(rows: list[dict]) -> list[float]:
    """Each row's x in steps: step + (phase index + time fraction inside the phase) / number of phases."""
    spans: dict[tuple[int, int, str], list[float]] = {}
    for r in rows:
        span = spans.setdefault((r["rank"], r["step"], r["phase"]), [r["t_s"], r["t_s"]])
        span[0], span[1] = min(span[0], r["t_s"]), max(span[1], r["t_s"])
    out = []
    for r in rows:
        start, end = spans[(r["rank"], r["step"], r["phase"])]
        inside = (r["t_s"] - start) / (end - start) if end > start else 0.0
        out.append(r["step"] + (TIMELINE_PHASES.index(r["phase"]) + inside) / len(TIMELINE_PHASES))
    return out


def representative_step(rows: list[dict]) -> int:
    """The step the stage chart shows: the last one (steady state; step 0 also creates the optimizer's states)."""
    return max(int(r["step"]) for r in rows)


def _stage_values(rows: list[dict], rank: int, step: int) -> tuple[list[str], dict[str, dict], dict[str, int]]:
    """(phases present, phase -> last sample, phase -> peak) of one rank's step."""
    after = phase_after(rows, rank, step)
    phases = [p for p in TIMELINE_PHASES if p in after]
    peaks = {p: max(int(r[PEAK_METRIC]) for r in phase_samples(rows)[(rank, step, p)]) for p in phases}
    return phases, after, peaks


def _draw_stages(ax, rows: list[dict], rank: int, step: int, scale: float, unit: str, heading: str) -> None:
    """One rank's stage chart (module doc) on ``ax``."""
    phases, after, peaks = _stage_values(rows, rank, step)
    xs = range(len(phases))
    bottoms = [0.0] * len(phases)
    for tag in TAGS:
        values = [after[p][f"tag/{tag}"] / scale for p in phases]
        if any(values):
            ax.bar(xs, values, bottom=bottoms, color=TAG_COLORS.get(tag, "grey"), width=0.7)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    measured = [after[p][USED_METRIC] / scale for p in phases]
    rest = [max(0.0, m - b) for m, b in zip(measured, bottoms)]
    ax.bar(xs, rest, bottom=bottoms, color=UNTAGGED_COLOR, width=0.7, hatch="//", edgecolor="white")
    ax.bar(xs, measured, fill=False, edgecolor="black", linewidth=1.3, width=0.7)
    peak_values = [peaks[p] / scale for p in phases]
    ax.scatter(xs, peak_values, marker="_", s=500, color="tab:red", linewidths=2.2, zorder=5)
    worst = max(range(len(phases)), key=lambda i: peak_values[i])
    ax.annotate(
        f"peak: {phases[worst]} {peak_values[worst]:.0f} {unit}",
        (worst, peak_values[worst]),
        xytext=(0, 9),
        textcoords="offset points",
        ha="center",
        color="tab:red",
        fontweight="bold",
        fontsize=9,
    )
    for x, m in zip(xs, measured):
        ax.text(x, m, f"{m:.0f}", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(phases, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(f"rank {rank}: {unit}")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(
        f"{heading}rank {rank}, step {step}: " + " -> ".join(f"{m:.0f}" for m in measured), fontsize=8, loc="left"
    )


def _legend_handles(tags_seen: list[str]):
    # optional: matplotlib is imported where it is used, not every install has it
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    handles = [Patch(color=TAG_COLORS[t], label=f"tag/{t}") for t in tags_seen]
    handles.append(Patch(facecolor=UNTAGGED_COLOR, hatch="//", edgecolor="white", label="untagged (measured - tags)"))
    handles.append(Patch(fill=False, edgecolor="black", label=f"measured after the phase ({USED_METRIC})"))
    handles.append(
        plt.Line2D(
            [], [], color="tab:red", marker="_", linestyle="", markersize=14, label=f"phase peak ({PEAK_METRIC})"
        )
    )
    return handles


def plot_stages(
    runs: list[tuple[str, list[dict]]] | list[dict],
    path: str | Path,
    step: int | None = None,
    max_ranks: int = 4,
    title: str = "",
) -> Path:
    """The stage chart (module doc) to ``path``: one panel per rank of one run's ``rows``, or, given
    ``[(label, rows), ...]``, the panels of each run one under the other on the same y-scale, to compare
    runs. ``step``: default :func:`representative_step` of each run."""
    # optional: matplotlib is imported where it is used, not every install has it
    import matplotlib

    matplotlib.use("Agg")
    # optional: matplotlib is imported where it is used, not every install has it
    import matplotlib.pyplot as plt

    if runs and isinstance(runs[0], dict):
        runs = [("", runs)]
    panels = [
        (label, rows, rank, representative_step(rows) if step is None else step)
        for label, rows in runs
        for rank in sorted({r["rank"] for r in rows})[:max_ranks]
    ]
    top = max(int(r[PEAK_METRIC]) for _, rows in runs for r in rows)
    scale, unit = _unit(top)
    height = 4.0 * len(panels) + 1.0
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, height), squeeze=False)
    window = wake_window_phases()
    for ax, (label, rows, rank, run_step) in zip(axes[:, 0], panels):
        _draw_stages(ax, rows, rank, run_step, scale, unit, heading=f"{label}: " if label else "")
        ax.set_ylim(0, top / scale * 1.25)
        phases = [p for p in TIMELINE_PHASES if p in phase_after(rows, rank, run_step)]
        inside = [i for i, p in enumerate(phases) if p in window]
        if inside:  # where staged and all-at-once differ
            ax.axvspan(inside[0] - 0.45, inside[-1] + 0.45, color="gold", alpha=0.15, lw=0, zorder=0)
            ax.text(inside[0] - 0.4, top / scale * 1.2, "wake window", fontsize=8, va="top", color="darkgoldenrod")
    tags_seen = [t for t in TAGS if any(r[f"tag/{t}"] for _, rows in runs for r in rows)]
    fig.legend(
        handles=_legend_handles(tags_seen),
        loc="upper center",
        ncol=4,
        fontsize=8,
        bbox_to_anchor=(0.5, 1 - 0.3 / height),
    )
    fig.suptitle(title or f"memory after each phase ({unit})", y=1 - 0.05 / height, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.7 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_timeline(rows: list[dict], path: str | Path, max_ranks: int = 4) -> Path:
    """The whole run per rank against steps (module doc): measured used and peak, each tag, phases shaded."""
    # optional: matplotlib is imported where it is used, not every install has it
    import matplotlib

    matplotlib.use("Agg")
    # optional: matplotlib is imported where it is used, not every install has it
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({r["rank"] for r in rows})[:max_ranks] or [0]
    top = max((int(r[PEAK_METRIC]) for r in rows), default=1)
    scale, unit = _unit(top)
    steps = sorted({r["step"] for r in rows})
    fig, axes = plt.subplots(len(ranks), 1, figsize=(15, 3.4 * len(ranks) + 1.2), sharex=True, squeeze=False)
    cmap = plt.get_cmap("tab20")
    phase_colors = {phase: cmap(i % 20) for i, phase in enumerate(TIMELINE_PHASES)}
    for ax, rank in zip(axes[:, 0], ranks):
        rank_rows = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["t_s"])
        x = timeline_x(rank_rows)
        if len(steps) <= 20:  # shade phases while they stay readable
            for s in steps:
                for i, phase in enumerate(TIMELINE_PHASES):
                    ax.axvspan(
                        s + i / len(TIMELINE_PHASES),
                        s + (i + 1) / len(TIMELINE_PHASES),
                        color=phase_colors[phase],
                        alpha=0.25,
                        lw=0,
                    )
        for s in steps:
            ax.axvline(s, color="black", lw=0.6, alpha=0.5)
        ax.plot(x, [r[USED_METRIC] / scale for r in rank_rows], "-", color="black", lw=1.8, label=USED_METRIC)
        ax.plot(
            x, [r[PEAK_METRIC] / scale for r in rank_rows], "-", color="tab:red", lw=0.9, alpha=0.7, label=PEAK_METRIC
        )
        for tag in TAGS:
            values = [r[f"tag/{tag}"] / scale for r in rank_rows]
            if any(values):
                ax.plot(x, values, "--", lw=1.2, color=TAG_COLORS.get(tag, "grey"), label=f"tag/{tag}")
        ax.set_ylabel(f"rank {rank}: {unit}")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    seen = [p for p in TIMELINE_PHASES if any(r["phase"] == p for r in rows)]
    if len(steps) <= 20:
        fig.legend(
            handles=[Patch(color=phase_colors[p], alpha=0.4, label=p) for p in seen],
            loc="upper center",
            ncol=min(8, max(1, len(seen))),
            fontsize=8,
        )
    axes[-1, 0].set_xlabel("step (each step split evenly among its phases)")
    axes[-1, 0].set_xticks(steps)
    fig.tight_layout(rect=(0, 0, 1, 1 - 1.1 / (3.4 * len(ranks) + 1.2)))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


# ---------------------------------------------------------------- tables
def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f}"


def phase_stats(rows: list[dict]) -> dict[str, dict[str, int]]:
    """phase -> {after, peak}: per rank the median over the steady steps, then the largest rank (bytes)."""
    steady = set(steady_steps(rows))
    per_rank: dict[str, dict[int, tuple[list[int], list[int]]]] = {}
    for (rank, step, phase), samples in phase_samples(rows).items():
        if step in steady:
            afters, peaks = per_rank.setdefault(phase, {}).setdefault(rank, ([], []))
            afters.append(int(samples[-1][USED_METRIC]))
            peaks.append(max(int(s[PEAK_METRIC]) for s in samples))
    return {
        phase: dict(
            after=max(int(statistics.median(a)) for a, _ in per_rank[phase].values()),
            peak=max(int(statistics.median(p)) for _, p in per_rank[phase].values()),
        )
        for phase in TIMELINE_PHASES
        if phase in per_rank
    }


def phase_table(rows: list[dict]) -> str:
    """One run, per phase: measured after / peak (MiB), bytes released measured vs expected, drift."""
    released = released_bytes(rows)
    drift = phase_drift(rows)
    lines = [
        f"{'phase':<18} {'after MiB':>10} {'peak MiB':>10} {'released MiB':>13} {'expected MiB':>13} {'drift %':>8}"
    ]
    for phase, s in phase_stats(rows).items():
        rel, d = released.get(phase), drift.get(phase)
        measured, expected = (_mib(rel["measured"]), _mib(rel["expected"])) if rel else ("", "")
        drift_pct = f"{100 * d['fraction']:.2f}" if d else ""
        lines.append(
            f"{phase:<18} {_mib(s['after']):>10} {_mib(s['peak']):>10} {measured:>13} {expected:>13} {drift_pct:>8}"
        )
    return "\n".join(lines)


def compare_table(runs: list[tuple[str, list[dict]]]) -> str:
    """Runs side by side: each phase's measured peak (MiB, steady median, largest rank), the wake-window
    and rollout peaks, and the difference of each run from the first."""
    stats = [phase_stats(rows) for _, rows in runs]
    window = wake_window_phases()
    extra = {
        "wake window": [max(steady_peak(rows, window, r) for r in {x["rank"] for x in rows}) for _, rows in runs],
    }
    header = f"{'peak MiB':<26}" + "".join(f" {label[:22]:>22}" for label, _ in runs)
    if len(runs) > 1:
        header += "".join(f" {('delta ' + label)[:22]:>22}" for label, _ in runs[1:])
    lines = [header]

    def line(name: str, values: list[int | None]) -> str:
        text = f"{name:<26}" + "".join(f" {_mib(v) if v is not None else '-':>22}" for v in values)
        base = values[0]
        for v in values[1:]:
            text += f" {_mib(v - base) if v is not None and base is not None else '-':>22}"
        return text

    for phase in TIMELINE_PHASES:
        values = [s[phase]["peak"] if phase in s else None for s in stats]
        if any(v is not None for v in values):
            lines.append(line(phase, values))
    for name, values in extra.items():
        lines.append(line(name, values))
    released = [released_bytes(rows) for _, rows in runs]
    for phase in RELEASE_TAGS:
        if any(phase in r for r in released):
            lines.append(line(f"{phase} released", [r[phase]["measured"] if phase in r else None for r in released]))
    return "\n".join(lines)
