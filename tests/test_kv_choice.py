"""gpu_memory_utilization=auto inside a run: the KV cache chosen in bytes (bounded by measured free memory on
CUDA), the check before an engine wake, and the predicted-vs-measured calibration (run/memory_plan.py, run/setup.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import run.shared_device
from planner import check_fits, make_plan
from run.compose import compose
from run.launch import free_port
from run.memory_plan import choose_kv_cache, engine_config, plan_inputs
from run.shared_device import MemoryPlanError, SharedDevice
from telemetry.memory_timeline import prediction_errors

GIB = 2**30


@pytest.fixture
def qwen7b():
    cfg = compose("qwen7b_1xh200", [])  # gpu_memory_utilization: auto, architecture only (no checkpoint)
    assert cfg.rollout.gpu_memory_utilization == "auto"
    return cfg, make_plan(plan_inputs(cfg))


def test_auto_takes_the_plans_recommendation_in_bytes(qwen7b):
    cfg, plan = qwen7b
    choice = choose_kv_cache(cfg, plan)
    assert choice.kv_cache_bytes == plan.recommended_kv_cache_bytes > plan.min_kv_cache_bytes
    assert choice.tokens == plan.kv_cache_tokens(choice.kv_cache_bytes) and "planner" in choice.source
    engine_cfg = engine_config(cfg, choice)
    # the engine gets bytes, and (for vLLM's start-up check) the fraction that those bytes are
    assert engine_cfg.kv_cache_bytes == choice.kv_cache_bytes
    assert engine_cfg.gpu_memory_utilization == pytest.approx(
        plan.equivalent_utilization(choice.kv_cache_bytes)["vllm"]
    )
    # planned again with it, the plan holds exactly that KV cache and fits
    replanned = make_plan(plan_inputs(dataclasses.replace(cfg, rollout=engine_cfg)))
    assert replanned.kv_cache_bytes == choice.kv_cache_bytes and replanned.fits


def test_auto_is_bounded_by_the_free_memory_measured_on_the_device(qwen7b):
    cfg, plan = qwen7b
    block = plan.kv_bytes_per_token * plan.inputs.kv_block_size
    # free memory that leaves room for 1 GiB of KV cache besides the weights, the engine reserve and the margin
    free = plan.engine_weight_bytes + plan.rollout_engine_reserve_bytes + plan.margin_bytes + GIB
    choice = choose_kv_cache(cfg, plan, measured_free_bytes=free)
    assert choice.kv_cache_bytes == GIB // block * block < plan.recommended_kv_cache_bytes
    assert "bounded by the" in choice.source and "measured free" in choice.line()
    roomy = choose_kv_cache(cfg, plan, measured_free_bytes=200 * GIB)
    assert roomy.kv_cache_bytes == plan.recommended_kv_cache_bytes
    with pytest.raises(ValueError, match="no KV cache fits.*actor.offload"):
        choose_kv_cache(cfg, plan, measured_free_bytes=plan.engine_weight_bytes)


def test_an_explicit_kv_cache_wins_and_a_float_is_left_to_the_engine(qwen7b):
    cfg, plan = qwen7b
    fixed = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, kv_cache_bytes=3 * GIB))
    choice = choose_kv_cache(fixed, make_plan(plan_inputs(fixed)))
    assert (choice.kv_cache_bytes, choice.source) == (3 * GIB, "rollout.kv_cache_bytes")
    floating = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gpu_memory_utilization=0.6))
    choice = choose_kv_cache(floating, make_plan(plan_inputs(floating)))
    assert choice.kv_cache_bytes is None and engine_config(floating, choice) is floating.rollout


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_check_before_the_kv_wake_stops_with_the_shortfall_and_a_fitting_value(qwen7b, one_rank, monkeypatch):
    cfg, plan = qwen7b
    shared = SimpleNamespace(plan=plan, device=torch.device("cpu"), procs_per_node=cfg.cluster.procs_per_node)
    monkeypatch.setattr(run.shared_device, "measured_free_bytes", lambda device, ranks: 500 * GIB)
    SharedDevice.check_wake(shared, "wake_kv_cache")  # plenty free: passes
    needed = check_fits(plan, 500 * GIB, "wake_kv_cache").needed_bytes  # the KV cache + rollout activations
    monkeypatch.setattr(run.shared_device, "measured_free_bytes", lambda device, ranks: needed - GIB)
    with pytest.raises(MemoryPlanError, match=r"rank 0: wake_kv_cache would overflow: .* short by 1.00 GiB") as info:
        SharedDevice.check_wake(shared, "wake_kv_cache")
    # the value it proposes fits the memory that was free
    fitting = int(str(info.value).split("rollout.kv_cache_bytes=")[1].split()[0])
    refit = make_plan(plan.inputs.with_rollout(kv_cache_bytes=fitting))
    assert check_fits(refit, needed - GIB, "wake_kv_cache").fits
    SharedDevice.check_wake(SimpleNamespace(plan=None), "wake_kv_cache")  # a run without a plan checks nothing


def test_prediction_errors_compare_each_phase_with_its_steady_measured_peak(qwen7b):
    _, plan = qwen7b
    # the measurement includes the process's runtime (CUDA context; on CPU what it allocates beside tensors)
    train = plan.phase("train").predicted_bytes + plan.runtime_overhead_bytes
    rows = [
        # step 0 is not steady (optimizer states created): its 10x peak must not count
        dict(rank=0, step=0, phase="train", t_s=0.0, device_peak=10 * train),
        dict(rank=0, step=1, phase="train", t_s=1.0, device_peak=train // 2),
        dict(rank=1, step=1, phase="train", t_s=1.0, device_peak=train),  # the worst rank is compared
        dict(rank=0, step=1, phase="rollout", t_s=2.0, device_peak=1000),
    ]
    errors = prediction_errors(plan, rows)
    assert errors["train"] == {"predicted_bytes": train, "measured_bytes": train, "relative_error": 0.0}
    assert set(errors) == {"train", "rollout"}
    assert set(prediction_errors(plan, rows, min_bytes=2000)) == {"train"}
