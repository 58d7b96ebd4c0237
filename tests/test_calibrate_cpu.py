"""`make calibrate` on CPU: the fit recovers the constants the fit set's timelines were made with.

The timelines are written from the plan under known constants (what a machine whose runtime, local-layer
factor, train workspace and engine constants are those would measure, phase by phase); the fit must find them.
In particular the two train terms (the factor on the per-token count, the fixed workspace) are separable on the
fit set: a fit set that could not tell them apart would fail here."""

from __future__ import annotations

import json

import pytest

from planner.calibration import load
from tests.test_calibrate_cuda import write_timeline
from tools.calibrate import fit
from tools.plan_runs import FIT_SET

MIB = 2**20
TRUTH = {
    "runtime_overhead_bytes": 30 * MIB,
    "local_spec_activation_factor": 1.4,
    "train_workspace_bytes": 5 * MIB,
    "vllm_runtime_bytes": 180 * MIB,
}


@pytest.mark.parametrize(
    "changed", [{}, {"local_spec_activation_factor": 1.1}, {"train_workspace_bytes": 1 * MIB}]
)
def test_cpu_fit_recovers_the_train_terms_the_timelines_were_made_with(tmp_path, changed):
    truth = load("cpu").with_values(**{**TRUTH, **changed})
    specs = {s.name: s for s in FIT_SET}
    for name, spec in specs.items():
        write_timeline(tmp_path / name, spec, truth)
    values, evidence = fit({name: tmp_path / name for name in specs})
    want = {**TRUTH, **changed}
    assert values["local_spec_activation_factor"][0] == pytest.approx(want["local_spec_activation_factor"], abs=0.01)
    assert values["train_workspace_bytes"][0] == pytest.approx(want["train_workspace_bytes"], abs=64 * 1024)
    assert values["runtime_overhead_bytes"][0] == pytest.approx(want["runtime_overhead_bytes"], abs=1)
    assert values["vllm_runtime_bytes"][0] == pytest.approx(want["vllm_runtime_bytes"], abs=1)


def test_runtime_is_the_middle_of_the_levels_and_a_level_only_run_leaves_the_transients_alone(tmp_path):
    """Runs whose shapes hold different runtime levels: the fitted constant is the middle of their range (the
    smallest worst error over the shapes), its uncertainty leave-one-out: without the 20 MiB run the others say
    30 MiB, 10 MiB off it (the in-fit half range said 5). A level-only run (the 4-rank pipeline run) moves the
    level, never the transient terms, however its rises look."""
    level_only = [s for s in FIT_SET if not s.fits_transients]
    assert level_only, "the fit set has a level-only run (tools/plan_runs.py)"
    truth = load("cpu").with_values(**TRUTH)
    for spec in FIT_SET:
        constants = truth
        if not spec.fits_transients:  # 10 MiB lower level, a train workspace 4x the others'
            constants = truth.with_values(runtime_overhead_bytes=20 * MIB, train_workspace_bytes=20 * MIB)
        write_timeline(tmp_path / spec.name, spec, constants)
    values, _ = fit({s.name: tmp_path / s.name for s in FIT_SET})
    assert values["runtime_overhead_bytes"] == pytest.approx((25 * MIB, 10 * MIB), abs=1)
    assert values["train_workspace_bytes"][0] == pytest.approx(TRUTH["train_workspace_bytes"], abs=64 * 1024)
    assert values["local_spec_activation_factor"][0] == pytest.approx(TRUTH["local_spec_activation_factor"], abs=0.01)


def test_the_launch_measurement_takes_the_shapes_level_out_of_the_fit(tmp_path):
    """Each run's level is what it measured at launch plus what its steps add: with the launch level in each run's
    summary.json, the fitted remainder (runtime_after_launch_bytes) is the same on every shape and its leave-one-out
    uncertainty is 0, while the level fitted without it (make plan's, before a launch) keeps the shapes' spread."""
    truth = load("cpu").with_values(**TRUTH)
    for spec in FIT_SET:
        level = 20 * MIB if not spec.fits_transients else 30 * MIB
        write_timeline(tmp_path / spec.name, spec, truth.with_values(runtime_overhead_bytes=level))
        summary = {"memory_plan": {"launch_runtime_bytes": level - 8 * MIB}}
        (tmp_path / spec.name / "summary.json").write_text(json.dumps(summary))
    values, evidence = fit({s.name: tmp_path / s.name for s in FIT_SET})
    assert values["runtime_after_launch_bytes"] == pytest.approx((8 * MIB, 0), abs=1)
    assert values["runtime_overhead_bytes"] == pytest.approx((25 * MIB, 10 * MIB), abs=1)
    assert set(evidence["leave_one_out"]) == {s.name for s in FIT_SET}
