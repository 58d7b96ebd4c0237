"""The memory planner's arithmetic against hand-computed values, the real layouts and the loop's phases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from colocation.engines import ENGINE_PROFILES, ENGINES
from modelspec.shape import ModelShape, list_architectures
from planner import COMPONENTS, PHASES, PlanInputs, check_fits, device_preset, make_plan, variants
from planner.devices import GIB
from planner.plan import phase_growth_bytes
from planner.report import format_table, verdict
from planner.sizes import actor_stage_param_count, engine_param_count, kv_bytes_per_token
from tests.planner_inputs import make_inputs, merged

QWEN7B = ModelShape.from_architecture("Qwen2.5-7B-Instruct")
KV_BLOCK_BYTES = 16 * 28_672  # one 16-token block of Qwen2.5-7B's KV cache at engine TP=2
KV_BYTES = 20_000 * KV_BLOCK_BYTES  # about 8.5 GiB


def qwen7b_inputs(*layers: dict, **overrides) -> PlanInputs:
    """Qwen2.5-7B, actor TP=4 x DP=2 with the distributed optimizer, engine TP=2, a fixed KV cache."""
    base = dict(
        actor=dict(tp=4),
        rollout=dict(tp=2, kv_cache_bytes=KV_BYTES),
        shape=QWEN7B,
        device=device_preset("H200-141GB"),
        actor_dp=2,
        distributed_optimizer=True,
        sequences_per_step=64,
        prompt_tokens=256,
        response_tokens=768,
    )
    return make_inputs(**merged(base, *layers, overrides))


def components_differ(a, b) -> dict[str, dict[str, int]]:
    """phase -> {component: b - a} where two plans differ."""
    out = {}
    for pa, pb in zip(a.phases, b.phases):
        diff = {k: pb.components[k] - v for k, v in pa.components.items() if pb.components[k] != v}
        if diff:
            out[pa.name] = diff
    return out


# ---------------------------------------------------------------- shipped architectures (item 7)
def test_shipped_architectures_have_the_published_parameter_counts():
    expected = {
        "Qwen2.5-0.5B-Instruct": 494_032_768,
        "Qwen2.5-1.5B-Instruct": 1_543_714_304,
        "Qwen2.5-7B-Instruct": 7_615_616_512,
        "Qwen2.5-32B-Instruct": 32_763_876_352,
        "Llama-3.1-8B-Instruct": 8_030_261_248,
        "Qwen3-8B": 8_190_735_360,
        "Qwen3-32B": 32_762_123_264,
    }
    assert set(expected) <= set(list_architectures())
    for name, count in expected.items():
        shape = ModelShape.from_pretrained(f"arch:{name}")
        assert shape == ModelShape.from_architecture(name)
        assert shape.param_count() == count, name
    llama = ModelShape.from_architecture("Llama-3.1-8B-Instruct")
    assert (llama.rope.rope_type, llama.rope.factor, llama.eos_token_id) == ("llama3", 8.0, 128001)
    with pytest.raises(ValueError, match="is not shipped; choose one of"):
        ModelShape.from_architecture("Qwen9-1T")


# ---------------------------------------------------------------- arithmetic by hand
def test_qwen7b_actor_bytes_at_tp4_by_hand():
    # per layer at TP=4: qkv (28+2*4)*128/4 = 1152 rows x 3584 + 1152 bias, proj 7*128 x 3584,
    # gate/up/down 3 x 4736 x 3584, two norms 2 x 3584 -> 58,269,824; x 28 layers = 1,631,555,072;
    # vocab 152064 (already a multiple of 128*4) / 4 = 38016 rows x 3584, embedding + output layer; final norm.
    params = 28 * (1152 * 3584 + 1152 + 896 * 3584 + 3 * 4736 * 3584 + 2 * 3584) + 2 * 38016 * 3584 + 3584
    assert params == 1_904_057_344
    assert actor_stage_param_count(QWEN7B, tp=4, pp=1, stage=0) == params
    train = make_plan(qwen7b_inputs()).phase("train").components
    assert train["actor_params"] == 2 * params == 3_808_114_688  # bf16
    assert train["actor_grads"] == 4 * params  # fp32 main grads
    assert train["optimizer"] == 12 * params // 2  # fp32 master + Adam m, v, sharded over DP=2
    unsharded = make_plan(qwen7b_inputs(distributed_optimizer=False)).phase("train").components
    assert unsharded["optimizer"] == 12 * params
    fp32 = make_plan(qwen7b_inputs(dtype="float32", distributed_optimizer=False)).phase("train").components
    assert fp32["optimizer"] == 8 * params  # fp32 params: no master copy


def test_pipeline_stages_split_the_vocab_tables():
    # PP=2: stage 0 holds the embedding, stage 1 the output layer and the final norm; 14 layers each.
    layer = 1152 * 3584 + 1152 + 896 * 3584 + 3 * 4736 * 3584 + 2 * 3584
    assert actor_stage_param_count(QWEN7B, 4, 2, 0) == 14 * layer + 38016 * 3584
    assert actor_stage_param_count(QWEN7B, 4, 2, 1) == 14 * layer + 38016 * 3584 + 3584
    tied = ModelShape.from_architecture("Qwen2.5-0.5B-Instruct")  # tied: PP=1 holds the table once
    one = actor_stage_param_count(tied, 1, 1, 0)
    two = actor_stage_param_count(tied, 1, 2, 0) + actor_stage_param_count(tied, 1, 2, 1)
    assert two - one == 151_936 * 896  # the last stage's copy of the tied table


def test_kv_bytes_per_token_with_kv_head_replication():
    # 2 (k, v) x 28 layers x KV heads per rank x 128 x 2 bytes
    assert kv_bytes_per_token(QWEN7B, 1, 2) == 2 * 28 * 4 * 128 * 2 == 57_344
    assert kv_bytes_per_token(QWEN7B, 2, 2) == 2 * 28 * 2 * 128 * 2
    assert kv_bytes_per_token(QWEN7B, 4, 2) == 2 * 28 * 1 * 128 * 2
    assert kv_bytes_per_token(QWEN7B, 28, 2) == 2 * 28 * 1 * 128 * 2  # TP 28 > 4 KV heads: each rank keeps one
    plan = make_plan(qwen7b_inputs(rollout=dict(kv_cache_bytes=28_672 * 1000 + 5)))  # engine TP=2: 28,672 B/token
    assert plan.kv_cache_tokens() == 992  # whole blocks of 16 tokens
    assert plan.kv_cache_bytes == 992 * 28_672


def test_engine_weights_match_the_vllm_layout():
    """The planner's restated vLLM layout against rollout/layout.py, parameter by parameter."""
    import math

    from rollout.layout import vllm_param_layouts

    for name in ("Qwen2.5-0.5B-Instruct", "Qwen2.5-7B-Instruct", "Qwen2.5-32B-Instruct", "Qwen3-8B"):
        shape = ModelShape.from_architecture(name)
        for tp in (1, 2, shape.num_heads // 2):
            if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
                continue
            real = sum(math.prod(p.local_shape) for p in vllm_param_layouts(shape, tp, 0))
            assert engine_param_count(shape, tp) == real, (name, tp)


def test_actor_params_match_the_megatron_layout():
    """The planner's restated megatron layout against megatron_backend/layout.py, every stage."""
    import math

    from megatron_backend.layout import ModelShape as MegatronShape
    from megatron_backend.layout import RankLayout, local_param_shapes

    for name in ("Qwen2.5-0.5B-Instruct", "Qwen2.5-7B-Instruct", "Qwen3-8B"):
        shape = ModelShape.from_architecture(name)
        mg = MegatronShape(
            shape.model_type, shape.num_layers, shape.hidden_size, shape.intermediate_size, shape.num_heads,
            shape.num_kv_heads, shape.head_dim, shape.vocab_size, shape.tie_word_embeddings, shape.qkv_bias,
            shape.qk_norm,
        )  # fmt: skip
        for tp, pp, vpp in ((1, 1, None), (2, 2, None), (2, 2, 2)):
            for stage in range(pp):
                local = local_param_shapes(mg, RankLayout(tp, pp, vpp, 0, stage))
                real = sum(math.prod(s) for s in local.values())
                assert actor_stage_param_count(shape, tp, pp, stage) == real, (name, tp, pp, vpp, stage)


# ---------------------------------------------------------------- phases, offload flags and wake strategy
def test_every_phase_is_itemized_in_every_component():
    plan = make_plan(qwen7b_inputs())
    assert tuple(p.name for p in plan.phases) == PHASES
    for p in plan.phases:
        assert tuple(p.components) == COMPONENTS
        assert p.predicted_bytes == sum(p.components.values())
    assert plan.phase("weight_sync").components["sync_bucket"] == 512 * 2**20
    assert sum(p.components["sync_bucket"] for p in plan.phases) == 512 * 2**20  # weight_sync only
    assert plan.phase("ref_logprob").components["activations"] == 0  # no reference model
    params = plan.phase("train").components["actor_params"]
    resident_ref = make_plan(qwen7b_inputs(offload=dict(ref_params=False), reference_model=True))
    assert all(p.components["ref_params"] == params for p in resident_ref.phases)
    with_ref = make_plan(qwen7b_inputs(reference_model=True))  # offloaded between its uses (the default)
    assert {p.name for p in with_ref.phases if p.components["ref_params"]} == {
        "onload_ref",
        "ref_logprob",
        "offload_ref",
    }
    assert all(with_ref.phase(n).components["ref_params"] == params for n in ("onload_ref", "ref_logprob"))
    assert (
        with_ref.phase("ref_logprob").components["activations"] == plan.phase("old_logprob").components["activations"]
    )


@pytest.mark.parametrize(
    "flag,component,phases",
    [
        ("params", "actor_params", ("rollout", "engine_sleep", "wake_kv_cache", "log")),
        (
            "grads",
            "actor_grads",
            (
                "rollout",
                "engine_sleep",
                "onload_params",
                "wake_weights",
                "weight_sync",
                "offload_params",
                "wake_kv_cache",
                "log",  # the step ends as it started: the state is away again
            ),
        ),
        (
            "optimizer",
            "optimizer",
            (
                "rollout",
                "engine_sleep",
                "onload_params",
                "onload_grads",
                "offload_grads",
                "wake_weights",
                "weight_sync",
                "offload_params",
                "wake_kv_cache",
                "log",  # the step ends as it started: the state is away again
            ),
        ),
    ],
)
def test_each_offload_flag_removes_exactly_its_component_where_the_state_is_away(flag, component, phases):
    offloaded = make_plan(qwen7b_inputs())
    kept = make_plan(qwen7b_inputs(offload={flag: False}))
    size = kept.phase("train").components[component]
    assert size > 0
    assert components_differ(offloaded, kept) == {name: {component: size} for name in phases}


@pytest.mark.parametrize("wake_strategy", ["staged", "all_at_once"])
def test_wake_phases_take_back_what_the_engines_wake_tags_say(wake_strategy):
    from configs.rollout import WAKE_TAGS

    plan = make_plan(qwen7b_inputs(rollout=dict(wake_strategy=wake_strategy)))
    component = {"weights": "engine_weights", "kv_cache": "kv_cache"}
    for phase, tags in WAKE_TAGS[wake_strategy].items():
        grown = set(phase_growth_bytes(plan, phase)) & set(component.values())
        assert grown == {component[t] for t in tags}, phase


def test_staged_wake_saves_the_actor_params_in_the_wake_window():
    staged = make_plan(qwen7b_inputs())
    at_once = make_plan(qwen7b_inputs(rollout=dict(wake_strategy="all_at_once")))
    params = staged.phase("train").components["actor_params"]
    # the phase where the KV cache comes back holds the actor's params only when it wakes with the weights
    kv_wake_staged, kv_wake_at_once = staged.phase("wake_kv_cache"), at_once.phase("wake_weights")
    assert kv_wake_staged.components["kv_cache"] == kv_wake_at_once.components["kv_cache"] == KV_BYTES
    assert kv_wake_at_once.predicted_bytes - kv_wake_staged.predicted_bytes == params
    assert {k for k, v in kv_wake_at_once.components.items() if v != kv_wake_staged.components[k]} == {"actor_params"}
    # the whole window: all-at-once's weight_sync holds params + weights + KV + bucket; staged's worst is weights + KV
    bucket = staged.phase("weight_sync").components["sync_bucket"]
    assert at_once.wake_window_peak.predicted_bytes - staged.wake_window_peak.predicted_bytes == params + bucket
    # with params kept on the device there is nothing for staging to save
    kept = [
        make_plan(qwen7b_inputs(rollout=dict(wake_strategy=w), offload=dict(params=False)))
        for w in ("staged", "all_at_once")
    ]
    assert kept[0].largest_safe_kv_cache_bytes == kept[1].largest_safe_kv_cache_bytes


# ---------------------------------------------------------------- results
def test_overflow_names_the_phase_and_the_bytes_over():
    # TP=2, DP=1: 45 GB of optimizer states alone, kept on the device through rollout
    inputs = qwen7b_inputs(
        actor=dict(tp=2), offload=dict(optimizer=False), device=device_preset("A100-40GB"), actor_dp=1
    )
    plan = make_plan(inputs)
    assert not plan.fits
    over = {o.phase: o for o in plan.overflows}
    assert "train" in over and "rollout" in over
    assert over["train"].over_bytes == plan.phase("train").predicted_bytes - plan.budget_bytes > 0
    assert plan.budget_bytes == plan.capacity_bytes - plan.runtime_overhead_bytes - plan.margin_bytes
    worst = max(plan.overflows, key=lambda o: o.over_bytes)
    line = verdict(plan)
    assert line.startswith(f"DOES NOT FIT: {worst.phase} needs") and f"{worst.over_bytes / GIB:.2f} GiB over" in line
    assert "OVER" in format_table(plan)


@pytest.mark.parametrize("wake_strategy", ["staged", "all_at_once"])
@pytest.mark.parametrize("engine", ["vllm", "native"])
def test_recommended_kv_cache_makes_the_tightest_phase_fit_exactly(engine, wake_strategy):
    inputs = qwen7b_inputs(rollout=dict(kv_cache_bytes=None, engine=engine, wake_strategy=wake_strategy))
    plan = make_plan(inputs)
    block = plan.kv_bytes_per_token * inputs.kv_block_size
    assert plan.kv_cache_source == "auto"
    assert plan.kv_cache_bytes == plan.recommended_kv_cache_bytes == plan.largest_safe_kv_cache_bytes > 0
    tightest = plan.phase(plan.kv_limiting_phase)
    assert plan.budget_bytes - block < tightest.predicted_bytes <= plan.budget_bytes
    assert plan.fits and plan.peak_bytes <= plan.budget_bytes
    one_more_block = make_plan(inputs.with_rollout(kv_cache_bytes=plan.kv_cache_bytes + block))
    assert [o.phase for o in one_more_block.overflows] == [
        p.name for p in one_more_block.phases if p.predicted_bytes > plan.budget_bytes
    ]
    assert plan.kv_limiting_phase in {o.phase for o in one_more_block.overflows}
    # the recommended gpu_memory_utilization, under this engine's meaning, gives back at most that KV cache
    # (rounded down to 3 decimals: within 0.001 of the device)
    util = plan.recommended_gpu_memory_utilization
    from_util = make_plan(inputs.with_rollout(gpu_memory_utilization=util))
    assert from_util.kv_cache_source == "gpu_memory_utilization"
    assert plan.kv_cache_bytes - 0.001 * inputs.device.total_bytes - block <= from_util.kv_cache_bytes
    assert from_util.kv_cache_bytes <= plan.kv_cache_bytes and from_util.fits


def test_kv_cache_is_capped_at_what_max_num_seqs_can_use():
    plan = make_plan(qwen7b_inputs(rollout=dict(kv_cache_bytes=None, max_num_seqs=8, max_model_len=1024)))
    assert plan.recommended_kv_cache_bytes == 8 * 1024 * plan.kv_bytes_per_token < plan.largest_safe_kv_cache_bytes
    assert plan.kv_cache_tokens() == 8 * 1024
    tiny_kv = make_plan(qwen7b_inputs(rollout=dict(kv_cache_bytes=1024 * 28_672, max_model_len=2048)))
    assert tiny_kv.kv_cache_too_small and not tiny_kv.fits and "smaller than one max_model_len" in verdict(tiny_kv)


def test_equivalent_utilization_follows_each_engines_meaning():
    plan = make_plan(qwen7b_inputs())
    util = plan.equivalent_utilization()
    weights, kv, total = plan.engine_weight_bytes, plan.kv_cache_bytes, plan.capacity_bytes
    assert util["vllm"] == pytest.approx((weights + kv + plan.rollout_engine_reserve_bytes) / total)
    assert util["native"] == pytest.approx((weights + kv + 64 * 2**20) / total)
    assert util["vllm"] > util["native"]  # vLLM's fraction also covers its CUDA graphs and profiled activations
    assert set(util) == set(ENGINES)  # one engine list (colocation.engines), no engine nothing implements


def test_check_fits_names_the_phase_the_shortfall_and_a_kv_cache_that_fits():
    plan = make_plan(qwen7b_inputs())
    assert phase_growth_bytes(plan, "wake_kv_cache") == {"kv_cache": KV_BYTES}
    needed = KV_BYTES + plan.rollout_engine_reserve_bytes - plan.phase("wake_kv_cache").components["engine_reserve"]
    ok = check_fits(plan, measured_free_bytes=needed)
    assert ok.fits and ok.phase == "wake_kv_cache" and ok.needed_bytes == needed and ok.line.endswith("fits")
    short = check_fits(plan, measured_free_bytes=needed - 3 * GIB)
    assert not short.fits and short.shortfall_bytes == 3 * GIB
    assert short.line.startswith("wake_kv_cache would overflow") and "short by 3.00 GiB" in short.line
    fitting = (KV_BYTES - 3 * GIB) // KV_BLOCK_BYTES * KV_BLOCK_BYTES
    assert short.fitting_kv_cache_bytes == fitting
    assert f"rollout.kv_cache_bytes={fitting}" in short.line
    refit = make_plan(qwen7b_inputs(rollout=dict(kv_cache_bytes=short.fitting_kv_cache_bytes)))
    assert check_fits(refit, measured_free_bytes=needed - 3 * GIB).fits
    # all at once: the KV cache wakes with the weights
    at_once = make_plan(qwen7b_inputs(rollout=dict(wake_strategy="all_at_once")))
    assert at_once.kv_wake_phase == "wake_weights"
    assert set(phase_growth_bytes(at_once, "wake_weights")) == {"engine_weights", "kv_cache"}
    hopeless = check_fits(at_once, measured_free_bytes=GIB)
    assert hopeless.fitting_kv_cache_bytes is None and "no KV cache fits" in hopeless.line


def test_side_by_side_keeps_the_kv_cache_and_flips_one_choice_each():
    rows = variants(qwen7b_inputs(rollout=dict(kv_cache_bytes=None)))
    labels = [label for label, _ in rows]
    assert labels == [
        "as configured",
        "wake_strategy=all_at_once",
        "offload.params=false",
        "offload.grads=false",
        "offload.optimizer=false",
    ]
    kv = rows[0][1].kv_cache_bytes
    assert all(p.kv_cache_bytes == kv for _, p in rows)
    assert (
        rows[4][1].phase("rollout").predicted_bytes - rows[0][1].phase("rollout").predicted_bytes
        == (rows[0][1].phase("train").components["optimizer"])
    )


def test_bad_inputs_fail_with_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"actor.tp=8 must divide the attention heads \(28\) and KV heads \(4\)"):
        qwen7b_inputs(actor=dict(tp=8))
    with pytest.raises(ValueError, match="rollout.tp=7 must divide"):
        qwen7b_inputs(rollout=dict(tp=7))
    with pytest.raises(ValueError, match="wake_strategy='lazy' is not one of"):
        qwen7b_inputs(rollout=dict(wake_strategy="lazy"))
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5 is outside"):
        qwen7b_inputs(rollout=dict(gpu_memory_utilization=1.5))
    with pytest.raises(ValueError, match="device 'TPU' is not a preset"):
        device_preset("TPU")
    with pytest.raises(TypeError):
        PlanInputs(QWEN7B, device_preset("H100-80GB"))  # keyword-only


