"""The native engine's forward: a decoder of :mod:`modelspec.families` over vLLM-layout weights, prefill and decode.

Tensor parallel over an explicit process group (gloo or NCCL; None = TP=1, no collectives):
vocab-parallel embedding (all-reduce), column-parallel qkv / gate_up, row-parallel o / down (all-reduce),
vocab-parallel lm_head (all-gather). h hidden, d head_dim, Hq/T q heads and kv KV heads on this rank.

- prefill: B prompts padded to one length, causal attention (SDPA), k/v written into each prompt's blocks;
- decode: one token for each of B running sequences in one batched forward whose attention gathers each
  sequence's KV blocks; at TP=1 in fp32 the layer loop of a dense model runs as TorchScript
  (:mod:`rollout.native.decode_tp1`).
- MoE layers (:meth:`NativeModel.moe`): transformers' routing (softmax over the router's E logits in fp32,
  top-k, renormalised when ``norm_topk_prob``), then each routed expert's SwiGLU over its tokens from FusedMoE's
  ``w13`` [E, 2m/T, h] / ``w2`` [E, h, m/T]; under TP every rank holds m/T rows of every expert, so the
  weighted sum is row-parallel (one all-reduce, like a dense MLP's down projection). Under engine expert
  parallel (``rollout.ep``, ``moe_group``: the replica's ranks, which all run the same tokens) a rank holds
  E/ep whole experts ([E/ep, 2m, h]) and sums its experts' share for every token; one all-reduce over the
  replica adds the other ranks' experts (vLLM's naive EP: each rank its local experts, then a reduction).
"""

from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from modelspec import ModelShape
from modelspec.family import MOE_PART_NAMES, layer_parts
from rollout.layout import TPShape
from rollout.native.decode_tp1 import scripted_decode_layers
from rollout.native.kv_cache import KVCache
from rollout.native.weights import NativeWeights

# sched_yields before giving up on a backend's thread letting go of a tensor: a bound, not a wait anyone expects
# (gloo's thread lets go within microseconds of running again)
_MAX_RELEASE_YIELDS = 1_000_000


def _references(tensor: torch.Tensor) -> tuple[int, int]:
    """(C++ references to the tensor, Python references to its object); only ever compared between two calls
    made the same way, so the references the calls themselves hold cancel."""
    return tensor._use_count(), sys.getrefcount(tensor)


def _collective(run, *tensors: torch.Tensor) -> None:
    """``run()`` a collective on ``tensors``; on CPU return only once no backend thread references them.

    A gloo collective returns when its result is ready, but the worker thread that ran it drops its references
    a moment later (after ``markCompleted``, in ``ProcessGroupGloo::runLoop``), often after the caller has gone
    on. Dropping a C++ reference to a tensor that has a Python object takes two steps on that thread
    (c10/util/intrusive_ptr.h ``reset_not_null_``): the use count goes down, then, under the GIL, the
    tensor's strong reference to its Python object goes (``decref_pyobject``). A tensor whose last Python
    reference went between or before those steps is freed from gloo's thread, at a moment nobody chose, so the
    forward's peak would be one of several values. Waiting until both counts are back to what they were before
    the collective frees each tensor on this thread, where the plan counts it. On CUDA, NCCL keeps them until
    its watchdog thread sees the kernel done; waiting for that would serialise the stream, so the plan counts
    the all-reduced tensor as held there (planner.sizes.native_retained_all_reduce_bytes)."""
    if any(tensor.device.type != "cpu" for tensor in tensors):
        run()
        return
    before = [_references(tensor) for tensor in tensors]
    run()
    for _ in range(_MAX_RELEASE_YIELDS):
        if [_references(tensor) for tensor in tensors] == before:  # the caller's references alone, as before
            return
        os.sched_yield()


def check_supported(shape: ModelShape) -> None:
    """Raise before any heavy work when the native forward cannot run this model exactly."""
    if shape.rope.rope_type != "default":
        raise ValueError(
            f"rope_type={shape.rope.rope_type!r} of {shape.source or 'this model'} is not supported by the "
            "native engine (only 'default'); use rollout.engine=vllm"
        )


def scaled_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """An RMSNorm weight [..., dim] as :meth:`NativeModel.rms_norm` takes it: times sqrt(dim), in fp32."""
    return weight.float() * math.sqrt(weight.shape[-1])


