"""The planner on mixture-of-experts models: experts over EP (their optimizer states over the expert-DP group), the
MoE layers' kept activations (router, dispatched copies, expert fc1 / SwiGLU), the engines' MoE working sets, each
against a hand count on tiny:qwen3_moe (4 experts, top-2, layers 0, 1, 3 sparse, layer 2 dense)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from modelspec import ModelShape
from modelspec.tiny import tiny_hf_config
from planner import make_plan
from planner.devices import device_preset
from planner.inputs import PlanInputs
from planner.plan import _layer_bytes, _stage
from planner.sizes import (
    FP32_BYTES,
    actor_stage_param_count,
    engine_activation_bytes,
    layer_activation_bytes_per_token,
    layer_forward_bytes_per_token,
    sampler_bytes,
)
from tests.planner_inputs import make_inputs, merged

TINY_MOE = ModelShape.from_hf_config(tiny_hf_config("qwen3_moe"))
BF16 = 2


def tiny_moe_inputs(*layers: dict, **overrides) -> PlanInputs:
    """tiny:qwen3_moe, actor EP=2 x DP=2 (TP=1) with the distributed optimizer, bfloat16 (fp32 main params)."""
    base = dict(
        actor=dict(ep=2),
        rollout=dict(kv_cache_bytes=2**20),
        shape=TINY_MOE,
        device=device_preset("H100-80GB"),
        actor_dp=2,
        distributed_optimizer=True,
        sequences_per_step=8,
        prompt_tokens=16,
        response_tokens=16,
    )
    return make_inputs(**merged(base, *layers, overrides))


def _expert_elements(shape: ModelShape) -> int:
    """One expert's gate, up and down: 3 x h x m."""
    return 3 * shape.hidden_size * shape.moe_intermediate_size


