"""Phi-3 (``Phi3ForCausalLM``): a Llama decoder whose checkpoint fuses q/k/v and gate/up.

- ``self_attn.qkv_proj.weight`` [(Hq + 2 Hkv) d, h]: rows [q; k; v] (transformers splits it at Hq d and
  (Hq + Hkv) d); no biases.
- ``mlp.gate_up_proj.weight`` [2 I, h]: rows [gate; up] (transformers ``chunk(2)``s the output, gate first).
- vLLM's ``phi3.py`` is a ``LlamaForCausalLM``: its ``qkv_proj`` / ``gate_up_proj`` take the fused HF tensor
  whole and split it into the same q/k/v and gate/up shards as Llama's, so its layout is Llama's.
- megatron-core: the same GPTModel as Llama (SwiGLU, RMSNorm, RoPE over the whole head).

Quirks this repo does not implement (``check_config`` refuses them): partial RoPE (Phi-4-mini's
``partial_rotary_factor`` 0.75), sliding-window attention shorter than the context (Phi-3-mini-4k's
2047 of 4096), and the long-context RoPE (``longrope``, refused by ``RopeParams``).
"""

from __future__ import annotations

from modelspec.family import (
    DOWN,
    GATE,
    INPUT_NORM,
    O_PROJ,
    POST_NORM,
    TINY_COMMON,
    UP,
    Family,
    HfTensor,
    K,
    Q,
    V,
    check_sliding_window,
)


def check_phi3_config(config: dict, source: str) -> None:
    """ValueError naming the config.json field when this Phi-3 needs what nothing here implements."""
    rope = config.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(
            f"{source}: partial_rotary_factor={partial} (RoPE on part of each head) is not implemented here "
            "(megatron actor, native engine); only 1.0 is supported"
        )
    check_sliding_window(config, source)


FAMILY = Family(
    model_type="phi3",
    config_class="Phi3Config",
    layer_tensors=(
        HfTensor("input_layernorm", (INPUT_NORM,)),
        HfTensor("self_attn.qkv_proj", (Q, K, V)),
        HfTensor("self_attn.o_proj", (O_PROJ,)),
        HfTensor("post_attention_layernorm", (POST_NORM,)),
        HfTensor("mlp.gate_up_proj", (GATE, UP)),
        HfTensor("mlp.down_proj", (DOWN,)),
    ),
    qkv_bias=False,
    check_config=check_phi3_config,
    # vocab 112: not a multiple of 64 (vLLM pads it to 128) and another size than every other tiny family's
    tiny_config=dict(TINY_COMMON, vocab_size=112, rope_theta=10_000.0, tie_word_embeddings=False, sliding_window=None),
)
