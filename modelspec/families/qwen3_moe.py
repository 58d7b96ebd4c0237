"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms, explicit head_dim)
with MoE layers.

- A sparse layer's MoE block is ``mlp``: the router ``mlp.gate.weight`` [E, h] and per expert e
  ``mlp.experts.<e>.{gate,up,down}_proj.weight`` ([m, h], [m, h], [h, m]; m = ``moe_intermediate_size``).
  E = ``num_experts`` (transformers 5 writes it as ``num_local_experts``), top-k = ``num_experts_per_tok``.
- Routing: softmax over E, top-k, renormalised only when ``norm_topk_prob`` (Qwen3-30B-A3B: true).
- Layer n is sparse when n is not in ``mlp_only_layers`` and (n + 1) % ``decoder_sparse_step`` == 0; a dense
  layer has Llama's ``mlp.{gate,up,down}_proj`` of ``intermediate_size``.
- vLLM (``qwen3_moe.py``): ``mlp.gate`` and FusedMoE ``mlp.experts.routed_experts.w13_weight`` / ``w2_weight``.

Refused (``check_config``): shared experts and grouped top-k routing (:data:`modelspec.family.UNSUPPORTED_MOE_FIELDS`),
a ``decoder_sparse_step`` below 1 (transformers divides by it), layers that leave no sparse layer, sliding-window
attention. Every routing switch and how each side runs it: docs/DESIGN.md "MoE routing switches".
"""

from __future__ import annotations

from modelspec.families.llama import LLAMA_LAYER_TENSORS
from modelspec.family import (
    K_NORM,
    Q_NORM,
    TINY_COMMON,
    Family,
    HfTensor,
    MoeSpec,
    check_sliding_window,
    moe_parts,
)

ROUTER, EXPERT_GATE, EXPERT_UP, EXPERT_DOWN = moe_parts("mlp")


def qwen3_moe_sparse_layers(config: dict) -> tuple[int, ...]:
    """Transformers' ``Qwen3MoeDecoderLayer`` rule (vLLM's is the same)."""
    dense = set(config.get("mlp_only_layers") or ())
    step = config.get("decoder_sparse_step", 1)
    return tuple(n for n in range(config["num_hidden_layers"]) if n not in dense and (n + 1) % step == 0)


def check_qwen3_moe_config(config: dict, source: str) -> None:
    FAMILY.moe.check_config(config, source)
    step = config.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:  # transformers takes (n + 1) % step
        raise ValueError(
            f"{source}: decoder_sparse_step={step!r} is not supported; set an integer >= 1 "
            "(layer n is sparse when (n + 1) % decoder_sparse_step == 0)"
        )
    if not qwen3_moe_sparse_layers(config):  # nothing here builds an MoE family's model without experts
        raise ValueError(
            f"{source}: mlp_only_layers={config.get('mlp_only_layers')} with decoder_sparse_step={step} leave no "
            f"sparse layer among num_hidden_layers={config['num_hidden_layers']}; supported: at least one sparse "
            "layer (a model without experts is a qwen3 checkpoint)"
        )
    check_sliding_window(config, source)


FAMILY = Family(
    model_type="qwen3_moe",
    config_class="Qwen3MoeConfig",
    layer_tensors=(
        *LLAMA_LAYER_TENSORS,
        HfTensor("self_attn.q_norm", (Q_NORM,)),
        HfTensor("self_attn.k_norm", (K_NORM,)),
    ),
    qkv_bias="attention_bias",
    check_config=check_qwen3_moe_config,
    moe=MoeSpec(
        router=HfTensor("mlp.gate", (ROUTER,)),
        experts=(
            HfTensor("mlp.experts.{expert}.gate_proj", (EXPERT_GATE,)),
            HfTensor("mlp.experts.{expert}.up_proj", (EXPERT_UP,)),
            HfTensor("mlp.experts.{expert}.down_proj", (EXPERT_DOWN,)),
        ),
        intermediate_key="moe_intermediate_size",
        norm_topk_prob="norm_topk_prob",
        sparse_layers=qwen3_moe_sparse_layers,
    ),
    # 4 experts, top-2, unnormalised top-k (Mixtral's tiny covers the normalised one); layer 2 dense (Llama's mlp,
    # on the second stage at PP=2); m = 64 splits over TP 2 into 32, the multiple vLLM's CPU experts pad to
    tiny_config=dict(
        TINY_COMMON,
        vocab_size=176,
        head_dim=32,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
    ),
)