def test_cpu_device_is_this_machines_memory_shared_by_its_ranks():
    import psutil

    assert device_preset("cpu", ranks_per_node=4).total_bytes == psutil.virtual_memory().total // 4
    assert device_preset("h100-80gb").name == "H100-80GB"
    assert device_preset("cpu").host_memory_bytes == psutil.virtual_memory().total
    assert device_preset("cpu", host_memory_bytes=2**30).host_memory_bytes == 2**30


def test_cuda_totals_are_mem_get_info_s_sourced_or_marked_estimates():
    """A preset's total is what torch.cuda.mem_get_info reports (less than NVML's), sourced or an estimate with an
    uncertainty; each names its node's RAM and where that figure comes from."""
    from planner.devices import CUDA_PRESETS

    assert device_preset("A100-40GB").total_bytes == 42298834944  # deviceQuery's totalGlobalMem
    assert device_preset("A100-40GB").total_uncertainty_bytes == 0
    h200 = device_preset("H200-141GB")
    assert h200.total_bytes < 143771 * 2**20 and h200.total_uncertainty_bytes > 0
    assert h200.total_source.startswith("estimate")
    for name, preset in CUDA_PRESETS.items():
        spec = device_preset(name)
        assert spec.total_bytes < preset.nvml_total_bytes, name
        assert spec.total_source and spec.host_memory_source and spec.host_memory_bytes >= 2**40, name
    assert device_preset("H100-80GB").host_memory_bytes == 2 * 2**40  # DGX H100: 2 TB
    assert device_preset("H100-80GB", host_memory_bytes=2**39).host_memory_source == "cluster.host_memory_gib"


