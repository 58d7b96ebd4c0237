"""`make calibrate` on a GPU node: the CUDA fit recovers the constants a GPU's timelines were made with.

No GPU here, so the timelines are written from the plan under known constants (what a GPU whose runtime,
vLLM graphs and NCCL buffers are those would measure, phase by phase); the fit must find those constants,
each from its own run, in order. The runs themselves (tools/plan_runs.py::cuda_fit_set) need a GPU node."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from planner.calibration import load
from tools.calibrate import fit_cuda
from tools.plan_runs import cuda_fit_set, inputs_for, plan_for, predicted_phases

MIB = 2**20
TRUTH = {
    "runtime_overhead_bytes": 700 * MIB,
    "vllm_cuda_graph_bytes": 900 * MIB,
    "nccl_bytes_per_communicator": 150 * MIB,
}


def write_timeline(run_dir: Path, spec, calibration) -> None:
    """Two samples per phase (its start level, then its peak), 4 steps, every rank alike."""
    predicted = predicted_phases(plan_for(spec, calibration))
    ranks = inputs_for(spec, calibration).actor.tp  # the fit set's runs are TP-only
    run_dir.mkdir(parents=True)
    fields = ["t_s", "step", "phase", "rank", "device_used", "device_peak", "tag/kv_cache"]
    with open(run_dir / "memory_timeline.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        t = 0.0
        for step in range(4):
            for name, p in predicted.items():
                start = p.peak_bytes - p.rise_bytes
                for rank in range(ranks):
                    for level in (start, p.peak_bytes):
                        t += 0.01
                        kv = p.components["kv_cache"]  # the engine's ledger tag: what it allocated
                        row = dict(t_s=t, step=step, phase=name, rank=rank, device_used=level, device_peak=level)
                        writer.writerow({**row, "tag/kv_cache": kv})


@pytest.mark.parametrize("device", ["H100-80GB", "A100-40GB"])
def test_cuda_fit_recovers_the_constants_the_timelines_were_made_with(tmp_path, device):
    specs = {s.name: s for s in cuda_fit_set(device)}
    truth = load("cuda").with_values(**TRUTH)
    for name, spec in specs.items():
        write_timeline(tmp_path / name, spec, truth)
    values, evidence = fit_cuda({name: tmp_path / name for name in specs}, specs)
    # world, megatron TP, megatron MODEL_PARALLEL (the grad norm), the native engine's TP group (planner/comms.py)
    assert evidence["cuda_tp2"]["communicators"] == 4
    for name, want in TRUTH.items():
        value, uncertainty = values[name]
        assert abs(value - want) <= 1, (name, value, want)
        assert uncertainty <= 1, (name, uncertainty)


def test_each_cuda_constant_comes_from_its_own_run(tmp_path):
    """A larger NCCL footprint moves only the NCCL constant (it is fitted last, on the two-GPU run)."""
    specs = {s.name: s for s in cuda_fit_set("H100-80GB")}
    truth = load("cuda").with_values(**{**TRUTH, "nccl_bytes_per_communicator": 400 * MIB})
    for name, spec in specs.items():
        write_timeline(tmp_path / name, spec, truth)
    values, _ = fit_cuda({name: tmp_path / name for name in specs}, specs)
    assert values["nccl_bytes_per_communicator"][0] == pytest.approx(400 * MIB, abs=1)
    assert values["runtime_overhead_bytes"][0] == pytest.approx(TRUTH["runtime_overhead_bytes"], abs=1)
    assert values["vllm_cuda_graph_bytes"][0] == pytest.approx(TRUTH["vllm_cuda_graph_bytes"], abs=1)
