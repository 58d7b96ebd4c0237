"""The planner against the Qwen 7B on 8x H200 breakdown in shared/reference/verl-memory-optimization-blog.md.

The blog (veRL, FSDP actor + SGLang, 8 GPUs of 141 GB) lists per GPU, in GB:

    training: weights (sharded) 1.9, gradients (sharded) 1.9, optimizer states (sharded) 3.9,
              activations 20-40, temporary all-gather 15.4; peak 40-65
    rollout:  weights 15.4 (full model), KV cache 80-100, CUDA graph 2-4, input/output buffers 5-10;
              total 100-120

Our closest run: Megatron actor TP=1 x DP=8 with the distributed optimizer (Qwen2.5-7B's 4 KV heads
rule out TP=8), vLLM engine TP=1, everything offloaded between phases, staged wake, micro-batch 2 x
2048 tokens. Each test below states one difference and pins it: the model is not tuned to the blog,
the blog is a check of where the two stacks differ and by how much.
"""

from __future__ import annotations

import pytest

from modelspec.shape import ModelShape
from planner import device_preset, make_plan
from tests.planner_inputs import make_inputs

GB = 1e9  # the blog's GB: 15.4 GB = 7.72e9 params x 2 bytes
BLOG = {
    "params": 7.72e9,
    "weights_full": 15.4 * GB,
    "weights_shard": 1.9 * GB,
    "grads_shard": 1.9 * GB,
    "optimizer_shard": 3.9 * GB,
    "activations": (20 * GB, 40 * GB),
    "all_gather": 15.4 * GB,
    "train_peak": (40 * GB, 65 * GB),
    "kv_cache": (80 * GB, 100 * GB),
    "cuda_graph": (2 * GB, 4 * GB),
    "io_buffers": (5 * GB, 10 * GB),
    "rollout_total": (100 * GB, 120 * GB),
}
SHAPE = ModelShape.from_architecture("Qwen2.5-7B-Instruct")


@pytest.fixture(scope="module")
def plan():
    return make_plan(
        make_inputs(
            actor=dict(tp=1, micro_batch_size=2),
            rollout=dict(tp=1, engine="vllm"),
            shape=SHAPE,
            device=device_preset("H200-141GB"),
            dtype="bfloat16",
            actor_dp=8,
            distributed_optimizer=True,
            sequences_per_step=1024,
            prompt_tokens=512,
            response_tokens=1536,
        )
    )


def test_the_parameter_count_is_the_checkpoints_not_the_blogs(plan):
    # The blog's 7.72B is 1.4% above Qwen2.5-7B's 7.62B; full bf16 weights are 15.23 GB, not 15.4.
    assert SHAPE.param_count() == 7_615_616_512
    engine_weights = plan.phase("rollout").components["engine_weights"]
    assert engine_weights == 2 * SHAPE.param_count()  # vocab 152064 is already a multiple of 64: no padding
    assert SHAPE.param_count() / BLOG["params"] == pytest.approx(0.986, abs=1e-3)
    assert 0.98 < engine_weights / BLOG["weights_full"] < 0.995


def test_training_state_is_not_sharded_like_fsdp(plan):
    train = plan.phase("train").components
    # params: Megatron DP replicates them (15.2 GB) where FSDP keeps a 1/8 shard and all-gathers 15.4 GB
    # per layer group; the two peaks hold about the same (ours 15.2 vs the blog's 1.9 + 15.4).
    assert train["actor_params"] / BLOG["weights_shard"] == pytest.approx(8, rel=0.02)
    assert abs(train["actor_params"] - (BLOG["weights_shard"] + BLOG["all_gather"])) < 2.2 * GB
    # grads: fp32 main grads, full on every DP rank: 16x the blog's bf16 1/8 shard (x8 sharding, x2 fp32).
    assert train["actor_grads"] == 4 * SHAPE.param_count()
    assert train["actor_grads"] / BLOG["grads_shard"] == pytest.approx(16, rel=0.02)
    # optimizer: fp32 master params + fp32 Adam m, v = 12 B/param over DP=8, 3x the blog's 4 B/param shard.
    assert train["optimizer"] == 12 * SHAPE.param_count() // 8
    assert train["optimizer"] / BLOG["optimizer_shard"] == pytest.approx(3, rel=0.03)


def test_training_peak_is_above_the_blogs_by_the_unsharded_grads_and_states(plan):
    train = plan.phase("train")
    c = train.components
    # activations + logits of a 2 x 2048-token micro-batch land inside the blog's 20-40 GB of activations
    lo, hi = BLOG["activations"]
    assert lo < c["activations"] + c["logits"] < hi
    # with the same activations, the blog's peak would be shards + all-gather + activations; ours exceeds it
    # by exactly our grads, optimizer and params beyond theirs plus the engine reserve and NCCL buffers
    blog_at_our_activations = (
        BLOG["weights_shard"] + BLOG["grads_shard"] + BLOG["optimizer_shard"] + BLOG["all_gather"]
    ) + c["activations"] + c["logits"]  # fmt: skip
    extra = train.predicted_bytes - blog_at_our_activations
    assert extra == pytest.approx(
        (c["actor_grads"] - BLOG["grads_shard"])
        + (c["optimizer"] - BLOG["optimizer_shard"])
        + (c["actor_params"] - BLOG["weights_shard"] - BLOG["all_gather"])
        + c["engine_reserve"]
        + c["comm_buffers"]
    )
    assert 30 * GB < extra < 40 * GB  # mostly the fp32 grads: 30.5 GB vs 1.9
    assert train.predicted_bytes > BLOG["train_peak"][1]
    assert plan.fits  # still fits on 141 GB


def test_rollout_gives_the_kv_cache_what_the_offloaded_actor_leaves(plan):
    rollout = plan.phase("rollout").components
    # auto: the KV cache is everything the budget leaves after the engine's weights and reserve (the actor
    # is fully offloaded), above the blog's 80-100 GB chosen by SGLang's mem-fraction
    assert plan.kv_cache_source == "auto" and plan.kv_limiting_phase == "rollout"
    assert rollout["kv_cache"] > BLOG["kv_cache"][1]
    assert plan.phase("rollout").predicted_bytes <= plan.budget_bytes < BLOG["rollout_total"][1] + 25 * GB
    assert rollout["actor_params"] == rollout["actor_grads"] == rollout["optimizer"] == 0
    # the engine reserve: vLLM's CUDA graphs (1 GiB default) + its profiled activations for 8192 tokens and the
    # sampler (about 1.6 GB) is 2.6 GB, below the blog's 7-14 GB of CUDA graph + I/O buffers under SGLang:
    # the first constants for calibration against measured runs to revisit
    graph = plan.inputs.engine_persistent_bytes
    assert graph < BLOG["cuda_graph"][0]
    assert rollout["engine_reserve"] < BLOG["cuda_graph"][0] + BLOG["io_buffers"][0]
    # per token: 2 x 28 layers x 4 KV heads x 128 x 2 bytes = 56 KiB, so the KV cache holds ~2.2M tokens
    assert plan.kv_bytes_per_token == 57_344
    assert plan.kv_cache_tokens() == rollout["kv_cache"] // 57_344 // 16 * 16
