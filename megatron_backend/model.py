"""Build a megatron-core GPTModel (one chunk per virtual pipeline stage) from a Hugging Face config.

Supported families: Qwen2 (qkv bias), Llama 3.x (tied or untied embeddings) and Qwen3 (q/k norms).
Local layer spec on CPU; Transformer Engine spec when TE is importable and CUDA is present.

Packed sequences (``actor.remove_padding``) use megatron's THD layout everywhere: tokens [1, T] with
``PackedSeqParams(qkv_format="thd", cu_seqlens...)``; RoPE restarts per sequence (megatron's
``_apply_rotary_pos_emb_thd``, or TE's fused kernel). The attention kernel is TE's
``TEDotProductAttention`` (flash / cuDNN varlen) with TE; without TE megatron's local
``DotProductAttention`` refuses THD, so the local spec gets :class:`VarlenDotProductAttention`, which
runs megatron's own unfused attention once per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_backend import cpu_compat
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
        # optional: Transformer Engine is imported where it is used, not every install has it
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def recompute_kwargs(recompute: str, method: str = "uniform", num_layers: int | None = None, modules=None) -> dict:
    """``actor.recompute*`` -> TransformerConfig's recompute_granularity / _method / _num_layers / _modules.

    ``full`` with ``uniform`` and no layer count checkpoints every layer on its own (each keeps only its
    input); ``block`` recomputes the first ``num_layers`` layers of each stage (all when None: megatron
    caps it at the stage's layers). ``selective`` recomputes ``modules`` (megatron's default: core_attn).
    """
    if recompute == "none":
        return {}
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=list(modules) if modules else None)
    if recompute == "full":
        layers = num_layers if num_layers is not None else (1 if method == "uniform" else 1_000_000)
        return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=layers)
    raise ValueError(f"actor.recompute={recompute!r} is not one of none, selective, full")


def moe_kwargs(
    shape: ModelShape,
    dims: ParallelDims,
    aux_loss_coef: float = 0.0,
    z_loss_coef: float = 0.0,
    token_dispatcher: str = "alltoall",
    capacity_factor: float | None = None,
) -> dict:
    """TransformerConfig's MoE fields for an MoE shape (``{}`` for a dense one).

    Routing as transformers does it for both families (softmax router, top-k): normalised top-k
    (``norm_topk_prob``; Mixtral always) is megatron's top-k of the logits then softmax over those k,
    which equals softmax-then-renormalise; unnormalised is ``moe_router_pre_softmax`` (softmax over all
    experts, then top-k). Normalised top-1 is the one exception: megatron refuses a softmax over one logit
    (its gradient is zero), so it runs pre-softmax too and :func:`renormalised_top1` divides the weight by
    itself afterwards (HF's 1.0 exactly; docs/DESIGN.md "MoE routing switches"). Router in fp32. Experts:
    TE's grouped GEMM (TEGroupedMLP) with TE on CUDA, else megatron's SequentialMLP (its legacy GroupedMLP
    needs the CUDA ``grouped_gemm`` package). Which layers are MoE: ``moe_layer_freq`` as a 0/1 list per layer
    (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``). ``capacity_factor``: megatron's ``moe_expert_capacity_factor`` (None: no dropping),
    dropping the lowest-probability copies beyond an expert's capacity (``moe_token_drop_policy`` "probs").
    """
    if not shape.is_moe:
        return {}
    return dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.moe_top_k,
        moe_ffn_hidden_size=shape.moe_intermediate_size,
        moe_layer_freq=[1 if layer in shape.moe_layers else 0 for layer in range(shape.num_layers)],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not shape.norm_topk_prob or shape.moe_top_k == 1,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coef,
        moe_z_loss_coeff=z_loss_coef or None,
        moe_token_dispatcher_type=token_dispatcher,
        moe_expert_capacity_factor=capacity_factor,
        moe_token_drop_policy="probs",
        moe_grouped_gemm=te_available(),
        # every router gets a RouterReplay (megatron_backend.routing_replay): the actor records its routing to
        # compare with the engine's, and replays the engine's with algorithm.routing_replay; no action: plain top-k
        moe_enable_routing_replay=True,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
    )


def renormalised_top1(_router, _args, output: tuple[torch.Tensor, torch.Tensor]):
    """A router's forward hook for normalised top-1 (see :func:`moe_kwargs`): its weights [N, E] (the top-1
    softmax probability, 0 elsewhere) divided by their row sum, as transformers renormalises, so a routed token's
    weight is exactly 1.0. It runs after megatron's token dropping and aux-loss attachment: a dropped token's row
    stays 0 (clamped divisor) and the aux loss's gradient still flows through the probabilities."""
    probs, routing_map = output
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny), routing_map


