"""The memory timeline measures: process memory on CPU (with the kernel's high-water mark between samples),
CUDA's allocator and device-used through torch's real API; rows -> peaks, hand-offs, drift; run outputs
and the offline W&B run read back through wandb's protobufs."""

from __future__ import annotations

import csv
import inspect
import json

import pytest
import torch

from colocation.host_memory import release_freed_host_memory
from telemetry.memory_timeline import (
    METRICS,
    PHASES,
    MemoryProbe,
    MemoryTimeline,
    phase_drift,
    phase_peaks,
    read_timeline_csv,
    released_bytes,
)
from telemetry.tracking import RunWriter
from tests.wandb_records import find_run_file, history_rows, summary_items

MB = 1 << 20


def _touch(num_bytes: int) -> torch.Tensor:
    return torch.ones(num_bytes // 4, dtype=torch.float32)  # every page written: resident


def test_a_peak_between_two_samples_is_measured():
    """A 96 MB buffer lives and dies inside a phase while the sampler sleeps: device_peak still sees it."""
    timeline = MemoryTimeline(MemoryProbe(torch.device("cpu")), rank=0, interval_s=3600)
    if not timeline.probe.process.tracks_peak:
        pytest.skip("no resettable RSS high-water mark (/proc/self/clear_refs) on this system")
    release_freed_host_memory()
    with timeline.phase("train", step=0):
        buffer = _touch(96 * MB)
        del buffer
        release_freed_host_memory()
    first, last = timeline.take_rows()
    assert abs(last["device_used"] - first["device_used"]) < 16 * MB  # the boundaries miss it
    assert last["device_peak"] - first["device_used"] > 90 * MB  # the kernel's high-water mark did not
    assert set(METRICS) <= set(first) and first["host_rss"] > 0
    assert first["device_used"] == first["host_rss"] - timeline.probe.baseline_bytes
    # the next phase starts a new high-water mark
    with timeline.phase("wake_weights", step=0):
        pass
    assert all(r["device_peak"] - first["device_used"] < 16 * MB for r in timeline.take_rows())
    timeline.close()


_HEAP_HOLES = """
import json, psutil, torch
from colocation.host_memory import configure_host_allocator
configure_host_allocator()
rss = psutil.Process().memory_info
before = rss().rss
buffers, pins = [], []
for _ in range(2048):
    buffers.append(torch.ones(4096))  # 16 KiB, written: resident
    pins.append(torch.ones(4))  # 16 bytes that stay, between the buffers: the heap cannot shrink past them
peak = rss().rss
del buffers
print(json.dumps({"rise": peak - before, "left": rss().rss - before}))
"""


def test_freed_buffers_of_a_page_or_more_leave_the_rss_without_a_trim():
    """configure_host_allocator mmaps buffers of a page or more (colocation/host_memory.py), so freeing 2048
    buffers of 16 KiB gives most of their 32 MiB back at once, though small live allocations sit between them
    (the rest came from the heap top's padding; measured: 11 of 41 MiB stay). In glibc's heap (a 64 KiB
    threshold) all 35 of 35 stayed, holes until a trim, which the phase after the trim faults back in wherever
    its small allocations land: a rise no count can follow."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HEAP_HOLES], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    assert result["rise"] > 32 * MB  # the buffers were resident
    assert result["left"] < result["rise"] / 2, result  # and most went back with their free


def test_count_tensors_splits_a_phases_rise_into_its_tensors_and_the_rest(tmp_path):
    """trainer.count_tensors: a phase's exit row carries the most bytes of tensors it made at once (here 4 MiB and
    2 MiB live together, then 8 MiB after both died: 8 MiB), not the tensors from before it (modified in place) nor
    a tensor's views; tools/phase_tensors.py puts the rest of the rise beside them. Off: no such key."""
    from telemetry.memory_timeline import TENSOR_PEAK
    from tools.phase_tensors import phase_parts

    before = torch.zeros(1 << 20)
    timeline = MemoryTimeline(MemoryProbe(torch.device("cpu")), rank=0, interval_s=3600, count_tensors=True)
    for step in range(2):
        with timeline.phase("train", step=step):
            before.add_(1.0)
            four, two = _touch(4 * MB), _touch(2 * MB)
            view = four[: 1 << 10]
            del four, two, view
            eight = _touch(8 * MB)
            del eight
    rows = timeline.take_rows()
    assert [r[TENSOR_PEAK] for r in rows if TENSOR_PEAK in r] == [8 * MB, 8 * MB]  # the exit rows only
    part = phase_parts(rows)["train"]
    assert part["tensor_peak_bytes"] == 8 * MB and part["ledger_bytes"] == 0
    assert part["beside_bytes"] == part["rise_bytes"] - 8 * MB
    timeline.count_tensors = False
    with timeline.phase("train", step=2):
        _touch(MB)
    assert not any(TENSOR_PEAK in r for r in timeline.take_rows())
    timeline.close()


