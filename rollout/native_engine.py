"""The native rollout engine: plain torch, CPU or CUDA, tensor parallel with exactly vLLM's weight layout.

- Parameters: one tensor per vLLM parameter (names, shapes, padding from :mod:`rollout.layout`), in the
  memory-saver region ``weights``.
- KV cache: one preallocated tensor [num_layers, 2 (k, v), kv_heads_per_rank, num_blocks * block_size,
  head_dim] in the region ``kv_cache``, handed out in blocks of ``rollout.block_size`` tokens. Its size is
  ``gpu_memory_utilization x capacity - weights - activation reserve`` (capacity: the CUDA device's total
  memory, or ``rollout.cpu_capacity_gb`` on CPU), capped at what ``max_num_seqs`` full-length sequences
  could ever use.
- Continuous batching: a sequence reserves the blocks for prompt + max_tokens when admitted; finished
  sequences free theirs at once and waiting sequences take them at the next step. Admitted sequences are
  prefilled together (padded, causal), then every running sequence decodes one token per step in one
  batched forward whose attention gathers each sequence's KV blocks.
- Tensor parallel over an explicit process group (gloo or NCCL): vocab-parallel embedding (all-reduce),
  column-parallel qkv / gate_up, row-parallel o / down (all-reduce), vocab-parallel lm_head (all-gather).
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rollout.config import RolloutConfig
from rollout.engine import Completion, SamplingParams
from rollout.layout import ModelShape, copy_hf_into_local, hf_to_vllm_index, tp_shape, vllm_param_layouts
from rollout.memory_saver import TAGS, MemorySaver

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor of the checkpoint directory (one or many shards)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {model_path}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _decode_layers_tp1(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm1: list[torch.Tensor],
    qkv_w: list[torch.Tensor],
    qkv_b: list[torch.Tensor],
    qk_norm: list[torch.Tensor],
    o_w_t: list[torch.Tensor],
    norm2: list[torch.Tensor],
    gate_up_w: list[torch.Tensor],
    down_w_t: list[torch.Tensor],
    token_rows: list[torch.Tensor],
    block_rows: list[torch.Tensor],
    new_rows: torch.Tensor,
    ctx_block_rows: torch.Tensor,
    mask: torch.Tensor,
    eps_hidden: torch.Tensor,
    eps_head: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    span: int,
    scale: float,
) -> torch.Tensor:
    """The decoder layers of one decode step at TP=1 in fp32: the same math as ``NativeEngine._forward`` with
    the decode ``attend``, written once more so TorchScript can run it without Python between kernels (on
    2 CPU cores the per-kernel Python overhead is about half of a tiny model's step). x [B, h] -> [B, h].
    Empty ``qkv_b`` / ``qk_norm`` lists mean no bias / no q-k norms; norm weights are pre-scaled (see _rms).
    """
    num, d, kv = x.shape[0], head_dim, num_kv_heads
    group = num_heads // kv
    for i in range(len(norm1)):
        h = x.div(torch.hypot(torch.linalg.vector_norm(x, 2, [-1], True), eps_hidden)).mul_(norm1[i])
        if len(qkv_b) > 0:
            qkv = torch.addmm(qkv_b[i], h, qkv_w[i].t())
        else:
            qkv = torch.mm(h, qkv_w[i].t())
        qk, v = qkv.view(num, num_heads + 2 * kv, d).split_with_sizes([num_heads + kv, kv], 1)
        if len(qk_norm) > 0:
            qk = qk.div(torch.hypot(torch.linalg.vector_norm(qk, 2, [-1], True), eps_head)).mul_(qk_norm[i])
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
        q, k = qk.split_with_sizes([num_heads, kv], 1)
        token_rows[i].index_copy_(0, new_rows, torch.stack((k, v)).view(2 * num * kv, d))
        ctx = block_rows[i].index_select(0, ctx_block_rows).view(2, num * kv, span, d)
        probs = torch.baddbmm(mask, q.reshape(num * kv, group, d), ctx[0].transpose(1, 2), beta=1.0, alpha=scale)
        x = torch.addmm(x, torch.bmm(probs.softmax(-1), ctx[1]).view(num, -1), o_w_t[i])
        h = x.div(torch.hypot(torch.linalg.vector_norm(x, 2, [-1], True), eps_hidden)).mul_(norm2[i])
        gate, up = torch.mm(h, gate_up_w[i].t()).chunk(2, -1)
        x = torch.addmm(x, torch.nn.functional.silu(gate) * up, down_w_t[i])
    return x


_SCRIPTED: dict[str, object] = {}


def _scripted_decode_layers():
    """``_decode_layers_tp1`` under TorchScript (compiled once per process), or the plain function if that fails."""
    if "fn" not in _SCRIPTED:
        try:
            _SCRIPTED["fn"] = torch.jit.script(_decode_layers_tp1)
        except Exception:  # noqa: BLE001 - TorchScript is optional: the eager function is the same math
            _SCRIPTED["fn"] = _decode_layers_tp1
    return _SCRIPTED["fn"]


class NativeEngine:
    """See the module doc. ``group`` is the rollout TP process group (None: TP=1, no collectives)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        group: dist.ProcessGroup | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "float32",
        load: bool = True,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        with open(os.path.join(model_path, "config.json")) as f:
            self.shape = ModelShape.from_hf_config(json.load(f))
        self.group = group
        self.tp = 1 if group is None else dist.get_world_size(group)
        self.tp_rank = 0 if group is None else dist.get_rank(group)
        if self.tp != cfg.tp:
            raise ValueError(f"rollout.tp={cfg.tp} but the process group given has {self.tp} ranks; make them agree")
        self._src_rank = 0 if group is None else dist.get_global_rank(group, 0)
        self.tps = tp_shape(self.shape, self.tp, self.tp_rank)
        self.layouts = vllm_param_layouts(self.shape, self.tp, self.tp_rank)
        self._hf_index = hf_to_vllm_index(self.layouts)
        self.max_model_len = cfg.max_model_len or self.shape.max_position_embeddings
        self.saver = MemorySaver(cfg.memory_saver, self.device)

        with self.saver.region("weights", cpu_backup=cfg.sleep_level == 1):
            self.params: dict[str, torch.Tensor] = {
                p.name: self.saver.track(torch.zeros(p.local_shape, dtype=self.dtype, device=self.device))
                for p in self.layouts
            }
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.params.values())
        self._weights_loaded = False
        self._layers: list[tuple] | None = None  # per-layer tensors for the forward, see _layer_weights
        self._final_norm: torch.Tensor | None = None
        self._eps_terms: dict[int, torch.Tensor] = {}
        self._rope_tables()
        if load:
            self.load_weights(iter_safetensors(model_path))
        self._allocate_kv_cache()
        self.max_running_seen = 0  # most sequences decoded together (continuous-batching stats)

    # ------------------------------------------------------------------ memory
    def _rope_tables(self) -> None:
        d = self.shape.head_dim
        inv_freq = 1.0 / (self.shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        positions = torch.arange(self.max_model_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_model_len, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_model_len, d] (neox / HF rotate_half style)
        sin = emb.sin()
        sin[:, : d // 2] = -sin[:, : d // 2]  # signed for the roll form of rotate_half (see _forward)
        self._cos_sin = torch.stack((emb.cos(), sin), dim=1).to(self.device, self.dtype)  # [max_model_len, 2, d]

    def kv_cache_capacity_bytes(self) -> int:
        """Bytes the KV cache may take: utilization x capacity - weights - activation reserve."""
        util = self.cfg.gpu_memory_utilization
        if util == "auto":
            raise ValueError(
                "rollout.gpu_memory_utilization='auto' must be resolved by the planner before the engine starts"
            )
        if self.device.type == "cuda":
            capacity = torch.cuda.mem_get_info(self.device)[1]
        else:
            capacity = int(self.cfg.cpu_capacity_gb * 2**30)
        return int(util * capacity) - self.weight_bytes - self.cfg.activation_reserve_mb * 2**20

    def _allocate_kv_cache(self) -> None:
        s, bs = self.shape, self.cfg.block_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        # one block = block_size tokens of k and v for every layer
        self.block_bytes = s.num_layers * 2 * bs * self.tps.num_kv_heads * s.head_dim * elem
        blocks_per_seq = math.ceil(self.max_model_len / bs)
        budget = self.kv_cache_capacity_bytes()
        num_blocks = min(budget // self.block_bytes, self.cfg.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"KV cache budget {budget / 2**20:.1f} MiB holds {max(num_blocks, 0)} blocks, fewer than one "
                f"max_model_len={self.max_model_len} sequence needs ({blocks_per_seq}); raise "
                "rollout.gpu_memory_utilization (or rollout.cpu_capacity_gb on CPU) or lower rollout.max_model_len"
            )
        self.num_blocks = int(num_blocks)
        with self.saver.region("kv_cache"):
            # [layer, k|v, kv head (local), slot = block * block_size + offset, head_dim]: one block of one
            # head is block_size * head_dim contiguous values, so decode gathers whole blocks
            self.kv_cache = self.saver.track(
                torch.zeros(
                    (s.num_layers, 2, self.tps.num_kv_heads, self.num_blocks * bs, s.head_dim),
                    dtype=self.dtype,
                    device=self.device,
                )
            )
        self.free_blocks: list[int] = list(range(self.num_blocks - 1, -1, -1))
        # per layer, its cache viewed as rows of one token [2*kv*slots, d] and of one block [2*kv*blocks, bs*d]
        self._kv_rows = [(c.view(-1, s.head_dim), c.view(-1, bs * s.head_dim)) for c in self.kv_cache]
        # first row of each (k|v, kv head) plane in one layer's cache, counted in slots and in blocks: [2, kv]
        planes = torch.arange(2 * self.tps.num_kv_heads, device=self.device).view(2, -1)
        self._plane_slot_offsets = planes * (self.num_blocks * bs)
        self._plane_block_offsets = planes * self.num_blocks
        self._positions = torch.arange(max(self.max_model_len + bs, self.cfg.max_num_seqs), device=self.device)

    def memory(self) -> dict[str, int]:
        by_tag = self.saver.bytes_by_tag()
        return {tag: by_tag.get(tag, 0) for tag in TAGS}

    def sleep(self, tags: Sequence[str] = TAGS) -> None:
        for tag in tags:
            if tag not in TAGS:
                raise ValueError(f"unknown memory tag {tag!r}; tags are {TAGS}")
            self.saver.pause(tag)
            if tag == "weights" and not (self.cfg.sleep_level == 1 and self.device.type != "cpu"):
                self._weights_loaded = False  # dropped: load_weights before generating again

    def wake_up(self, tags: Sequence[str] = TAGS) -> None:
        for tag in tags:
            if tag not in TAGS:
                raise ValueError(f"unknown memory tag {tag!r}; tags are {TAGS}")
            if self.saver.resume(tag) and tag == "kv_cache":
                self.kv_cache.zero_()  # torch-memory-saver hands back uninitialised pages

    # ------------------------------------------------------------------ weights
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under vLLM's names: the live tensors, writable in place (e.g. by a resharder
        using :mod:`rollout.layout`). After writing weights that sleep() dropped, call ``load_weights([])`` to
        mark them loaded again."""
        return dict(self.params)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.saver.is_paused("weights"):
            raise RuntimeError("weights are asleep; call wake_up(['weights']) before load_weights")
        for name, tensor in weights:
            if name == "lm_head.weight" and self.shape.tie_word_embeddings:
                continue  # tied: the engine's lm_head is model.embed_tokens.weight
            targets = self._hf_index.get(name)
            if targets is None:
                if "rotary_emb" in name:
                    continue
                raise KeyError(f"{name!r} is not a Hugging Face tensor of this {self.shape.model_type} model")
            tensor = tensor.to(self.device, self.dtype)
            for layout, spec in targets:
                copy_hf_into_local(self.params[layout.name], layout, spec, tensor)
        self._weights_loaded = True

    # ------------------------------------------------------------------ model
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm weight [..., dim] as :meth:`_rms` takes it: times sqrt(dim), in fp32 (a small copy)."""
        return weight.float() * math.sqrt(weight.shape[-1])

    def _eps_term(self, dim: int) -> torch.Tensor:
        """sqrt(dim * eps) as a tensor (the second leg of the hypot in :meth:`_rms`), cached per dim."""
        eps_term = self._eps_terms.get(dim)
        if eps_term is None:
            eps_term = self._eps_terms[dim] = torch.tensor(math.sqrt(dim * self.shape.rms_norm_eps), device=self.device)
        return eps_term

    def _rms(self, x: torch.Tensor, scaled_weight: torch.Tensor) -> torch.Tensor:
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
        table = self.params["model.embed_tokens.weight"]  # [P/T, h]
        if self.group is None:
            return table[ids]
        local = ids - self.tps.vocab_start
        outside = (local < 0) | (local >= self.tps.vocab_per_rank)
        x = table[local.masked_fill(outside, 0)].masked_fill(outside[:, None], 0.0)
        return self._all_reduce(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # x [N, h] (final-normed) -> [N, V]
        name = "model.embed_tokens.weight" if self.shape.tie_word_embeddings else "lm_head.weight"
        local = F.linear(x, self.params[name])  # [N, P/T]
        if self.group is not None:
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(parts, local.contiguous(), group=self.group)
            local = torch.cat(parts, dim=-1)  # [N, P]
        return local[:, : self.shape.vocab_size]

    def _row_parallel_add(self, x: torch.Tensor, inp: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        """x + all_reduce(inp @ weight_t): the residual add after a row-parallel (input-split) linear."""
        if self.group is None:
            return torch.addmm(x, inp, weight_t)  # one op: matmul and residual add
        return x + self._all_reduce(torch.mm(inp, weight_t))

    def _layer_weights(self) -> list[tuple]:
        """Per layer, the tensors one forward uses, looked up once per generate() call, not per step.

        The RMSNorm weights are small scaled copies (see :meth:`_rms`), rebuilt at every generate() so that
        weights written in place through :meth:`named_parameters` are always seen.
        """
        if self._layers is None:
            p, t = self.params, self.tps
            layers = []
            for i in range(self.shape.num_layers):
                pre = f"model.layers.{i}"
                qk_norm = None
                if self.shape.qk_norm:  # [Hq/T + kv, d]: q_norm repeated over the q heads, then k_norm
                    qk_norm = self._norm_weight(
                        torch.cat(
                            [
                                p[f"{pre}.self_attn.q_norm.weight"].expand(t.num_heads, -1),
                                p[f"{pre}.self_attn.k_norm.weight"].expand(t.num_kv_heads, -1),
                            ]
                        )
                    )
                layers.append(
                    (
                        self._norm_weight(p[f"{pre}.input_layernorm.weight"]),
                        p[f"{pre}.self_attn.qkv_proj.weight"],
                        p.get(f"{pre}.self_attn.qkv_proj.bias"),
                        qk_norm,
                        p[f"{pre}.self_attn.o_proj.weight"].t(),  # [Hq/T*d, h]
                        self._norm_weight(p[f"{pre}.post_attention_layernorm.weight"]),
                        p[f"{pre}.mlp.gate_up_proj.weight"],
                        p[f"{pre}.mlp.down_proj.weight"].t(),  # [I/T, h]
                    )
                )
            self._layers = layers
            self._final_norm = self._norm_weight(p["model.norm.weight"])
        return self._layers

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """ids, positions [N] -> final-normed hidden [N, h]; ``attend(layer, q, k, v)`` -> [N, Hq/T * d]."""
        t, d = self.tps, self.shape.head_dim
        num_qk, half_d = t.num_heads + t.num_kv_heads, d // 2
        cos_sin = self._cos_sin[positions]  # [N, 2, d]
        cos, sin = cos_sin[:, :1], cos_sin[:, 1:]  # [N, 1, d]
        x = self._embed(ids)
        n = ids.shape[0]
        for i, (ln1, qkv_w, qkv_b, qk_norm, o_w_t, ln2, gate_up_w, down_w_t) in enumerate(self._layer_weights()):
            qkv = F.linear(self._rms(x, ln1), qkv_w, qkv_b)
            qkv = qkv.view(n, num_qk + t.num_kv_heads, d)  # heads: [q (Hq/T) | k (kv) | v (kv)]
            qk, v = qkv.split_with_sizes((num_qk, t.num_kv_heads), dim=1)  # (C++ method: no python wrapper)
            if qk_norm is not None:  # q_norm on the q heads, k_norm on the k heads, in one op
                qk = self._rms(qk, qk_norm)
            # rope on q and k heads: rotate_half(x) * sin == roll(x, d/2) * [-sin_lo, sin_hi] (signed table)
            qk = torch.addcmul(qk * cos, qk.roll(half_d, dims=-1), sin)
            q, k = qk.split_with_sizes((t.num_heads, t.num_kv_heads), dim=1)
            x = self._row_parallel_add(x, attend(i, q, k, v), o_w_t)
            gate, up = F.linear(self._rms(x, ln2), gate_up_w).chunk(2, dim=-1)
            x = self._row_parallel_add(x, F.silu(gate) * up, down_w_t)
        return self._rms(x, self._final_norm)

    def _prefill(self, prompts: list[list[int]], block_table: torch.Tensor) -> torch.Tensor:
        """Padded causal prefill of B prompts; writes their KV into their blocks. Returns logits [B, V]."""
        bs, d = self.cfg.block_size, self.shape.head_dim
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
            self.kv_cache[layer, 0].index_copy_(1, write_slots, k[flat_valid].transpose(0, 1))
            self.kv_cache[layer, 1].index_copy_(1, write_slots, v[flat_valid].transpose(0, 1))
            q4 = q.view(num, length, -1, d).transpose(1, 2)  # [B, Hq/T, L, d]
            k4 = k.view(num, length, -1, d).transpose(1, 2)  # [B, kv, L, d]
            v4 = v.view(num, length, -1, d).transpose(1, 2)
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
            return out.transpose(1, 2).reshape(num * length, -1)

        hidden = self._forward(ids.flatten(), pos.flatten(), attend).view(num, length, -1)
        return self._logits(hidden[torch.arange(num, device=self.device), lens - 1])

    def _decode(
        self, last_tokens: torch.Tensor, ctx_lens: torch.Tensor, block_table: torch.Tensor, slot_table: torch.Tensor
    ) -> torch.Tensor:
        """One token for each of B running sequences -> logits [B, V].

        ctx_lens [B]: tokens already cached; block_table [B, width]: each sequence's blocks;
        slot_table [B, width * block_size]: the cache slot of each of its positions.
        """
        bs, d, kv = self.cfg.block_size, self.shape.head_dim, self.tps.num_kv_heads
        num, group = last_tokens.shape[0], self.tps.num_heads // kv
        new_slots = slot_table.gather(1, ctx_lens[:, None])  # [B, 1]
        # rows of one layer's cache viewed [2*kv*slots, d] receiving the new k and v, ordered (k|v, B, head)
        new_rows = (new_slots + self._plane_slot_offsets[:, None, :]).flatten()
        num_ctx_blocks = (int(ctx_lens.max()) + bs) // bs  # blocks covering ctx + the new token
        span = num_ctx_blocks * bs
        # rows of one layer's cache viewed [2*kv*num_blocks, bs*d] holding each sequence's first nb blocks,
        # ordered (k|v, B, head, block)
        ctx_block_rows = (
            block_table[None, :, None, :num_ctx_blocks] + self._plane_block_offsets[:, None, :, None]
        ).flatten()
        # additive mask [B*kv, 1, nb*bs]: 0 for cached tokens and the new one, -inf elsewhere
        visible = self._positions[:span] <= ctx_lens.repeat_interleave(kv)[:, None]
        mask = torch.where(visible[:, None], 0.0, float("-inf"))
        if mask.dtype != self.dtype:
            mask = mask.to(self.dtype)
        scale = 1.0 / math.sqrt(d)
        if self.group is None and self.dtype == torch.float32:
            return self._logits(self._decode_tp1(last_tokens, ctx_lens, new_rows, ctx_block_rows, mask, span, scale))

        def attend(layer: int, q, k, v):  # q [B, Hq/T, d], k/v [B, kv, d]
            token_rows, block_rows = self._kv_rows[layer]
            token_rows.index_copy_(0, new_rows, torch.stack((k, v)).view(2 * num * kv, d))
            ctx = block_rows.index_select(0, ctx_block_rows).view(2, num * kv, span, d)
            # grouped-query attention per (sequence, kv head): q [B*kv, group, d] x k^T [B*kv, d, nb*bs]
            q = q.reshape(num * kv, group, d)
            probs = torch.baddbmm(mask, q, ctx[0].transpose(1, 2), alpha=scale).softmax(dim=-1)
            return torch.bmm(probs, ctx[1]).view(num, -1)  # [B, Hq/T * d]

        return self._logits(self._forward(last_tokens, ctx_lens, attend))

    def _decode_tp1(self, last_tokens, ctx_lens, new_rows, ctx_block_rows, mask, span: int, scale: float):
        """TP=1 fp32 decode through the TorchScript layer loop -> final-normed hidden [B, h]."""
        layers = self._layer_weights()
        cos_sin = self._cos_sin[ctx_lens]  # [B, 2, d]
        x = self._run_decode_layers(layers, last_tokens, cos_sin, new_rows, ctx_block_rows, mask, span, scale)
        return self._rms(x, self._final_norm)

    def _run_decode_layers(self, layers, last_tokens, cos_sin, new_rows, ctx_block_rows, mask, span, scale):
        d = self.shape.head_dim
        return _scripted_decode_layers()(
            self._embed(last_tokens),
            cos_sin[:, :1],
            cos_sin[:, 1:],
            [w[0] for w in layers],
            [w[1] for w in layers],
            [w[2] for w in layers] if self.shape.qkv_bias else [],
            [w[3] for w in layers] if self.shape.qk_norm else [],
            [w[4] for w in layers],
            [w[5] for w in layers],
            [w[6] for w in layers],
            [w[7] for w in layers],
            [rows[0] for rows in self._kv_rows],
            [rows[1] for rows in self._kv_rows],
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

    # ------------------------------------------------------------------ sampling
    def _sample(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None):
        """logits [B, V] -> (tokens [B], their raw log-probs [B])."""
        logits = logits.float()
        log_normalizer = torch.logsumexp(logits, dim=-1)  # [B]: log p(token) = logit - log_normalizer
        if params.temperature == 0:
            chosen, tokens = logits.max(dim=-1)
            if self.group is None:
                return tokens, chosen - log_normalizer
        else:
            scaled = logits / params.temperature
            if params.top_k > 0 and params.top_k < scaled.shape[-1]:
                kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if params.top_p < 1.0:
                sorted_logits, order = scaled.sort(dim=-1, descending=True)
                probs = sorted_logits.softmax(dim=-1)
                drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
                scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
            tokens = torch.multinomial(scaled.softmax(dim=-1), 1, generator=gen).squeeze(1)
        if self.group is not None:  # every TP rank continues with rank 0's tokens
            dist.broadcast(tokens, src=self._src_rank, group=self.group)
        return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - log_normalizer

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if self.saver.is_paused("weights") or self.saver.is_paused("kv_cache"):
            raise RuntimeError("engine is asleep; wake_up(['weights', 'kv_cache']) first")
        if not self._weights_loaded:
            raise RuntimeError("weights were released by sleep(); load_weights(...) after wake_up before generating")
        self._layers = None  # re-read the parameters (they may have been written in place since the last call)
        bs = self.cfg.block_size
        for i, prompt in enumerate(prompts):
            if not 0 < len(prompt) < self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; it must have 1..{self.max_model_len - 1}")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.shape.eos_token_id is not None:
            stop_ids.add(self.shape.eos_token_id)
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)

        results = [[Completion(i, j) for j in range(params.n)] for i in range(len(prompts))]
        waiting = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        waiting.reverse()  # pop() from the end = FIFO
        width = math.ceil(min(max(len(p) for p in prompts) + params.max_tokens, self.max_model_len) / bs)
        # running batch, one row per sequence
        seqs: list[tuple[int, int]] = []
        blocks: list[list[int]] = []
        block_table = torch.zeros((0, width), dtype=torch.long, device=self.device)  # [B, width]
        slot_table = torch.zeros((0, width * bs), dtype=torch.long, device=self.device)  # [B, width * bs]
        limits = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] most tokens it may generate
        ctx_lens = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] tokens in the cache
        last = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] newest token (not cached yet)
        out_tokens = torch.zeros((0, params.max_tokens), dtype=torch.long, device=self.device)
        out_logprobs = torch.zeros((0, params.max_tokens), dtype=torch.float32, device=self.device)
        gen_lens = torch.zeros(0, dtype=torch.long, device=self.device)

        while waiting or seqs:
            # admit FIFO while blocks (reserved for prompt + max_tokens) and max_num_seqs allow
            admitted, new_blocks = [], []
            while waiting and len(seqs) + len(admitted) < self.cfg.max_num_seqs:
                i, j = waiting[-1]
                need = math.ceil(min(len(prompts[i]) + params.max_tokens, self.max_model_len) / bs)
                if need > len(self.free_blocks):
                    if not seqs and not admitted:
                        raise RuntimeError(f"KV cache of {self.num_blocks} blocks cannot hold one sequence ({need})")
                    break
                waiting.pop()
                admitted.append((i, j))
                new_blocks.append([self.free_blocks.pop() for _ in range(need)])
            if admitted:
                table = torch.zeros((len(admitted), width), dtype=torch.long, device=self.device)
                for b, blk in enumerate(new_blocks):
                    table[b, : len(blk)] = torch.tensor(blk, dtype=torch.long)
                logits = self._prefill([list(prompts[i]) for i, _ in admitted], table)
                tokens, lps = self._sample(logits, params, gen)
                num_new = len(admitted)
                seqs += admitted
                blocks += new_blocks
                block_table = torch.cat([block_table, table])
                slot_table = torch.cat([slot_table, (table[:, :, None] * bs + self._positions[:bs]).flatten(1)])
                limits = torch.cat(
                    [
                        limits,
                        torch.tensor(
                            [min(params.max_tokens, self.max_model_len - len(prompts[i])) for i, _ in admitted],
                            device=self.device,
                        ),
                    ]
                )
                ctx_lens = torch.cat(
                    [ctx_lens, torch.tensor([len(prompts[i]) for i, _ in admitted], device=self.device)]
                )
                last = torch.cat([last, tokens])
                new_out = torch.zeros((num_new, params.max_tokens), dtype=torch.long, device=self.device)
                new_out[:, 0] = tokens
                new_lp = torch.zeros((num_new, params.max_tokens), dtype=torch.float32, device=self.device)
                new_lp[:, 0] = lps
                out_tokens = torch.cat([out_tokens, new_out])
                out_logprobs = torch.cat([out_logprobs, new_lp])
                gen_lens = torch.cat([gen_lens, torch.ones(num_new, dtype=torch.long, device=self.device)])
            else:
                self.max_running_seen = max(self.max_running_seen, len(seqs))
                logits = self._decode(last, ctx_lens, block_table, slot_table)
                tokens, lps = self._sample(logits, params, gen)
                rows = self._positions[: len(seqs)]
                out_tokens[rows, gen_lens] = tokens
                out_logprobs[rows, gen_lens] = lps
                ctx_lens = ctx_lens + 1
                gen_lens = gen_lens + 1
                last = tokens
            # finished: a stop token, max_tokens, or the context is full (limits)
            stopped = torch.isin(last, stop)
            done = stopped | (gen_lens >= limits)
            if bool(done.any()):
                done_rows = done.nonzero().squeeze(1).tolist()
                stopped_list = stopped.tolist()
                lens_list = gen_lens.tolist()
                for r in done_rows:
                    i, j = seqs[r]
                    c = results[i][j]
                    c.token_ids = out_tokens[r, : lens_list[r]].tolist()
                    c.logprobs = out_logprobs[r, : lens_list[r]].tolist()
                    c.finish_reason = "stop" if stopped_list[r] else "length"
                    self.free_blocks.extend(reversed(blocks[r]))
                keep = (~done).nonzero().squeeze(1)
                keep_list = keep.tolist()
                seqs = [seqs[r] for r in keep_list]
                blocks = [blocks[r] for r in keep_list]
                block_table, slot_table, limits = block_table[keep], slot_table[keep], limits[keep]
                ctx_lens, last = ctx_lens[keep], last[keep]
                out_tokens, out_logprobs, gen_lens = out_tokens[keep], out_logprobs[keep], gen_lens[keep]
        return results