def renormalise_top1_routers(chunks) -> None:
    # first use: keeps megatron-core (~4 s) out of `import megatron_backend.model` (tools/parity.py's input check reads rope_scaling_kwargs)
    from megatron.core.transformer.moe.router import TopKRouter

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(renormalised_top1)


# megatron's router losses as its tracker names them, and the actor.* coefficient that turns each on
ROUTER_LOSSES = {"load_balancing_loss": "moe_aux_loss_coef", "z_loss": "moe_z_loss_coef"}


def clear_router_losses() -> None:
    """Empty megatron's router-loss tracker (before a pass whose losses :func:`router_losses` reads)."""
    # first use: keeps megatron-core (~4 s) out of `import megatron_backend.model` (tools/parity.py's input check reads rope_scaling_kwargs)
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def router_losses(dims: ParallelDims, names: list[str], num_moe_layers: int, num_micro_batches: int) -> dict:
    """The router losses of the last pass as ``moe/<name>``: megatron's tracker holds, per MoE layer on the
    stage that has it, the loss before its coefficient summed over micro-batches; this is its mean over MoE
    layers, micro-batches and DP ranks. Collective over the PP, DP and TP groups: every rank calls it."""
    if not names or not num_moe_layers:
        return {}
    # first use: keeps megatron-core (~4 s) out of `import megatron_backend.model` (tools/parity.py's input check reads rope_scaling_kwargs)
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()

    def stage_sum(name: str) -> torch.Tensor:
        """This stage's layers' sum (a stage without MoE layers has no tracker entry). A loss megatron tracks
        with a ``reduce_group`` (the load-balancing loss under sequence parallelism: each TP rank's value is its
        S / tp tokens' share) is summed over that group first, as its ``reduce_aux_losses_tracker_across_ranks``
        does."""
        if name not in tracker:
            return torch.zeros((), device=dims.device)
        value = tracker[name]["values"].sum()
        group = tracker[name].get("reduce_group")
        if group is not None and group.size() > 1:
            torch.distributed.all_reduce(value, group=group)
        return value

    values = torch.stack([stage_sum(n) for n in names]).to(torch.float32) / num_micro_batches  # [len(names)]
    if dims.pp > 1:
        torch.distributed.all_reduce(values, group=dims.pp_group)
    if dims.dp > 1:
        torch.distributed.all_reduce(values, group=dims.dp_group)
    values /= num_moe_layers * dims.dp
    return {f"moe/{name}": float(v) for name, v in zip(names, values.tolist())}


