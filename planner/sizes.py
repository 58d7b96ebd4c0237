"""Element counts and bytes of each thing a rank holds, from the :class:`ModelShape` alone.

Notation: h hidden, I intermediate, d head_dim, Hq / Hkv q / KV heads, L layers, V vocab, t a TP size,
e the dtype's bytes, N tokens of one micro-batch (micro_batch_size x sequence length padded; the
real tokens of its sequences packed).

The two layouts are the ones DESIGN.md pins (megatron-core's for the actor, vLLM's for the engine):
megatron pads the vocab to a multiple of 128 x TP and gives the first pipeline stage the embedding
and the last one the output layer (a copy of the embedding when tied and PP > 1); vLLM pads the vocab
to a multiple of 64 and, when rollout TP exceeds the KV heads, replicates KV heads so each rank holds
one. The padding rules are restated here (and pinned against the real layouts by a test) so this
package stays free of torch and megatron.
"""

from __future__ import annotations

import math

from modelspec.family import (
    dims_size,
    even_split_sizes,
    hf_tensor_shapes,
    layer_param_count,
    layer_parts,
    megatron_layer_param_order,
    rank_sizes,
)
from modelspec.shape import ModelShape

MEGATRON_VOCAB_DIVISOR = 128  # megatron_backend.layout.MAKE_VOCAB_SIZE_DIVISIBLE_BY
VLLM_VOCAB_PADDING = 64  # rollout.layout.VOCAB_PADDING (vLLM's DEFAULT_VOCAB_PADDING_SIZE)
FP32_BYTES = 4
INT64_BYTES = 8
INT16_BYTES = 2


def megatron_padded_vocab(vocab_size: int, tp: int) -> int:
    multiple = MEGATRON_VOCAB_DIVISOR * tp
    return math.ceil(vocab_size / multiple) * multiple