# ---------------------------------------------------------------- train-phase levers (issue 15)
def _train(plan, component=None):
    comps = plan.phase("train").components
    return comps[component] if component else comps["activations"] + comps["logits"]


def test_packing_and_token_budgets_follow_the_real_tokens():
    # 8 sequences per rank, micro-batches of 4, responses of 128 on average out of 768 allowed
    base = dict(actor=dict(micro_batch_size=4), sequences_per_step=16, mean_prompt_tokens=256, mean_response_tokens=128)
    padded = make_plan(qwen7b_inputs(**base))
    packed = make_plan(qwen7b_inputs(base, actor=dict(remove_padding=True)))
    assert padded.inputs.micro_batches(train=True).model_tokens == 4 * 1024
    assert packed.inputs.micro_batches(train=True).model_tokens == 4 * 384
    assert _train(packed, "activations") < 0.4 * _train(padded, "activations")
    assert _train(packed, "logits") < _train(padded, "logits")
    # without mean lengths the planner assumes full-length sequences: packing alone bounds nothing
    worst = make_plan(qwen7b_inputs(actor=dict(micro_batch_size=4, remove_padding=True), sequences_per_step=16))
    assert _train(worst, "activations") == _train(
        make_plan(qwen7b_inputs(actor=dict(micro_batch_size=4), sequences_per_step=16)), "activations"
    )
    # a token budget bounds every micro-batch whatever the lengths; forward-only gets twice the budget
    budget = qwen7b_inputs(actor=dict(remove_padding=True, max_tokens_per_micro_batch=2048), sequences_per_step=16)
    train_mb, forward_mb = budget.micro_batches(train=True), budget.micro_batches(train=False)
    assert train_mb.model_tokens <= 2048 and train_mb.count == 4
    assert forward_mb.model_tokens <= 4096 and forward_mb.count == 2
    plan = make_plan(budget)
    assert plan.phase("old_logprob").components["activations"] > 0
    assert _train(plan) < _train(worst)
    # padded rows under a budget: budget // padded length rows each
    rows = qwen7b_inputs(actor=dict(max_tokens_per_micro_batch=3000), sequences_per_step=16).micro_batches(train=True)
    assert (rows.sequences, rows.count, rows.model_tokens) == (2, 4, 2048)


