"""Run outputs on rank 0: metrics.jsonl, memory_timeline.{csv,png}, summary.json and a W&B run.

W&B is offline unless ``wandb.mode=online`` (``wandb sync <run dir>/wandb/offline-run-*`` uploads later).
``wandb.init`` takes the run id from ``WANDB_RUN_ID`` and ``WANDB_RESUME`` from the environment: a Slurm
job (``make sbatch``) fixes both, so a requeued job resumes the same W&B run.
Timeline series are logged as ``memory/<metric>/rank<r>`` against a custom x-axis ``timeline/t_s``
(seconds since the run started); per-step scalars against ``trainer/step``, among them
``memory/peak/<phase>`` (max over ranks of the phase's ``device_allocated``).
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from rl.memory import METRICS, PEAK_METRIC, PHASES, phase_peaks

CSV_COLUMNS = ("t_s", "step", "phase", "rank", *METRICS)


WANDB_MODES = ("offline", "online", "disabled")


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases tracking (``wandb.*``); offline unless asked otherwise."""

    mode: str = "offline"
    project: str = "rlmem"
    entity: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={self.mode!r} is not one of {WANDB_MODES}")

    def build(self, run_dir: Path, config: Any, name: str) -> RunWriter:
        """Rank 0's writer of the run's files and W&B run."""
        return RunWriter(run_dir, config, self.mode, self.project, self.entity, name)


class RunWriter:
    """Everything rank 0 writes for one run. Other ranks never construct one."""

    def __init__(self, run_dir: Path, config: Any, wandb_mode: str, project: str, entity: str | None, name: str):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config = asdict(config) if is_dataclass(config) else dict(config)
        self.timeline_rows: list[dict] = []
        self._metrics_file = open(self.run_dir / "metrics.jsonl", "a")
        self._csv_file = open(self.run_dir / "memory_timeline.csv", "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        self._csv.writeheader()
        self._defined: set[str] = set()
        self.wandb_run = None
        if wandb_mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                mode=wandb_mode,
                project=project,
                entity=entity,
                name=name,
                dir=str(self.run_dir),
                config=self.config,
                reinit="finish_previous",
            )
            self.wandb_run.define_metric("trainer/step")
            self.wandb_run.define_metric("timeline/t_s")

    @property
    def wandb_dir(self) -> str | None:
        return str(Path(self.wandb_run.dir).parent) if self.wandb_run is not None else None

    def _define(self, name: str, step_metric: str) -> None:
        if self.wandb_run is not None and name not in self._defined:
            self.wandb_run.define_metric(name, step_metric=step_metric)
            self._defined.add(name)

    def log_timeline(self, rows: list[dict]) -> None:
        """Append gathered rows (all ranks) to the CSV and to W&B's timeline series."""
        rows = sorted(rows, key=lambda r: (r["t_s"], r["rank"]))
        self.timeline_rows.extend(rows)
        self._csv.writerows(rows)
        self._csv_file.flush()
        if self.wandb_run is None:
            return
        for row in rows:
            record = {"timeline/t_s": row["t_s"]}
            for metric in METRICS:
                key = f"memory/{metric}/rank{row['rank']}"
                self._define(key, "timeline/t_s")
                record[key] = row[metric]
            self.wandb_run.log(record)

    def log_step(self, step: int, metrics: dict[str, float], step_rows: list[dict]) -> dict[str, int]:
        """Per-step scalars plus ``memory/peak/<phase>`` from this step's rows; returns those peaks."""
        peaks = phase_peaks(step_rows)
        record = {"trainer/step": step, **metrics}
        record.update({f"memory/peak/{phase}": value for phase, value in peaks.items()})
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        if self.wandb_run is not None:
            for key in record:
                if key != "trainer/step":
                    self._define(key, "trainer/step")
            self.wandb_run.log(record)
        return peaks

    def finish(self, summary: dict) -> dict:
        """Write the timeline plot and summary.json, close W&B. Returns the summary as written."""
        png = self.run_dir / "memory_timeline.png"
        plot_timeline(self.timeline_rows, png)
        summary = dict(summary, wandb_dir=self.wandb_dir)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self._metrics_file.close()
        self._csv_file.close()
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({"memory/timeline_chart": wandb.Image(str(png))})
            self.wandb_run.summary.update({k: v for k, v in summary.items() if k != "wandb_dir"})
            self.wandb_run.finish()
        return summary


