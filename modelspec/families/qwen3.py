"""Qwen3 (``Qwen3ForCausalLM``): Llama's tensors plus per-head q/k RMSNorms [d], an explicit head_dim, q/k/v
biases only with ``attention_bias``."""

from __future__ import annotations

from modelspec.families.llama import LLAMA_LAYER_TENSORS
from modelspec.family import K_NORM, Q_NORM, TINY_COMMON, Family, HfTensor

FAMILY = Family(
    model_type="qwen3",
    config_class="Qwen3Config",
    layer_tensors=(
        *LLAMA_LAYER_TENSORS,
        HfTensor("self_attn.q_norm", (Q_NORM,)),
        HfTensor("self_attn.k_norm", (K_NORM,)),
    ),
    qkv_bias="attention_bias",
    tiny_config=dict(TINY_COMMON, vocab_size=160, head_dim=32, rope_theta=1_000_000.0, tie_word_embeddings=False),
)