def test_recompute_and_chunked_logprob_lower_the_train_peak():
    cpu = dict(actor=dict(micro_batch_size=2), attention="unfused", sequences_per_step=4)
    none, selective, full = (
        make_plan(qwen7b_inputs(cpu, actor=dict(recompute=r))) for r in ("none", "selective", "full")
    )
    assert _train(full, "activations") < _train(selective, "activations") < _train(none, "activations")
    block = make_plan(
        qwen7b_inputs(cpu, actor=dict(recompute="full", recompute_method="block", recompute_num_layers=3))
    )
    assert _train(full, "activations") < _train(block, "activations") < _train(none, "activations")
    mlp = make_plan(qwen7b_inputs(cpu, actor=dict(recompute="selective", recompute_modules=("core_attn", "mlp"))))
    assert _train(mlp, "activations") < _train(selective, "activations")
    # chunked log-prob: no fp32 softmax of every response token kept for backward
    unchunked = make_plan(qwen7b_inputs(**cpu))
    chunked = make_plan(qwen7b_inputs(cpu, actor=dict(logprob_chunk_tokens=1024)))
    assert _train(chunked, "logits") < _train(unchunked, "logits")
    entropy_kept = make_plan(
        qwen7b_inputs(cpu, actor=dict(logprob_chunk_tokens=1024, entropy_recompute=False), entropy_grad=True)
    )
    entropy_recomputed = make_plan(qwen7b_inputs(cpu, actor=dict(logprob_chunk_tokens=1024), entropy_grad=True))
    assert _train(chunked, "logits") <= _train(entropy_recomputed, "logits") < _train(entropy_kept, "logits")
    with pytest.raises(ValueError, match="recompute_method"):
        qwen7b_inputs(actor=dict(recompute_method="every"))
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0"):
        qwen7b_inputs(actor=dict(max_tokens_per_micro_batch=0))


