"""`make calibrate` on CPU: the fit recovers the constants the fit set's timelines were made with.

The timelines are written from the plan under known constants (what a machine whose runtime, local-layer
factor, train workspace, per-sequence attention cost and engine constants are those would measure, phase by
phase); the fit must find them. In particular the three train terms (the factor on the per-token count, the
per packed sequence and layer cost of megatron's local attention loop, the fixed workspace) are separable on
the fit set: a fit set that could not tell them apart would fail here."""

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
    "local_attention_sequence_bytes": 30_000,
    "vllm_runtime_bytes": 180 * MIB,
}


@pytest.mark.parametrize(
    "changed", [{}, {"local_attention_sequence_bytes": 60_000}, {"train_workspace_bytes": 1 * MIB}]
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
    assert values["local_attention_sequence_bytes"][0] == pytest.approx(
        want["local_attention_sequence_bytes"], rel=0.02
    )
    assert values["runtime_overhead_bytes"][0] == pytest.approx(want["runtime_overhead_bytes"], abs=1)
    assert values["vllm_runtime_bytes"][0] == pytest.approx(want["vllm_runtime_bytes"], abs=1)
    # every transient-fitting run's train rise carries sequence-layers: the per-sequence term is counted, not
    # guessed; except where the DistributedOptimizer's gloo grad-sync copy sets train's peak (memory_cpu, DP=2:
    # the whole fp32 grad buffer, more than its activations), which hides the per-sequence term
    rises = {s.name: evidence[s.name]["train_rise"] for s in FIT_SET if s.fits_transients}
    bound = rises["memory_cpu"]  # skipped, or a row with nothing to fit
    assert isinstance(bound, str) or bound["planned_activations"] == bound["sequence_layers"] == 0
    assert all(r["sequence_layers"] > 0 for name, r in rises.items() if name != "memory_cpu")


def test_a_negative_per_sequence_cost_is_not_fitted():
    """Four rows whose three-term least squares puts the per-sequence cost below zero (-15.4 kB here; the stored fit
    runs of 64fc8ec's CI clone gave -19.7 kB a sequence and layer, and a factor of 1.21 with it, 1.12 without):
    bytes a sequence's autograd nodes hold cannot be negative, so the term is dropped and the rest is the line fit."""
    from tools.calibrate import _actor_fit, _line_fit

    rows = [(14.7e6, 128, 17.0e6), (8.3e6, 32, 11.4e6), (36.7e6, 256, 40.6e6), (31.2e6, 64, 37.1e6)]
    workspace, factor, per_sequence, residual = _actor_fit(rows)
    assert per_sequence == 0
    assert (workspace, factor, residual) == _line_fit([(act, y, True) for act, _, y in rows])
    # where the rows carry a positive per-sequence cost, it is fitted
    truth = [(act, seq, 1e6 + 1.1 * act + 20_000 * seq) for act, seq, _ in rows]
    assert _actor_fit(truth)[2] == pytest.approx(20_000, rel=1e-6)


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
