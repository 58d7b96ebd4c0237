"""``make report RUN=<dir>`` / ``make compare RUNS="<dir> <dir>"``: a run's measured memory from its files alone.

One run: renders ``memory_stages.png`` (the per-step stage chart) and ``memory_timeline.png`` (the whole
run against steps) into the run directory from ``memory_timeline.csv``, and prints a table per phase:
measured memory after it and its peak, the bytes released at each hand-off (measured, next to what the
ledgers expected) and the drift of its peak over the steps.

Several runs (e.g. staged vs all-at-once): the table of each phase's measured peak side by side with the
differences from the first run, and the stage charts of rank 0 side by side (``--out``, default
``compare.png`` in the current directory).

Everything comes from ``memory_timeline.csv`` (the measured ``device_used`` / ``device_peak`` columns,
the ``tag/*`` columns as the explanation) and ``config.yaml`` (labels).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from telemetry.memory_charts import (
    compare_table,
    phase_table,
    plot_stages,
    plot_timeline,
    representative_step,
    run_label,
)
from telemetry.memory_timeline import read_timeline_csv


def load_run(run_dir: str | Path) -> tuple[str, list[dict]]:
    """(label, timeline rows) of one run directory; a clear error when it is not one."""

    run_dir = Path(run_dir)
    csv_path = run_dir / "memory_timeline.csv"
    if not csv_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no memory_timeline.csv; pass a run directory (runs/<exp>/<timestamp>)")
    rows = read_timeline_csv(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no samples: the run stopped before its first step ended")
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    return run_label(config) if config else run_dir.name, rows


def report(run_dir: str | Path) -> str:
    label, rows = load_run(run_dir)
    run_dir = Path(run_dir)
    stages = plot_stages(rows, run_dir / "memory_stages.png", title=f"memory after each phase (measured): {label}")
    timeline = plot_timeline(rows, run_dir / "memory_timeline.png")
    step = representative_step(rows)
    return f"{label}\n{phase_table(rows)}\nstage chart (step {step}): {stages}\ntimeline: {timeline}"


def compare(run_dirs: list[str], out: str | Path) -> str:
    runs = [load_run(d) for d in run_dirs]
    first_rank = [
        (f"run {i} ({label})", [r for r in rows if r["rank"] == min(x["rank"] for x in rows)])
        for i, (label, rows) in enumerate(runs)
    ]
    chart = plot_stages(first_rank, out, title="memory after each phase (measured), one run under the other")
    legend = "\n".join(f"run {i}: {d} ({label})" for i, (d, (label, _)) in enumerate(zip(run_dirs, runs)))
    return f"{legend}\n{compare_table([(f'run {i}', rows) for i, (_, rows) in enumerate(runs)])}\nchart: {chart}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (one: report; more: compare)")
    parser.add_argument("--out", default="compare.png", help="compare: where the side-by-side stage charts go")
    args = parser.parse_args(argv)
    try:
        text = report(args.runs[0]) if len(args.runs) == 1 else compare(args.runs, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