def test_unset_engine_knobs_follow_the_engines_own_defaults():
    """Left null, vLLM's max_num_batched_tokens is its per-device default (16384 on an H100, 8192 on an
    A100, 4096 x TP on CPU, capped at max_num_seqs x max_model_len) and its CPU block size is 128."""
    shape = ModelShape.from_architecture("Qwen2.5-7B-Instruct")
    h100 = make_inputs(
        rollout=dict(engine="vllm", tp=4, max_model_len=4096), shape=shape, device=device_preset("H100-80GB")
    )
    assert h100.vllm_batched_tokens == 16384 and h100.kv_block_size == 16
    a100 = replace(h100, device=device_preset("A100-80GB"))
    assert a100.vllm_batched_tokens == 8192
    assert h100.with_rollout(max_num_seqs=2, max_model_len=1000).vllm_batched_tokens == 2000
    cpu = replace(h100.with_rollout(tp=2), device=device_preset("cpu"))
    assert cpu.vllm_batched_tokens == 8192 and cpu.kv_block_size == 128
    assert (
        cpu.with_rollout(engine="native").kv_block_size == 16 and h100.with_rollout(block_size=32).kv_block_size == 32
    )
    # rollout activations of vLLM on the H100 are profiled at 16384 tokens: twice the 8192-token working set
    assert (
        make_plan(h100).rollout_engine_reserve_bytes
        > make_plan(h100.with_rollout(max_num_batched_tokens=8192)).rollout_engine_reserve_bytes
    )


def test_the_local_spec_factor_scales_per_token_activations_not_the_attention_scores():
    """The factor is fitted on short sequences (make calibrate): the [b, Hq/t, s, s] scores are counted as they
    are, so doubling the factor doubles only the per-token part of a layer's kept activations."""
    from planner.plan import _layer_bytes
    from planner.sizes import unfused_attention_bytes

    base = qwen7b_inputs(actor=dict(micro_batch_size=2), attention="unfused", sequences_per_step=4)
    mb = base.micro_batches(train=True)
    scores = unfused_attention_bytes(
        base.shape, base.actor.tp, base.element_bytes, mb.sequences, mb.attention_span, kept=True
    )

    def layer(factor: float) -> int:
        inp = replace(base, calibration=base.constants.with_values(local_spec_activation_factor=factor))
        return _layer_bytes(inp, inp.micro_batches(train=True))

    per_token = layer(1.0) - scores
    assert scores > 0 and per_token > 0
    assert layer(2.0) == 2 * per_token + scores