def vllm_padded_vocab(vocab_size: int) -> int:
    return math.ceil(vocab_size / VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def actor_rank_sizes(shape: ModelShape, tp: int, ep: int = 1, etp: int | None = None) -> dict[str, int]:
    """Dim sizes on one actor rank (megatron layout): heads and rows split by TP, experts by EP (E / ep local
    experts), each expert's rows by expert TP ``etp`` (TP unless set)."""
    return even_split_sizes(shape, tp, ep, etp)


def routing_host_bytes(shape: ModelShape, sequences_per_step: int, rank_sequences: int, seq_len: int) -> int:
    """Host bytes of the engine's routing in one rank, from the rollout to the end of the step: each of the step's
    completions' ``routed_experts`` [MoE layers, prompt + response - 1, top-k] int16 (rollout/engine.py
    ``Completion``; every rank holds every sample), the rank's batch [B, S, layers, k] int16 (rl/batching.py
    ``pack_sequences``, kept on the host by ``make_batch``) and a pass's micro-batches, in the routers' token order,
    int16 (megatron_backend/packing.py), all at ``seq_len`` tokens a row."""
    per_token = len(shape.moe_layers) * shape.moe_top_k * INT16_BYTES
    return per_token * seq_len * (sequences_per_step + 2 * rank_sequences)


def routing_device_bytes(shape: ModelShape, pp: int, stage: int, routed_tokens: int) -> int:
    """Device bytes of the routing a pass holds on a rank of ``stage``: each of its MoE routers' [N, k] int64 for
    the micro-batch in flight (megatron_backend/routing_replay.py: the replay's targets, kept until the pass ends,
    or the engine's routing the recorded top-k is compared with), N the tokens the router sees."""
    layers = sum(1 for layer in stage_layers(shape, pp, stage) if shape.is_moe_layer(layer))
    return layers * routed_tokens * shape.moe_top_k * INT64_BYTES


def stage_layers(shape: ModelShape, pp: int, stage: int) -> range:
    """The layers pipeline stage ``stage`` holds without VPP (with VPP its chunks hold as many, interleaved:
    the same count, and the same parameters unless dense and sparse layers mix)."""
    per_stage = shape.num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def actor_stage_param_count(
    shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1, etp: int | None = None
) -> int:
    """Parameters one actor rank of pipeline stage ``stage`` holds (megatron layout, VPP chunks summed); an MoE
    layer's experts E / ep of them (each expert's rows over ``etp``), the router whole."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is outside [0, {pp})")
    h = shape.hidden_size
    sizes = actor_rank_sizes(shape, tp, ep, etp)
    count = sum(layer_param_count(shape, sizes, layer) for layer in stage_layers(shape, pp, stage))
    vocab_rows = megatron_padded_vocab(shape.vocab_size, tp) // tp * h
    if stage == 0:
        count += vocab_rows  # embedding
    if stage == pp - 1:
        count += h  # final norm
        if not shape.tie_word_embeddings or pp > 1:
            count += vocab_rows  # output layer (tied + PP > 1: the last stage keeps its own copy)
    return count


def actor_stage_param_tensors(
    shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1, etp: int | None = None, te_norms: bool = False
) -> tuple[list[int], list[int]]:
    """(dense, routed experts): the elements of each parameter tensor one actor rank of pipeline stage ``stage``
    holds, in the order megatron registers them (the embedding, each layer's by
    modelspec.family.megatron_layer_param_order, the final norm, the output layer): megatron's own tensors (one
    fused qkv, a tensor per local expert's fc1 and fc2; ``te_norms``: Transformer Engine's spec, norms fused into
    linear_qkv / linear_fc1 and the experts grouped). The layers as :func:`stage_layers` gives them (VPP chunks
    each have their own buffers: not split here)."""
    h = shape.hidden_size
    sizes = actor_rank_sizes(shape, tp, ep, etp)
    vocab_rows = megatron_padded_vocab(shape.vocab_size, tp) // tp * h
    dense, experts = [vocab_rows] if stage == 0 else [], []
    for layer in stage_layers(shape, pp, stage):
        sparse = shape.is_moe_layer(layer)
        params: dict[str, int] = {}  # megatron's name -> elements (stacked parts summed)
        for part, kind in layer_parts(shape, layer):
            elements = math.prod(dims_size(part.kind_dims(kind), sizes))
            names = (
                [part.megatron_expert_param(kind, e, te_norms) for e in range(sizes["experts"])]
                if part.expert
                else [part.megatron_param(kind, te_norms, sparse)]
            )
            for name in names:
                params[name] = params.get(name, 0) + elements
        for name in sorted(params, key=megatron_layer_param_order):
            (experts if name.startswith("mlp.experts.") else dense).append(params[name])
    if stage == pp - 1:
        dense.append(h)  # final norm
        if not shape.tie_word_embeddings or pp > 1:
            dense.append(vocab_rows)  # output layer
    return dense, experts


def actor_stage_expert_param_count(
    shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1, etp: int | None = None
) -> int:
    """The routed experts' share of :func:`actor_stage_param_count` (E / ep experts, their rows over ``etp``): the
    params megatron keeps in its expert-parallel buffers (distributed/distributed_data_parallel.py,
    ``expert_parallel_buffers``), whose grads reduce and whose optimizer states shard over the expert-data-parallel
    group, not DP (optimizer/__init__.py builds their optimizer on ``intra_expt_dp_group``). 0 for a dense model."""
    sizes = actor_rank_sizes(shape, tp, ep, etp)
    return sum(
        math.prod(dims_size(part.kind_dims(kind), sizes)) * sizes["experts"]
        for layer in stage_layers(shape, pp, stage)
        for part, kind in layer_parts(shape, layer)
        if part.expert
    )


def moe_layer_kinds(shape: ModelShape) -> tuple[bool, ...]:
    """Which kinds of decoder layer the model has: (False,) dense only, (True,) MoE only, (False, True) mixed."""
    return tuple(sorted({shape.is_moe_layer(layer) for layer in range(shape.num_layers)}))


def engine_kv_heads_per_rank(shape: ModelShape, rollout_tp: int) -> int:
    """KV heads one engine rank holds: Hkv / t, or 1 (replicated) when t >= Hkv."""
    return max(1, shape.num_kv_heads // rollout_tp)


def engine_rank_sizes(
    shape: ModelShape, rollout_tp: int, rollout_ep: int = 1, expert_tp: int | None = None
) -> dict[str, int]:
    """Dim sizes on one engine rank (vLLM layout): heads with KV replication, E / ``rollout_ep`` experts (engine
    expert parallel, native engine), each expert's rows split over ``expert_tp`` ranks (None: rollout TP; vLLM
    with several replicas: every engine rank, ``PlanInputs.engine_expert_split``)."""
    t = rollout_tp
    return rank_sizes(
        shape,
        shape.num_heads // t,
        engine_kv_heads_per_rank(shape, t),
        shape.intermediate_size // t,
        moe_intermediate=shape.moe_intermediate_size // (expert_tp or t),
        experts=shape.num_experts // rollout_ep,
    )


def engine_param_count(shape: ModelShape, rollout_tp: int, rollout_ep: int = 1, expert_tp: int | None = None) -> int:
    """Parameters one engine rank holds (vLLM layout: KV-head replication, vocab padded to 64, tied once;
    E / ``rollout_ep`` experts, m / ``expert_tp`` rows of each: :func:`engine_rank_sizes`)."""
    h, t = shape.hidden_size, rollout_tp
    sizes = engine_rank_sizes(shape, t, rollout_ep, expert_tp)
    layers = sum(layer_param_count(shape, sizes, layer) for layer in range(shape.num_layers))
    vocab_rows = vllm_padded_vocab(shape.vocab_size) // t * h
    return layers + vocab_rows * (1 if shape.tie_word_embeddings else 2) + h


def engine_gemm_weights(
    shape: ModelShape, rollout_tp: int, rollout_ep: int = 1, expert_tp: int | None = None
) -> dict[tuple[int, int], int]:
    """The weights one engine rank multiplies its rows by, as {(out, in): how many}: per layer each vLLM module's
    weight (the parts it stacks along rows: qkv, o, gate_up, down; an MoE layer's router and each local expert's
    w13 and w2), and the lm_head [P/t, h] (tied or not, the sampled rows meet it). rollout/native/model.py runs each
    as ``F.linear`` / ``mm`` of [rows, in] by [out, in] (o and down through their transposed views)."""
    sizes = engine_rank_sizes(shape, rollout_tp, rollout_ep, expert_tp)
    counts: dict[tuple[int, int], int] = {}
    for layer in range(shape.num_layers):
        modules: dict[str, tuple[int, int, int]] = {}  # vLLM module -> (rows stacked, in, how many)
        for part, kind in layer_parts(shape, layer):
            dims = dims_size(part.kind_dims(kind), sizes)
            if kind != "weight" or len(dims) != 2:  # a bias, a norm
                continue
            rows, columns, _ = modules.get(part.vllm, (0, dims[1], 0))
            modules[part.vllm] = (rows + dims[0], columns, sizes["experts"] if part.expert else 1)
        for out_features, in_features, how_many in modules.values():
            counts[(out_features, in_features)] = counts.get((out_features, in_features), 0) + how_many
    head = (vllm_padded_vocab(shape.vocab_size) // rollout_tp, shape.hidden_size)
    counts[head] = counts.get(head, 0) + 1
    return counts


def kv_bytes_per_token(shape: ModelShape, rollout_tp: int, element_bytes: int) -> int:
    """KV-cache bytes per token on one engine rank: 2 (k, v) x L x KV heads per rank x d x e."""
    return 2 * shape.num_layers * engine_kv_heads_per_rank(shape, rollout_tp) * shape.head_dim * element_bytes


def layer_activation_bytes_per_token(
    shape: ModelShape,
    tp: int,
    element_bytes: int,
    attention: str,
    recomputed: tuple[str, ...] = (),
    sparse: bool = False,
    etp: int | None = None,
    sequence_parallel: bool = False,
    routed_copies_ratio: float = 1.0,
    packed: bool = False,
) -> int:
    """Bytes one decoder layer keeps for backward per token (megatron).

    Kept per token: the inputs and outputs of the two fused RMSNorm+linear blocks (4h), the qkv output, RoPE'd
    q and k and the attention output (3(Hq + Hkv)d / t), the gate/up output and SwiGLU output (3I / t), all in
    the dtype, plus the fp32 log-sum-exp per q head of flash attention. ``sequence_parallel`` (megatron's, at
    t > 1): the 4h are the sequence-parallel region's, each rank holding S / t of the tokens there
    (transformer_layer.py's norms and residual adds run on the [S / t, b, h] shard; tensor_parallel/layers.py
    ``LinearWithGradAccumulationAndAsyncCommunication`` saves its local input shard and all-gathers it again in
    backward), so 4h / t; without it they are not split by TP. ``attention="unfused"`` (megatron's local spec,
    used on CPU, no sequence parallelism): its own count (:func:`local_layer_activation_elements_per_token`); the
    [Hq/t, s, s] scores and probabilities are counted by the caller (:func:`unfused_attention_bytes`), and with
    ``packed`` sequences (megatron_backend/model.py ``VarlenDotProductAttention``, torch's flash kernel) the two
    int64 indices that place each token in the padded rows; what the kernel keeps per padded row is the caller's
    (:func:`local_packed_attention_padding_bytes_per_token`). ``recomputed`` (megatron's selective ``recompute_modules``) drops
    what those modules recompute: ``layernorm`` the two norm outputs (2h), ``mlp`` the MLP's
    internals (3I / t), ``core_attn`` the log-sum-exp (and the unfused scores, by the caller). ``sparse``: an MoE
    layer, its router and experts in place of the dense MLP (:func:`moe_activation_bytes_per_token`; ``mlp`` or
    ``moe`` recomputes them; ``routed_copies_ratio``: the copies an EP rank's experts receive over balanced
    routing's, :func:`moe_activation_bytes_per_token`). Qwen3's per-head q and k norms (``qk_norm``; megatron's TE spec builds them as
    ``TENorm``, Transformer Engine 2's ``RMSNorm`` op, transformer_engine/pytorch/ops/basic/rmsnorm.py
    ``op_forward``): each saves ``input_.contiguous()`` and the fp32 rstdevs per head; the query and key reach
    them as views of the fused qkv output that are not contiguous (attention.py ``get_query_key_value_tensors``),
    so the copies are new: (Hq / t + KV heads per rank) x (d elements + 4 B). Read from the source, not measured.
    """
    h, d, t = shape.hidden_size, shape.head_dim, tp
    sp = t if sequence_parallel else 1  # the sequence-parallel region's split
    qk_rstdevs = indices = 0
    if attention == "unfused":
        elements = local_layer_activation_elements_per_token(shape, tp, recomputed, sparse, packed)
        if packed:
            indices = 2 * INT64_BYTES
    else:
        norms = (4 * h - (2 * h if "layernorm" in recomputed else 0)) // sp
        mlp = 0 if "mlp" in recomputed or sparse else 3 * shape.intermediate_size // t
        elements = norms + 3 * (shape.num_heads + shape.num_kv_heads) * d // t + mlp
        if shape.qk_norm:  # Qwen3's q and k norms (the docstring's end)
            q_heads, kv_heads = shape.num_heads // t, engine_kv_heads_per_rank(shape, t)
            elements += (q_heads + kv_heads) * d
            qk_rstdevs = (q_heads + kv_heads) * FP32_BYTES
    lse = FP32_BYTES * shape.num_heads // t if attention == "flash" and "core_attn" not in recomputed else 0
    moe = 0
    if sparse and not {"mlp", "moe"} & set(recomputed):
        moe = moe_activation_bytes_per_token(
            shape, etp or t, element_bytes, sp, local=attention == "unfused", routed_copies_ratio=routed_copies_ratio
        )
    return elements * element_bytes + lse + moe + qk_rstdevs + indices


def stage_ends_activation_bytes_per_token(
    shape: ModelShape, tp: int, element_bytes: int, local: bool, *, first: bool, last: bool, split: int
) -> int:
    """What a train forward keeps for backward per token outside the decoder layers, on a first and/or last stage.

    - First stage, the embedding (megatron/core/tensor_parallel/layers.py ``VocabParallelEmbedding``): the token
      ids it looked up, int64 (8 B), and at TP > 1 the bool mask of ids outside the rank's vocab slice (1 B).
    - Last stage, the final RMSNorm (``TransformerBlock.final_layernorm``, on 1/``split`` of the tokens: TP under
      sequence parallelism, else 1). megatron's local spec runs torch's composite RMSNorm, which keeps its input,
      ``x * rsqrt``, its output (the output layer's input) and the rsqrt [s, b, 1]: 3h + 1 elements. Transformer
      Engine's fused RMSNorm keeps its input and the fp32 rsigma, and the output layer keeps the norm's output:
      2h elements + 4 B (read from TE's source, not measured).
    Counted with ``torch.autograd.graph.saved_tensors_hooks`` on tiny:qwen2 at TP 1 and 2, exactly
    (tests/test_local_layer_count.py::test_the_ends_of_the_model_are_counted); the log-prob pass's tensors are
    :func:`logits_bytes`'."""
    h = shape.hidden_size
    out = (8 + (1 if tp > 1 else 0)) if first else 0
    if last:
        norm = (3 * h + 1) * element_bytes if local else 2 * h * element_bytes + FP32_BYTES
        out += norm / split
    return math.ceil(out)


def local_layer_activation_elements_per_token(
    shape: ModelShape, tp: int, recomputed: tuple[str, ...] = (), sparse: bool = False, packed: bool = False
) -> int:
    """Elements one decoder layer of megatron's local spec (CPU: no Transformer Engine, no Apex) keeps for backward per
    token, counted with ``torch.autograd.graph.saved_tensors_hooks`` on the tiny Qwen2 (TP 1; at head_dim 32 and 48,
    intermediate 256 and 384, exactly): parameters and the [Hq/t, s, s] scores and mask
    (:func:`unfused_attention_bytes`) apart.

    - two RMSNorms, torch's (megatron/core/transformer/torch_norm.py falls back to ``torch.nn.RMSNorm``, composite):
      each keeps its input, ``x * rsqrt`` and its output (the next linear's input), 3h, and the rsqrt [s, b, 1];
    - RoPE, unfused (megatron/core/models/common/embeddings/rope_utils.py ``_apply_rotary_pos_emb_bshd``, no rope
      fusion): cos and sin [s, 1, 1, d] for q and again for k, 4d;
    - attention (megatron/core/transformer/dot_product_attention.py): q, k and v with k and v repeated to the
      Hq/t query heads (``repeat_interleave`` for GQA) for the bmm's, and the context (linear_proj's input), 4 Hq d/t;
      ``packed`` (megatron_backend/model.py ``VarlenDotProductAttention``: torch's flash kernel over the sequences
      padded to [b, H, L, d]): the context gathered from the kernel's output, Hq d/t per real token (the padded q,
      k, v and output are per padded row: :func:`local_packed_attention_padding_bytes_per_token`, the caller's);
    - the MLP (megatron/core/transformer/mlp.py, unfused ``glu``): fc1's output [s, b, 2I/t] and three I/t tensors
      of SwiGLU's chunk / SiLU / product.
    - Qwen3's q and k norms (``qk_norm``: megatron's ``q_layernorm`` / ``k_layernorm``, torch's composite RMSNorm
      per head, attention.py ``get_query_key_value_tensors``): each keeps ``x * rsqrt`` and the rsqrt per head
      ((Hq + Hkv) d / t + (Hq + Hkv) / t), and its input; the key's input is a view of the fused qkv output, so that
      whole storage stays ((Hq + 2 Hkv) d / t), and with more than one KV head per rank the query is regrouped by a
      copying ``reshape`` whose result the q norm keeps (Hq d / t) (counted with the same hooks on tiny:qwen3 at
      TP 1 and 2, exactly: tests/test_local_layer_count.py).
    ``recomputed`` (not measured on the local spec): ``layernorm`` keeps the norms' inputs only (2h), ``mlp`` nothing
    of the MLP, ``core_attn`` drops only the scores (the caller); ``sparse``: an MoE layer's router and experts in
    place of the MLP (:func:`moe_activation_bytes_per_token`, added by the caller)."""
    h, d, t = shape.hidden_size, shape.head_dim, tp
    norms = 2 * h if "layernorm" in recomputed else 6 * h + 2
    heads = shape.num_heads * d // t
    # with core_attn recomputed too (the scores apart): an upper bound, not measured
    attention = (heads if packed else 4 * heads) + 4 * d
    if shape.qk_norm:
        q_heads, kv_heads = shape.num_heads // t, engine_kv_heads_per_rank(shape, t)
        qk = (q_heads + 2 * kv_heads) * d + (q_heads + kv_heads) * (d + 1)
        attention += qk + (q_heads * d if kv_heads > 1 else 0)
    mlp = 0 if "mlp" in recomputed or sparse else 5 * shape.intermediate_size // t
    return norms + attention + mlp


def worst_routed_copies_ratio(shape: ModelShape, ep: int) -> float:
    """The most routed copies one EP rank's experts can receive, over balanced routing's N k (1.0 for a dense
    model or EP 1): every token of the EP group's ep N sends min(k, E / ep) of its k copies to that rank's
    E / ep experts (megatron's alltoall dispatcher drops nothing without a capacity factor)."""
    if not shape.is_moe or ep == 1:
        return 1.0
    return ep * min(shape.moe_top_k, shape.num_experts // ep) / shape.moe_top_k


def capacity_routed_copies_ratio(shape: ModelShape, ep: int, capacity_factor: float) -> float:
    """The most routed copies one EP rank's experts receive under megatron's capacity factor, over balanced
    routing's N k: the router keeps at most ceil(N k cf / E) copies per expert of each rank's N tokens
    (transformer/moe/moe_utils.py ``apply_router_token_dropping``, ``get_capacity``; the rest are dropped:
    the token skips that expert), and a rank's E / ep experts receive them from the ep ranks: E ceil(N k cf / E),
    cf N k (the ceil adds at most E / (N k): 0.4% at 128 experts, top-8 and 4096-token micro-batches), never
    beyond :func:`worst_routed_copies_ratio`."""
    return min(capacity_factor, worst_routed_copies_ratio(shape, ep))


def moe_activation_bytes_per_token(
    shape: ModelShape,
    etp: int,
    element_bytes: int,
    sequence_parallel_tp: int = 1,
    local: bool = False,
    received_per_token: float | None = None,
    routed_copies_ratio: float = 1.0,
) -> int:
    """What one MoE layer keeps for backward per token of the rank's micro-batch (megatron-core 0.16, alltoall
    dispatcher, balanced routing: a rank's E / ep experts receive on average N k of the EP group's routed copies).

    The router (transformer/moe/router.py, moe_utils.py ``topk_softmax_with_capacity``): the logits [N, E] and their
    softmax scores [N, E], fp32 (``moe_router_dtype`` fp32 / the softmax's saved output). The dispatcher
    (transformer/moe/token_dispatcher.py ``MoEAlltoAllTokenDispatcher``: ``permute`` then the all-to-all then
    ``sort_chunks_by_idxs``; moe_utils.py ``permute`` is an ``index_select``, which keeps only its indices): one
    permuted copy of each routed token survives to backward, the experts' fc1 input [N k, h]; the other copies
    (the pre-all-to-all one, the all-to-all's output) are transients of the forward. The experts
    (transformer/moe/experts.py, ``activation_func_with_probs``): fc1's output [N k, 2m / etp] (kept by SwiGLU),
    SwiGLU x probs [N k, m / etp] (kept by fc2). The unpermute's ``scatter_add`` keeps only its indices.

    ``sequence_parallel_tp`` = t under megatron's sequence parallelism (1 without): the router sees the rank's
    N / t tokens ([N / t, E] logits and scores), and the dispatcher gathers the routed copies over the expert TP
    group after the all-to-all (``token_dispatcher.py`` ``dispatch_postprocess``:
    ``gather_from_sequence_parallel_region(group=tp_group)``), so the experts run on N k etp / t of them.
    ``local``: megatron's local spec (CPU: SequentialMLP, each expert an unfused ``MLP``), counted with
    ``saved_tensors_hooks`` on the tiny Qwen3-MoE at EP 2 with the router's aux and z losses on
    (tests/test_local_layer_count.py, exact given the copies a rank received): the router keeps four fp32 [N, E]
    (the logits, the softmax, the aux loss's scores, the transposed map's scores), a bool [E, N] routing map, three
    int64 [N, k] (the top-k indices twice, the permutation's), the z loss's fp32 log-sum-exp [N]; per routed copy
    received, the fc1 input (h), fc1's output (2m / etp), four m / etp tensors of the unfused SwiGLU with probs
    (SiLU, ``x_linear + glu_linear_offset``, the product, the product x probs: fc2's input) and the fp32 prob.
    ``received_per_token`` (``local``): the routed copies the rank received per token of its micro-batch (balanced: k).
    ``routed_copies_ratio``: how many times balanced routing's copies the rank's experts received (megatron routes
    unevenly: the run records the most per step, ``train/moe/routed_copies_max_ratio``); None of
    ``received_per_token``: k times it.
    """
    k, m, h, sp = shape.moe_top_k, shape.moe_intermediate_size // etp, shape.hidden_size, sequence_parallel_tp
    if local:  # no sequence parallelism on the local spec
        received = k * routed_copies_ratio if received_per_token is None else received_per_token
        router = 4 * shape.num_experts * FP32_BYTES + shape.num_experts + 3 * k * INT64_BYTES + FP32_BYTES
        return round(router + received * ((h + 6 * m) * element_bytes + FP32_BYTES))
    router = 2 * shape.num_experts * FP32_BYTES // sp
    return router + round(routed_copies_ratio * k * (h + 2 * m + m) * element_bytes * (etp if sp > 1 else 1) / sp)


def moe_forward_bytes_per_token(
    shape: ModelShape,
    etp: int,
    element_bytes: int,
    local: bool = False,
    received_per_token: float | None = None,
    routed_copies_ratio: float = 1.0,
) -> int:
    """Peak bytes per token of an MoE layer's forward without grad beside the residual stream, at the experts' fc1
    (same sources as :func:`moe_activation_bytes_per_token`): the normed input (h), the router's fp32 logits and
    scores (2E), the dispatcher's token copies still referenced (the all-to-all's output and the chunk-sorted fc1
    input, k h each), fc1's output (2k m / etp) and SwiGLU's (k m / etp).

    ``local`` (megatron's local spec, EP > 1; beyond the block's input, the caller's): the live tensors at
    SequentialMLP's ``torch.cat`` of its experts' outputs, counted per aten op on the tiny Qwen3-MoE at EP 2
    (tests/test_local_layer_count.py, exact given the copies received): the permuted copy sent (k h), and per copy
    received the all-to-all's output, the chunk-sorted experts' input, the experts' outputs and their cat (4h),
    with the router's fp32 [N, E] scores and bool [N, E] map, and per copy received two fp32 probs and an int64
    index.
    One expert's SwiGLU at a time is narrower while m / etp is at most h. ``routed_copies_ratio``: as in
    :func:`moe_activation_bytes_per_token` (the copies received; the k copies a rank sends are its own tokens')."""
    k, m, h = shape.moe_top_k, shape.moe_intermediate_size // etp, shape.hidden_size
    received = k * routed_copies_ratio if received_per_token is None else received_per_token
    if local:
        router = 5 * shape.num_experts
        return round(router + k * h * element_bytes + received * (4 * h * element_bytes + 2 * FP32_BYTES + INT64_BYTES))
    return 2 * shape.num_experts * FP32_BYTES + round((h + received * (2 * h + 3 * m)) * element_bytes)


def layer_forward_bytes_per_token(
    shape: ModelShape,
    tp: int,
    element_bytes: int,
    sparse: bool = False,
    etp: int | None = None,
    routed_copies_ratio: float = 1.0,
) -> int:
    """Peak bytes per token of one decoder layer's forward without grad (old/ref_logprob), beside the residual
    stream [N, h] (the caller counts it): nothing is kept, so the peak is the larger of the two blocks' live
    tensors at their widest moment, in the dtype.

    Attention, at the core attention: the normed input (h), the qkv output ((Hq + 2 Hkv) d / t), RoPE'd q and k
    ((Hq + Hkv) d / t) and the attention output (Hq d / t). MLP, at SwiGLU's product: the normed input (h), the
    fc1 output [gate, up] (2I / t), silu(gate) and the product (I / t each). Unfused [s, s] scores are the
    caller's (one packed sequence's at a time).
    """
    h, d, t = shape.hidden_size, shape.head_dim, tp
    attention = h + (2 * shape.num_heads + 3 * shape.num_kv_heads) * d // t + shape.num_heads * d // t
    mlp = h + 4 * shape.intermediate_size // t
    if sparse:  # an MoE layer: its router and experts in place of the dense MLP
        moe = moe_forward_bytes_per_token(shape, etp or t, element_bytes, routed_copies_ratio=routed_copies_ratio)
        return max(attention * element_bytes, moe)
    return max(attention, mlp) * element_bytes


def local_layer_written_bytes_per_token(
    shape: ModelShape,
    tp: int,
    element_bytes: int,
    backward: bool,
    sparse: bool = False,
    etp: int | None = None,
    routed_copies_ratio: float = 1.0,
) -> int:
    """Bytes of the new tensors one decoder layer of megatron's local spec (CPU) makes per token in a forward or a
    backward over packed sequences without padding (every op's outputs that alias no input, kept or not: on CPU
    each buffer of a page or more is a fresh mapping, colocation/host_memory.py). Counted with torch's dispatcher
    on 11 shapes of the tiny Qwen2 and Qwen3 at TP 1, exactly (tests/test_local_layer_count.py), in elements of
    h, q = Hq d / t, kv = Hkv d / t, I / t, d and the heads per rank:

    - fp32 forward: 10h + 10.5q + 11.5kv + 5I + 10d + Hq + 4, and q more where the query is regrouped by a copy
      (more than one KV head per rank, fewer than the q heads); backward 22h + 12.5q + 12.5kv + 6I + 8;
    - 16-bit (the attention and the norms' statistics in fp32): forward 8h + 4q + 4kv + 10d + Hq + 4 in fp32 and
      6h + 8.5q + 9.5kv + 5I + 4d (+ the regrouped q) in the dtype; backward 20h + 5q + 4kv + 8 in fp32 and
      6h + 9.5q + 10.5kv + 6I in the dtype;
    - Qwen3's q and k norms (measured in fp32): forward 2q + kv + 2Hq + 2Hkv more, backward 9q + 9kv + 4Hq + 4Hkv;
    - forward, the packed attention's int64 indices: 5 per token.

    The padded attention rows' share (per padded row, fp32): :func:`local_packed_attention_padding_bytes_per_token`
    forward, :func:`local_packed_attention_backward_padding_bytes_per_token` backward; the caller counts them per
    padded row. The weight gradients (one per parameter, per micro-batch) are the caller's. ``sparse``: an MoE
    layer (megatron's router, alltoall dispatcher and SequentialMLP), the dense MLP's terms (5I, 6I) replaced by the
    block's, in bytes, counted the same way on 8 shapes of tiny:qwen3_moe (E experts, top-k, m = the expert's
    intermediate / expert TP), exactly: forward 20kh + 24km + 34E + 28k + 8, backward 12h + 20kh + 32km + 20E + 16k
    (fp32; the routing's int32, int64 and bool maps included; 16-bit not measured, counted the same). Of these,
    per routed copy the rank's experts received (k per token at balanced routing, k x ``routed_copies_ratio`` on
    the rank that received the most): forward 20h + 24m + 8, backward 20h + 32m + 12; the rest per token of the
    rank's micro-batch (two EP ranks' differences over their received copies, two shapes,
    tests/test_local_layer_count.py)."""
    h, d, t, e = shape.hidden_size, shape.head_dim, tp, element_bytes
    q_heads, kv_heads = shape.num_heads // t, engine_kv_heads_per_rank(shape, t)
    q, kv, inter = q_heads * d, kv_heads * d, 0 if sparse else shape.intermediate_size // t
    regrouped = q if 1 < kv_heads < q_heads else 0
    # doubled: the .5 coefficients
    if e == FP32_BYTES:
        fp32 = (
            (44 * h + 25 * q + 25 * kv + 12 * inter + 16)
            if backward
            else (20 * h + 21 * q + 23 * kv + 10 * inter + 20 * d + 2 * q_heads + 8 + 2 * regrouped)
        )
        dtype = 0
    else:
        fp32 = (40 * h + 10 * q + 8 * kv + 16) if backward else (16 * h + 8 * q + 8 * kv + 20 * d + 2 * q_heads + 8)
        dtype = (
            (12 * h + 19 * q + 21 * kv + 12 * inter)
            if backward
            else (12 * h + 17 * q + 19 * kv + 10 * inter + 8 * d + 2 * regrouped)
        )
    if shape.qk_norm:
        qk = (
            (18 * q + 18 * kv + 8 * q_heads + 8 * kv_heads)
            if backward
            else (4 * q + 2 * kv + 4 * q_heads + 4 * kv_heads)
        )
        dtype, fp32 = (dtype + qk, fp32) if e != FP32_BYTES else (dtype, fp32 + qk)
    moe = 0
    if sparse:
        k, m = shape.moe_top_k, shape.moe_intermediate_size // (etp or t)
        received = k * routed_copies_ratio  # routed copies per token of the micro-batch
        moe = round(
            12 * h + received * (20 * h + 32 * m + 12) + 20 * shape.num_experts + 4 * k
            if backward
            else received * (20 * h + 24 * m + 8) + 34 * shape.num_experts + 20 * k + 8
        )
    # forward: the packed attention's five int64 indices per token (megatron_backend/model.py: each token's
    # sequence, its place in it, and their gathers)
    indices = 0 if backward else 5 * INT64_BYTES
    return (fp32 * FP32_BYTES + dtype * e) // 2 + moe + indices


def local_packed_attention_padding_bytes_per_token(shape: ModelShape, tp: int) -> int:
    """What megatron_backend/model.py's packed attention holds per padded row (the micro-batch's sequences x the
    longest): the padded q, k and v ((Hq + 2 Hkv) d / t), torch's flash output (Hq d / t) and its log-sum-exp
    (Hq / t), all fp32 on CPU whatever the model's dtype, with grad (kept for backward) or without (the forward's
    widest moment)."""
    q, kv = shape.num_heads * shape.head_dim // tp, shape.num_kv_heads * shape.head_dim // tp
    return (2 * q + 2 * kv + shape.num_heads // tp) * FP32_BYTES


def local_packed_attention_backward_padding_bytes_per_token(shape: ModelShape, tp: int) -> int:
    """What the packed attention's backward writes per padded row (fp32 on CPU): the output's gradient scattered
    back to the padded rows and made contiguous for the kernel (2 Hq d / t), and the kernel's q, k and v gradients
    ((Hq + 2 Hkv) d / t); counted with torch's dispatcher (tests/test_local_layer_count.py)."""
    q, kv = shape.num_heads * shape.head_dim // tp, shape.num_kv_heads * shape.head_dim // tp
    return (3 * q + 2 * kv) * FP32_BYTES


def local_packed_layer_forward_bytes(
    shape: ModelShape,
    tp: int,
    element_bytes: int,
    num_tokens: int,
    padded_tokens: int,
    sequences: int,
    sparse: bool = False,
    etp: int | None = None,
    routed_copies_ratio: float = 1.0,
) -> int:
    """Peak bytes of one decoder layer of megatron's local spec (CPU) over ``sequences`` packed sequences
    (``num_tokens`` real, padded to ``padded_tokens`` rows) in a forward without grad (old/ref_logprob), beyond its
    input: the live tensors at its widest moment, counted per aten op (tests/test_local_layer_count.py).

    - attention, at torch's flash kernel's output (megatron_backend/model.py ``VarlenDotProductAttention``): the
      normed input (h), the qkv output ((Hq + 2Hkv) d / t), the query regrouped by a copy (Hq d / t; a view at one
      KV head a rank), RoPE's q and
      k ((Hq + Hkv) d / t), per padded row :func:`local_packed_attention_padding_bytes_per_token` (q, k, v, the
      output, the log-sum-exp), the two int64 token indices and the int64 bounds and lengths (2b + 1); in 16 bits
      (the kernel runs in fp32 on CPU) the moment after it may be wider: its fp32 output, the real rows gathered
      from it (fp32) and cast back (the dtype), the padded q, k, v and the log-sum-exp freed. The
      kernel's own per-thread buffers ([q block, kv block] floats, at most 256 x 512 a thread,
      aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) are made below the dispatcher: not counted here;
    - the MLP (mlp.py, unfused ``glu``): the attention's residual sum and the normed input (2h), fc1's output
      (2I / t), SiLU, ``x_linear + glu_linear_offset`` and the product (I / t each);
    - ``sparse``: the residual sum and the normed input (2h) and the MoE block beyond them
      (:func:`moe_forward_bytes_per_token`, ``local``) in place of the MLP.
    """
    h, t = shape.hidden_size, tp
    q, kv = shape.num_heads * shape.head_dim // t, shape.num_kv_heads * shape.head_dim // t
    query_copy = q if shape.num_kv_heads // t > 1 else 0  # regrouping [s, b, Hkv, Hq/Hkv d] copies the query
    held = num_tokens * ((h + 2 * q + query_copy + 3 * kv) * element_bytes + 2 * INT64_BYTES)
    held += INT64_BYTES * (2 * sequences + 1)
    attention = held + padded_tokens * local_packed_attention_padding_bytes_per_token(shape, t)
    if element_bytes < FP32_BYTES:  # the fp32 output's rows gathered and cast back, the rest of the kernel's freed
        gathered = padded_tokens * q * FP32_BYTES + num_tokens * q * (FP32_BYTES + element_bytes)
        attention = max(attention, held + gathered)
    if sparse:
        moe = moe_forward_bytes_per_token(shape, etp or t, element_bytes, True, routed_copies_ratio=routed_copies_ratio)
        block = num_tokens * (2 * h * element_bytes + moe)
    else:
        block = num_tokens * (2 * h + 5 * shape.intermediate_size // t) * element_bytes
    return max(attention, block)


def local_layer_forward_bytes(
    shape: ModelShape,
    tp: int,
    element_bytes: int,
    num_tokens: int,
    attending_tokens: float,
    scores_bytes: int,
    sparse: bool = False,
    etp: int | None = None,
    routed_copies_ratio: float = 1.0,
) -> int:
    """Peak bytes of one decoder layer of megatron's local spec (CPU) over padded rows (``actor.remove_padding``
    false; packed sequences: :func:`local_packed_layer_forward_bytes`) in a forward without grad (old/ref_logprob),
    beyond its input (the residual stream [N, h], the caller's): the live tensors at the layer's widest moment,
    counted per aten op with a ``TorchDispatchMode`` on the tiny Qwen2 (exact at Hq/Hkv 4/2 and 8/2, head_dim 32 and
    48, intermediate 256 and 384, when megatron's attention ran 1-8 sequences one at a time).

    - attention (megatron/core/transformer/attention.py ``get_query_key_value_tensors``, dot_product_attention.py),
      for the whole micro-batch: the normed input (h), the qkv output ((Hq + 2Hkv) d / t), the query regrouped
      [s, b, Hkv, Hq/Hkv d] and copied [s, b, Hq, d] (2 Hq d / t) and the key (Hkv d / t), and the contexts of the
      sequences already attended (Hq d / t); for the ``attending_tokens`` of the sequences attending at once the key
      and value
      repeated to the Hq query heads, the bmm's context and its contiguous copy (3 Hq d / t beyond the context
      counted above), with ``scores_bytes`` (:func:`unfused_attention_bytes`); at the contexts' ``torch.cat``
      the whole micro-batch's contexts twice (the widest moment when many short sequences are packed);
    - the MLP (mlp.py, unfused ``glu``): the attention's residual sum and the normed input (2h), fc1's output
      (2I / t), SiLU, ``x_linear + glu_linear_offset`` and the product (I / t each), beside megatron's global
      memory buffer the scores were computed in (a third of ``scores_bytes``, kept across calls);
    - ``sparse``: the residual sum and the normed input (2h) and the MoE block beyond them
      (:func:`moe_forward_bytes_per_token`, ``local``) in place of the MLP.
    """
    h, t = shape.hidden_size, tp
    q, kv = shape.num_heads * shape.head_dim // t, shape.num_kv_heads * shape.head_dim // t
    attention = max(
        num_tokens * (h + 4 * q + 3 * kv) + round(3 * attending_tokens * q), num_tokens * (h + 5 * q + 3 * kv)
    )
    if sparse:
        moe = moe_forward_bytes_per_token(shape, etp or t, element_bytes, True, routed_copies_ratio=routed_copies_ratio)
        block = num_tokens * (2 * h * element_bytes + moe)
    else:
        block = num_tokens * (2 * h + 5 * shape.intermediate_size // t) * element_bytes
    return max(attention * element_bytes + scores_bytes, block + scores_bytes // 3)


def unfused_attention_bytes(
    shape: ModelShape, tp: int, element_bytes: int, micro_batch_size: float, seq_len: float, kept: bool = False
) -> int:
    """One layer's unfused attention (megatron's local DotProductAttention) over b sequences of length s.

    Without grad (``kept=False``: the forward's peak) it holds three [b, Hq/t, s, s] tensors in the dtype:
    megatron's global memory buffer ``baddbmm`` reads (``get_global_memory_buffer``, kept across calls), the
    scores ``baddbmm`` returns and the probabilities (counted per aten op: tests/test_local_layer_count.py). For backward (``kept=True``) autograd keeps the probabilities and the [s, s] bool causal
    mask the scores were ``masked_fill_``'d with (megatron's ``get_default_causal_mask``, built per call): one
    of each per sequence and layer, counted with ``torch.autograd.graph.saved_tensors_hooks`` on a tiny Qwen2
    at TP 1 and 2. Packed sequences attend within themselves: b sequences of (mean) length s, not b x the
    padded length.
    """
    square = micro_batch_size * seq_len * seq_len
    heads = shape.num_heads // tp
    if kept:
        return int(square * (heads * element_bytes + 1))
    return int(3 * square * heads * element_bytes)


def logits_bytes(
    shape: ModelShape,
    tp: int,
    element_bytes: int,
    num_tokens: int,
    num_rows: int | None = None,
    chunk_tokens: int | None = None,
    train: bool = False,
    keep_softmax: bool | None = None,
    entropy_grad: bool = False,
    output_copy: bool = False,
) -> int:
    """Peak of the log-prob/entropy pass over vocab-parallel logits [N, V/t] on the last stage.

    megatron_backend.logprobs.fused_logprobs_entropy over ``num_rows`` response rows (default: all N)
    of the logits (the model's output, in the dtype; ``output_copy``: GPTModel's [s, b] -> [b, s]
    ``contiguous()`` copy of a padded micro-batch of b > 1 rows lives with it for a moment), ``chunk_tokens``
    rows at a time (None: all rows together). Per chunk: the gathered rows in fp32 (plus the 16-bit
    gather when the dtype is narrower) and their exp. Training also keeps the softmax of every row
    until backward when ``keep_softmax`` (default: unchunked), and backward holds the logits, their
    gradient (dtype) and one chunk's work (below).
    """
    vocab = megatron_padded_vocab(shape.vocab_size, tp) // tp
    logits = num_tokens * vocab * element_bytes
    rows = num_tokens if num_rows is None else num_rows
    work_rows = rows if chunk_tokens is None else min(chunk_tokens, rows)
    narrow = element_bytes if element_bytes < FP32_BYTES else 0
    forward_work = work_rows * vocab * (2 * FP32_BYTES + narrow)
    forward = max(logits * (2 if output_copy else 1), logits + forward_work)
    if not train:
        return forward
    keep = chunk_tokens is None if keep_softmax is None else keep_softmax
    kept = rows * vocab * FP32_BYTES if keep else 0
    if keep and chunk_tokens is not None:
        forward = max(forward, logits + kept + forward_work)
    # backward per chunk (megatron_backend/logprobs.py, _FusedLogprobEntropy.backward) beside the logits and
    # their zeroed gradient: the chunk's fp32 softmax (the kept one, mul_'d in place into the gradient, or
    # recomputed from an index_select: a new fp32 chunk), xlogy's new fp32 chunk with an entropy gradient, and
    # the gradient's cast to a narrower dtype before index_add_
    work = (0 if keep else FP32_BYTES) + (FP32_BYTES if entropy_grad else 0) + narrow
    backward = 2 * logits + kept + work_rows * vocab * work
    return max(forward, backward)


def largest_actor_weight_elements(shape: ModelShape, tp: int, pp: int, stage: int) -> int:
    """Elements of the largest weight one actor rank of stage ``stage`` holds (megatron layout): qkv
    [(Hq + 2 Hkv) d / t, h], fc1 [2I / t, h], or the vocab rows [V / t, h] of the embedding (first stage) or
    the output layer (last stage).

    Its gradient is a transient of train's backward: megatron_backend/model.py builds the layers with
    ``gradient_accumulation_fusion=False``, so each linear's backward returns a new [out, in] weight gradient
    in the params' dtype that DDP's hook adds into the fp32 ``main_grad`` and drops (megatron-core
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``; the embedding's is a dense [V / t, h] too).
    """
    h, d, t = shape.hidden_size, shape.head_dim, tp
    largest = max((shape.num_heads + 2 * shape.num_kv_heads) * d // t * h, 2 * shape.intermediate_size // t * h)
    # MoE: the router [E, h] and one expert's fc1 [2m / t, h] (megatron keeps a tensor per local expert)
    largest = max(largest, shape.num_experts * h, 2 * shape.moe_intermediate_size // t * h)
    if stage == 0 or stage == pp - 1:
        largest = max(largest, megatron_padded_vocab(shape.vocab_size, tp) // tp * h)
    return largest


def largest_hf_tensor_elements(shape: ModelShape) -> int:
    """Elements of the largest tensor of the HF checkpoint (full, unsharded: a vocab table, or a fused
    qkv_proj / gate_up_proj where the family stores one)."""
    return max(math.prod(dims) for dims in hf_tensor_shapes(shape).values())


def actor_stage_fc1_elements(shape: ModelShape, tp: int, pp: int) -> int:
    """Elements of the gated MLP's ``linear_fc1`` weights ([2I / t, h], gate and up stacked) one actor rank of a
    stage holds (every stage has L / pp layers). megatron's checkpoint saves each as its two halves
    (``apply_swiglu_sharded_factory``: ``torch.chunk`` views of the weight); 0 without a gated MLP. An MoE layer's
    experts' fc1 ([2m / t, h] each, E local experts at EP 1) are saved the same way. The largest stage's."""
    sizes = actor_rank_sizes(shape, tp)
    fc1_modules = ("mlp.linear_fc1", "mlp.experts.linear_fc1")

    def fc1_elements(layer: int) -> int:
        parts = [(part, kind) for part, kind in layer_parts(shape, layer) if part.megatron in fc1_modules]
        return sum(
            math.prod(dims_size(part.kind_dims(kind), sizes)) * (sizes["experts"] if part.expert else 1)
            for part, kind in parts
        )

    return max(sum(fc1_elements(layer) for layer in stage_layers(shape, pp, stage)) for stage in range(pp))


def in_flight_layers(num_layers: int, pp: int, vpp: int | None, stage: int, num_micro_batches: int) -> int:
    """Layers' worth of one micro-batch's activations stage ``stage`` holds at its peak under 1F1B.

    Non-interleaved 1F1B: stage r runs pp - r forwards before its first backward, each over L / pp
    layers. Interleaved (VPP v): megatron's warm-up is (pp - r - 1) * 2 + (v - 1) * pp chunk forwards,
    plus one in the steady state, each over L / (pp * v) layers. Both are capped by the micro-batches
    there are.
    """
    if vpp is None or vpp == 1:
        return min(num_micro_batches, pp - stage) * (num_layers // pp)
    chunks = min(num_micro_batches * vpp, (pp - stage - 1) * 2 + (vpp - 1) * pp + 1)
    return chunks * (num_layers // (pp * vpp))


def optimizer_bytes_per_param(element_bytes: int) -> int:
    """Adam: fp32 m and v, plus fp32 main params when the model is in 16-bit (megatron's mixed precision)."""
    return 2 * FP32_BYTES + (FP32_BYTES if element_bytes < FP32_BYTES else 0)


def engine_activation_bytes(
    shape: ModelShape,
    rollout_tp: int,
    element_bytes: int,
    max_batched_tokens: int,
    max_num_seqs: int,
    sampler_vocab_tensors: int,
    moe_workspace: str = "fused_moe",
    expert_tp: int | None = None,
    gathered_replicas: int = 1,
) -> int:
    """vLLM's profiled activation peak: one layer's working set for ``max_batched_tokens`` tokens plus the
    sampler's full-vocab fp32 tensors for ``max_num_seqs`` sequences (:func:`sampler_bytes`). ``expert_tp``,
    ``gathered_replicas``: the MoE layer's (:func:`engine_moe_bytes_per_token`; None: rollout TP).

    Per token and rank: residual, normed input and o_proj output (3h), qkv and attention output
    ((2 Hq / t + 2 KV heads per rank) d), gate/up and SwiGLU output (3I / t), in the dtype. An MoE layer has its
    experts' working set in place of the dense MLP's (:func:`engine_moe_bytes_per_token`, ``moe_workspace`` the
    engine's MoE path), the larger of the two kinds of layer when they mix.
    """
    h, d, t = shape.hidden_size, shape.head_dim, rollout_tp
    common = 3 * h + (2 * shape.num_heads // t + 2 * engine_kv_heads_per_rank(shape, t)) * d
    kinds = moe_layer_kinds(shape)
    per_token = max(
        (
            common * element_bytes
            + engine_moe_bytes_per_token(shape, expert_tp or t, element_bytes, moe_workspace, gathered_replicas)
        )
        if sparse
        else (common + 3 * shape.intermediate_size // t) * element_bytes
        for sparse in kinds
    )
    return max_batched_tokens * per_token + sampler_bytes(shape, max_num_seqs, sampler_vocab_tensors)


def engine_moe_bytes_per_token(
    shape: ModelShape, expert_tp: int, element_bytes: int, moe_workspace: str, gathered_replicas: int = 1
) -> int:
    """One MoE layer's working set per token of an engine rank's batch, each expert's rows split over
    ``expert_tp`` ranks (m / t; under expert parallelism t = 1: whole experts, E / ep of them, and the [M, k]
    caches below are sized for every token's k choices all the same).

    ``fused_moe`` (vLLM, vllm/model_executor/layers/fused_moe/fused_moe.py ``fused_experts_impl``, the triton path
    on CUDA): the gate's logits [M, E] (dtype), top-k weights and ids [M, k] (fp32, int32), ``cache13``
    [M k max(2m / t, h)] (intermediate_cache1 [M, k, 2m / t] and intermediate_cache3 [M, k, h] share it) and
    intermediate_cache2 [M k, m / t] (SwiGLU halves N), the output [M, h].
    ``native`` (rollout/native/model.py ``moe``): the fp32 router probabilities and the logits (E each), the
    output [N, h], the flattened ids, their argsort and token index (int64, k each) and the sorted weights
    (k), and one expert's SwiGLU at a time, counted for the worst case of every token in one expert: its
    gathered input (h), gate/up (2m / t), silu and the product (m / t each), fc2's output and its weighted copy
    (h each).
    ``gathered_replicas`` R (vLLM with R > 1 data-parallel replicas, whose MoE layers span them): the default
    all-to-all (``all2all_backend="allgather_reducescatter"``, vllm/distributed/device_communicators/all2all.py
    ``AgRsAll2AllManager.dispatch_router_logits``) all-gathers every replica's hidden states [R M, h] and router
    logits [R M, E] before the experts, which then run on R M tokens; the combine reduce-scatters back to [M, h].
    """
    k, m, h, e = shape.moe_top_k, shape.moe_intermediate_size // expert_tp, shape.hidden_size, element_bytes
    if moe_workspace == "fused_moe":
        fused = shape.num_experts * e + k * 2 * FP32_BYTES + (k * max(2 * m, h) + k * m + h) * e
        return gathered_replicas * fused + (gathered_replicas * h * e if gathered_replicas > 1 else 0)
    if moe_workspace == "native":
        if gathered_replicas != 1:
            raise ValueError("the native engine gathers no replica's tokens: gathered_replicas must be 1")
        routing = shape.num_experts * (FP32_BYTES + e) + k * (3 * 8 + e)
        return routing + (h + h + 2 * m + m + m + h + h) * e
    raise ValueError(f"moe_workspace={moe_workspace!r} must be 'fused_moe' or 'native'")


def native_engine_activation_bytes(
    shape: ModelShape,
    rollout_tp: int,
    element_bytes: int,
    *,
    prefill_seqs: int,
    prompt_tokens: int,
    decode_seqs: int,
    response_tokens: int,
    block_size: int,
    sampler_vocab_tensors: int,
    moe_bytes_per_token: int = 0,
    max_tokens: int | None = None,
) -> int:
    """The native engine's peak while it generates (rollout/native/), counted from its source: the running batch's
    tables for ``max_tokens`` a sample (None: ``response_tokens``; :func:`native_running_batch_bytes`), plus the
    largest of a prefill's forward over ``prefill_seqs`` prompts padded to ``prompt_tokens``
    (:func:`native_prefill_bytes`), a decode step's forward at the longest context (:func:`native_decode_bytes`)
    and the sampler's full-vocab tensors (:func:`sampler_bytes`). ``moe_bytes_per_token``: an MoE layer's working
    set (:func:`engine_moe_bytes_per_token`, ``native``; a bound, every token in one expert), in place of the dense
    MLP's where larger."""
    scripted = rollout_tp == 1 and element_bytes == FP32_BYTES and not any(moe_layer_kinds(shape))
    # the last decode step feeds the response's last-but-one token, with prompt + response - 2 tokens cached
    context = max(0, prompt_tokens + response_tokens - 2)
    sizes = dict(
        shape=shape, rollout_tp=rollout_tp, element_bytes=element_bytes, moe_bytes_per_token=moe_bytes_per_token
    )
    max_tokens = max_tokens or response_tokens
    tables = native_running_batch_bytes(decode_seqs, prompt_tokens + max_tokens, max_tokens, block_size)
    return tables + max(
        native_prefill_bytes(seqs=prefill_seqs, prompt_tokens=prompt_tokens, **sizes),
        native_decode_bytes(
            seqs=decode_seqs, context_tokens=context, block_size=block_size, scripted=scripted, **sizes
        ),
        sampler_bytes(shape, max(prefill_seqs, decode_seqs), sampler_vocab_tensors),
    )


def native_running_batch_bytes(seqs: int, sequence_tokens: int, max_tokens: int, block_size: int) -> int:
    """rollout/native/scheduler.py ``RunningBatch`` for ``seqs`` rows: block_table [B, W] and slot_table [B, W bs]
    (int64, W blocks hold ``sequence_tokens``), out_tokens (int64) and out_logprobs (fp32) [B, max_tokens], and
    four [B] int64 vectors (limits, ctx_lens, last, gen_lens)."""
    width = math.ceil(sequence_tokens / block_size)
    return seqs * (width * (1 + block_size) * INT64_BYTES + max_tokens * (INT64_BYTES + FP32_BYTES) + 4 * INT64_BYTES)


def _native_norm_bytes(width: int, rows: int, e: int) -> int:
    """What ``NativeModel.rms_norm`` of a token's ``width`` elements in ``rows`` rows holds beside its input, at its
    widest: in fp32 the hypot per row and the quotient; in 16-bit the fp32 copy, the fp32 quotient and the result
    cast back."""
    return FP32_BYTES * (width + rows) if e == FP32_BYTES else (2 * FP32_BYTES + e) * width


def _native_layer_moments(shape: ModelShape, t: int, moe_bytes_per_token: int, e: int) -> int:
    """Bytes per token at the widest moment of one decoder layer of ``NativeModel.forward`` (eager), x [N, h]
    that enters it included. Each block is a call, so only its own intermediates and x are alive. Elements per
    token: Q = (Hq / t + 2 kv) d of qkv, K = (Hq / t + kv) d of the q and k heads. Attention: the input norm
    (:func:`_native_norm_bytes`); norm(x) and qkv (2h + Q); Qwen3's q / k norm beside qkv; rope's qk * cos, roll
    and addcmul (h + Q + 3K, + K beside the q / k norm's output); SDPA's output (h + Q + K + Hq d / t); o_proj's
    add (TP 1 addmm: 2h + Q + K + Hq d / t; TP > 1: mm, then x + it, one h more). MLP: the norm; norm(x) and
    gate_up (2h + 2I / t); silu(gate) and its product with up (h + 4I / t); the down projection's add
    (2h + 3I / t, one h more at TP > 1). An MoE layer: x, norm(x) and ``moe_bytes_per_token``. At TP > 1 each
    moment may hold one h more: the previous block's all-reduced [N, h], which the collective's work object keeps
    until its backend lets go of it (:func:`native_retained_all_reduce_bytes`)."""
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size // t
    hq, kv = shape.num_heads // t, engine_kv_heads_per_rank(shape, t)
    q, k, add = (hq + 2 * kv) * d, (hq + kv) * d, (0 if t == 1 else h)
    norm = h * e + _native_norm_bytes(h, 1, e)
    attention = max(
        norm,
        (2 * h + q) * e,
        ((h + q) * e + _native_norm_bytes(k, hq + kv, e)) if shape.qk_norm else 0,
        (h + q + 3 * k + (k if shape.qk_norm else 0)) * e,
        (h + q + k + hq * d) * e,
        (2 * h + q + k + hq * d + add) * e,
    )
    dense = max(norm, (2 * h + 2 * i) * e, (h + 4 * i) * e, (2 * h + 3 * i + add) * e)
    mlp = max((2 * h * e + moe_bytes_per_token) if sparse else dense for sparse in moe_layer_kinds(shape))
    return max(attention, mlp) + native_retained_all_reduce_bytes(shape, t, e)


def native_retained_all_reduce_bytes(shape: ModelShape, rollout_tp: int, element_bytes: int) -> int:
    """Per token: the last all-reduced hidden state [N, h] (o_proj's or down's partial sum, TP > 1), alive into the
    next block: ``dist.all_reduce`` returns once the sum is done, but its work object still references the tensor
    until the backend releases the work (NCCL keeps a collective's tensors for its watchdog). Counted as held on
    every backend: the bound. On CPU the engine waits for gloo's thread to let go first
    (rollout/native/model.py ``_collective``), so a CPU peak is the count less this term
    (tests/test_planner_native_engine.py)."""
    return shape.hidden_size * element_bytes if rollout_tp > 1 else 0


def native_prefill_bytes(
    shape: ModelShape, rollout_tp: int, element_bytes: int, *, seqs: int, prompt_tokens: int, moe_bytes_per_token: int
) -> int:
    """``NativeModel.prefill`` of B = ``seqs`` prompts padded to L = ``prompt_tokens`` (N = B L tokens, every
    one a prompt token: the longest case), its live tensors at their widest (tests/test_rollout_native_engine.py
    checks it byte for byte): the padded ids and slots [B, L] and the flattened positions, valid rows and their
    slots [N] (int64), the key mask [B, L, L] and the valid mask [B, L] (bool), the positions [L] (int64), each
    token's rope rows [N, 2, d], then one decoder layer's widest moment (:func:`_native_layer_moments`) or the end:
    the final norm of x [N, h], the last token's hidden [B, h] and the logits [B, P / t] (all-gathered at
    TP > 1: t parts and their concatenation [B, P])."""
    e, t, b, length = element_bytes, rollout_tp, seqs, prompt_tokens
    n, h = b * length, shape.hidden_size
    index = (2 * b * length + 3 * n + length) * INT64_BYTES + b * length * (length + 1)
    rope = n * 2 * shape.head_dim * e
    layer = _native_layer_moments(shape, t, moe_bytes_per_token, e)
    vocab = vllm_padded_vocab(shape.vocab_size)
    logits = b * vocab // t * e + (2 * b * vocab * e if t > 1 else 0)
    retained = n * native_retained_all_reduce_bytes(shape, t, e)
    end = max(
        n * (h * e + _native_norm_bytes(h, 1, e)) + retained, n * h * e + b * h * e + 2 * b * INT64_BYTES + logits
    )
    return index + rope + max(n * layer, end)


def native_decode_bytes(
    shape: ModelShape,
    rollout_tp: int,
    element_bytes: int,
    *,
    seqs: int,
    context_tokens: int,
    block_size: int,
    scripted: bool,
    moe_bytes_per_token: int,
) -> int:
    """``NativeModel.decode`` of B = ``seqs`` sequences, the longest with ``context_tokens`` cached: its live
    tensors at their widest. Attention reads each sequence's whole context: the gathered block rows
    ctx [2, B kv, S, d] (S = ``context_tokens`` rounded up to blocks), the scores and their softmax
    [B kv, Hq / (t kv), S], the additive mask [B kv, 1, S] (dtype) and the visible mask [B kv, S] (bool), the
    new rows [2 B kv] and context block rows [2 B kv S / bs] (int64), the rope rows [B, 2, d] and x [B, h].
    Eager, qkv, the rope'd heads and q's reshaped copy [B, Hq / t, d] (with more than one KV head) are alive
    too; TorchScript (TP 1, fp32, dense: rollout/native/decode_tp1.py) frees them first, but the embedding it was
    called with stays referenced beside x. The layer's other moments (:func:`_native_layer_moments`) with N = B
    where they are wider."""
    e, t, b = element_bytes, rollout_tp, seqs
    h, d = shape.hidden_size, shape.head_dim
    hq, kv = shape.num_heads // t, engine_kv_heads_per_rank(shape, t)
    blocks = context_tokens // block_size + 1  # kv_cache.decode_rows: blocks covering the context + the new token
    span = blocks * block_size
    rows = 2 * b * kv * (1 + blocks) * INT64_BYTES + b * kv * span * (1 + e) + b * 2 * d * e + b * h * e
    attention = (2 * b * kv * span * d + 2 * b * hq * span) * e
    if scripted:
        attention += b * h * e
    else:
        # q [B, Hq / t, d] (a view into the rope'd heads) reshaped to [B kv, group, d]: a copy unless one KV head
        # (or one sequence) lets the view through
        q_copy = hq * d if kv > 1 and b > 1 else 0
        attention += b * ((hq + 2 * kv) * d + (hq + kv) * d + q_copy) * e
        attention += b * native_retained_all_reduce_bytes(shape, t, e)
    layer = _native_layer_moments(shape, t, moe_bytes_per_token, e)
    return rows + max(attention, b * (layer - h * e) + (b * h * e if scripted else 0))


def native_new_tensor_bytes_per_row(
    shape: ModelShape, rollout_tp: int, element_bytes: int, *, prefill: bool, scripted: bool = False
) -> dict[str, dict[int, int]]:
    """The new tensors one pass of the native engine allocates (rollout/native/model.py, decode_tp1.py, sampling.py),
    as {bytes per row: how many} by what their rows are: ``token`` (every token the pass runs: its rope rows, the
    embedding, each layer's tensors, the final norm), ``sampled`` (each sampled row: prefill's last hidden state,
    the logits and the sampler's [V] fp32 tensors at temperature > 0) and ``expert`` (each row an MoE layer routes
    to one of its local experts, per MoE layer). Left out: what grows with the context (the gathered KV blocks,
    the scores and their softmax, the masks), int64 [N] vectors, SDPA's internals.

    A decode layer (eager, ``forward`` with ``attend``): the input norm (:func:`_native_norm_tensor_bytes`, its fp32
    norms included); qkv ((Hq / t + 2 kv) d); Qwen3's q / k norm; rope's ``qk * cos``, ``roll`` and ``addcmul``
    ((Hq / t + kv) d each); the new K and V stacked (2 kv d); q reshaped for the grouped scores (a copy with more than
    one KV head: Hq d / t); the attention output (Hq d / t); o_proj's add (TP 1 ``addmm``: h; TP > 1 ``mm``, then
    ``x +`` it: 2h); the post norm; gate_up (2I / t), ``silu`` and its product with up (I / t each); down's add (as
    o_proj's). TorchScript (``scripted``: TP 1, fp32, dense) runs each ``addmm`` as ``mm`` and an add: qkv's bias and
    both residual adds one tensor more each. An MoE layer in place of the MLP: :func:`native_moe_tensor_bytes`.
    Prefill attends with SDPA (eager): the valid tokens' K and V (kv d each) and SDPA's output (laid out by token: no
    copy back) in place of the decode's stack, q copy and attention output. The logits: lm_head's [P / t] (TP > 1: t
    gathered parts of P / t and their concatenation, P); the sampler: in 16-bit the ``float`` copy of the [V] logits,
    then logsumexp's ``self - max``, the temperature's quotient, ``softmax`` and ``multinomial``'s exponential draws
    (fp32 [V] each). tests/test_step_time.py checks the lists against what a real engine allocates: the decode step at
    TP 1 (TorchScript and eager) and TP 2 (two gloo ranks), the prefill, and the MoE layer's per token and per expert
    row."""
    e, f, t = element_bytes, FP32_BYTES, rollout_tp
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size // t
    hq, kv = shape.num_heads // t, engine_kv_heads_per_rank(shape, t)
    token: dict[int, int] = {}
    sampled: dict[int, int] = {}
    expert: dict[int, int] = {}

    def add(into: dict[int, int], *widths: int, times: int = 1) -> None:
        for width in widths:
            if width and times:
                into[width] = into.get(width, 0) + times

    def norm(width: int, vectors: int = 1) -> tuple[int, ...]:
        return _native_norm_tensor_bytes(width, e, vectors)

    residual_add = (h * e,) if t == 1 and not scripted else (h * e, h * e)
    qkv = (hq + 2 * kv) * d * e
    add(token, 2 * d * e, h * e, h * e if t > 1 else 0)  # rope rows; the embedding (and its masked copy at TP > 1)
    for layer in range(shape.num_layers):
        add(token, *norm(h), qkv, qkv if scripted and shape.qkv_bias else 0)
        if shape.qk_norm:
            add(token, *norm((hq + kv) * d, hq + kv))
        add(token, *(3 * ((hq + kv) * d * e,)))
        if prefill:  # SDPA's output is laid out [B, L, Hq / t, d]: its transpose back to tokens is a view
            add(token, kv * d * e, kv * d * e, hq * d * e)
        else:
            add(token, 2 * kv * d * e, hq * d * e if kv > 1 else 0, hq * d * e)
        add(token, *residual_add, *norm(h))
        if shape.is_moe_layer(layer):
            per_token, per_expert_row = native_moe_tensor_bytes(shape, t, e)
            add(token, *per_token)
            add(expert, *per_expert_row)
        else:
            add(token, 2 * i * e, i * e, i * e, *residual_add)
    add(token, *norm(h))
    vocab, padded = shape.vocab_size, vllm_padded_vocab(shape.vocab_size)
    add(sampled, h * e if prefill else 0, padded // t * e, padded * e if t > 1 else 0)
    add(sampled, padded // t * e, times=t if t > 1 else 0)
    add(sampled, vocab * f if e != f else 0, *(4 * (vocab * f,)))
    return {"token": token, "sampled": sampled, "expert": expert}


def native_moe_tensor_bytes(
    shape: ModelShape, rollout_tp: int, element_bytes: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An MoE layer's new tensors in the native engine (rollout/native/model.py ``moe``, ``route`` and the block's add),
    in place of the MLP's, as (bytes per token, bytes per expert row): per token the router's logits (E), in 16-bit
    their fp32 copy (E), the fp32 ``softmax`` (E), the zeroed output (h) and the block's ``x +`` it (h); per row routed
    to a local expert its gathered input (h), gate_up (2m / t), ``silu`` (m / t), the product (m / t), fc2's output
    (h) and its weighted copy (h)."""
    e, f, h = element_bytes, FP32_BYTES, shape.hidden_size
    num_experts, m = shape.num_experts, shape.moe_intermediate_size // rollout_tp
    per_token = (num_experts * e, *((num_experts * f,) if e != f else ()), num_experts * f, h * e, h * e)
    return per_token, (h * e, 2 * m * e, m * e, m * e, h * e, h * e)


def _native_norm_tensor_bytes(width: int, element_bytes: int, vectors: int = 1) -> tuple[int, ...]:
    """The new tensors of ``NativeModel.rms_norm`` over ``vectors`` vectors of ``width`` elements in all (per row):
    the fp32 norms and their ``hypot`` with eps (``vectors`` each), the fp32 quotient (its ``mul_`` is in place);
    in 16-bit the fp32 copy before them and the result cast back after."""
    norms = (vectors * FP32_BYTES, vectors * FP32_BYTES, width * FP32_BYTES)
    if element_bytes == FP32_BYTES:
        return norms
    return (width * FP32_BYTES, *norms, width * element_bytes)


def sampler_bytes(shape: ModelShape, num_seqs: int, vocab_tensors: int) -> int:
    """The sampler's peak for ``num_seqs`` sequences: ``vocab_tensors`` (the engine's profile,
    ``EngineProfile.sampler_vocab_tensors``) x [num_seqs, V] fp32, the full vocabulary (the logits are gathered
    across the engine's TP ranks before sampling)."""
    return vocab_tensors * num_seqs * vllm_padded_vocab(shape.vocab_size) * FP32_BYTES


def largest_engine_tensor_elements(
    shape: ModelShape, rollout_tp: int, rollout_ep: int = 1, expert_tp: int | None = None
) -> int:
    """Elements of the largest tensor one engine rank holds: a vocab table, gate_up or qkv (vLLM layout)."""
    h, d, t = shape.hidden_size, shape.head_dim, rollout_tp
    qkv = (shape.num_heads // t + 2 * engine_kv_heads_per_rank(shape, t)) * d * h
    # MoE: FusedMoE's w13 [E / ep, 2m / expert_tp, h] holds every local expert in one tensor
    w13 = shape.num_experts // rollout_ep * 2 * shape.moe_intermediate_size // (expert_tp or t) * h
    return max(vllm_padded_vocab(shape.vocab_size) // t * h, 2 * shape.intermediate_size // t * h, qkv, w13)


# weight_sync.verify checksums each slice as int64: its bits, the position weights and their product are
# alive together (weight_sync/verify.py::checksum), 3 x 8 bytes per element of the largest slice
VERIFY_BYTES_PER_ELEMENT = 24


def _layer_tensor_elements(
    shape: ModelShape, sizes: dict[str, int], layer: int, module_of, experts_fused: bool, experts: bool | None = None
) -> list[int]:
    """Elements of each parameter tensor of decoder layer ``layer`` whose dims have ``sizes``, parts stacked into
    the module ``module_of(part)`` names (megatron's linear_qkv / linear_fc1, vLLM's qkv_proj / gate_up_proj /
    w13). Expert parts: one tensor for all ``sizes["experts"]`` experts when ``experts_fused`` (vLLM's
    FusedMoE), else one per expert (megatron's SequentialMLP). ``experts`` True / False: only the routed experts'
    tensors / only the others (None: all)."""
    tensors: dict[str, int] = {}
    per_expert: dict[str, int] = {}
    for part, kind in layer_parts(shape, layer):
        if experts is not None and part.expert != experts:
            continue
        elements = math.prod(dims_size(part.kind_dims(kind), sizes))
        key = f"{module_of(part)}.{kind}"
        if part.expert and not experts_fused:
            per_expert[key] = per_expert.get(key, 0) + elements
            continue
        tensors[key] = tensors.get(key, 0) + elements * (sizes["experts"] if part.expert else 1)
    return list(tensors.values()) + [n for n in per_expert.values() for _ in range(sizes["experts"])]


def actor_stage_tensor_elements(
    shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1, etp: int | None = None, experts: bool | None = None
) -> list[int]:
    """Elements of each parameter tensor one actor rank of stage ``stage`` holds (megatron layout; sums to
    :func:`actor_stage_param_count`): what a checkpoint save stages one host buffer for, each. ``experts`` True /
    False: only the routed experts' tensors / only the others (None: all)."""
    sizes = actor_rank_sizes(shape, tp, ep, etp)
    out = [
        n
        for layer in stage_layers(shape, pp, stage)
        for n in _layer_tensor_elements(shape, sizes, layer, lambda part: part.megatron, False, experts)
    ]
    if experts:
        return out
    vocab_rows = megatron_padded_vocab(shape.vocab_size, tp) // tp * shape.hidden_size
    if stage == 0:
        out.append(vocab_rows)
    if stage == pp - 1:
        out.append(shape.hidden_size)
        if not shape.tie_word_embeddings or pp > 1:
            out.append(vocab_rows)
    return out


def engine_tensor_elements(
    shape: ModelShape, rollout_tp: int, rollout_ep: int = 1, expert_tp: int | None = None
) -> list[int]:
    """Elements of each parameter tensor one engine rank holds (vLLM layout; sums to :func:`engine_param_count`)."""
    t = rollout_tp
    sizes = engine_rank_sizes(shape, t, rollout_ep, expert_tp)
    out = [
        n
        for layer in range(shape.num_layers)
        for n in _layer_tensor_elements(shape, sizes, layer, lambda part: part.vllm, experts_fused=True)
    ]
    vocab_rows = vllm_padded_vocab(shape.vocab_size) // t * shape.hidden_size
    out += [vocab_rows] * (1 if shape.tie_word_embeddings else 2) + [shape.hidden_size]
    return out


def power_of_two_bytes(num_bytes: int) -> int:
    """torch's caching host allocator's block for a request (CachingHostAllocator rounds up to a power of two)."""
    return 1 << max(0, num_bytes - 1).bit_length() if num_bytes > 0 else 0
