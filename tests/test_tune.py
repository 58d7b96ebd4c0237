"""make tune (tools/tune.py): the enumeration, the rejection reasons, the ranking, the YAML it writes, bad input."""

from __future__ import annotations

import dataclasses

import pytest

import tools.speed_probe
from colocation.phases import WAKE_STRATEGIES
from planner.sizes import engine_gemm_weights
from run.compose import compose, compose_from_file
from run.memory_plan import plan_inputs
from tests.planner_inputs import CPU_SPEED as CPU
from tools import tune

# a fixed CPU speed: no probe in the tests


@pytest.fixture(scope="module")
def tiny():
    cfg = compose("tiny_cpu")
    return cfg, plan_inputs(cfg, None)


def test_the_enumeration_honours_divisibility():
    shape = compose("qwen3_30b_a3b_8xh100").model.shape()
    layouts = tune.enumerate_layouts(shape, world=16, per_node=8, on_cuda=True)
    assert layouts
    for lay in layouts:
        assert 16 % (lay.tp * lay.pp) == 0 and lay.tp <= 8 and lay.rollout_tp <= 8 and 16 % lay.rollout_tp == 0
        assert shape.num_layers % lay.pp == 0
        assert lay.vpp is None or (lay.pp > 1 and shape.num_layers % (lay.pp * lay.vpp) == 0)
        assert shape.num_experts % lay.ep == 0
        dp = 16 // (lay.tp * lay.pp)
        assert (lay.tp * dp) % (lay.ep * (lay.etp or lay.tp)) == 0
    assert {lay.ep for lay in layouts} >= {1, 2, 4, 8, 16}
    assert {lay.wake_strategy for lay in layouts} == set(WAKE_STRATEGIES)


def test_every_wake_strategy_and_offload_passes_the_runs_checks(tiny):
    """Each value an axis takes is one the run accepts: a misspelt wake strategy would be rejected by every check
    and silently leave the axis unsearched."""
    cfg, _ = tiny
    own = tune.experiment_layout(cfg)
    for wake in WAKE_STRATEGIES:
        for offload in ((True, True, True), (False, False, False)):
            tune.configure(cfg, dataclasses.replace(own, wake_strategy=wake, offload=offload))


def test_search_ranks_by_predicted_time_and_rejects_with_a_reason(tiny):
    cfg, base = tiny
    result = tune.search(cfg, base, CPU, max_layouts=200)
    ok, bad = tune.ranked(result)
    assert ok, "some tiny_cpu layout fits"
    assert [j.seconds for j in ok] == sorted(j.seconds for j in ok)
    assert all(j.reason is None for j in ok)
    assert all(j.reason for j in bad)
    # a layout the run's own checks refuse is rejected before planning (TP 3 does not divide the tiny model's heads)
    with pytest.raises(ValueError):
        tune.configure(cfg, dataclasses.replace(tune.experiment_layout(cfg), tp=3))


def test_a_layout_is_planned_with_its_own_sync_not_the_experiments(tiny):
    """The experiment's inputs carry its sync plan per pipeline stage (run/memory_plan.py); a layout of another PP
    must not inherit them (they would fail its checks and silently drop every PP layout from the search)."""
    cfg, base = tiny
    assert base.sync_traffic is not None and base.sync_staged_bytes is not None
    lay = dataclasses.replace(tune.experiment_layout(cfg), tp=1, pp=2, rollout_tp=1)
    inputs = tune.layout_inputs(base, tune.configure(cfg, lay))
    assert inputs.actor.pp == 2
    assert inputs.sync_traffic is inputs.sync_staged_bytes is inputs.sync_peers is inputs.reference_check is None


def test_an_infeasible_layout_is_rejected_with_the_overflowing_phase(tiny):
    cfg, base = tiny
    small = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, cpu_capacity_gb=0.01))
    lay = tune.Layout(1, 1, None, 1, None, 1, (False, False, False), "none", 8, "staged")
    inputs = tune.layout_inputs(dataclasses.replace(base, rollout=small.rollout), tune.configure(small, lay))
    from planner import make_plan

    plan = make_plan(dataclasses.replace(inputs, device=dataclasses.replace(base.device, total_bytes=2**20)))
    judged = tune.judge(lay, plan, CPU)
    assert not judged.feasible and "DOES NOT FIT" in judged.reason and "GiB over" in judged.reason


def test_the_written_yaml_composes(tiny, tmp_path):
    cfg, base = tiny
    ok, _ = tune.ranked(tune.search(cfg, base, CPU, max_layouts=100))
    out = tmp_path / "tuned_tiny_cpu.yaml"
    plan = tune.write_winner("tiny_cpu", {}, ok[0], out, "test")
    composed = compose_from_file(out)
    assert composed.actor.tp == ok[0].layout.tp and composed.rollout.tp == ok[0].layout.rollout_tp
    assert composed.actor.micro_batch_size == ok[0].layout.micro_batch_size
    assert plan.fits


def test_the_chart_marks_the_winner_and_the_experiments_own_layout(tiny, tmp_path):
    cfg, base = tiny
    result = tune.search(cfg, base, CPU, max_layouts=100)
    ok, _ = tune.ranked(result)
    own = next(j for j in result.judged if j.layout == tune.experiment_layout(cfg))
    labels = tune.chart(result, tmp_path / "c.png", "tiny", {"fastest that fits": ok[0], "the experiment's own": own})
    assert (tmp_path / "c.png").stat().st_size > 0
    assert f"fastest that fits: {ok[0].layout.label()} {ok[0].seconds:.3g} s" in labels
    assert f"the experiment's own: {own.layout.label()} {own.seconds:.3g} s" in labels
    assert any(label.startswith("fits (") for label in labels) and "budget" in labels


def test_a_device_without_a_speed_profile_is_one_line(capsys):
    assert tune.main(["--exp", "tiny_cpu", "--device", "TPU-v9", "--no-write"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "TPU-v9" in err


def test_a_model_that_fits_no_layout_is_one_line(capsys, tmp_path, monkeypatch):
    probed = []
    monkeypatch.setattr(tools.speed_probe, "measure_cpu_speed", lambda *args: probed.append(args) or CPU)
    args = ["--exp", "tiny_cpu", "--no-write", "--chart", str(tmp_path / "c.png"), "rollout.cpu_capacity_gb=0.001"]
    rc = tune.main([*args, "--max-layouts", "50"])
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert err.startswith("no layout of ") and "the smallest peak is" in err and len(err.splitlines()) == 1
    # the CPU's GEMMs were probed at the experiment's own native engine rank's weights, in its dtype
    cfg = compose("tiny_cpu")
    shape = plan_inputs(cfg, None).shape
    assert probed == [(engine_gemm_weights(shape, cfg.rollout.tp), "float32")]


@pytest.mark.slow
def test_qwen3_30b_a3b_on_8_h100_has_a_feasible_layout():
    from planner.speed import speed_preset

    cfg = compose("qwen3_30b_a3b_8xh100")
    result = tune.search(cfg, plan_inputs(cfg, None), speed_preset("H100-80GB"), max_layouts=400, fraction_budget=0)
    ok, _ = tune.ranked(result)
    assert ok
