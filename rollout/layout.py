"""vLLM's per-rank weight layout, as data: the single source of that knowledge in this repo.

Pure python + torch (no process group, no vLLM import). For a :class:`modelspec.ModelShape`, a rollout TP size
and a TP rank, :func:`vllm_param_layouts` lists every parameter vLLM (the Llama-derived models of
:mod:`modelspec.families`) holds on that rank: its vLLM name, its local shape, and which slices of which
full HF tensors it is made of (the family says where each part lives in its checkpoint, e.g. rows of a
fused ``qkv_proj``). The native engine's loader fills its tensors from this list; a resharding planner can use the
same list to move only the slices each rank needs.

Layout (h = hidden, d = head_dim, Hq / Hkv = q / KV heads, I = intermediate, V = vocab, P = padded vocab
= V rounded up to a multiple of 64, T = rollout TP, r = rank):

- ``model.embed_tokens.weight`` [P/T, h]: rows [r*P/T, (r+1)*P/T) of the padded table; rows >= V are 0.
- ``lm_head.weight`` [P/T, h]: same split. Tied embeddings: no ``lm_head.weight``; the engine uses
  ``model.embed_tokens.weight`` (vLLM ties the two modules, so ``named_parameters`` lists it once).
- ``model.layers.N.self_attn.qkv_proj.weight`` [(Hq/T + 2*kv)*d, h], rows [q shard; k shard; v shard];
  kv = Hkv/T heads when T <= Hkv, else 1 head: rank r holds KV head r // (T/Hkv) (replicated).
  ``.bias`` (Qwen2) [(Hq/T + 2*kv)*d], same rows.
- ``self_attn.o_proj.weight`` [h, Hq/T*d]: columns of the q heads this rank holds.
- ``self_attn.q_norm.weight`` / ``k_norm.weight`` [d] (Qwen3): replicated.
- ``mlp.gate_up_proj.weight`` [2*I/T, h]: rows [gate shard; up shard].
- ``mlp.down_proj.weight`` [h, I/T]: columns.
- ``input_layernorm.weight``, ``post_attention_layernorm.weight``, ``model.norm.weight`` [h]: replicated.
- MoE layers (E experts of intermediate m; ``<block>`` is ``mlp`` or Mixtral's ``block_sparse_moe``):
  ``<block>.gate.weight`` [E, h] replicated; FusedMoE's ``<block>.experts.routed_experts.w13_weight`` [E, 2*m/T, h], per
  expert rows [w1 = gate shard; w3 = up shard], and ``w2_weight`` [E, h, m/T], per expert the columns of its
  down_proj: TP splits every expert by its intermediate dim. A slice of an expert part lands in
  ``local[expert]`` (``SliceSpec.expert``). These are the shapes vLLM loads into; its CPU experts then repack
  them (the weight sync writes through that post-load step, as for dense layers on CPU).
  Who holds which experts is an :class:`ExpertSplit` (:func:`engine_expert_split`): E/ep whole experts
  [ep_rank*E/ep, (ep_rank+1)*E/ep) (local index = expert - first), m/etp rows of each. vLLM 0.32 with R > 1
  replicas (data parallel) flattens TP across DP in its MoE layers (``FusedMoEParallelConfig.make``:
  tp = R*T, rank = replica*T + tp_rank), so there w13 is [E, 2*m/(R*T), h]; the native engine's replica of
  T x ep ranks (``rollout.ep``) holds E/ep experts per EP rank, m/T rows of each. vLLM's expert parallel
  (``enable_expert_parallel``, ``rollout.ep`` = R*T) turns that flattened TP into EP: rank i (= replica*T +
  tp_rank) holds experts [i*E/(R*T), (i+1)*E/(R*T)) whole, so w13 is [E/(R*T), 2*m, h], w2 [E/(R*T), h, m].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelspec import ColocatedMesh, ModelShape
from modelspec.family import dims_size, full_sizes, layer_parts
from modelspec.mesh import check_rollout_split

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def padded_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    return -(-vocab_size // pad_to) * pad_to


@dataclass(frozen=True)
class TPShape:
    """What one rollout TP rank holds (counts of heads, rows, vocab entries)."""

    tp: int
    tp_rank: int
    num_heads: int  # q heads on this rank = Hq / T
    num_kv_heads: int  # KV heads on this rank: Hkv / T, or 1 when T > Hkv
    kv_head_start: int  # first global KV head on this rank
    intermediate_size: int  # I / T
    moe_intermediate_size: int  # m / T: each expert's share
    vocab_padded: int  # P
    vocab_per_rank: int  # P / T
    vocab_start: int  # first (padded) vocab row on this rank


def tp_shape(shape: ModelShape, tp: int, tp_rank: int) -> TPShape:
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank={tp_rank} is outside [0, {tp})")
    check_rollout_split(shape, tp)
    hq, hkv = shape.num_heads, shape.num_kv_heads
    if tp >= hkv:  # vLLM QKVParallelLinear: one KV head per rank, replicated T/Hkv times
        kv, kv_start = 1, tp_rank // (tp // hkv)
    else:
        kv = hkv // tp
        kv_start = tp_rank * kv
    vocab_padded = padded_vocab_size(shape.vocab_size)
    if vocab_padded % tp:
        raise ValueError(f"rollout.tp={tp} must divide the padded vocab {vocab_padded}")
    per_rank = vocab_padded // tp
    return TPShape(
        tp=tp,
        tp_rank=tp_rank,
        num_heads=hq // tp,
        num_kv_heads=kv,
        kv_head_start=kv_start,
        intermediate_size=shape.intermediate_size // tp,
        moe_intermediate_size=shape.moe_intermediate_size // tp,
        vocab_padded=vocab_padded,
        vocab_per_rank=per_rank,
        vocab_start=tp_rank * per_rank,
    )


@dataclass(frozen=True)
class SliceSpec:
    """local[dim, local_start : local_start + (hf_stop - hf_start)] = hf_tensor[dim, hf_start:hf_stop].

    ``dim`` is the same on both sides (0 = rows, 1 = columns); every other dim is taken whole. ``expert``: the
    HF tensor is one routed expert's, written into ``local[expert]`` (a FusedMoE parameter [E, ...]).
    """

    hf_name: str
    dim: int
    hf_start: int
    hf_stop: int
    local_start: int
    expert: int | None = None

    @property
    def length(self) -> int:
        return self.hf_stop - self.hf_start


@dataclass(frozen=True)
class ParamLayout:
    """One vLLM parameter on one rank: its name, local shape and the HF slices it is built from.

    Local elements not covered by any slice (vocab padding rows) are zero.
    """

    name: str
    local_shape: tuple[int, ...]
    slices: tuple[SliceSpec, ...]
    replicated: bool = False  # every TP rank holds the same full tensor


@dataclass(frozen=True)
class ExpertSplit:
    """Which routed experts one engine rank holds: experts [ep_rank*E/ep, (ep_rank+1)*E/ep), rows
    [etp_rank*m/etp, (etp_rank+1)*m/etp) of each expert's intermediate dim."""

    etp: int = 1
    etp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0

    def check(self, shape: ModelShape) -> None:
        if shape.num_experts % self.ep:
            raise ValueError(f"engine expert parallel {self.ep} must divide the {shape.num_experts} experts")
        if shape.moe_intermediate_size % self.etp:
            raise ValueError(
                f"the engine splits each expert over {self.etp} ranks (vLLM: rollout.tp x replicas), which must "
                f"divide the experts' intermediate size {shape.moe_intermediate_size}; pick another rollout.tp or world"
            )

    def experts(self, shape: ModelShape) -> range:
        per_rank = shape.num_experts // self.ep
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)


