"""Run outputs on rank 0: metrics.jsonl, memory_timeline.csv, the memory charts, summary.json and a W&B run.

W&B is offline unless ``wandb.mode=online`` (``wandb sync <run dir>/wandb/offline-run-*`` uploads later).
``wandb.init`` takes the run id from ``WANDB_RUN_ID`` and ``WANDB_RESUME`` from the environment: a Slurm
job (``make sbatch``) fixes both, so a requeued job resumes the same W&B run; a run resumed from a
checkpoint takes the id saved in it. Records reach W&B only once a checkpoint covers their step (see
:class:`RunWriter`), with explicit W&B steps that continue across resumes, so no step is logged twice.
(W&B 0.31 does not resume *offline* runs: each attempt writes its own ``offline-run-*`` directory under
the same id, holding only its own steps.)
Timeline series are logged as ``memory/<metric>/rank<r>`` against a custom x-axis ``timeline/step``
(the step, each step split evenly among its phases; ``timeline/t_s`` rides along); per-step scalars
against ``trainer/step``, among them ``memory/peak/<phase>`` (max over ranks of the phase's measured
peak, ``device_peak``), ``memory/predicted/<phase>`` and ``memory/prediction_error/<phase>`` (the memory
plan's prediction and predicted / measured - 1) and ``memory/drift/<phase>`` (growth of that peak over the
steady steps so far, as a fraction of it). At the end: ``memory/stage_chart`` and ``memory/timeline_chart`` images
(:mod:`telemetry.memory_charts`).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from telemetry.memory_charts import plot_stages, plot_timeline, run_label, timeline_x
from telemetry.memory_timeline import METRICS, TENSOR_PEAK, phase_drift, phase_peak_rows, phase_peaks, read_timeline_csv

CSV_COLUMNS = ("t_s", "step", "phase", "rank", *METRICS, TENSOR_PEAK)
SUMMARY_FILE = "summary.json"  # written last, by RunWriter.finish: its presence means the run finished


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

    def build(self, run_dir: Path, config: Any, name: str, **resume: Any) -> RunWriter:
        """Rank 0's writer of the run's files and W&B run (``resume``: see :class:`RunWriter`)."""
        return RunWriter(run_dir, config, self.mode, self.project, self.entity, name, **resume)


def _truncate_jsonl(path: Path, completed_steps: int) -> list[dict]:
    """Keep the records of steps < completed_steps (a resumed run redoes the rest); returns them."""
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            if record.get("trainer/step", completed_steps) < completed_steps:
                records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _truncate_csv(path: Path, completed_steps: int) -> list[dict]:
    """The timeline rows of steps < completed_steps, typed, rewritten to ``path``; returns them."""
    rows = read_timeline_csv(path, skip_broken=True) if path.is_file() else []
    rows = [row for row in rows if "step" in row and row["step"] < completed_steps]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return rows


class RunWriter:
    """Everything rank 0 writes for one run. Other ranks never construct one.

    Resuming (``completed_steps`` > 0): metrics.jsonl and memory_timeline.csv keep only the steps before
    the checkpoint (the rest is redone), and the W&B run continues under ``wandb_run_id`` (else
    ``WANDB_RUN_ID`` from the environment, else a new id). With ``defer_wandb`` the W&B records wait in
    memory until :meth:`flush_wandb` (called once a checkpoint that covers them is complete), so no step
    reaches W&B twice; their W&B step continues from ``wandb_step`` (saved in the checkpoint).
    """

    def __init__(
        self,
        run_dir: Path,
        config: Any,
        wandb_mode: str,
        project: str,
        entity: str | None,
        name: str,
        completed_steps: int = 0,
        wandb_run_id: str | None = None,
        wandb_step: int = 0,
        defer_wandb: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config = asdict(config) if is_dataclass(config) else dict(config)
        metrics_path = self.run_dir / "metrics.jsonl"
        restarted = completed_steps == 0 and metrics_path.is_file() and metrics_path.stat().st_size > 0
        self.previous_metrics = _truncate_jsonl(metrics_path, completed_steps)
        previous_rows = _truncate_csv(self.run_dir / "memory_timeline.csv", completed_steps)
        # the timeline's last time stamp so far (a resumed run's timeline continues from it)
        self.last_t_s = max((row["t_s"] for row in previous_rows), default=0.0)
        # one summary row per (rank, step, phase) with its measured peak, for the drift: the samples themselves
        # live in memory_timeline.csv only (keeping them in memory would grow rank 0 with every step)
        self.phase_peak_rows: list[dict] = phase_peak_rows(previous_rows)
        self._metrics_file = open(metrics_path, "a")
        self._csv_file = open(self.run_dir / "memory_timeline.csv", "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        self._defined: set[str] = set()
        # phase -> the memory plan's prediction (set by run.setup.plan_and_build_engine): logged beside each measured peak
        self.predicted_bytes: dict[str, int] = {}
        self._deferred: list[dict] | None = [] if defer_wandb else None
        self.wandb_step = wandb_step  # the next W&B step (explicit, so a resumed run continues the count)
        self.wandb_run = None
        if wandb_mode != "disabled":
            # optional: W&B is imported where it is used, not every install has it
            import wandb

            wandb_run_id = wandb_run_id or os.environ.get("WANDB_RUN_ID")  # a requeued Slurm job's fixed id
            if restarted and wandb_run_id is None and not defer_wandb:
                # an earlier attempt in this directory died and its W&B records (sent at once, nothing
                # deferred) cannot be taken back: this fresh start is a new W&B run
                wandb_run_id = wandb.util.generate_id()
            if wandb_mode == "offline":
                # wandb.init(mode="offline") leaves the process's global settings online, and wandb 0.31's
                # analytics (wandb/analytics/opentelemetry/opentelemetry_proxy.py, OpenTelemetryProxy.from_settings)
                # then start two export threads at the first run.log that post to the W&B server every 60 s
                wandb.setup(wandb.Settings(mode="offline"))
            self.wandb_run = wandb.init(
                mode=wandb_mode,
                project=project,
                entity=entity,
                name=name,
                dir=str(self.run_dir),
                config=self.config,
                reinit="finish_previous",
                id=wandb_run_id,
                resume="allow" if wandb_run_id else None,
            )
            self.wandb_run.define_metric("trainer/step")
            self.wandb_run.define_metric("timeline/step")

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    @property
    def num_deferred(self) -> int:
        return len(self._deferred or ())

    @property
    def wandb_step_after_deferred(self) -> int:
        """The W&B step after the deferred records are sent (what a checkpoint covering them continues from)."""
        return self.wandb_step + self.num_deferred

    def _wandb_log(self, record: dict) -> None:
        if self.wandb_run is None:
            return
        if self._deferred is not None:
            self._deferred.append(record)
            return
        # every record is a whole row of its own step: commit it now (with an explicit step wandb otherwise keeps
        # the row open until a later step or finish() flushes it)
        self.wandb_run.log(record, step=self.wandb_step, commit=True)
        self.wandb_step += 1

    def flush_wandb(self) -> None:
        """Send the deferred W&B records (their steps are now covered by a complete checkpoint)."""
        deferred, self._deferred = self._deferred, None
        for record in deferred or ():
            self._wandb_log(record)
        if deferred is not None:
            self._deferred = []

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
        self.phase_peak_rows += phase_peak_rows(rows)
        self._csv.writerows(rows)
        self._csv_file.flush()
        if self.wandb_run is None:
            return
        for row, x in zip(rows, timeline_x(rows)):
            record = {"timeline/step": x, "timeline/t_s": row["t_s"]}
            for metric in METRICS:
                key = f"memory/{metric}/rank{row['rank']}"
                self._define(key, "timeline/step")
                record[key] = row[metric]
            self._wandb_log(record)

    def read_rows(self) -> list[dict]:
        """Every sample written so far, all ranks (read back from memory_timeline.csv)."""
        self._csv_file.flush()
        return read_timeline_csv(self.run_dir / "memory_timeline.csv")

    def read_metrics(self) -> list[dict]:
        """Every record of metrics.jsonl so far (read back)."""
        self._metrics_file.flush()
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def log_step(self, step: int, metrics: dict[str, float], step_rows: list[dict]) -> dict[str, int]:
        """Per-step scalars, ``memory/peak/<phase>`` (measured, this step's rows) and ``memory/drift/<phase>``
        (all steps so far, once there are enough); returns the peaks."""
        peaks = phase_peaks(step_rows)
        record = {"trainer/step": step, **metrics}
        record.update({f"memory/peak/{phase}": value for phase, value in peaks.items()})
        record.update({f"memory/drift/{p}": d["fraction"] for p, d in phase_drift(self.phase_peak_rows).items()})
        for phase, measured in peaks.items():
            if phase in self.predicted_bytes and measured > 0:
                record[f"memory/predicted/{phase}"] = self.predicted_bytes[phase]
                record[f"memory/prediction_error/{phase}"] = self.predicted_bytes[phase] / measured - 1.0
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        if self.wandb_run is not None:
            for key in record:
                if key != "trainer/step":
                    self._define(key, "trainer/step")
            self._wandb_log(record)
        return peaks

    def close(self) -> None:
        """Stop without a summary (a preempted run): files closed, deferred W&B records dropped (the run
        that resumes redoes their steps), the W&B run finished so that it can be resumed."""
        self._metrics_file.close()
        self._csv_file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()

    def finish(self, summary: dict) -> dict:
        """Write the memory charts and summary.json, close W&B. Returns the summary as written."""
        rows = self.read_rows()
        charts = {}
        if rows:  # a run stopped before its first step has no samples to draw
            charts["memory/timeline_chart"] = plot_timeline(rows, self.run_dir / "memory_timeline.png")
            title = f"memory after each phase (measured): {run_label(self.config)}"
            charts["memory/stage_chart"] = plot_stages(rows, self.run_dir / "memory_stages.png", title=title)
        summary = dict(summary, wandb_dir=self.wandb_dir)
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        self._metrics_file.close()
        self._csv_file.close()
        if self.wandb_run is not None:
            # optional: W&B is imported where it is used, not every install has it
            import wandb

            self.flush_wandb()
            self._deferred = None
            if charts:
                self._wandb_log({key: wandb.Image(str(png)) for key, png in charts.items()})
            self.wandb_run.summary.update(wandb_summary(summary))
            self.wandb_run.finish()
        return summary


def wandb_summary(summary: dict) -> dict:
    """summary.json as the W&B run's summary: a group of plain figures (``memory_figures``: the planned and
    measured peaks a sweep compares) as flat ``<group>/<name>`` keys, which W&B's sweep views (runs table,
    parallel coordinates) offer as columns; the rest as it is."""
    out = {}
    for key, value in summary.items():
        if key == "wandb_dir":
            continue
        if isinstance(value, dict) and value and all(v is None or isinstance(v, (int, float)) for v in value.values()):
            out.update({f"{key}/{name}": v for name, v in value.items()})
        else:
            out[key] = value
    return out
