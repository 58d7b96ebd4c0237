"""rollout.layout: vLLM's per-rank layout, checked against hand-written expectations and by round trip."""

from __future__ import annotations

import pytest
import torch

from configs.rollout import RolloutConfig
from modelspec import ModelShape
from modelspec.families import FAMILIES
from modelspec.family import hf_tensor_shapes
from modelspec.tiny import tiny_hf_config
from rollout.layout import assemble_local, local_view, padded_vocab_size, tp_shape, vllm_param_layouts


def _shape(family: str) -> ModelShape:
    return ModelShape.from_hf_config(tiny_hf_config(family))


def _random_hf_state(family: str) -> dict[str, torch.Tensor]:
    """Random tensors under the checkpoint's names (hf_tensor_shapes, pinned to the saved tiny checkpoints by
    test_moe_family; transformers 5 fuses MoE experts in memory, so its state_dict has other names)."""
    torch.manual_seed(0)
    return {name: torch.randn(dims) for name, dims in hf_tensor_shapes(_shape(family)).items()}


def test_padded_vocab_and_shapes():
    assert [padded_vocab_size(v) for v in (99, 128, 160, 1)] == [128, 128, 192, 64]
    llama = {p.name: p for p in vllm_param_layouts(_shape("llama"), tp=2, tp_rank=1)}
    assert "lm_head.weight" not in llama  # tied: lm_head is embed_tokens
    embed = llama["model.embed_tokens.weight"]
    assert embed.local_shape == (64, 128)  # 99 -> 128 padded, 64 rows per rank (hidden 128)
    (spec,) = embed.slices
    assert (spec.hf_start, spec.hf_stop, spec.local_start) == (64, 99, 0)  # rows 35..63 stay zero
    qwen3 = {p.name: p for p in vllm_param_layouts(_shape("qwen3"), tp=2, tp_rank=0)}
    assert qwen3["lm_head.weight"].local_shape == (96, 128)  # 160 -> 192 / 2
    assert qwen3["model.layers.3.self_attn.q_norm.weight"].replicated
    assert qwen3["model.layers.0.self_attn.qkv_proj.weight"].local_shape == ((2 + 2 * 1) * 32, 128)
    assert qwen3["model.layers.0.mlp.gate_up_proj.weight"].local_shape == (256, 128)
    assert qwen3["model.layers.0.mlp.down_proj.weight"].local_shape == (128, 128)
    assert qwen3["model.layers.0.self_attn.o_proj.weight"].local_shape == (128, 64)
    assert "model.layers.0.self_attn.qkv_proj.bias" not in qwen3
    qwen2 = {p.name: p for p in vllm_param_layouts(_shape("qwen2"), tp=1, tp_rank=0)}
    assert qwen2["model.layers.0.self_attn.qkv_proj.bias"].local_shape == (4 * 32 + 2 * 2 * 32,)


def test_qkv_rows_and_kv_head_replication():
    state = _random_hf_state("qwen2")  # 4 q heads, 2 KV heads, head_dim 32, hidden 128
    q, k, v = (state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    for tp, rank, q_heads, kv_head in ((2, 1, [2, 3], [1]), (4, 2, [2], [1]), (4, 1, [1], [0])):
        layouts = {p.name: p for p in vllm_param_layouts(_shape("qwen2"), tp, rank)}
        local = assemble_local(layouts["model.layers.1.self_attn.qkv_proj.weight"], state)
        expect = torch.cat(
            [q.view(4, 32, 128)[q_heads].flatten(0, 1), k.view(2, 32, 128)[kv_head][0], v.view(2, 32, 128)[kv_head][0]]
        )
        assert torch.equal(local, expect), (tp, rank)
    assert [tp_shape(_shape("qwen2"), 4, r).kv_head_start for r in range(4)] == [
        0,
        0,
        1,
        1,
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_reassemble_to_hf(family, tp):
    """Concatenating every rank's slices gives back each full HF tensor; padding rows are zero."""
    state = _random_hf_state(family)
    shape = _shape(family)
    rebuilt = {name: torch.full_like(t, float("nan")) for name, t in state.items()}
    for rank in range(tp):
        for layout in vllm_param_layouts(shape, tp, rank):
            local = assemble_local(layout, state)
            assert tuple(local.shape) == layout.local_shape
            covered = torch.zeros(local.shape, dtype=torch.bool)
            for s in layout.slices:
                piece = local_view(local, s)
                local_view(covered, s).fill_(True)
                target = rebuilt[s.hf_name].narrow(s.dim, s.hf_start, s.length)
                if not target.isnan().any():  # already written by another rank: replicas must agree
                    assert torch.equal(target, piece), (layout.name, rank)
                target.copy_(piece)
            assert not local[~covered].any()  # only vocab padding is uncovered, and it is zero
    for name, full in state.items():
        if name == "lm_head.weight" and shape.tie_word_embeddings:
            continue
        assert torch.equal(rebuilt[name], full), name


def test_layout_rejects_bad_tp():
    with pytest.raises(ValueError, match=r"must divide the attention heads \(4\)"):
        vllm_param_layouts(_shape("qwen2"), tp=3, tp_rank=0)
    with pytest.raises(TypeError, match="ModelShape.from_hf_config"):  # one parser: configs go through ModelShape
        vllm_param_layouts(tiny_hf_config("qwen2"), tp=1, tp_rank=0)


def test_rope_theta_from_v5_and_v4_configs():
    config = tiny_hf_config("qwen2").to_dict()
    assert ModelShape.from_hf_config(config).rope.theta == 1_000_000.0
    v4 = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 5.0}
    assert ModelShape.from_hf_config(v4).rope.theta == 5.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(block_size=12), "rollout.block_size"),
        (dict(max_num_seqs=0), "rollout.max_num_seqs"),
        (dict(max_model_len=1), "rollout.max_model_len"),
        (dict(activation_reserve_mb=-1), "rollout.activation_reserve_mb"),
        (dict(memory_saver="cuda"), "rollout.memory_saver"),
        (dict(sleep_level=3), "rollout.sleep_level"),
    ],
)
def test_rollout_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**overrides)