class LayerWeights(NamedTuple):
    """One decoder layer's tensors as the forward takes them: views of the parameters, except the norm
    weights, which are small scaled fp32 copies (rebuilt by :meth:`NativeModel.refresh_weights`)."""

    input_norm: torch.Tensor  # [h] scaled
    qkv_w: torch.Tensor  # [(Hq/T + 2*kv) * d, h]
    qkv_b: torch.Tensor | None  # [(Hq/T + 2*kv) * d] (families with a qkv bias)
    qk_norm: torch.Tensor | None  # [Hq/T + kv, d] scaled: q_norm repeated over the q heads, then k_norm (Qwen3)
    o_w_t: torch.Tensor  # [Hq/T * d, h]
    post_norm: torch.Tensor  # [h] scaled
    gate_up_w: torch.Tensor  # [2 * I/T, h]; empty in an MoE layer (its MoeWeights instead)
    down_w_t: torch.Tensor  # [I/T, h]; empty in an MoE layer


class MoeWeights(NamedTuple):
    """One MoE layer's tensors (views of the parameters)."""

    router_w: torch.Tensor  # [E, h]
    w13: torch.Tensor  # [E/ep, 2 * m/T, h]: per local expert [gate shard; up shard]
    w2: torch.Tensor  # [E/ep, h, m/T]


