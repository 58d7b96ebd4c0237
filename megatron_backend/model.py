"""Build a megatron-core GPTModel (one chunk per virtual pipeline stage) from a Hugging Face config.

Supported families: Qwen2 (qkv bias), Llama 3.x (tied or untied embeddings) and Qwen3 (q/k norms).
Local layer spec on CPU; Transformer Engine spec when TE is importable and CUDA is present.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_backend.layout import padded_vocab_size
from megatron_backend.parallel import ParallelDims
from modelspec import ModelShape, torch_dtype


def rope_scaling_kwargs(shape: ModelShape) -> dict:
    """GPTModel RoPE-scaling kwargs: none for default RoPE, megatron's llama3 scaling for Llama 3.1+."""
    rope = shape.rope
    if rope.rope_type == "default":
        return {}
    # megatron hard-codes low/high freq factors 1/4 and original max positions 8192 (Llama 3.1)
    expected = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    for key, value in expected.items():
        if float(getattr(rope, key)) != value:
            raise ValueError(f"llama3 rope {key}={getattr(rope, key)} is not supported (megatron uses {value})")
    return dict(rope_scaling=True, rope_scaling_factor=rope.factor)


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(shape: ModelShape, dims: ParallelDims, dtype: str = "float32"):
    """Map the model's shape onto megatron's TransformerConfig."""
    from megatron.core.transformer import TransformerConfig

    params_dtype = torch_dtype(dtype)
    on_cpu = dims.device.type == "cpu"
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
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


def build_gpt_chunks(shape: ModelShape, dims: ParallelDims, dtype: str = "float32", max_seq_len: int | None = None):
    """One GPTModel per virtual pipeline stage held by this rank (a list of length vpp or 1)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(shape, dims, dtype)
    spec = layer_spec(config)
    num_chunks = dims.vpp or 1
    chunks = []
    for vp_stage in range(num_chunks):
        vp = vp_stage if dims.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(shape.vocab_size, dims.tp),
            max_sequence_length=max_seq_len or shape.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=shape.rope.theta,
            **rope_scaling_kwargs(shape),
            parallel_output=True,
            vp_stage=vp,
        )
        chunks.append(model.to(dims.device))
    return chunks