def engine_expert_split(mesh: ColocatedMesh, rank: int) -> ExpertSplit:
    """The experts global ``rank``'s engine holds (see the module doc): within its replica (native engine: EP x
    TP), or over every engine rank of every replica (vLLM with several replicas)."""
    tp, tp_rank = mesh.rollout_tp, mesh.rollout_tp_rank(rank)
    if mesh.rollout_experts_span_replicas and mesh.rollout_ep > 1:
        # vLLM's enable_expert_parallel: FusedMoEParallelConfig.make makes EP = the flattened TP (ep_size R T,
        # ep_rank replica T + tp rank), expert TP 1; determine_expert_map("linear") gives rank i experts
        # [i E/ep, (i+1) E/ep), local ids from 0 (FusedMoE.weight_loader maps global -> local, skips the rest)
        return ExpertSplit(ep=mesh.rollout_ep, ep_rank=mesh.rollout_ep_rank(rank))
    if mesh.rollout_experts_span_replicas:  # vLLM: FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp
        return ExpertSplit(etp=tp * mesh.num_replicas, etp_rank=mesh.replica(rank) * tp + tp_rank)
    return ExpertSplit(etp=tp, etp_rank=tp_rank, ep=mesh.rollout_ep, ep_rank=mesh.rollout_ep_rank(rank))


