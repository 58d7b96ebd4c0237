"""Llama 3.x (``LlamaForCausalLM``): one HF tensor per part, q/k/v biases only with ``attention_bias``; tied or
untied embeddings and llama3 RoPE scaling come from config.json."""

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
)

# Qwen2's and Qwen3's checkpoints name their tensors as Llama's does (Qwen3 adds q/k norms); Mixtral's attention
# and norms too (its MLPs are experts).
LLAMA_ATTENTION_TENSORS = (
    HfTensor("input_layernorm", (INPUT_NORM,)),
    HfTensor("self_attn.q_proj", (Q,)),
    HfTensor("self_attn.k_proj", (K,)),
    HfTensor("self_attn.v_proj", (V,)),
    HfTensor("self_attn.o_proj", (O_PROJ,)),
    HfTensor("post_attention_layernorm", (POST_NORM,)),
)
LLAMA_LAYER_TENSORS = (
    *LLAMA_ATTENTION_TENSORS,
    HfTensor("mlp.gate_proj", (GATE,)),
    HfTensor("mlp.up_proj", (UP,)),
    HfTensor("mlp.down_proj", (DOWN,)),
)

FAMILY = Family(
    model_type="llama",
    config_class="LlamaConfig",
    layer_tensors=LLAMA_LAYER_TENSORS,
    qkv_bias="attention_bias",
    # tied embeddings; vocab 99, the tiny tokenizer's size, NOT a multiple of 64: every vocab-padding path runs
    tiny_config=dict(
        TINY_COMMON,
        vocab_size=99,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    ),
)
