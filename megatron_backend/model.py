"""Build a megatron-core GPTModel (one chunk per virtual pipeline stage) from a Hugging Face config.

Supported families: Qwen2 (qkv bias), Llama 3.x (tied or untied embeddings) and Qwen3 (q/k norms).
Local layer spec on CPU; Transformer Engine spec when TE is importable and CUDA is present.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_backend.layout import MAKE_VOCAB_SIZE_DIVISIBLE_BY, SUPPORTED_MODEL_TYPES, padded_vocab_size
from megatron_backend.parallel import ParallelDims

__all__ = ["MAKE_VOCAB_SIZE_DIVISIBLE_BY", "SUPPORTED_MODEL_TYPES", "build_gpt_chunks", "padded_vocab_size"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_get(hf_config: Any, key: str, default: Any = None) -> Any:
    """Read a field from a transformers config object or a config.json dict."""
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def rope_theta(hf_config: Any) -> float:
    """transformers >= 5 keeps rope_theta under ``rope_parameters``; older configs at top level."""
    params = hf_get(hf_config, "rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else hf_get(hf_config, "rope_theta", 10000.0))


def rope_scaling_kwargs(hf_config: Any) -> dict:
    """GPTModel RoPE-scaling kwargs: none for default RoPE, megatron's llama3 scaling for Llama 3.1+."""
    params = hf_get(hf_config, "rope_parameters") or hf_get(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type in (None, "default"):
        return {}
    if rope_type == "llama3":
        # megatron hard-codes low/high freq factors 1/4 and original max positions 8192 (Llama 3.1)
        expected = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        for key, value in expected.items():
            if key in params and float(params[key]) != value:
                raise ValueError(f"llama3 rope {key}={params[key]} is not supported (megatron uses {value})")
        return dict(rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, llama3")


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config_from_hf(hf_config: Any, dims: ParallelDims, dtype: str = "float32"):
    """Map a HF config (object or dict) of a supported family onto megatron's TransformerConfig."""
    from megatron.core.transformer import TransformerConfig

    model_type = hf_get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    heads = hf_get(hf_config, "num_attention_heads")
    hidden = hf_get(hf_config, "hidden_size")
    head_dim = hf_get(hf_config, "head_dim") or hidden // heads
    params_dtype = DTYPES[dtype]
    on_cpu = dims.device.type == "cpu"
    return TransformerConfig(
        num_layers=hf_get(hf_config, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=hf_get(hf_config, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=hf_get(hf_config, "num_key_value_heads") or heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_get(hf_config, "rms_norm_eps"),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2" or bool(hf_get(hf_config, "attention_bias", False)),
        qk_layernorm=model_type == "qwen3",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        sequence_parallel=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        # fused kernels are CUDA-only
        bias_dropout_fusion=not on_cpu,
        masked_softmax_fusion=not on_cpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # gloo matches p2p messages between a pair of ranks in posting order; with PP=2 + VPP the
        # batched ops post a forward and a backward tensor to the same peer and they cross. The
        # unbatched path posts even/odd-ordered ops on two communicators, which keeps them apart.
        batch_p2p_comm=not on_cpu,
    )


def layer_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if te_available():
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")


def build_gpt_chunks(hf_config: Any, dims: ParallelDims, dtype: str = "float32", max_seq_len: int | None = None):
    """One GPTModel per virtual pipeline stage held by this rank (a list of length vpp or 1)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    config = transformer_config_from_hf(hf_config, dims, dtype)
    spec = layer_spec(config)
    num_chunks = dims.vpp or 1
    chunks = []
    for vp_stage in range(num_chunks):
        vp = vp_stage if dims.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(hf_get(hf_config, "vocab_size"), dims.tp),
            max_sequence_length=max_seq_len or hf_get(hf_config, "max_position_embeddings"),
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=bool(hf_get(hf_config, "tie_word_embeddings", False)),
            position_embedding_type="rope",
            rotary_base=rope_theta(hf_config),
            **rope_scaling_kwargs(hf_config),
            parallel_output=True,
            vp_stage=vp,
        )
        chunks.append(model.to(dims.device))
    return chunks