def vllm_param_layouts(
    shape: ModelShape, tp: int = 1, tp_rank: int = 0, experts: ExpertSplit | None = None
) -> list[ParamLayout]:
    """Every vLLM parameter of rank ``tp_rank`` at rollout TP ``tp``, in vLLM's order (see module doc);
    ``experts``: which routed experts it holds (None: all, m/tp rows of each)."""
    if not isinstance(shape, ModelShape):
        raise TypeError(
            f"vllm_param_layouts takes a modelspec.ModelShape, got {type(shape).__name__}; build one with "
            "ModelShape.from_pretrained(path) or ModelShape.from_hf_config(config)"
        )
    t = tp_shape(shape, tp, tp_rank)
    experts = experts or ExpertSplit(etp=tp, etp_rank=tp_rank)
    if shape.is_moe:
        experts.check(shape)
    expert_rows = shape.moe_intermediate_size // experts.etp
    local_experts = experts.experts(shape)
    h, d = shape.hidden_size, shape.head_dim
    out: list[ParamLayout] = []

    def vocab_rows(hf_name: str, name: str) -> ParamLayout:
        # local rows [0, P/T) <- padded rows [vocab_start, vocab_start + P/T), of which only those < V exist.
        stop = min(t.vocab_start + t.vocab_per_rank, shape.vocab_size)
        slices = (SliceSpec(hf_name, 0, t.vocab_start, stop, 0),) if stop > t.vocab_start else ()
        return ParamLayout(name, (t.vocab_per_rank, h), slices)

    def replicated(hf_name: str, name: str, size: int) -> ParamLayout:
        return ParamLayout(name, (size,), (SliceSpec(hf_name, 0, 0, size, 0),), replicated=True)

    family, sizes = shape.family, full_sizes(shape)
    # rows of this rank's share of a split dim: (first full row, rows); kv heads follow the replication rule
    rank_rows = {
        "q": (tp_rank * t.num_heads * d, t.num_heads * d),
        "kv": (t.kv_head_start * d, t.num_kv_heads * d),
        "i": (tp_rank * t.intermediate_size, t.intermediate_size),
        "m": (experts.etp_rank * expert_rows, expert_rows),
    }
    local_sizes = {symbol: rows for symbol, (_, rows) in rank_rows.items()} | dict(h=h, d=d, E=shape.num_experts)
    out.append(vocab_rows(family.embed, "model.embed_tokens.weight"))
    for layer in range(shape.num_layers):
        params: dict[str, tuple[tuple[int, ...], list[SliceSpec], bool]] = {}  # vLLM name -> shape, slices, replicated
        for part, kind in layer_parts(shape, layer):  # in vLLM's order; parts of one module stack along rows
            name = f"model.layers.{layer}.{part.vllm_param(kind)}"
            rows, *rest = dims_size(part.kind_dims(kind), local_sizes)
            experts_here = local_experts if part.expert else (None,)
            prior = params.get(name)
            local_start = (prior[0][1] if part.expert else prior[0][0]) if prior else 0
            specs = []
            for expert in experts_here:
                hf_name, offset = family.hf_slot(part, kind, layer, sizes, expert)
                local_expert = None if expert is None else expert - local_experts.start
                if part.vllm_split == "columns":  # e.g. o_proj [h, Hq/T*d], down_proj [h, I/T], w2 [E, h, m/T]
                    first, cols = rank_rows[part.dims[1]]
                    specs.append(SliceSpec(hf_name, 1, first, first + cols, 0, local_expert))
                elif part.vllm_split == "rows":  # e.g. qkv_proj [q; k; v], gate_up [gate; up], w13 [E, gate; up]
                    first, _ = rank_rows[part.dims[0]]
                    specs.append(
                        SliceSpec(hf_name, 0, offset + first, offset + first + rows, local_start, local_expert)
                    )
                else:
                    specs.append(SliceSpec(hf_name, 0, offset, offset + rows, 0, local_expert))
            slices = prior[1] if prior else []
            local = (local_start + rows, *rest)
            if part.expert:
                local = (len(local_experts), *local)
            params[name] = (local, [*slices, *specs], part.vllm_split == "replicate")
        out += [ParamLayout(name, local, tuple(slices), rep) for name, (local, slices, rep) in params.items()]
    out.append(replicated(family.final_norm, "model.norm.weight", h))
    if not shape.tie_word_embeddings:
        out.append(vocab_rows(family.lm_head, "lm_head.weight"))
    return out