def test_packed_sequences_on_the_local_spec_hold_no_attention_scores_and_count_their_padded_rows():
    """megatron_backend/model.py's packed attention (torch's flash kernel over the sequences padded to the longest)
    keeps no [s, s] scores, with grad or without; what grows with the padding is the padded q, k, v, output and
    log-sum-exp (per padded row: shorter sequences padded to the same longest keep as much). A padded
    micro-batch goes through megatron's own attention: every row's scores, which selective core_attn drops."""
    from planner.plan import _layer_bytes
    from planner.sizes import local_packed_attention_padding_bytes_per_token, unfused_attention_bytes

    packed = qwen7b_inputs(
        actor=dict(micro_batch_size=4, remove_padding=True), attention="unfused", sequences_per_step=8
    )
    packed = replace(packed, calibration=packed.constants.with_values(local_spec_activation_factor=1.0))
    mb = packed.micro_batches(train=True)
    assert mb.padded_tokens == mb.model_tokens == 4 * packed.seq_len  # lengths as planned: no padding
    assert _layer_bytes(packed, mb) == _layer_bytes(packed, mb, ("core_attn",))  # no scores to drop
    shorter = replace(packed, mean_response_tokens=packed.response_tokens // 2)
    short_mb = shorter.micro_batches(train=True)
    assert short_mb.padded_tokens == mb.padded_tokens > short_mb.model_tokens
    per_row = local_packed_attention_padding_bytes_per_token(packed.shape, packed.actor.tp)
    per_token = _layer_bytes(packed, mb) // mb.model_tokens
    assert _layer_bytes(shorter, short_mb) - _layer_bytes(packed, mb) == (
        short_mb.model_tokens - mb.model_tokens
    ) * (per_token - per_row)

    padded = packed.with_actor(remove_padding=False)
    mb = padded.micro_batches(train=True)
    kept = unfused_attention_bytes(padded.shape, padded.actor.tp, padded.element_bytes, 4, mb.attention_span, True)
    assert _layer_bytes(padded, mb) - _layer_bytes(padded, mb, ("core_attn",)) == kept > 0  # selective drops them
    forward = _layer_bytes(padded, padded.micro_batches(train=False), train=False)
    assert forward > _layer_bytes(packed, packed.micro_batches(train=False), train=False)


def test_a_forward_without_grad_counts_its_working_set_and_the_logprob_pass_one_after_the_other():
    """old/ref_logprob keep nothing for backward: the layers' planned bytes are the widest moment of one layer
    (layer_forward_bytes_per_token, not the kept count times the fitted factor), and the log-prob pass comes
    after the layers, so the stage's forward peak is the residual stream plus the larger of the two. Measured
    (long_sequences, 64 KiB mmap threshold): old_logprob rise 25 MiB planned with this, 38 measured; the kept
    count x 1.35 plus the logits planned 61."""
    from planner.plan import _layer_bytes, _stage, logprob_pass_bytes
    from planner.sizes import layer_activation_bytes_per_token, layer_forward_bytes_per_token

    inp = qwen7b_inputs(actor=dict(micro_batch_size=4), attention="flash", sequences_per_step=8)
    s, t, e = inp.shape, inp.actor.tp, inp.element_bytes
    assert layer_forward_bytes_per_token(s, t, e) < layer_activation_bytes_per_token(s, t, e, "flash")
    factor2 = replace(inp, calibration=inp.constants.with_values(local_spec_activation_factor=2.0))
    mb = inp.micro_batches(train=False)
    assert _layer_bytes(factor2, mb, train=False) == _layer_bytes(inp, mb, train=False)  # the factor is train's
    assert _layer_bytes(inp, mb, train=False) == mb.model_tokens * layer_forward_bytes_per_token(s, t, e)
    last = _stage(inp, inp.actor.pp - 1)
    stream = mb.model_tokens * s.hidden_size * e
    logits = logprob_pass_bytes(inp, train=False)
    assert last.forward_logits == logits
    assert last.forward_activations + last.forward_logits == stream + max(_layer_bytes(inp, mb, train=False), logits)


def test_the_logprob_backward_reuses_the_kept_softmax():
    """megatron_backend/logprobs.py: with the softmax kept (unchunked), backward mul_'s it in place into the
    gradient: beside the logits and their gradient nothing new unless an entropy gradient (xlogy) or a narrower
    dtype (the cast before index_add_). Chunked without keeping it, each chunk's softmax is recomputed into a
    new fp32 block. Measured on transients_long_vocab (16k vocab, unchunked, fp32): train rise 434 MiB planned
    with this, 445 measured; with a recomputed block counted beside the kept softmax, 530."""
    from planner.sizes import logits_bytes, megatron_padded_vocab

    s = qwen7b_inputs().shape
    n, rows = 1024, 768
    vocab = megatron_padded_vocab(s.vocab_size, 1)
    logits32, kept, block = n * vocab * 4, rows * vocab * 4, rows * vocab * 4
    assert logits_bytes(s, 1, 4, n, num_rows=rows, train=True) == 2 * logits32 + kept
    assert logits_bytes(s, 1, 4, n, num_rows=rows, train=True, entropy_grad=True) == 2 * logits32 + kept + block
    logits16 = n * vocab * 2
    forward16 = logits16 + rows * vocab * (8 + 2)  # the bf16 gather, its fp32 copy and exp
    assert logits_bytes(s, 1, 2, n, num_rows=rows, train=True) == max(forward16, 2 * logits16 + kept + rows * vocab * 2)
    chunk = 128
    chunked = logits_bytes(s, 1, 4, n, num_rows=rows, chunk_tokens=chunk, train=True, keep_softmax=False)
    assert chunked == max(logits32 + chunk * vocab * 8, 2 * logits32 + chunk * vocab * 4)


_SAMPLER_PEAK = """
import re, sys, torch
from rollout.engine import SamplingParams
from rollout.native.sampling import Sampler

def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

sampler = Sampler(SamplingParams(temperature=1.0, seed=0), torch.device("cpu"))
sampler(torch.randn(4, 64))  # the kernels' first-use setup, outside the window
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS")
sampler(torch.randn(int(sys.argv[1]), int(sys.argv[2])))  # the engine's logits [seqs, V] fp32, then sampling
print(status("VmHWM") - base)
"""


def test_the_sampler_is_planned_as_the_native_sampler_runs():
    """The native sampler's measured peak (logits included, fresh processes, 256 sequences x 16k vocabulary: 16 MiB
    per [seqs, V] fp32) is never above what sizes.sampler_bytes plans with the CPU profile (4), and holds at
    least the three tensors alive at the draw. It is 3 or 4 from one process to the next: glibc hands the freed
    scaled copy's block to the draws or not (colocation/engines.py)."""
    import subprocess
    import sys

    from planner.sizes import sampler_bytes, vllm_padded_vocab

    seqs, vocab = 256, 16384
    shape = replace(QWEN7B, vocab_size=vocab)  # the sampler's bytes depend on the vocabulary only
    assert vllm_padded_vocab(vocab) == vocab
    unit = seqs * vocab * 4
    planned = sampler_bytes(shape, seqs, ENGINE_PROFILES["native"].sampler_tensors("cpu")) / unit
    measured = [
        int(
            subprocess.run(
                [sys.executable, "-c", _SAMPLER_PEAK, str(seqs), str(vocab)], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
        / unit
        for _ in range(4)
    ]
    assert all(2.85 <= m <= planned + 0.15 for m in measured), (measured, planned)


def test_train_holds_the_largest_weight_gradient_unless_the_logprob_pass_is_larger():
    """gradient_accumulation_fusion=False (megatron_backend/model.py): each linear's backward makes a new
    [out, in] weight gradient before DDP's hook adds it into main_grad. The largest is a vocab table on the
    first and last stages, else qkv or fc1; it comes after the log-prob pass's backward has freed its buffers."""
    from planner.plan import train_backward_bytes
    from planner.sizes import largest_actor_weight_elements, megatron_padded_vocab

    s = QWEN7B
    vocab_rows = megatron_padded_vocab(s.vocab_size, 4) // 4 * s.hidden_size
    fc1 = 2 * s.intermediate_size // 4 * s.hidden_size
    assert largest_actor_weight_elements(s, 4, 4, 0) == largest_actor_weight_elements(s, 4, 4, 3) == vocab_rows
    assert (
        largest_actor_weight_elements(s, 4, 4, 1)
        == fc1
        > (s.num_heads + 2 * s.num_kv_heads) * s.head_dim // 4 * s.hidden_size
    )

    inp = qwen7b_inputs(actor=dict(pp=4), attention="flash", actor_dp=1, distributed_optimizer=False)
    workspace = int(inp.constants.value("train_workspace_bytes"))
    assert train_backward_bytes(inp, 1) == fc1 * inp.element_bytes + workspace
    assert train_backward_bytes(inp, 3, logits_pass=fc1) == vocab_rows * inp.element_bytes - fc1 + workspace
    assert train_backward_bytes(inp, 3, logits_pass=10 * vocab_rows) == workspace


def test_a_run_that_exports_plans_the_export_hf_phase_with_what_the_export_holds():
    """trainer.export_every / export_at_end plan ``export_hf`` after train: the state train leaves resident plus
    the export's transient on CPU (megatron_backend/hf_export.py::save_live): the larger of what megatron's
    params-only save clones (every param with the distributed optimizer, else the fc1 halves) and one HF tensor
    plus two stored chunks; nothing on a GPU (the save stages to the host, the files are written from there)."""
    from colocation.phases import EVERY_HANDOFF, EXPORT_PHASE, phase_names, step_phases
    from planner.sizes import actor_stage_fc1_elements, largest_actor_weight_elements, largest_hf_tensor_elements
    from run.compose import compose
    from run.memory_plan import plan_inputs

    table = {p.name: p for p in step_phases(EVERY_HANDOFF)}
    assert table[EXPORT_PHASE].transients == ("hf_export",)
    off = make_plan(plan_inputs(compose("tiny_cpu"), 6))
    assert not off.inputs.hf_exports and EXPORT_PHASE not in off.names and off.names == PHASES
    for overrides in (["trainer.export_every=1"], ["trainer.export_at_end=true"]):
        plan = make_plan(plan_inputs(compose("tiny_cpu", overrides), 6))
        assert plan.inputs.hf_exports and plan.names == phase_names(exports=True, saves=False)
        export, train = plan.phase(EXPORT_PHASE), plan.phase("train")
        inp = plan.inputs
        e = inp.element_bytes
        hf_write = (
            largest_hf_tensor_elements(inp.shape) + 2 * largest_actor_weight_elements(inp.shape, inp.actor.tp, 1, 0)
        ) * e
        fc1 = actor_stage_fc1_elements(inp.shape, inp.actor.tp, 1) * e
        assert 0 < fc1 and export.components["export_staging"] == max(fc1, hf_write) > 0
        # after train: its resident state (params, grads, optimizer), none of its activations
        transient = ("export_staging", "activations", "logits")
        resident = {k: v for k, v in export.components.items() if k not in transient}
        assert resident == {k: v for k, v in train.components.items() if k not in transient}
        assert sum(p.components["export_staging"] for p in plan.phases) == export.components["export_staging"]
    # the distributed optimizer: the save clones every param (views of DDP's param buffer)
    dist = make_plan(qwen7b_inputs(rollout=dict(kv_cache_bytes=2**30), device=device_preset("cpu"), hf_exports=True))
    stage_params = dist.phase("train").components["actor_params"]
    assert dist.phase(EXPORT_PHASE).components["export_staging"] == stage_params
    gpu = make_plan(qwen7b_inputs(hf_exports=True))
    assert EXPORT_PHASE in gpu.names and gpu.phase(EXPORT_PHASE).components["export_staging"] == 0


def test_weight_sync_phase_counts_the_reference_check_from_the_models_shape():
    """weight_sync.check_every > 0: the weight_sync phase holds the reference check's gather at its largest
    check (the first: layer 0, the vocab tensors and the final norm), counted from tiny_cpu's shape (qwen2, actor
    TP=2, 2 gloo ranks): each rank's clones (the split tensors halved, the norms whole), the serialized copy and
    all_gather_object's gathered bytes (gloo's flat copy while it gathers), one rank's bytes read out and its pickled
    storages while they load, every rank's unpickled blocks, then the full tensors (planner/plan.py::_reference_bytes),
    beyond the sync's freed buckets (they run one after another). 0 with check_every=0; on a
    CUDA preset the host plan has the blocks and the full tensors, the device only the byte tensors."""
    from planner.host import host_plan
    from planner.sizes import megatron_padded_vocab
    from run.compose import compose
    from run.memory_plan import plan_inputs

    plan = make_plan(plan_inputs(compose("tiny_cpu"), 6))
    s, e, w, tp = plan.inputs.shape, plan.inputs.element_bytes, 2, 2
    assert (plan.inputs.actor.tp, plan.inputs.actor.pp, plan.inputs.actor_dp) == (tp, 1, 1)
    assert s.model_type == "qwen2" and not s.tie_word_embeddings and s.qkv_bias and not s.is_moe
    h, i, q, kv, vocab = (
        s.hidden_size,
        s.intermediate_size,
        s.num_heads * s.head_dim,
        s.num_kv_heads * s.head_dim,
        s.vocab_size,
    )
    norms = 2 * h  # input and post-attention norms: replicated, every TP rank sends them
    layer = h * q + q + 2 * (kv * h + kv) + q * h + 3 * i * h + norms
    full = layer + 2 * vocab * h + h  # + embed_tokens and lm_head (untied) + the final norm
    # embed_tokens and lm_head: megatron's padded vocab split in rows over TP, each rank sends its real rows
    rows = megatron_padded_vocab(vocab, tp) // tp
    sent = [
        (layer - norms) // tp + norms + h + 2 * h * max(0, min(vocab, (r + 1) * rows) - r * rows) for r in range(tp)
    ]
    own = largest = max(sent)  # one stage: its worst rank is the largest
    gathered = sum(sent)
    check = e * max(
        own + (1 + 2 * w) * largest,  # the all_gather: the serialized blocks, the gathered tensor, gloo's flat output
        own + (1 + w) * largest + 2 * largest + gathered,  # unpickling: one rank's bytes and memo, every rank's blocks
        own + gathered + full,  # assembled
    )
    sync = plan.phase("weight_sync")
    # after the sync's buckets are freed (the native engine reloads nothing): what the check needs beyond them
    expected = check - sync.components["sync_bucket"]
    assert sync.components["reference_check"] == expected > 0
    assert sum(p.components["reference_check"] for p in plan.phases) == expected  # the weight_sync phase only
    assert sync.start_components.get("reference_check", 0) == 0  # a transient: the phase's rise has it
    off = make_plan(plan_inputs(compose("tiny_cpu", ["weight_sync.check_every=0"]), 6))
    assert off.inputs.reference_check == () and off.phase("weight_sync").components["reference_check"] == 0
    assert sync.predicted_bytes - off.phase("weight_sync").predicted_bytes == expected
    # a later step's recorded check (StepLengths.reference_layer): layer 1 alone, smaller; -1 (none): 0
    lengths = plan.inputs.planned_lengths()
    later = plan.at_lengths(replace(lengths, reference_layer=1)).phase("weight_sync").components["reference_check"]
    assert 0 < later < expected
    assert plan.at_lengths(replace(lengths, reference_layer=-1)).phase("weight_sync").components["reference_check"] == 0

    # CUDA: the check gathers over a gloo group (weight_sync.reference.host_group), so nothing on the device and
    # the same count in host memory (CUDA's element bytes: the experiment's dtype, as on CPU)
    cuda = make_plan(plan_inputs(compose("tiny_cpu", ["cluster.device=H100-80GB"]), 6))
    assert all(p.components["reference_check"] == 0 for p in cuda.phases)
    host = {p.name: p.components["reference_check"] for p in host_plan(cuda).phases}
    assert cuda.inputs.element_bytes == e and host["weight_sync"] == check > 0
    assert sum(host.values()) == host["weight_sync"]
    cuda_off = make_plan(plan_inputs(compose("tiny_cpu", ["cluster.device=H100-80GB", "weight_sync.check_every=0"]), 6))
    assert cuda_off.phase("weight_sync").components["reference_check"] == 0
    assert all(p.components["reference_check"] == 0 for p in host_plan(cuda_off).phases)


def test_a_step_replayed_at_its_lengths_keeps_a_kv_cache_under_the_floor_a_user_may_set():
    """The engine sizes a cache of max_num_seqs x max_model_len tokens, under 1 MiB for a small model; replaying a
    step's recorded lengths (the run's summary) refused it as if a user had set it (make gpu-check on CPU ended
    with "rollout.kv_cache_bytes=131072 must be an integer >= 1048576" after its steps)."""
    from configs.rollout import MIN_KV_CACHE_BYTES
    from run.compose import compose
    from run.memory_plan import plan_inputs

    cfg = compose("tiny_cpu", ["rollout.max_num_seqs=4", "rollout.max_model_len=32", "rollout.max_new_tokens=8"])
    plan = make_plan(plan_inputs(cfg, 6))
    assert 0 < plan.kv_cache_bytes < MIN_KV_CACHE_BYTES
    again = plan.at_lengths(plan.inputs.planned_lengths())
    assert again.kv_cache_bytes == plan.kv_cache_bytes
    assert again.phase("rollout").predicted_bytes == plan.phase("rollout").predicted_bytes
