"""One point run here as the command W&B's agent would run (a subprocess in its own session), and what its
run directory measured."""

from __future__ import annotations

import contextlib
import csv
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
from telemetry.memory_timeline import PEAK_METRIC
from tools.sweep.points import Point

# measured peak of a phase, max over ranks (telemetry.memory_timeline: CUDA allocator peak + memory outside it; CPU: RSS high-water mark)
MEASURED_METRIC = PEAK_METRIC


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
    """What a finished run directory measured: per-phase peaks (max over ranks), step time, reward."""
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    timeline = run_dir / "memory_timeline.csv"
    if timeline.is_file():
        peaks: dict[str, int] = {}
        with open(timeline, newline="") as f:
            for row in csv.DictReader(f):
                value = int(float(row[MEASURED_METRIC]))
                peaks[row["phase"]] = max(peaks.get(row["phase"], 0), value)
        out["measured"] = peaks
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
        # the plan the run made before its engine started (the task's real prompt lengths, the KV cache
        # the engine got): a sharper prediction than the launch-time check's worst case
        phases = (data.get("memory_plan") or {}).get("phases") or {}
        if phases:
            out["predicted"] = {phase: v["predicted_bytes"] for phase, v in phases.items()}
    return out
