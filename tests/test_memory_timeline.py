"""Memory timeline sampling, run outputs and the offline W&B run read back through wandb's protobufs."""

from __future__ import annotations

import csv
import json
import time

import torch

from rl.memory import METRICS, PHASES, MemoryProbe, MemoryTimeline, phase_peaks, window_peak
from rl.tracking import RunWriter
from tests.wandb_records import find_run_file, history_rows


def test_background_sampler_catches_a_peak_inside_a_phase():
    held = {"weights": 0}
    timeline = MemoryTimeline(MemoryProbe(torch.device("cpu"), [lambda: dict(held)]), rank=0, interval_s=0.005)
    with timeline.phase("weight_sync", step=0):
        held["weights"] = 10 << 20  # a transient bucket, gone again before the phase ends
        deadline = time.monotonic() + 5
        while not any(r["tag/weights"] for r in timeline.rows) and time.monotonic() < deadline:
            time.sleep(0.005)
        held["weights"] = 0
    rows = timeline.take_rows()
    assert rows[0]["tag/weights"] == 0 and rows[-1]["tag/weights"] == 0  # boundaries miss it
    assert phase_peaks(rows)["weight_sync"] == 10 << 20  # the sampler did not
    assert set(METRICS) <= set(rows[0]) and rows[0]["host_rss"] > 0
    assert timeline.take_rows() == []


def test_ledgers_add_up_per_tag_and_pinned():
    probe = MemoryProbe(
        torch.device("cpu"), [lambda: {"weights": 5, "kv_cache": 7}, lambda: {"actor_params": 11, "host_pinned": 3}]
    )
    sample = probe.read()
    assert sample["tag/weights"] == 5 and sample["tag/kv_cache"] == 7 and sample["tag/actor_params"] == 11
    assert sample["device_allocated"] == 23 and sample["host_pinned"] == 3
    assert sample["device_used"] == sample["host_rss"]


def test_window_peak_spans_phases_in_order():
    rows = [dict(phase=p, device_allocated=i) for i, p in enumerate(PHASES)]
    assert window_peak(rows, "wake_weights", "wake_kv_cache") == PHASES.index("wake_kv_cache")
    assert window_peak(rows, "rollout", "engine_sleep") == 1


def test_run_outputs_and_offline_wandb_run_read_back(tmp_path):
    held = {"weights": 0, "actor_params": 1 << 20}
    timeline = MemoryTimeline(MemoryProbe(torch.device("cpu"), [lambda: dict(held)]), rank=0, interval_s=0.01)
    writer = RunWriter(tmp_path, {"exp": "unit"}, "offline", "rlmem-test", None, "unit")
    for step in range(2):
        for i, phase in enumerate(PHASES):
            with timeline.phase(phase, step):
                held["weights"] = (i + 1) << 16
        rows = timeline.take_rows()
        other_rank = [dict(r, rank=1, device_allocated=r["device_allocated"] * 2) for r in rows]
        writer.log_timeline(rows + other_rank)
        peaks = writer.log_step(step, {"reward/mean": 0.25 * step}, rows + other_rank)
        assert peaks["train"] == 2 * ((1 << 20) + ((PHASES.index("train") + 1) << 16))  # max over ranks
    summary = writer.finish({"steps": 2})

    with open(tmp_path / "memory_timeline.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert {r["phase"] for r in csv_rows} == set(PHASES) and {r["rank"] for r in csv_rows} == {"0", "1"}
    assert (tmp_path / "memory_timeline.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert [json.loads(line)["trainer/step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
    ]

    history = history_rows(find_run_file(summary["wandb_dir"]))
    timeline_points = [h for h in history if "memory/device_allocated/rank1" in h]
    assert len(timeline_points) == len(csv_rows) // 2 and all("timeline/t_s" in h for h in timeline_points)
    step_rows = [h for h in history if "memory/peak/train" in h]
    assert [h["trainer/step"] for h in step_rows] == [0, 1]
    assert step_rows[1]["memory/peak/train"] == peaks["train"] and step_rows[1]["reward/mean"] == 0.25