def test_experts_split_over_ep_and_their_optimizer_over_expert_dp():
    s = TINY_MOE
    inp = tiny_moe_inputs()
    assert inp.expert_tp == 1 and inp.expert_dp == 1  # TP x DP = 2 = ETP x EP: each expert lives on one rank
    all_experts = len(s.moe_layers) * s.num_experts * _expert_elements(s)
    dense = actor_stage_param_count(s, 1, 1, 0) - all_experts  # attention, norms, routers, layer 2's MLP, vocab
    local_experts = len(s.moe_layers) * (s.num_experts // 2) * _expert_elements(s)
    st = _stage(inp, 0)
    assert st.actor_params == (dense + local_experts) * BF16
    assert st.actor_grads == (dense + local_experts) * FP32_BYTES  # DDP's fp32 main_grad buffers, unsharded
    # Adam's m, v and fp32 main params (12 B): the dense params over DP=2, the local experts over expert DP=1
    assert st.optimizer == dense * 12 // 2 + local_experts * 12
    # at EP=1 (DP=2) every rank holds every expert and the expert-DP group is DP: all of it over 2
    one = _stage(tiny_moe_inputs(actor=dict(ep=1)), 0)
    assert one.optimizer == (dense + all_experts) * 12 // 2


def test_expert_tp_splits_each_experts_rows():
    s = TINY_MOE
    inp = tiny_moe_inputs(actor=dict(tp=2, ep=1, etp=2), actor_dp=1)
    halves = len(s.moe_layers) * s.num_experts * _expert_elements(s) // 2
    assert _stage(inp, 0).actor_params < _stage(tiny_moe_inputs(actor=dict(ep=1), actor_dp=1), 0).actor_params
    assert actor_stage_param_count(s, 2, 1, 0, 1, 2) - actor_stage_param_count(s, 2, 1, 0, 1, 1) == -halves


def test_moe_layer_keeps_router_dispatched_tokens_and_expert_activations():
    s, e = TINY_MOE, BF16
    h, d, hq, hkv = s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads
    k, m, E = s.moe_top_k, s.moe_intermediate_size, s.num_experts
    attention_and_norms = (4 * h + 3 * (hq + hkv) * d) * e + FP32_BYTES * hq  # flash's log-sum-exp
    # Qwen3's q and k norms under TE: a contiguous copy of each head's input and its fp32 rstdevs
    # (transformer_engine/pytorch/ops/basic/rmsnorm.py, RMSNorm.op_forward)
    attention_and_norms += (hq + hkv) * (d * e + FP32_BYTES)
    router = 2 * E * FP32_BYTES  # fp32 logits and softmax scores [N, E]
    dispatched = k * h * e  # the experts' fc1 input: one permuted copy per routed token
    experts = k * (2 * m + m) * e  # fc1's output [N k, 2m] and SwiGLU x probs [N k, m]
    sparse = layer_activation_bytes_per_token(s, 1, e, "flash", sparse=True)
    assert sparse == attention_and_norms + router + dispatched + experts
    dense = layer_activation_bytes_per_token(s, 1, e, "flash")
    assert dense == attention_and_norms + 3 * s.intermediate_size * e
    # recomputing the MoE (megatron's recompute_modules "moe") drops all of it
    assert layer_activation_bytes_per_token(s, 1, e, "flash", ("moe",), sparse=True) == attention_and_norms
    # the plan's layer: the larger of the dense layer 2 and a sparse one, per token of the micro-batch
    inp = tiny_moe_inputs(attention="flash")
    mb = inp.micro_batches(train=True)
    assert _layer_bytes(inp, mb) == round(mb.model_tokens * max(sparse, dense) * inp.activation_factor)


def test_sequence_parallelism_splits_the_norms_router_and_residual_stream_over_tp():
    """megatron's sequence parallelism (on for an MoE model at TP 2): the norms' inputs and outputs (4h), the router's
    fp32 logits and scores and the residual stream hold S / tp of the tokens per rank; the experts' tokens are
    gathered over expert TP, so at etp = tp they are the TP group's N k as without it."""
    s, e = TINY_MOE, BF16
    h, d, hq, hkv = s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads
    k, m, E = s.moe_top_k, s.moe_intermediate_size // 2, s.num_experts
    attention = 3 * (hq + hkv) * d // 2 * e + FP32_BYTES * hq // 2
    attention += (hq + hkv) // 2 * (d * e + FP32_BYTES)  # the q and k norms' inputs and rstdevs (2 + 1 heads a rank)
    experts = k * (h + 3 * m) * e
    assert layer_activation_bytes_per_token(s, 2, e, "flash", sparse=True, sequence_parallel=True) == (
        attention + 4 * h // 2 * e + 2 * E * FP32_BYTES // 2 + experts
    )
    assert layer_activation_bytes_per_token(s, 2, e, "flash", sparse=True) == (
        attention + 4 * h * e + 2 * E * FP32_BYTES + experts
    )
    # expert TP 1 under TP 2: each rank's experts run on the N k / 2 routed copies of its own S / 2 tokens
    one = layer_activation_bytes_per_token(s, 2, e, "flash", sparse=True, etp=1, sequence_parallel=True)
    assert one == attention + 4 * h // 2 * e + 2 * E * FP32_BYTES // 2 + k * (h + 3 * 2 * m) * e // 2
    # the plan: an MoE model at TP 2 runs with it unless actor.sequence_parallel is false; a dense one only when true
    on = tiny_moe_inputs(actor=dict(tp=2, ep=2), actor_dp=2, attention="flash")
    off = on.with_actor(sequence_parallel=False)
    assert on.sequence_parallel_on and not off.sequence_parallel_on
    mb = on.micro_batches(train=True)
    assert _layer_bytes(on, mb) < _layer_bytes(off, mb)
    assert _stage(on, 0).train_activations < _stage(off, 0).train_activations
    # the forward's residual stream [N, h] -> [N / 2, h]
    assert _stage(off, 0).forward_activations - _stage(on, 0).forward_activations == (
        on.micro_batches(train=False).model_tokens * h * e // 2
    )
    dense = dataclasses.replace(on.with_actor(ep=1), shape=ModelShape.from_pretrained("tiny:qwen3"))
    assert not dense.sequence_parallel_on and dense.with_actor(sequence_parallel=True).sequence_parallel_on


def test_moe_forward_without_grad_counts_the_dispatched_copies():
    s, e = TINY_MOE, BF16
    h, k, m, E = s.hidden_size, s.moe_top_k, s.moe_intermediate_size, s.num_experts
    moe = 2 * E * FP32_BYTES + (h + k * (2 * h + 3 * m)) * e
    assert layer_forward_bytes_per_token(s, 1, e, sparse=True) == max(moe, (h + 3 * 4 * 32 + 4 * 32) * e)
    assert layer_forward_bytes_per_token(s, 1, e, sparse=True) == moe  # tiny: the MoE block is the wider


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_moe_workspace(tp):
    s, e = TINY_MOE, BF16
    h, d, k, m, E = s.hidden_size, s.head_dim, s.moe_top_k, s.moe_intermediate_size // tp, s.num_experts
    common = (3 * h + (2 * s.num_heads // tp + 2 * max(1, s.num_kv_heads // tp)) * d) * e
    dense = common + 3 * s.intermediate_size // tp * e
    # vLLM's fused_experts: gate logits, top-k weights / ids, cache13 (k max(2m, h)), cache2 (k m), the output
    fused = common + E * e + k * 2 * FP32_BYTES + (k * max(2 * m, h) + k * m + h) * e
    # the native engine: fp32 probs + logits, int64 ids / argsort / token index, sorted weights, one expert's SwiGLU
    native = common + E * (FP32_BYTES + e) + k * (3 * 8 + e) + (4 * h + 4 * m) * e
    tokens, seqs = 100, 3
    sampler = sampler_bytes(s, seqs, 3)
    assert engine_activation_bytes(s, tp, e, tokens, seqs, 3) == tokens * max(dense, fused) + sampler
    assert engine_activation_bytes(s, tp, e, tokens, seqs, 3, "native") == tokens * max(dense, native) + sampler
    with pytest.raises(ValueError, match="moe_workspace"):
        engine_activation_bytes(s, tp, e, tokens, seqs, 3, "triton")
    # vLLM with R = 2 replicas spanned by its MoE layers: the experts' rows over both ranks (expert TP 2 tp), and
    # the default all-gather dispatch runs them on both replicas' tokens beside the gathered hidden states
    m2 = s.moe_intermediate_size // (2 * tp)
    gathered = common + 2 * (E * e + k * 2 * FP32_BYTES + (k * max(2 * m2, h) + k * m2 + h) * e) + 2 * h * e
    spanned = engine_activation_bytes(s, tp, e, tokens, seqs, 3, expert_tp=2 * tp, gathered_replicas=2)
    assert spanned == tokens * max(dense, gathered) + sampler
    with pytest.raises(ValueError, match="gathered_replicas must be 1"):
        engine_activation_bytes(s, tp, e, tokens, seqs, 3, "native", gathered_replicas=2)


def test_the_vllm_engines_moe_layers_gather_their_replicas_tokens():
    """The plan's vLLM reserve with two replicas (actor DP 2 -> rollout TP 1): R = 2 in the MoE working set, expert
    rows over the world (or whole experts under rollout.ep); the native engine's replicas gather nothing."""
    two = tiny_moe_inputs(actor=dict(ep=1), rollout=dict(engine="vllm", tp=1))
    assert two.engine_moe_gathered_replicas == 2 and two.engine_expert_split == (1, 2)
    assert two.with_rollout(ep=2).engine_expert_split == (2, 1)
    assert tiny_moe_inputs(actor=dict(ep=1), rollout=dict(engine="vllm", tp=2)).engine_moe_gathered_replicas == 1
    assert tiny_moe_inputs(actor=dict(ep=1), rollout=dict(engine="native", tp=1)).engine_moe_gathered_replicas == 1


def test_the_vllm_engines_moe_gather_is_timed_on_the_link():
    """The step-time model's rollout sends what vLLM's allgather_reducescatter all-to-all sends: per MoE layer, each
    replica's tokens' hidden states and router logits gathered and the output reduce-scattered, (R - 1) x M rows
    of (2h + E) elements per rank, 3 collectives of R - 1 ring steps per engine step; one replica or the native
    engine gathers nothing."""
    from planner.step_time import phase_work

    def rollout(**rollout_fields):
        inp = tiny_moe_inputs(actor=dict(ep=1), rollout=rollout_fields, ranks_per_node=2)
        return inp, phase_work(make_plan(inp))["rollout"]

    native_inp, native = rollout(engine="native", tp=1)
    vllm_inp, vllm = rollout(engine="vllm", tp=1)
    assert vllm_inp.engine_moe_gathered_replicas == 2 and native_inp.engine_moe_gathered_replicas == 1
    s, e = TINY_MOE, vllm_inp.element_bytes
    tokens = vllm_inp.sequences_per_step // 2 * (vllm_inp.prompt_tokens + vllm_inp.response_tokens)
    gathered = tokens * len(s.moe_layers) * (2 * s.hidden_size + s.num_experts) * e
    assert vllm.link_bytes["intra_node"] - native.link_bytes["intra_node"] == gathered  # TP 1: no all-reduce
    engine_steps = vllm_inp.response_tokens + 1  # decode steps + one prefill
    assert vllm.collective_steps - native.collective_steps == engine_steps * len(s.moe_layers) * 3
    one_replica_inp, one_replica = rollout(engine="vllm", tp=2)
    assert one_replica_inp.engine_moe_gathered_replicas == 1
    assert one_replica.collective_steps == rollout(engine="native", tp=2)[1].collective_steps


def test_the_plan_holds_the_moe_terms():
    """The plan's train activations, optimizer and engine reserve move with the MoE fields they are counted from."""
    base = make_plan(tiny_moe_inputs(rollout=dict(engine="vllm", tp=1)))
    wider = dataclasses.replace(TINY_MOE, moe_top_k=4)
    more = make_plan(tiny_moe_inputs(rollout=dict(engine="vllm", tp=1), shape=wider))
    train = base.phase("train").components, more.phase("train").components
    assert train[1]["activations"] > train[0]["activations"]
    rollout = base.phase("rollout").components, more.phase("rollout").components
    assert rollout[1]["engine_reserve"] > rollout[0]["engine_reserve"]


def test_bad_expert_layouts_are_refused_in_one_line():
    with pytest.raises(ValueError, match="actor.ep=3 must divide"):
        tiny_moe_inputs(actor=dict(ep=3), actor_dp=3, sequences_per_step=9)
    with pytest.raises(ValueError, match="need an MoE model"):
        tiny_moe_inputs(actor=dict(ep=2), shape=ModelShape.from_hf_config(tiny_hf_config("qwen2")))
    with pytest.raises(ValueError, match="must divide actor.tp x actor_dp"):
        tiny_moe_inputs(actor=dict(ep=4))


def test_checkpoint_staging_shards_expert_optimizer_states_over_expert_dp():
    from planner.host import checkpoint_staging_bytes
    from planner.sizes import actor_stage_tensor_elements, power_of_two_bytes

    s, e = TINY_MOE, BF16
    h, m = s.hidden_size, s.moe_intermediate_size
    plan = make_plan(tiny_moe_inputs())  # EP=2 x DP=2: expert DP 1, every state of the local experts whole
    everything = actor_stage_tensor_elements(s, 1, 1, 0, 2)
    others = actor_stage_tensor_elements(s, 1, 1, 0, 2, experts=False)
    experts = actor_stage_tensor_elements(s, 1, 1, 0, 2, experts=True)
    assert sorted(everything) == sorted(others + experts)
    # megatron's SequentialMLP: per local expert fc1 [2m, h] and fc2 [h, m], 2 of the 4 experts in 3 sparse layers
    assert sorted(experts) == sorted([2 * m * h, h * m] * 2 * len(s.moe_layers))

    def staged(n: int, shard: int) -> int:  # the param in the dtype, fp32 main + 2 moments of its shard
        return power_of_two_bytes(n * e) + 3 * power_of_two_bytes(-(-n * FP32_BYTES // shard))

    hand = sum(staged(n, 2) for n in others) + sum(staged(n, 1) for n in experts)
    assert checkpoint_staging_bytes(plan) == hand


def test_engine_weights_per_rank_follow_the_engines_expert_split():
    """The native engine at rollout.ep: E / ep experts per rank; vLLM with several replicas: every expert split
    over all its ranks (it flattens TP across DP); each equal to the layout's own count."""
    from planner.sizes import engine_param_count
    from rollout.layout import ExpertSplit, vllm_param_layouts

    def engine_weights(**rollout) -> int:
        return make_plan(tiny_moe_inputs(rollout=dict(tp=1, **rollout))).phase("rollout").components["engine_weights"]

    def layout_bytes(split: ExpertSplit) -> int:
        return BF16 * sum(math.prod(p.local_shape) for p in vllm_param_layouts(TINY_MOE, 1, 0, split))

    moe_layers, whole = len(TINY_MOE.moe_layers), engine_param_count(TINY_MOE, 1) * BF16
    assert engine_weights(engine="native") == whole
    assert engine_weights(engine="native", ep=2) == layout_bytes(ExpertSplit(ep=2, ep_rank=1))
    assert whole - engine_weights(engine="native", ep=2) == moe_layers * 2 * _expert_elements(TINY_MOE) * BF16
    assert engine_weights(engine="vllm") == layout_bytes(ExpertSplit(etp=2, etp_rank=1))  # 2 replicas
    # vLLM's expert parallel over both ranks: E / 2 whole experts per rank, as the native engine's rollout.ep=2
    assert engine_weights(engine="vllm", ep=2) == layout_bytes(ExpertSplit(ep=2, ep_rank=1))
    assert engine_weights(engine="vllm", ep=2) == engine_weights(engine="native", ep=2)
    with pytest.raises(ValueError, match="rollout.ep=4: vllm's expert parallel spans every engine rank; set 1 or 2"):
        tiny_moe_inputs(rollout=dict(engine="vllm", ep=4))
    with pytest.raises(ValueError, match="rollout.ep=3 must divide the 4 experts"):
        tiny_moe_inputs(rollout=dict(engine="native", ep=3))


def test_the_engines_routing_is_planned_on_the_device_and_the_host():
    """The routing the engine returns (MoE layers x top-k per token): on the device each router's [N, k] int64 of the
    micro-batch in flight (old/ref_logprob when returned; train too when replayed), on the host the step's
    completions, the rank's batch and a pass's micro-batches in int16."""
    from planner.host import host_plan

    layers, k = len(TINY_MOE.moe_layers), TINY_MOE.moe_top_k
    off, returned, replayed = (
        make_plan(tiny_moe_inputs(routed_experts=r, routing_replay=p)) for r, p in ((0, 0), (1, 0), (1, 1))
    )
    inp = returned.inputs
    forward = layers * inp.micro_batches(train=False).model_tokens * k * 8
    train = layers * inp.micro_batches(train=True).model_tokens * k * 8

    def activations(plan, phase):
        return plan.phase(phase).components["activations"]

    assert activations(returned, "old_logprob") - activations(off, "old_logprob") == forward
    assert activations(returned, "train") == activations(off, "train")
    assert activations(replayed, "train") - activations(off, "train") == train
    rows = inp.sequences_per_step // inp.actor_dp
    host = layers * k * 2 * inp.seq_len * (inp.sequences_per_step + 2 * rows)
    assert {p.components["routing"] for p in host_plan(returned).phases} == {host}
    assert {p.components["routing"] for p in host_plan(off).phases} == {0}
    with pytest.raises(ValueError, match="routing_replay=True needs routed_experts=True"):
        tiny_moe_inputs(routing_replay=True)


def test_the_batch_keeps_the_routing_on_the_host():
    """make_batch moves the batch to the actor's device but the routing [B, S, layers, k] int16 stays in host memory
    (a micro-batch's routers take their layer's [N, k] to the device)."""
    import torch

    from rl.batching import Sample, make_batch

    samples = [
        Sample(i, [5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], "stop", float(i), torch.zeros(3, 4, 2, dtype=torch.int16))
        for i in range(4)
    ]
    batch, _ = make_batch(samples, group_size=2, dp=1, dp_rank=0, pad_id=0, device=torch.device("meta"))
    assert batch.input_ids.device.type == "meta"
    assert batch.routed_experts.device.type == "cpu" and batch.routed_experts.shape == (4, 5, 3, 2)


def test_uneven_routing_grows_the_experts_activations_by_the_recorded_ratio():
    """The plan at a step's recorded values takes the routed copies the step's train pass measured
    (train/moe/routed_copies_max_ratio, megatron_backend/model.py::RoutedCopies): the experts' share of an MoE layer
    scales with it, the router's does not, and the launch plan assumes balanced routing (1)."""
    from planner.sizes import moe_activation_bytes_per_token, moe_forward_bytes_per_token
    from telemetry.metrics import ROUTED_COPIES_RATIO, recorded_lengths, step_lengths

    k = TINY_MOE.moe_top_k
    for local in (False, True):
        balanced = moe_activation_bytes_per_token(TINY_MOE, 1, BF16, local=local)
        uneven = moe_activation_bytes_per_token(TINY_MOE, 1, BF16, local=local, routed_copies_ratio=1.25)
        router = moe_activation_bytes_per_token(TINY_MOE, 1, BF16, local=local, routed_copies_ratio=0.0)
        assert uneven - router == pytest.approx(1.25 * (balanced - router), abs=1), local
        assert moe_forward_bytes_per_token(TINY_MOE, 1, BF16, local, routed_copies_ratio=1.25) == (
            moe_forward_bytes_per_token(TINY_MOE, 1, BF16, local, received_per_token=1.25 * k)
        )
    plan = make_plan(tiny_moe_inputs(rollout=dict(engine="vllm", tp=1)))
    assert plan.inputs.routed_copies_ratio == 1.0
    at = {r: plan.at_lengths(plan.inputs.planned_lengths(routed_copies_ratio=r)) for r in (1.0, 1.25)}
    assert at[1.25].phase("train").components["activations"] > at[1.0].phase("train").components["activations"]
    assert at[1.0].phase("train").components == plan.phase("train").components
    # metrics.jsonl -> the step's StepLengths: the train pass's ratio beside the samples' lengths (1 without it)
    from rl.batching import Sample

    record = {"trainer/step": 0, **step_lengths([Sample(0, [1, 2], [3], [0.0], "stop", 0.0)])}
    assert recorded_lengths([record])[0].routed_copies_ratio == 1.0
    assert recorded_lengths([{**record, ROUTED_COPIES_RATIO: 1.25}])[0].routed_copies_ratio == 1.25
    with pytest.raises(ValueError, match="routed_copies_ratio=0 must be > 0"):
        tiny_moe_inputs(routed_copies_ratio=0)


def test_the_routing_bounds_are_megatrons():
    """The worst case: every token of the EP group sends min(k, E / ep) copies to one rank's E / ep experts; megatron's
    capacity factor keeps at most cf x balanced routing's copies per rank (never beyond the worst case)."""
    from planner.sizes import capacity_routed_copies_ratio, worst_routed_copies_ratio

    qwen3_30b = dataclasses.replace(TINY_MOE, num_experts=128, moe_top_k=8)
    assert worst_routed_copies_ratio(TINY_MOE, 1) == 1.0  # EP 1: every copy stays on its rank
    assert worst_routed_copies_ratio(TINY_MOE, 2) == 2 * min(TINY_MOE.moe_top_k, TINY_MOE.num_experts // 2) / 2
    assert worst_routed_copies_ratio(qwen3_30b, 8) == 8.0  # 8 x min(8, 16) / 8
    assert worst_routed_copies_ratio(qwen3_30b, 32) == 32 * 4 / 8  # 4 experts a rank: at most 4 of a token's 8
    assert capacity_routed_copies_ratio(qwen3_30b, 8, 1.25) == 1.25
    assert capacity_routed_copies_ratio(TINY_MOE, 2, 5.0) == worst_routed_copies_ratio(TINY_MOE, 2)


def test_the_capacity_factor_is_the_launch_plans_routing_and_make_plan_says_how_far_routing_may_skew(tmp_path):
    """actor.moe_expert_capacity_factor sets the launch plan's routed copies; make plan's routing line and JSON give the
    most skewed routing at which the plan still fits (the KV cache fixed): it fits there and not just above."""
    import json

    from planner.report import routing_headroom
    from run.compose import compose
    from run.memory_plan import plan_inputs
    from tools.plan import main

    gap = ["trainer.max_logprob_gap=3.0", "trainer.max_logprob_gap_p99=0.1"]  # dropped copies move the log-probs
    cfg = compose("qwen3_30b_a3b_8xh100", ["actor.moe_expert_capacity_factor=1.5", *gap])
    capped = plan_inputs(cfg)
    assert capped.actor.moe_expert_capacity_factor == 1.5 and capped.routed_copies_ratio == 1.5
    balanced = plan_inputs(compose("qwen3_30b_a3b_8xh100"))
    assert balanced.routed_copies_ratio == 1.0 and balanced.actor.moe_expert_capacity_factor is None
    plan = make_plan(balanced)
    headroom = routing_headroom(plan)
    assert headroom.planned_ratio == 1.0 and headroom.source == "balanced" and headroom.worst_ratio == 8.0
    assert 1.0 < headroom.fits_up_to_ratio < headroom.worst_ratio  # the 30B preset: some skew fits, not all
    at = {
        r: make_plan(balanced.at_lengths(balanced.planned_lengths(routed_copies_ratio=r), plan.kv_cache_bytes))
        for r in (headroom.fits_up_to_ratio, headroom.fits_up_to_ratio + 0.01)
    }
    assert at[headroom.fits_up_to_ratio].fits and not at[headroom.fits_up_to_ratio + 0.01].fits
    capped_plan = make_plan(capped)
    assert capped_plan.phase("train").components["activations"] > plan.phase("train").components["activations"]
    assert routing_headroom(capped_plan).source == "capacity_factor"
    # a dense model, or EP 1, routes nothing across ranks
    assert routing_headroom(make_plan(tiny_moe_inputs(actor=dict(ep=1), actor_dp=4))) is None
    out = tmp_path / "plan.json"
    assert main(["--exp", "qwen3_30b_a3b_8xh100", "--json", str(out)]) == 0
    written = json.loads(out.read_text())["moe_routing"]
    assert written == {
        "planned_ratio": 1.0,
        "source": "balanced",
        "worst_ratio": 8.0,
        "fits_up_to_ratio": headroom.fits_up_to_ratio,
    }
    assert main(["--exp", "tiny_cpu", "--json", str(out)]) == 0 and json.loads(out.read_text())["moe_routing"] is None
    with pytest.raises(ValueError, match="moe_expert_capacity_factor=0 must be > 0"):
        tiny_moe_inputs(actor=dict(moe_expert_capacity_factor=0))


def test_a_run_says_when_its_routing_skews_beyond_what_the_plan_fits():
    """telemetry.metrics.RoutingWatch (the loop, rank 0): a step whose recorded routed copies exceed the launch plan's
    routing headroom prints one warning per new high; nothing for routing the plan fits, a dense model or EP 1."""
    from planner.report import routing_headroom
    from run.compose import compose
    from run.memory_plan import plan_inputs
    from telemetry.metrics import ROUTED_COPIES_RATIO, RoutingWatch

    plan = make_plan(plan_inputs(compose("qwen3_30b_a3b_8xh100")))
    limit = routing_headroom(plan).fits_up_to_ratio
    watch = RoutingWatch(plan)
    seen = [watch.check(step, {ROUTED_COPIES_RATIO: r}) for step, r in enumerate((1.2, limit + 0.2, limit + 0.1, 7.9))]
    assert seen[0] is None and seen[2] is None  # fits; not a new high
    assert seen[1].startswith(f"warning: step 1: one rank's experts received {limit + 0.2:.2f}x") and "7.90x" in seen[3]
    assert f"beyond the {limit:.2f}x the plan fits" in seen[1] and "actor.moe_expert_capacity_factor" in seen[1]
    assert watch.check(4, {"reward/mean": 1.0}) is None  # a step without the metric
    fits_any = RoutingWatch(make_plan(tiny_moe_inputs()))  # tiny on an 80 GB device: any routing fits
    assert fits_any.limit is None and fits_any.check(0, {ROUTED_COPIES_RATIO: 2.0}) is None
    assert RoutingWatch(None).check(0, {ROUTED_COPIES_RATIO: 9.0}) is None  # not rank 0, or no plan


def test_the_summary_puts_the_steps_routing_beside_the_plans_headroom():
    """summary.json's memory_plan.moe_routing and make run's closing line: the most routed copies any step sent one
    rank, next to how far the plan fits; nothing for a dense plan."""
    from planner.report import routing_headroom
    from run.compose import compose
    from run.memory_plan import plan_inputs
    from telemetry.metrics import ROUTED_COPIES_RATIO, closing_lines, routing_summary

    plan = make_plan(plan_inputs(compose("qwen3_30b_a3b_8xh100")))
    records = [{"trainer/step": 0, ROUTED_COPIES_RATIO: 1.3}, {"trainer/step": 1, ROUTED_COPIES_RATIO: 1.7}, {}]
    routing = routing_summary(plan, records)
    assert routing == {**routing_headroom(plan).to_json(), "recorded_max_ratio": 1.7}
    assert routing_summary(plan, [{}])["recorded_max_ratio"] is None
    assert routing_summary(make_plan(tiny_moe_inputs(actor=dict(ep=1), actor_dp=4)), records) is None
    summary = {"steps": 2, "wall_seconds": 1.0, "memory_plan": {"moe_routing": routing}}
    line = next(x for x in closing_lines(summary, "run") if x.startswith("MoE routing"))
    assert line.startswith("MoE routing: at most 1.70x balanced routing's copies on one rank; the plan fits up to")
    assert f"{routing['fits_up_to_ratio']:.2f}x" in line
    assert not any(x.startswith("MoE routing") for x in closing_lines({"steps": 2, "wall_seconds": 1.0}, "run"))
    unfit = {**summary, "memory_plan": {"moe_routing": {**routing, "fits_up_to_ratio": None}}}
    line = next(x for x in closing_lines(unfit, "run") if x.startswith("MoE routing"))
    assert "the plan fits no routing" in line and "0.00x" not in line
