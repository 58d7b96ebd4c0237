"""Mixtral (``MixtralForCausalLM``): Llama's attention with every layer an MoE layer.

- The MoE block is ``block_sparse_moe``: the router ``block_sparse_moe.gate.weight`` [E, h] and per expert e
  ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` (gate [I, h], up [I, h], down [h, I]; I =
  ``intermediate_size``, E = ``num_local_experts``, top-k = ``num_experts_per_tok``).
- Routing: softmax over E, top-k, always renormalised to sum to 1 (top-1: every weight 1.0; a
  ``norm_topk_prob`` key in config.json is ignored, as transformers and vLLM ignore it).
- vLLM (``mixtral.py``): ``block_sparse_moe.gate`` and FusedMoE ``block_sparse_moe.experts.routed_experts.w13_weight`` /
  ``w2_weight``; transformers 5 renames the block to ``mlp`` in memory only (its files keep these names).

Refused (``check_config``): a training-time ``router_jitter_noise`` (transformers multiplies the router's input
by noise in train mode, which neither the actor nor the engines do), sliding-window attention, and the MoE
designs of :data:`modelspec.family.UNSUPPORTED_MOE_FIELDS`.
"""

from __future__ import annotations

from modelspec.families.llama import LLAMA_ATTENTION_TENSORS
from modelspec.family import TINY_COMMON, Family, HfTensor, MoeSpec, check_sliding_window, moe_parts

ROUTER, EXPERT_GATE, EXPERT_UP, EXPERT_DOWN = moe_parts("block_sparse_moe")


def check_mixtral_config(config: dict, source: str) -> None:
    FAMILY.moe.check_config(config, source)
    jitter = config.get("router_jitter_noise") or 0.0
    if jitter:
        # megatron-core's moe_input_jitter_eps jitters the router's input only, transformers the experts' too
        raise ValueError(
            f"{source}: router_jitter_noise={jitter} (training-time noise on the MoE block's input) is not "
            "implemented here; supported: 0.0, set it to 0.0"
        )
    check_sliding_window(config, source)


FAMILY = Family(
    model_type="mixtral",
    config_class="MixtralConfig",
    layer_tensors=LLAMA_ATTENTION_TENSORS,
    qkv_bias=False,
    check_config=check_mixtral_config,
    moe=MoeSpec(
        router=HfTensor("block_sparse_moe.gate", (ROUTER,)),
        experts=(
            HfTensor("block_sparse_moe.experts.{expert}.w1", (EXPERT_GATE,)),
            HfTensor("block_sparse_moe.experts.{expert}.w3", (EXPERT_UP,)),
            HfTensor("block_sparse_moe.experts.{expert}.w2", (EXPERT_DOWN,)),
        ),
        intermediate_key="intermediate_size",
        norm_topk_prob=True,
    ),
    # 4 experts, top-2, every layer sparse; experts of I = 128 (64 per rank at TP 2, a multiple of vLLM's 32)
    tiny_config=dict(
        TINY_COMMON,
        intermediate_size=128,
        vocab_size=144,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        router_jitter_noise=0.0,
    ),
)