def test_a_sampling_fallback_is_named_and_warned_once(monkeypatch, tmp_path, capsys):
    """A container where /proc/self/clear_refs is not writable: peaks fall back to sampling, which the
    probe names (summary.json's memory_peak_method) and rank 0 says once on stderr."""
    import telemetry.memory_timeline

    assert MemoryProbe(torch.device("cpu")).peak_method in ("rss_high_water_mark", "rss_sampled")
    monkeypatch.setattr(telemetry.memory_timeline, "_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    probes = [MemoryProbe(torch.device("cpu")) for _ in range(2)]
    assert [p.peak_method for p in probes] == ["rss_sampled"] * 2
    capsys.readouterr()
    for rank, probe in enumerate(probes):
        MemoryTimeline(probe, rank=rank).close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: memory peaks are CPU: RSS sampled" in err, err
    assert "a peak between two samples is missed" in telemetry.memory_timeline.PEAK_METHODS["rss_sampled"]


def test_memory_held_is_measured_not_read_from_the_ledger():
    """The ledger claims 1 GiB of weights that do not exist and misses a real 64 MB buffer: the measured
    columns show the buffer and not the claim; the tag columns repeat the claim (an explanation only)."""
    probe = MemoryProbe(torch.device("cpu"), [lambda: {"weights": 1 << 30, "kv_cache": 7}, lambda: {"host_pinned": 3}])
    timeline = MemoryTimeline(probe, rank=0, interval_s=0.01)
    with timeline.phase("rollout", step=0):
        pass
    before = timeline.take_rows()[-1]
    kept = _touch(64 * MB)
    with timeline.phase("engine_sleep", step=0):
        pass
    after = timeline.take_rows()[-1]
    del kept
    timeline.close()
    assert 60 * MB < after["device_used"] - before["device_used"] < 80 * MB
    assert after["device_used"] < 1 << 30 and after["tag/weights"] == 1 << 30 and after["tag/kv_cache"] == 7
    assert after["host_pinned"] == 3
    assert after["device_allocated"] == after["device_reserved"] == after["device_used"]  # no CPU allocator


def _checked(real, value, calls: list):
    """A stand-in for ``real`` that refuses any call the real function would refuse (its signature)."""
    signature = inspect.signature(real)

    def stub(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        calls.append((real.__name__, dict(bound.arguments)))
        return value

    return stub


def test_cuda_probe_uses_torch_allocator_stats_and_device_used(monkeypatch):
    """CUDA: allocator counters and cudaMemGetInfo through torch's real functions (signatures checked), for
    the torch.device this rank uses (CUDA_VISIBLE_DEVICES-relative: no NVML by physical index)."""
    gib = 1 << 30
    values = dict(
        memory_allocated=10 * gib,
        memory_reserved=12 * gib,
        max_memory_reserved=20 * gib,
        mem_get_info=(60 * gib, 80 * gib),  # (free, total)
        reset_peak_memory_stats=None,
    )
    calls: list = []
    for name, value in values.items():
        monkeypatch.setattr(torch.cuda, name, _checked(getattr(torch.cuda, name), value, calls))
    device = torch.device("cuda", 3)
    probe = MemoryProbe(device, [lambda: {"weights": 5 * gib}])
    probe.reset_peak()
    sample = probe.read()
    assert sample["device_used"] == 20 * gib  # total - free: includes memory torch's allocator never saw
    assert sample["device_allocated"] == 10 * gib and sample["device_reserved"] == 12 * gib
    # the allocator's peak since the phase began, over what the device holds outside the allocator now
    assert sample["device_peak"] == 20 * gib - 12 * gib + 20 * gib
    assert sample["tag/weights"] == 5 * gib
    assert {name for name, _ in calls} == set(values)
    assert all(args.get("device") == device for _, args in calls), calls


def _rows(values: dict[str, list[int]], steps: int, rank: int = 0, tags: dict[str, list[int]] | None = None):
    """Synthetic rows: per phase, per step, the device_used of its first and last sample."""
    rows, t = [], 0.0
    for step in range(steps):
        for phase, (first, last) in values.items():
            for i, used in enumerate((first, last)):
                t += 1.0
                row = dict.fromkeys(METRICS, 0)
                row.update(t_s=t, step=step, phase=phase, rank=rank, device_used=used, device_peak=max(first, last))
                for tag, (tag_first, tag_last) in (tags or {}).items():
                    row[f"tag/{tag}"] = (tag_first, tag_last)[i]
                rows.append(row)
    return rows


def test_released_bytes_are_measured_next_to_the_ledgers_expectation():
    rows = _rows(
        {"engine_sleep": [900, 300], "offload_params": [500, 400]},
        steps=3,
        tags={"weights": [400, 0], "kv_cache": [200, 0], "actor_params": [100, 0]},
    )
    released = released_bytes(rows)
    assert released["engine_sleep"] == dict(measured=600, expected=600, rank=0)
    assert released["offload_params"] == dict(measured=100, expected=100, rank=0)
    assert "offload_grads" not in released  # nothing expected, nothing reported


def test_drift_is_the_growth_of_a_phase_peak_over_the_steady_steps():
    steps = 6
    rows = []
    for step in range(steps):
        leak = 10 * step
        rows += [
            dict(r, step=step)
            for r in _rows({"train": [1000 + leak, 1000 + leak], "rollout": [500, 500 + (step % 2)]}, steps=1)
        ]
    # allocators settle over the first steps, then stay (9 steady steps, as memory_cpu's 10-step run)
    warm_up = {1: 1000, 2: 1030, 3: 1040, 4: 1040, 5: 1041, 6: 1040, 7: 1041, 8: 1041, 9: 1040}
    rows += [dict(r, step=s) for s, used in warm_up.items() for r in _rows({"wake_weights": [used, used]}, steps=1)]
    drift = phase_drift(rows)
    assert drift["train"]["bytes"] == pytest.approx(40)  # steps 1..5: 10 per step, a leak in full
    assert drift["train"]["fraction"] == pytest.approx(40 / 1050)
    assert abs(drift["rollout"]["bytes"]) <= 1  # noise
    assert drift["wake_weights"]["fraction"] < 0.02  # a one-time rise is not a leak
    assert phase_drift(rows[: 4 * 3]) == {}  # fewer than 3 steady steps: no verdict


def test_phase_peaks_take_the_max_over_ranks():
    rows = [dict(phase=p, device_peak=i, rank=0) for i, p in enumerate(PHASES)]
    assert phase_peaks(rows + [dict(phase="train", device_peak=10**9, rank=1)])["train"] == 10**9


def test_run_outputs_and_offline_wandb_run_read_back(tmp_path):
    held = {"weights": 0, "actor_params": 1 << 20}
    timeline = MemoryTimeline(MemoryProbe(torch.device("cpu"), [lambda: dict(held)]), rank=0, interval_s=0.01)
    writer = RunWriter(tmp_path, {"exp": "unit"}, "offline", "rlmem-test", None, "unit")
    steps = 4
    for step in range(steps):
        for i, phase in enumerate(PHASES):
            with timeline.phase(phase, step):
                held["weights"] = (i + 1) << 16
                buffer = _touch(8 * MB) if phase == "train" else None
                del buffer
        rows = timeline.take_rows()
        other_rank = [dict(r, rank=1, device_peak=r["device_peak"] + (1 << 30)) for r in rows]
        writer.log_timeline(rows + other_rank)
        peaks = writer.log_step(step, {"reward/mean": 0.25 * step}, rows + other_rank)
        assert peaks["train"] == max(r["device_peak"] for r in other_rank if r["phase"] == "train")  # max over ranks
    timeline.close()
    figures = {"planned_train_peak_bytes": 5 * MB, "measured_train_peak_bytes": 6 * MB}
    summary = writer.finish({"steps": steps, "memory_figures": figures})

    csv_rows = read_timeline_csv(tmp_path / "memory_timeline.csv")
    assert {r["phase"] for r in csv_rows} == set(PHASES) and {r["rank"] for r in csv_rows} == {0, 1}
    with open(tmp_path / "memory_timeline.csv") as f:
        assert list(csv.DictReader(f))[0]["device_peak"] == str(csv_rows[0]["device_peak"])
    for png in ("memory_timeline.png", "memory_stages.png"):
        assert (tmp_path / png).stat().st_size > 10_000, png
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == steps
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["trainer/step"] for m in metrics] == list(range(steps))
    assert "memory/drift/train" not in metrics[2] and "memory/drift/train" in metrics[3]  # from 3 steady steps

    history = history_rows(find_run_file(summary["wandb_dir"]))
    timeline_points = [h for h in history if "memory/device_used/rank1" in h]
    assert len(timeline_points) == len(csv_rows) // 2 and all("timeline/step" in h for h in timeline_points)
    assert all(0 <= h["timeline/step"] <= steps for h in timeline_points)
    step_rows = [h for h in history if "memory/peak/train" in h]
    assert [h["trainer/step"] for h in step_rows] == list(range(steps))
    assert step_rows[1]["memory/peak/train"] == metrics[1]["memory/peak/train"] and step_rows[1]["reward/mean"] == 0.25
    assert any(h.get("memory/stage_chart/_type") == "image-file" for h in history)
    # the run's summary: a group of plain figures as flat keys (W&B's sweep views offer those as columns)
    wandb_summary = summary_items(find_run_file(summary["wandb_dir"]))
    assert wandb_summary["memory_figures/planned_train_peak_bytes"] == 5 * MB and "memory_figures" not in wandb_summary
    assert wandb_summary["memory_figures/measured_train_peak_bytes"] == 6 * MB and wandb_summary["steps"] == steps


def test_a_resumed_writer_keeps_the_completed_steps_rows_and_drops_a_row_cut_by_a_kill(tmp_path):
    """memory_timeline.csv of a killed run: rows of completed steps survive a resume (also one with an empty
    cell, a metric that rank did not report), later steps and the half-written last line are dropped."""
    head = "t_s,step,phase,rank,device_used,device_peak,tag/ref_params\n"
    (tmp_path / "memory_timeline.csv").write_text(
        head + "0.5,0,rollout,0,100,110,\n1.0,0,train,0,200,210,7\n1.5,1,rollout,0,300,310,7\n2.0,1,tra"
    )
    with pytest.raises((TypeError, ValueError)):
        read_timeline_csv(tmp_path / "memory_timeline.csv")
    writer = RunWriter(tmp_path, {"exp": "unit"}, "disabled", "rlmem-test", None, "unit", completed_steps=1)
    writer.close()
    rows = read_timeline_csv(tmp_path / "memory_timeline.csv")
    assert [(r["t_s"], r["phase"], r["device_used"]) for r in rows] == [(0.5, "rollout", 100), (1.0, "train", 200)]
    assert "tag/ref_params" not in rows[0] and rows[1]["tag/ref_params"] == 7
    assert writer.last_t_s == 1.0


def test_the_runtime_level_is_what_the_rank_holds_beside_its_tagged_tensors():
    """The launch measurement the plan's runtime level starts from (run/setup.py::launch_runtime_bytes): a 64 MB
    buffer its ledger names moves RSS by 64 MB and the level by much less; one it does not name moves both."""
    named = {"actor_params": 0}
    probe = MemoryProbe(torch.device("cpu"), [lambda: dict(named)])
    before = probe.runtime_level_bytes()
    params = _touch(64 * MB)
    named["actor_params"] = 64 * MB
    tagged = probe.runtime_level_bytes()
    unnamed = _touch(64 * MB)
    untagged = probe.runtime_level_bytes()
    del params, unnamed
    assert abs(tagged - before) < 8 * MB
    assert 56 * MB < untagged - tagged < 72 * MB


def test_phase_tensors_says_what_a_run_without_counts_lacks(tmp_path, capsys):
    from tools.phase_tensors import main

    assert main([str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    from telemetry.tracking import CSV_COLUMNS

    with open(tmp_path / "memory_timeline.csv", "w", newline="") as f:  # a run made without the count
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerow(dict(t_s=0.0, step=0, phase="train", rank=0, **dict.fromkeys(METRICS, 0)))
    assert main([str(tmp_path)]) == 2
    assert "trainer.count_tensors=true" in capsys.readouterr().err


def test_an_offline_wandb_run_sends_nothing(tmp_path):
    """Offline means nothing leaves the machine: wandb's analytics export (OpenTelemetry threads posting to the
    W&B server) must not start when a step is logged."""
    import threading

    from wandb.analytics.opentelemetry.opentelemetry_proxy import get_open_telemetry_proxy

    writer = RunWriter(tmp_path, {"exp": "unit"}, "offline", "rlmem-test", None, "unit")
    writer.log_step(0, {"reward/mean": 0.5}, [])
    exporters = [t.name for t in threading.enumerate() if t.name.startswith("Otel")]
    writer.finish({"steps": 1})
    assert get_open_telemetry_proxy() is None and not exporters, exporters
