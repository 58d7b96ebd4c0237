"""The cluster experiments: checkpoints from $RLMEM_CKPT_DIR, each fits its device with room to spare, and
``make run`` of one on a machine without its GPUs stops at once with the plan and one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planner import make_plan
from planner.report import headroom_beyond_uncertainty_bytes
from run.compose import compose, list_experiments
from run.launch import missing_devices
from run.main import main
from run.memory_plan import plan_inputs

GIB = 2**30
CLUSTER_EXPERIMENTS = [e for e in list_experiments() if compose(e).cluster.device != "cpu"]


def test_the_cluster_experiments_are_there():
    assert {
        "qwen2.5_0.5b_1xh200",
        "qwen7b_1xh200",
        "llama3.1_8b_8xh100",
        "qwen32b_8xh100",
        "qwen32b_16xh100",
        "qwen3_30b_a3b_8xh100",
    } <= set(CLUSTER_EXPERIMENTS)


@pytest.mark.parametrize("exp", CLUSTER_EXPERIMENTS)
def test_checkpoint_directory_comes_from_the_environment(exp, monkeypatch):
    monkeypatch.delenv("RLMEM_CKPT_DIR", raising=False)
    default = compose(exp).model.path
    assert default.startswith("/checkpoints/")
    monkeypatch.setenv("RLMEM_CKPT_DIR", "/lustre/ckpt")
    cfg = compose(exp)
    assert cfg.model.path == "/lustre/ckpt/" + default.removeprefix("/checkpoints/")
    assert cfg.model.architecture.startswith("arch:")  # planned and validated without the checkpoint


@pytest.mark.parametrize("exp", CLUSTER_EXPERIMENTS)
def test_every_cluster_experiment_fits_its_device_with_room_to_spare(exp):
    plan = make_plan(plan_inputs(compose(exp)))
    # the budget already keeps the 5% fragmentation margin and the CUDA runtime off; ask for 1 GiB more
    assert plan.fits and plan.headroom_bytes >= GIB, (exp, plan.peak_phase, plan.headroom_bytes / GIB)
    assert plan.kv_cache_bytes >= plan.min_kv_cache_bytes


def test_qwen32b_on_two_nodes_shards_the_optimizer_and_trains_longer_sequences():
    one, two = (plan_inputs(compose(e)) for e in ("qwen32b_8xh100", "qwen32b_16xh100"))
    # one node steps part of Adam on the host (actor.optimizer_offload_fraction): compare without it
    one = dataclasses.replace(one.with_actor(optimizer_offload_fraction=0.0), distributed_optimizer=False)
    assert (two.actor_dp, two.distributed_optimizer) == (2, True) and one.actor_dp == 1
    assert two.seq_len > one.seq_len
    assert (
        make_plan(two).phase("train").components["optimizer"] * 2
        == make_plan(one).phase("train").components["optimizer"]
    )


def test_qwen3_moe_on_one_node_plans_experts_over_ep():
    """EP=8 at TP=1 x DP=8: a rank holds 16 of each layer's 128 experts, their optimizer states unsharded (expert
    DP 1), the dense params' over DP=8."""
    inp = plan_inputs(compose("qwen3_30b_a3b_8xh100"))
    assert (inp.actor.tp, inp.actor_dp, inp.actor.ep, inp.expert_dp) == (1, 8, 8, 1)
    plan = make_plan(inp)
    assert plan.peak_phase == "train" and headroom_beyond_uncertainty_bytes(plan) >= 4 * GIB


def test_cpu_experiments_need_no_device():
    assert missing_devices(compose("tiny_cpu").cluster, external=False) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the GPUs")
@pytest.mark.parametrize("exp,needs", [("qwen32b_8xh100", "8 x H100-80GB"), ("qwen32b_16xh100", "16 x H100-80GB")])
def test_run_without_the_gpus_prints_the_plan_and_one_line(exp, needs, capsys):
    assert main(["--exp", exp]) == 2
    out, err = capsys.readouterr()
    assert "phase (GiB)" in out and "fits: peak train" in out  # the memory plan
    assert err.count("\n") == 1
    assert err.startswith(f"error: {exp} needs {needs}") and "this machine has no CUDA device" in err
    assert f"make sbatch EXP={exp} SUBMIT=1" in err