class NativeModel:
    """The forward over ``weights``, reading and writing ``kv_cache`` (see the module doc)."""

    def __init__(
        self,
        shape: ModelShape,
        tps: TPShape,
        weights: NativeWeights,
        kv_cache: KVCache,
        max_model_len: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        dtype: torch.dtype,
        moe_group: dist.ProcessGroup | None = None,
        first_expert: int = 0,
    ) -> None:
        """``group``: the TP group (None: TP=1); ``moe_group``: the ranks whose MoE outputs sum (the replica;
        None: ``group``); ``first_expert``: the global index of this rank's local expert 0 (engine EP)."""
        check_supported(shape)
        self.shape, self.tps, self.weights, self.kv_cache = shape, tps, weights, kv_cache
        self.group, self.tp = group, tps.tp
        self.moe_group = moe_group if moe_group is not None else group
        self.first_expert = first_expert
        self.device, self.dtype = device, dtype
        self._eps_terms: dict[int, torch.Tensor] = {}
        # when a list: every MoE layer appends (layer, top-k expert ids [N, k]) of each forward (routing replay)
        self.routing_log: list[tuple[int, torch.Tensor]] | None = None
        self._cos_sin = self._rope_table(max_model_len)
        self._positions = torch.arange(max_model_len + kv_cache.block_size, device=device)
        self.refresh_weights()

    def _rope_table(self, max_model_len: int) -> torch.Tensor:
        """[max_model_len, 2 (cos, signed sin), d] (neox / HF rotate_half style)."""
        d = self.shape.head_dim
        inv_freq = 1.0 / (self.shape.rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        positions = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_model_len, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_model_len, d]
        sin = emb.sin()
        sin[:, : d // 2] = -sin[:, : d // 2]  # signed for the roll form of rotate_half (see forward)
        return torch.stack((emb.cos(), sin), dim=1).to(self.device, self.dtype)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Rebuild the per-layer tensors (and scaled norm copies) from the parameters; call after every write."""
        p, t = self.weights.params, self.tps
        self.layers: list[LayerWeights] = []
        self.moe_layers: dict[int, MoeWeights] = {}  # layer index -> its MoE block's tensors
        no_mlp = torch.empty(0, device=self.device, dtype=self.dtype)
        for i in range(self.shape.num_layers):
            pre = f"model.layers.{i}"
            if self.shape.is_moe_layer(i):
                router, w13, w2 = (p[f"{pre}.{part.vllm_param('weight')}"] for part, _ in self._moe_parts(i))
                self.moe_layers[i] = MoeWeights(router, w13, w2)
            qk_norm = None
            if f"{pre}.self_attn.q_norm.weight" in p:  # the layout has what the family has
                qk_norm = scaled_norm_weight(
                    torch.cat(
                        [
                            p[f"{pre}.self_attn.q_norm.weight"].expand(t.num_heads, -1),
                            p[f"{pre}.self_attn.k_norm.weight"].expand(t.num_kv_heads, -1),
                        ]
                    )
                )
            self.layers.append(
                LayerWeights(
                    input_norm=scaled_norm_weight(p[f"{pre}.input_layernorm.weight"]),
                    qkv_w=p[f"{pre}.self_attn.qkv_proj.weight"],
                    qkv_b=p.get(f"{pre}.self_attn.qkv_proj.bias"),
                    qk_norm=qk_norm,
                    o_w_t=p[f"{pre}.self_attn.o_proj.weight"].t(),
                    post_norm=scaled_norm_weight(p[f"{pre}.post_attention_layernorm.weight"]),
                    gate_up_w=no_mlp if i in self.moe_layers else p[f"{pre}.mlp.gate_up_proj.weight"],
                    down_w_t=no_mlp if i in self.moe_layers else p[f"{pre}.mlp.down_proj.weight"].t(),
                )
            )
        self.final_norm = scaled_norm_weight(p["model.norm.weight"])
        self.embed_table = p["model.embed_tokens.weight"]  # [P/T, h]
        self.lm_head = p.get("lm_head.weight", self.embed_table)  # tied embeddings: the layout has no lm_head
        # the TorchScript decode takes one list per field of LayerWeights (empty: the model has no such tensor)
        self._tp1_weight_lists = [[t for t in field if t is not None] for field in zip(*self.layers)]

    def _moe_parts(self, layer: int) -> list:
        """The (router, w13, w2) parts of an MoE layer, one per vLLM parameter (w13 holds gate and up)."""
        parts = [(part, kind) for part, kind in layer_parts(self.shape, layer) if part.name in MOE_PART_NAMES]
        return [(part, kind) for part, kind in parts if part.name != "expert_up"]

    # ------------------------------------------------------------------ building blocks
    def _all_reduce(self, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Sum over ``group`` (None: the TP group; no collective when that is None too)."""
        group = self.group if group is None else group
        if group is not None:
            _collective(lambda: dist.all_reduce(x, group=group), x)
        return x

    def _eps_term(self, dim: int) -> torch.Tensor:
        """sqrt(dim * eps) as a tensor (the second leg of the hypot in :meth:`rms_norm`), cached per dim."""
        eps_term = self._eps_terms.get(dim)
        if eps_term is None:
            eps_term = self._eps_terms[dim] = torch.tensor(math.sqrt(dim * self.shape.rms_norm_eps), device=self.device)
        return eps_term

    def rms_norm(self, x: torch.Tensor, scaled_weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm: x / sqrt(mean(x^2) + eps) * w == x / hypot(||x||, sqrt(dim * eps)) * (w * sqrt(dim)).

        Four kernels instead of seven; agrees with transformers' RMSNorm to ~1 ulp in fp32.
        """
        eps_term = self._eps_term(x.shape[-1])
        if x.dtype == torch.float32:
            return x.div(torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), eps_term)).mul_(scaled_weight)
        xf = x.float()
        out = xf.div(torch.hypot(torch.linalg.vector_norm(xf, dim=-1, keepdim=True), eps_term)).mul_(scaled_weight)
        return out.to(x.dtype)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:  # ids [N] -> [N, h]
        if self.group is None:
            return self.embed_table[ids]
        local = ids - self.tps.vocab_start
        outside = (local < 0) | (local >= self.tps.vocab_per_rank)
        x = self.embed_table[local.masked_fill(outside, 0)].masked_fill(outside[:, None], 0.0)
        return self._all_reduce(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # x [N, h] (final-normed) -> [N, V]
        local = F.linear(x, self.lm_head)  # [N, P/T]
        if self.group is not None:
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            local = local.contiguous()
            _collective(lambda: dist.all_gather(parts, local, group=self.group), local, *parts)
            local = torch.cat(parts, dim=-1)  # [N, P]
        return local[:, : self.shape.vocab_size]

    def _row_parallel_add(self, x: torch.Tensor, inp: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        """x + all_reduce(inp @ weight_t): the residual add after a row-parallel (input-split) linear."""
        if self.group is None:
            return torch.addmm(x, inp, weight_t)  # one op: matmul and residual add
        return x + self._all_reduce(torch.mm(inp, weight_t))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """ids, positions [N] -> final-normed hidden [N, h]; ``attend(layer, q, k, v)`` -> [N, Hq/T * d].

        Each block is a call, so its intermediates die when it returns: between blocks only x [N, h] is alive
        (a loop body's locals would hold one layer's qkv [N, (Hq/T + 2 kv) d] and gate_up [N, 2 I/T] through the
        next layer's blocks)."""
        cos_sin = self._cos_sin[positions]  # [N, 2, d]
        cos, sin = cos_sin[:, :1], cos_sin[:, 1:]  # [N, 1, d]
        x = self._embed(ids)
        for i, layer in enumerate(self.layers):
            x = self._attention_block(i, x, layer, cos, sin, attend)
            if i in self.moe_layers:
                x = x + self._all_reduce(
                    self.moe(self.rms_norm(x, layer.post_norm), self.moe_layers[i], i), self.moe_group
                )
            else:
                x = self._mlp_block(x, layer)
        return self.rms_norm(x, self.final_norm)

    def _attention_block(self, i: int, x: torch.Tensor, layer: LayerWeights, cos, sin, attend) -> torch.Tensor:
        """x [N, h] -> x + o_proj(attention(rope(qkv(norm(x))))), [N, h]."""
        t, d = self.tps, self.shape.head_dim
        n, num_qk = x.shape[0], t.num_heads + t.num_kv_heads
        qkv = F.linear(self.rms_norm(x, layer.input_norm), layer.qkv_w, layer.qkv_b)
        qkv = qkv.view(n, num_qk + t.num_kv_heads, d)  # heads: [q (Hq/T) | k (kv) | v (kv)]
        qk, v = qkv.split_with_sizes((num_qk, t.num_kv_heads), dim=1)  # (C++ method: no python wrapper)
        if layer.qk_norm is not None:  # q_norm on the q heads, k_norm on the k heads, in one op
            qk = self.rms_norm(qk, layer.qk_norm)
        # rope on q and k heads: rotate_half(x) * sin == roll(x, d/2) * [-sin_lo, sin_hi] (signed table)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
        q, k = qk.split_with_sizes((t.num_heads, t.num_kv_heads), dim=1)
        return self._row_parallel_add(x, attend(i, q, k, v), layer.o_w_t)

    def _mlp_block(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """x [N, h] -> x + down(silu(gate) * up), gate and up [N, I/T] halves of gate_up(norm(x))."""
        gate, up = F.linear(self.rms_norm(x, layer.post_norm), layer.gate_up_w).chunk(2, dim=-1)
        return self._row_parallel_add(x, F.silu(gate) * up, layer.down_w_t)

    def route(self, x: torch.Tensor, router_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, h] (post-attention-normed) -> (top-k weights [N, k] in the dtype, top-k expert ids [N, k]), as
        transformers routes: softmax of the logits in fp32, top-k, renormalised when ``norm_topk_prob``."""
        probs = F.linear(x, router_w).float().softmax(dim=-1)  # [N, E]
        top_weights, top_ids = probs.topk(self.shape.moe_top_k, dim=-1)
        if self.shape.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_weights.to(x.dtype), top_ids

    def moe(self, x: torch.Tensor, w: MoeWeights, layer: int) -> torch.Tensor:
        """x [N, h] normed -> this rank's partial MoE output [N, h] (sum over the MoE group = the block's output):
        its local experts' (global ids [first_expert, first_expert + E/ep)) m/T rows."""
        top_weights, top_ids = self.route(x, w.router_w)
        if self.routing_log is not None:
            self.routing_log.append((layer, top_ids))
        out = torch.zeros_like(x)
        rows = w.w13.shape[1] // 2  # m/T
        flat_ids = top_ids.flatten()  # [N * k]: token n's j-th choice at n * k + j
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.shape.num_experts).tolist()
        token_of = order // self.shape.moe_top_k
        weight_of = top_weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            local = expert - self.first_expert
            if count == 0 or not 0 <= local < w.w13.shape[0]:  # unused, or another EP rank's expert
                start += count
                continue
            tokens = token_of[start : start + count]
            gate_up = F.linear(x[tokens], w.w13[local])  # [n_e, 2 m/T]
            act = F.silu(gate_up[:, :rows]) * gate_up[:, rows:]
            out.index_add_(0, tokens, F.linear(act, w.w2[local]) * weight_of[start : start + count, None])
            start += count
        return out

    # ------------------------------------------------------------------ prefill / decode
    def prefill(self, prompts: list[list[int]], block_table: torch.Tensor) -> torch.Tensor:
        """Padded causal prefill of B prompts; writes their KV into their blocks. Returns logits [B, V]."""
        bs, d = self.kv_cache.block_size, self.shape.head_dim
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        num, length = len(prompts), int(lens.max())
        ids = torch.zeros((num, length), dtype=torch.long, device=self.device)
        for b, prompt in enumerate(prompts):
            ids[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        pos = torch.arange(length, device=self.device).expand(num, length)  # [B, L]
        valid = pos < lens[:, None]  # [B, L]
        slots = block_table.gather(1, pos // bs) * bs + pos % bs  # [B, L]
        flat_valid = valid.flatten().nonzero().squeeze(1)  # token rows that exist
        write_slots = slots.flatten()[flat_valid]
        # [B, 1, L(query), L(key)]: causal and key inside the prompt
        mask = (torch.ones(length, length, dtype=torch.bool, device=self.device).tril()[None] & valid[:, None, :])[
            :, None
        ]

        def attend(layer: int, q, k, v):  # q [B*L, Hq/T, d], k/v [B*L, kv, d]
            self.kv_cache.write_prefill(layer, write_slots, k[flat_valid], v[flat_valid])
            q4 = q.view(num, length, -1, d).transpose(1, 2)  # [B, Hq/T, L, d]
            k4 = k.view(num, length, -1, d).transpose(1, 2)  # [B, kv, L, d]
            v4 = v.view(num, length, -1, d).transpose(1, 2)
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
            return out.transpose(1, 2).reshape(num * length, -1)

        hidden = self.forward(ids.flatten(), pos.flatten(), attend).view(num, length, -1)
        return self._logits(hidden[torch.arange(num, device=self.device), lens - 1])

    def decode(
        self, last_tokens: torch.Tensor, ctx_lens: torch.Tensor, block_table: torch.Tensor, slot_table: torch.Tensor
    ) -> torch.Tensor:
        """One token for each of B running sequences -> logits [B, V].

        last_tokens [B]: the newest token (not cached yet); ctx_lens [B]: tokens already cached;
        block_table [B, width]: each sequence's blocks; slot_table [B, width * block_size]: the cache slot
        of each of its positions.
        """
        d, kv = self.shape.head_dim, self.tps.num_kv_heads
        num, group = last_tokens.shape[0], self.tps.num_heads // kv
        new_rows, ctx_block_rows, span = self.kv_cache.decode_rows(ctx_lens, block_table, slot_table)
        # additive mask [B*kv, 1, nb*bs]: 0 for cached tokens and the new one, -inf elsewhere
        visible = self._positions[:span] <= ctx_lens.repeat_interleave(kv)[:, None]
        mask = torch.where(visible[:, None], 0.0, float("-inf"))
        if mask.dtype != self.dtype:
            mask = mask.to(self.dtype)
        scale = 1.0 / math.sqrt(d)
        if self.group is None and self.dtype == torch.float32 and not self.moe_layers:
            hidden = self._decode_layers_tp1(last_tokens, ctx_lens, new_rows, ctx_block_rows, mask, span, scale)
            return self._logits(self.rms_norm(hidden, self.final_norm))

        def attend(layer: int, q, k, v):  # q [B, Hq/T, d], k/v [B, kv, d]
            self.kv_cache.token_rows[layer].index_copy_(0, new_rows, torch.stack((k, v)).view(2 * num * kv, d))
            ctx = self.kv_cache.block_rows[layer].index_select(0, ctx_block_rows).view(2, num * kv, span, d)
            # grouped-query attention per (sequence, kv head): q [B*kv, group, d] x k^T [B*kv, d, nb*bs]
            q = q.reshape(num * kv, group, d)
            probs = torch.baddbmm(mask, q, ctx[0].transpose(1, 2), alpha=scale).softmax(dim=-1)
            return torch.bmm(probs, ctx[1]).view(num, -1)  # [B, Hq/T * d]

        return self._logits(self.forward(last_tokens, ctx_lens, attend))

    def _decode_layers_tp1(self, last_tokens, ctx_lens, new_rows, ctx_block_rows, mask, span: int, scale: float):
        """The decode layer loop at TP=1 in fp32, through TorchScript -> hidden [B, h] (before the final norm)."""
        d = self.shape.head_dim
        cos_sin = self._cos_sin[ctx_lens]  # [B, 2, d]
        return scripted_decode_layers()(
            self._embed(last_tokens),
            cos_sin[:, :1],
            cos_sin[:, 1:],
            *self._tp1_weight_lists,
            self.kv_cache.token_rows,
            self.kv_cache.block_rows,
            new_rows,
            ctx_block_rows,
            mask,
            self._eps_term(self.shape.hidden_size),
            self._eps_term(d),
            self.tps.num_heads,
            self.tps.num_kv_heads,
            d,
            span,
            scale,
        )