def plot_timeline(rows: list[dict], path: Path, max_ranks: int = 4) -> None:
    """One panel per rank, phases shaded in their own colours. Left axis: what the device holds
    (``device_allocated`` and each tag, MiB); right axis: the process view (``host_rss``, and
    ``device_used`` where it differs, e.g. NVML on GPU). Lines identical to another are not redrawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({r["rank"] for r in rows})[:max_ranks] or [0]
    fig, axes = plt.subplots(len(ranks), 1, figsize=(15, 3.4 * len(ranks) + 1.2), sharex=True, squeeze=False)
    cmap = plt.get_cmap("tab20")
    phase_colors = {phase: cmap(i % 20) for i, phase in enumerate(PHASES)}
    for ax, rank in zip(axes[:, 0], ranks):
        rank_rows = [r for r in rows if r["rank"] == rank]
        t = [r["t_s"] for r in rank_rows]
        spans: dict[tuple[int, str], list[float]] = {}
        for r in rank_rows:  # shade each contiguous (step, phase) span
            span = spans.setdefault((r["step"], r["phase"]), [r["t_s"], r["t_s"]])
            span[0], span[1] = min(span[0], r["t_s"]), max(span[1], r["t_s"])
        for (_, phase), (t_start, t_end) in spans.items():
            ax.axvspan(t_start, t_end, color=phase_colors.get(phase, "grey"), alpha=0.35, lw=0)

        def series(metric: str, rank_rows=rank_rows) -> list[float]:
            return [r[metric] / 2**20 for r in rank_rows]

        ax.plot(t, series(PEAK_METRIC), "-", color="black", lw=2.0, label=PEAK_METRIC)
        if series("device_reserved") != series(PEAK_METRIC):
            ax.plot(t, series("device_reserved"), "-", color="grey", lw=1.2, label="device_reserved")
        for i, metric in enumerate(m for m in METRICS if m.startswith("tag/")):
            if any(series(metric)):
                ax.plot(t, series(metric), "--", lw=1.4, color=plt.get_cmap("tab10")(i), label=metric)
        ax.set_ylabel(f"rank {rank}: device MiB")
        ax.grid(alpha=0.3)
        host = ax.twinx()
        host.plot(t, series("host_rss"), ":", color="tab:red", lw=1.4, label="host_rss (right)")
        if series("device_used") != series("host_rss"):
            host.plot(t, series("device_used"), ":", color="tab:purple", lw=1.4, label="device_used (right)")
        if any(series("host_pinned")):
            host.plot(t, series("host_pinned"), ":", color="tab:brown", lw=1.4, label="host_pinned (right)")
        host.set_ylabel("process MiB")
        lines = ax.get_legend_handles_labels()
        host_lines = host.get_legend_handles_labels()
        ax.legend(
            lines[0] + host_lines[0],
            lines[1] + host_lines[1],
            loc="upper left",
            bbox_to_anchor=(1.06, 1.0),
            fontsize=8,
            framealpha=0.9,
        )
    seen = [p for p in PHASES if any(r["phase"] == p for r in rows)]
    fig.legend(
        handles=[Patch(color=phase_colors[p], alpha=0.5, label=p) for p in seen],
        loc="upper center",
        ncol=min(7, max(1, len(seen))),
        fontsize=8,
        title="phases (shaded)",
    )
    axes[-1, 0].set_xlabel("seconds since start")
    top = 1 - 1.1 / (3.4 * len(ranks) + 1.2)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