class RoutedCopies:
    """The most routed copies one rank's experts received in any MoE layer call of a pass, as a multiple of what
    balanced routing gives them: N k for the N tokens the layer's router saw on this rank, times the expert-TP
    group's gather under sequence parallelism (token_dispatcher.py ``dispatch_postprocess``), the planner's
    balanced count (planner/sizes.py ``moe_activation_bytes_per_token``). megatron routes unevenly (no capacity
    factor here: nothing is dropped), and the received copies size the experts' activations. Forward pre-hooks
    on each ``MoELayer`` (its input [S, b, h]) and on its ``experts`` (their input [copies, h])."""

    def __init__(self, chunks, top_k: int, gathered: int = 1) -> None:
        # first use: keeps megatron-core (~4 s) out of `import megatron_backend.model` (tools/parity.py's input check reads rope_scaling_kwargs)
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.balanced_per_token = top_k * gathered
        self.max_ratio = 0.0
        self._tokens = 0
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, MoELayer):
                    module.register_forward_pre_hook(self._layer_input)
                    module.experts.register_forward_pre_hook(self._experts_input)

    def _layer_input(self, _module, args) -> None:
        hidden = args[0]
        self._tokens = hidden.numel() // hidden.shape[-1]

    def _experts_input(self, _module, args) -> None:
        if self._tokens:
            self.max_ratio = max(self.max_ratio, args[0].shape[0] / (self._tokens * self.balanced_per_token))

    def reset(self) -> None:
        """Forget what earlier passes received (the log-prob passes run the same hooks)."""
        self.max_ratio = 0.0

    def take(self, device: torch.device, group=None) -> float:
        """The most over this pass and every rank of ``group`` (collective: every rank calls it); resets."""
        ratio = torch.tensor([self.max_ratio], dtype=torch.float32, device=device)
        torch.distributed.all_reduce(ratio, op=torch.distributed.ReduceOp.MAX, group=group)
        self.reset()
        return float(ratio)


def transformer_config(
    shape: ModelShape,
    dims: ParallelDims,
    dtype: str = "float32",
    recompute: dict | None = None,
    variable_seq_lengths: bool = False,
    moe: dict | None = None,
    sequence_parallel: bool = False,
):
    """Map the model's shape onto megatron's TransformerConfig.

    ``recompute``: :func:`recompute_kwargs`. ``variable_seq_lengths``: micro-batches differ in shape
    (packed sequences, token-budget micro-batches), so pipeline stages send each other the shape first.
    ``moe``: :func:`moe_kwargs` (an MoE model; the dispatcher defaults to alltoall). ``sequence_parallel``:
    megatron's (``ActorConfig.sequence_parallel_for``); the model's input length must then divide by TP
    (``megatron_backend.packing`` pads it).
    """
    # first use: keeps megatron-core (~4 s) out of `import megatron_backend.model` (tools/parity.py's input check reads rope_scaling_kwargs)
    from megatron.core.transformer import TransformerConfig

    params_dtype = torch_dtype(dtype)
    on_cpu = dims.device.type == "cpu"
    recompute = dict(recompute or {})
    if recompute.get("recompute_method") == "block":  # "all layers": megatron wants <= layers per stage
        per_stage = shape.num_layers // (dims.pp * (dims.vpp or 1))
        recompute["recompute_num_layers"] = min(recompute["recompute_num_layers"], per_stage)
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
        sequence_parallel=sequence_parallel and dims.tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        # fused kernels are CUDA-only
        bias_dropout_fusion=not on_cpu,
        masked_softmax_fusion=cpu_compat.fused_softmax_available(),  # apex's kernels
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # gloo matches p2p messages between a pair of ranks in posting order; with PP=2 + VPP the
        # batched ops post a forward and a backward tensor to the same peer and they cross. The
        # unbatched path posts even/odd-ordered ops on two communicators, which keeps them apart.
        batch_p2p_comm=not on_cpu,
        variable_seq_lengths=variable_seq_lengths and dims.pp > 1,
        # a dense model has no token dispatcher; megatron's default (allgather) rejects variable lengths
        **({"moe_token_dispatcher_type": "alltoall"} | (moe or {})),
        **recompute,
    )


