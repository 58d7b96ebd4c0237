"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's tensors, q/k/v biases always."""

from __future__ import annotations

from modelspec.families.llama import LLAMA_LAYER_TENSORS
from modelspec.family import TINY_COMMON, Family

FAMILY = Family(
    model_type="qwen2",
    config_class="Qwen2Config",
    layer_tensors=LLAMA_LAYER_TENSORS,
    qkv_bias=True,
    tiny_config=dict(TINY_COMMON, vocab_size=128, rope_theta=1_000_000.0, tie_word_embeddings=False),
)
