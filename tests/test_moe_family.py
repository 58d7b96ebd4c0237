"""The MoE families as data (modelspec.families.qwen3_moe / mixtral): their checkpoints' tensors, the shape's MoE
fields, which layers are sparse, the parameter names each engine uses, the refused configs, the tiny routers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from modelspec import ModelShape
from modelspec.families import FAMILIES
from modelspec.family import MOE_PART_NAMES, hf_tensor_shapes, layer_parts
from modelspec.tiny import tiny_hf_config
from planner.sizes import actor_stage_param_count, engine_param_count, engine_tensor_elements
from rollout.layout import ExpertSplit, vllm_param_layouts
from tests.family_helpers import MOE_FAMILIES


def test_moe_families_are_registered():
    assert MOE_FAMILIES == ("qwen3_moe", "mixtral")
    assert FAMILIES["qwen3_moe"].config_class == "Qwen3MoeConfig"
    assert FAMILIES["mixtral"].config_class == "MixtralConfig"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tensors_match_the_saved_checkpoint(tiny_model_dirs, family):
    """hf_tensor_shapes lists exactly the checkpoint transformers writes, per-expert names and all."""
    shape = ModelShape.from_pretrained(tiny_model_dirs[family])
    with safe_open(str(Path(tiny_model_dirs[family]) / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert saved == hf_tensor_shapes(shape)
    assert shape.param_count() == sum(torch.Size(dims).numel() for dims in saved.values())


def test_shape_fields_and_sparse_layers(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    qwen = ModelShape.from_pretrained(tiny_model_dirs["qwen3_moe"])
    assert (qwen.num_experts, qwen.moe_top_k, qwen.moe_intermediate_size) == (4, 2, 64)
    assert qwen.moe_layers == (0, 1, 3) and not qwen.norm_topk_prob and qwen.qk_norm  # mlp_only_layers=[2]
    mixtral = ModelShape.from_pretrained(tiny_model_dirs["mixtral"])
    assert (mixtral.num_experts, mixtral.moe_top_k, mixtral.moe_intermediate_size) == (4, 2, 128)
    assert mixtral.moe_layers == (0, 1, 2, 3) and mixtral.norm_topk_prob and not mixtral.qk_norm
    for shape, path in ((qwen, tiny_model_dirs["qwen3_moe"]), (mixtral, tiny_model_dirs["mixtral"])):
        model = AutoModelForCausalLM.from_pretrained(path)
        sparse = tuple(n for n, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
        assert sparse == shape.moe_layers  # transformers' own rule
    # decoder_sparse_step: every second layer (1, 3), minus mlp_only_layers
    stepped = ModelShape.from_hf_config(tiny_hf_config("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[3]))
    assert stepped.moe_layers == (1,)
    # a sparse layer has the router and experts instead of the dense MLP parts
    names = [part.name for part, _ in layer_parts(qwen, 0)]
    assert names[-6:-2] == list(MOE_PART_NAMES) and "gate" not in names
    assert [part.name for part, _ in layer_parts(qwen, 2)][-5:-2] == ["gate", "up", "down"]


def test_qwen3_30b_a3b_architecture():
    shape = ModelShape.from_architecture("Qwen3-30B-A3B")
    assert (shape.num_layers, shape.num_experts, shape.moe_top_k, len(shape.moe_layers)) == (48, 128, 8, 48)
    assert shape.norm_topk_prob
    assert round(shape.param_count() / 1e9, 1) == 30.5  # "30.5B in total and 3.3B activated" (its model card)
    assert round(shape.active_param_count() / 1e9, 1) == 3.4  # 3.35: the card rounds down


@pytest.mark.parametrize(
    "family, overrides, field",
    [
        ("qwen3_moe", dict(shared_expert_intermediate_size=512), "shared_expert_intermediate_size"),
        ("qwen3_moe", dict(n_shared_experts=1), "n_shared_experts"),
        ("qwen3_moe", dict(n_group=4, topk_group=2), "n_group"),
        ("qwen3_moe", dict(topk_method="group_limited_greedy"), "topk_method"),
        ("qwen3_moe", dict(scoring_func="sigmoid"), "scoring_func"),
        ("qwen3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok"),
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64), "sliding_window"),
        ("mixtral", dict(router_jitter_noise=0.01), "router_jitter_noise"),
        ("mixtral", dict(sliding_window=64), "sliding_window"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(family, overrides, field):
    config = {**tiny_hf_config(family).to_dict(), **overrides}
    with pytest.raises(ValueError, match=field) as info:
        ModelShape.from_hf_config(config, source="config.json")
    assert "\n" not in str(info.value)


def test_engine_parameter_names():
    qwen = ModelShape.from_hf_config(tiny_hf_config("qwen3_moe"))
    router, gate, up, down = (part for part, _ in layer_parts(qwen, 0) if part.name in MOE_PART_NAMES)
    assert router.megatron_param("weight", te_norms=False) == "mlp.router.weight"
    assert (
        gate.megatron_expert_param("weight", 3, grouped_gemm=False) == "mlp.experts.local_experts.3.linear_fc1.weight"
    )
    assert up.megatron_expert_param("weight", 3, grouped_gemm=True) == "mlp.experts.linear_fc1.weight3"
    assert (
        down.megatron_expert_param("weight", 0, grouped_gemm=False) == "mlp.experts.local_experts.0.linear_fc2.weight"
    )
    with pytest.raises(ValueError, match="megatron_expert_param"):
        gate.megatron_param("weight", te_norms=False)
    assert (router.vllm_param("weight"), gate.vllm_param("weight"), down.vllm_param("weight")) == (
        "mlp.gate.weight",
        "mlp.experts.routed_experts.w13_weight",
        "mlp.experts.routed_experts.w2_weight",
    )
    mixtral = ModelShape.from_hf_config(tiny_hf_config("mixtral"))
    names = {p.name: p.local_shape for p in vllm_param_layouts(mixtral, tp=2, tp_rank=1)}
    assert names["model.layers.3.block_sparse_moe.gate.weight"] == (4, 128)
    assert names["model.layers.3.block_sparse_moe.experts.routed_experts.w13_weight"] == (
        4,
        2 * 64,
        128,
    )  # [E, 2 I/T, h]
    assert names["model.layers.3.block_sparse_moe.experts.routed_experts.w2_weight"] == (4, 128, 64)  # [E, h, I/T]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_planner_counts_match_the_layouts(family):
    shape = ModelShape.from_hf_config(tiny_hf_config(family))
    for tp in (1, 2):
        layouts = vllm_param_layouts(shape, tp, 0)
        assert engine_param_count(shape, tp) == sum(torch.Size(p.local_shape).numel() for p in layouts)
        assert sorted(engine_tensor_elements(shape, tp)) == sorted(torch.Size(p.local_shape).numel() for p in layouts)
    # engine expert parallel (E / ep experts per rank) and vLLM's experts split over every rank of 2 replicas
    for ep, etp in [(2, 1), (4, 1), (1, 2), (2, 2)]:
        layouts = vllm_param_layouts(shape, 1, 0, ExpertSplit(etp=etp, etp_rank=etp - 1, ep=ep, ep_rank=ep - 1))
        numels = [torch.Size(p.local_shape).numel() for p in layouts]
        assert engine_param_count(shape, 1, ep, etp) == sum(numels)
        assert sorted(engine_tensor_elements(shape, 1, ep, etp)) == sorted(numels)
    # the actor at EP 2: half the experts of every sparse layer, the router and everything else whole
    per_expert = 3 * shape.hidden_size * shape.moe_intermediate_size
    full = sum(actor_stage_param_count(shape, 1, 1, 0, ep=1) for _ in range(1))
    half = actor_stage_param_count(shape, 1, 1, 0, ep=2)
    assert full - half == len(shape.moe_layers) * 2 * per_expert


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tiny_routers_are_sharp_and_used(tiny_model_dirs, family):
    """Top-k margins far above float rounding (parity does not hinge on near-ties) and every expert gets
    tokens (routing matters): over 64 random tokens, in every sparse layer."""
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(tiny_model_dirs[family]) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[family])
    ids = torch.randint(3, 99, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits
    top_k = config["num_experts_per_tok"]
    for logits in router_logits:
        ranked = logits.topk(top_k + 1, dim=-1).values
        margins = ranked[:, top_k - 1] - ranked[:, top_k]
        # logits ~5 differ by ~1e-6 between implementations (fp32 rounding); margins are continuous, so the
        # smallest of 64 is small, but still two orders of magnitude above that
        assert margins.median() > 0.5 and margins.min() > 1e-4
        assert logits.std() > 2.0  # HF's init (std 0.02) gives ~0.2
        used = torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=logits.shape[-1])
        assert (used > 0).all()


def test_rollout_ep_refusals_are_one_line():
    """vLLM: engine expert parallel on CUDA only (its CPU experts ignore expert_map) and only over every engine
    rank (its EP size is tp x dp); native: rollout.ep with TP 1 only; a dense model or an EP that does not divide
    the experts: named before any engine starts."""
    from colocation.engines import engine_profile
    from configs.rollout import RolloutConfig
    from modelspec import ColocatedMesh
    from modelspec.mesh import check_rollout_experts

    RolloutConfig(engine="native", ep=2)  # accepted
    RolloutConfig(engine="vllm", ep=4, tp=2)  # accepted: vLLM's EP spans TP and the replicas
    engine_profile("vllm").check_expert_parallel("cuda", 4)
    ColocatedMesh(world_size=4, rollout_tp=2, rollout_ep=4, rollout_experts_span_replicas=True)
    for make, match in [
        (lambda: RolloutConfig(engine="native", ep=2, tp=2), r"rollout.ep=2 with rollout.tp=2"),
        (lambda: RolloutConfig(engine="native", ep=0), "rollout.ep=0 must be a positive integer"),
        (
            lambda: engine_profile("vllm").check_expert_parallel("cpu", 2),
            r"rollout.ep=2 with rollout.engine=vllm on cpu: vLLM's CPU build has no expert parallel",
        ),
        (
            lambda: ColocatedMesh(world_size=4, rollout_tp=1, rollout_ep=2, rollout_experts_span_replicas=True),
            r"rollout.ep=2: vLLM's expert parallel size is rollout.tp x replicas .* set rollout.ep=4 or 1",
        ),
    ]:
        with pytest.raises(ValueError, match=match) as info:
            make()
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="rollout.ep=3 must divide the 4 experts"):
        check_rollout_experts(ModelShape.from_hf_config(tiny_hf_config("mixtral")), 3)
    with pytest.raises(ValueError, match="rollout.ep=2 needs a mixture-of-experts model"):
        check_rollout_experts(ModelShape.from_hf_config(tiny_hf_config("llama")), 2)