def hf_to_vllm_index(layouts: list[ParamLayout]) -> dict[str, list[tuple[ParamLayout, SliceSpec]]]:
    """HF tensor name -> the (param, slice) pairs on this rank that read from it."""
    index: dict[str, list[tuple[ParamLayout, SliceSpec]]] = {}
    for layout in layouts:
        for s in layout.slices:
            index.setdefault(s.hf_name, []).append((layout, s))
    return index


def copy_hf_into_local(local, layout: ParamLayout, spec: SliceSpec, hf_tensor) -> None:
    """Write ``spec``'s slice of the full ``hf_tensor`` into the local parameter tensor ``local``."""
    local_view(local, spec).copy_(hf_tensor.narrow(spec.dim, spec.hf_start, spec.length))


def local_view(local, spec: SliceSpec):
    """The block of the local parameter tensor ``local`` that ``spec`` fills (in ``local[expert]`` for an expert)."""
    return (local if spec.expert is None else local[spec.expert]).narrow(spec.dim, spec.local_start, spec.length)


def assemble_local(layout: ParamLayout, hf_tensors: dict, dtype=None):
    """Build one local vLLM tensor from full HF tensors (reference implementation for tests / planners)."""

    first = hf_tensors[layout.slices[0].hf_name] if layout.slices else None
    out = torch.zeros(layout.local_shape, dtype=dtype or (first.dtype if first is not None else torch.float32))
    for spec in layout.slices:
        copy_hf_into_local(out, layout, spec, hf_tensors[spec.hf_name])
    return out


def split_in_place(layouts: list[ParamLayout], destinations: dict) -> tuple[list[ParamLayout], list[ParamLayout]]:
    """(layouts an engine's ``begin_weight_update`` tensors can take in place, the ones that must fall back).

    A layout falls back when the engine has no tensor of that name or one of another shape: the caller then
    sends that parameter's full HF tensors (``hf_name`` of its slices) through ``engine.load_weights`` inside
    the same update window, and counts those bytes apart from the planned sync.
    """
    in_place, fallback = [], []
    for layout in layouts:
        tensor = destinations.get(layout.name)
        ok = tensor is not None and tuple(tensor.shape) == layout.local_shape
        (in_place if ok else fallback).append(layout)
    return in_place, fallback