def _varlen_attention_class():
    # first use: keeps megatron-core (~4 s) out of `import megatron_backend.model` (tools/parity.py's input check reads rope_scaling_kwargs)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class VarlenDotProductAttention(DotProductAttention):
        """megatron's local (unfused) attention, THD-capable: the packed sequences attend in one batched call.

        With ``packed_seq_params.qkv_format == "thd"`` megatron's SelfAttention hands q/k/v as [T, heads, d] (batch
        dim squeezed, RoPE already applied per sequence). Each sequence ``cu_seqlens[i]:cu_seqlens[i+1]`` is placed
        at the start of row i of [b, heads, L, d] (L: the longest), zeros after it, and the b rows go through
        torch's ``scaled_dot_product_attention`` with a causal mask at once: a real query attends only to keys at
        or before it, all of its own sequence, so the padding changes nothing it reads; the padded queries' rows
        are dropped. On CPU torch runs its flash kernel, in fp32 (no [L, L] scores kept; backward keeps q, k, v, the
        output and a log-sum-exp per query head, planner/sizes.py). One call per layer instead of one per sequence
        (and per sequence an RNG-tracker fork and a causal-mask build): the step's largest cost on CPU before.
        Output [T, 1, heads * d], which SelfAttention reshapes as it does TE's THD output.
        """

        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            bounds = packed_seq_params.cu_seqlens_q.to(torch.long)  # [b + 1]
            lengths = bounds[1:] - bounds[:-1]
            num_tokens, longest = int(bounds[-1]), int(lengths.max())
            row = torch.repeat_interleave(torch.arange(len(lengths), device=bounds.device), lengths)  # [T]: its sequence
            position = torch.arange(num_tokens, device=bounds.device) - bounds[row]  # [T]: its place in it

            # on CPU a 16-bit attention runs in fp32: torch's CPU flash kernel caches its reduced-precision backward
            # per sequence length (measured: +0.5 MiB RSS for each new length, never released)
            dtype = torch.float32 if query.device.type == "cpu" else query.dtype

            def padded(x):  # [T, heads, d] -> [b, heads, L, d], zeros after each sequence
                rows = x.new_zeros(len(lengths), longest, *x.shape[1:], dtype=dtype)
                return rows.index_put_((row, position), x.to(dtype)).transpose(1, 2)

            heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
            out = F.scaled_dot_product_attention(
                padded(query),
                padded(key),
                padded(value),
                dropout_p=self.config.attention_dropout if self.training else 0.0,
                is_causal=True,
                scale=self.softmax_scale * (self.scale_mask_softmax.scale or 1.0),  # apply_query_key_layer_scaling
                enable_gqa=heads != groups,
            )  # [b, heads, L, d]
            return out.transpose(1, 2)[row, position].reshape(num_tokens, 1, -1).to(query.dtype)  # [T, 1, heads * d]

    return VarlenDotProductAttention


def layer_spec(config, vp_stage: int | None = None):
    """TE's spec when TE is usable, else megatron's local spec with THD-capable core attention.

    An MoE config gets megatron's decoder block spec (this stage's layers, dense or MoE per
    ``moe_layer_freq``) instead of one layer spec."""
    # first use: keeps megatron-core (~4 s) out of `import megatron_backend.model` (tools/parity.py's input check reads rope_scaling_kwargs)
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    use_te = te_available()
    if config.num_moe_experts:
        block = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )
        if not use_te:
            for spec in block.layer_specs:
                spec.submodules.self_attention.submodules.core_attention = _varlen_attention_class()
        return block
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _varlen_attention_class()
    return spec


def build_gpt_chunks(
    shape: ModelShape,
    dims: ParallelDims,
    dtype: str = "float32",
    max_seq_len: int | None = None,
    recompute: dict | None = None,
    variable_seq_lengths: bool = False,
    moe: dict | None = None,
    sequence_parallel: bool = False,
):
    """One GPTModel per virtual pipeline stage held by this rank (a list of length vpp or 1).
    ``moe``: :func:`moe_kwargs` for an MoE shape; ``sequence_parallel``: see :func:`transformer_config`."""
    # first use: keeps megatron-core (~4 s) out of `import megatron_backend.model` (tools/parity.py's input check reads rope_scaling_kwargs)
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(shape, dims, dtype, recompute, variable_seq_lengths, moe, sequence_parallel)
    num_chunks = dims.vpp or 1
    chunks = []
    for vp_stage in range(num_chunks):
        vp = vp_stage if dims.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, vp),
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
        # every param in the model's dtype, as megatron's Float16Module casts it (``module.bfloat16()``): the local
        # spec's torch-norm fallback (no TE, CPU) creates its weights in fp32 whatever params_dtype says
        chunks.append(model.to(device=dims.device, dtype=config.params_dtype))
    if shape.is_moe and shape.norm_topk_prob and shape.moe_top_k == 1:
        renormalise_top1_routers(chunks)
    return chunks
