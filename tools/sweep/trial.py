"""One point run here as the command W&B's agent would run (a subprocess in its own session), and what its
run directory measured."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from run.compose import REPO_ROOT
from telemetry.memory_timeline import FIGURES_KEY, memory_figures, read_timeline_csv
from tools.sweep.points import Point


def run_point(point: Point, command: list[str], run_dir: Path, progress) -> None:
    """One point as a subprocess (its own session, so an interrupt stops its ranks too); output to a log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "sweep_point.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(shlex.quote(c) for c in command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while proc.poll() is None:
                progress.set_postfix_str(f"{point.name} {time.monotonic() - start:.0f}s", refresh=True)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)  # the point's own session: run.main and its ranks
            proc.wait()
            raise
    point.result = collect_result(run_dir)
    point.result["wall_seconds"] = time.monotonic() - start
    if proc.returncode == 0 and (run_dir / "summary.json").is_file():
        point.status = "ok"
    else:
        point.status, point.reason = "failed", f"exit {proc.returncode}: {last_error_line(log_path)} (log {log_path})"


def last_error_line(log_path: Path) -> str:
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()[1:] if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower() or ln.startswith("rank "):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def collect_result(run_dir: Path) -> dict:
    """What a run directory holds: the memory figures (telemetry.memory_timeline.memory_figures: the run's own plan and
    measurements from summary.json; a run that stopped early: what its timeline measured, ``planned_by``
    empty), how the peaks were measured, step time and reward."""

    out: dict[str, Any] = {"run_dir": str(run_dir)}
    timeline = run_dir / "memory_timeline.csv"
    if timeline.is_file():
        out["figures"] = memory_figures(None, read_timeline_csv(timeline, skip_broken=True))
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        step_seconds = [sum(v for k, v in m.items() if k.startswith("time/")) for m in steps]
        if step_seconds:
            out["step_seconds"] = statistics.median(step_seconds)
    summary = run_dir / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        out["reward"] = data.get("reward_last5")
        out["steps"] = data.get("steps")
        out["peak_method"] = data.get("memory_peak_method")
        if data.get(FIGURES_KEY):
            # planned by the run before its engine started (the task's real prompts, the KV cache the engine
            # got), measured over its steady steps
            out["figures"], out["planned_by"] = data[FIGURES_KEY], "run"
    return out
