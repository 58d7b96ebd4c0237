"""The single source of megatron-core weight-layout knowledge (pure: plain python + torch, no megatron).

Given a model shape (its family, :mod:`modelspec.families`, says where each part lives in the HF checkpoint,
which megatron parameter holds it and how TP splits it) and one rank's place in the TP x PP (x VPP) grid, this module says which
megatron parameters that rank holds, their local shapes, and how each local shard is built from the
full HF tensors. The loader (:mod:`megatron_backend.checkpoint`), the exporter and a future weight-sync
planner all read the same :class:`SlicePiece` list, so the layout lives in exactly one place.

A shard is described as a list of pieces; each piece copies one contiguous block along ``dim``::

    local[vp_stage][megatron_name].narrow(dim, local_start, length)
        <- hf[hf_name].narrow(dim, hf_start, length)

Layouts (megatron-core 0.16, local spec; H hidden, F ffn, d head_dim, nq/ng query/KV heads,
qpg = nq // ng query heads per KV group, V vocab, Vp = V padded to a multiple of 128 * TP):

- ``embedding.word_embeddings.weight`` / ``output_layer.weight`` [Vp/TP, H]: rows of the padded vocab,
  split across TP; rows >= V are padding (zero on load, dropped on export). Tied embeddings: the first
  stage has no ``output_layer``; the last stage (if it is not also the first) holds a copy as
  ``output_layer.weight`` (``primary=False``: the exporter skips it, the loader fills it).
- ``linear_qkv.{weight,bias}`` [ng/TP * (qpg + 2) * d, H]: per KV group g, rows [q heads of g; k_g; v_g]
  (grouped interleave); the groups are split across TP.
- ``linear_proj.weight`` [H, nq*d/TP]: o_proj split on columns.
- ``linear_fc1.weight`` [2F/TP, H]: per TP rank [gate shard; up shard]; ``linear_fc2.weight`` [H, F/TP].
- norms replicated: ``input_layernorm`` / ``pre_mlp_layernorm`` (Transformer Engine spec:
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``, an MoE layer's stays
  ``pre_mlp_layernorm``), ``q_layernorm`` /
  ``k_layernorm`` [d], ``decoder.final_layernorm`` [H].
- MoE layers (``RankLayout.ep`` / ``etp``): the router ``mlp.router.weight`` [E, H] replicated; EP rank
  e holds experts [e * E/EP, (e+1) * E/EP), numbered 0.. locally, each split like a dense MLP by expert TP:
  ``mlp.experts.local_experts.<le>.linear_fc1.weight`` [2m/ETP, H] ([gate shard; up shard]) and
  ``...linear_fc2.weight`` [H, m/ETP] (SequentialMLP; TEGroupedMLP: ``mlp.experts.linear_fc1.weight<le>``).
- layers: chunk (pp_rank, vp_stage) holds L / (PP * VPP) consecutive layers starting at
  ``vp_stage * L / VPP + pp_rank * L / (PP * VPP)`` (megatron's ``get_transformer_layer_offset`` for an
  even split); megatron names them by local index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelspec import ModelShape
from modelspec.family import Part, dims_size, even_split_sizes, full_sizes, layer_parts
from modelspec.mesh import check_actor_split, check_expert_split

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # megatron pads the vocab to a multiple of this x TP


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class RankLayout:
    """One rank's place in the actor grid (DP ranks hold identical shards)."""

    tp: int
    pp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    te_norms: bool = False  # Transformer Engine spec: norms fused into linear_qkv / linear_fc1
    # MoE: this rank's place in megatron's expert grid (etp x ep x expert-dp x pp; etp None = tp): it holds
    # experts [ep_rank * E/ep, (ep_rank + 1) * E/ep), rows etp_rank of each expert's etp-way split
    ep: int = 1
    etp: int | None = None
    ep_rank: int = 0
    etp_rank: int = 0
    grouped_experts: bool = False  # TEGroupedMLP (Transformer Engine) rather than SequentialMLP names

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def num_chunks(self) -> int:
        return self.vpp or 1

    def is_first_chunk(self, vp_stage: int) -> bool:
        return self.pp_rank == 0 and vp_stage == 0

    def is_last_chunk(self, vp_stage: int) -> bool:
        return self.pp_rank == self.pp - 1 and vp_stage == self.num_chunks - 1


def layer_offset(num_layers: int, pp: int, vpp: int | None, pp_rank: int, vp_stage: int) -> int:
    """Global index of the first layer of chunk (pp_rank, vp_stage); even split as in megatron."""
    layers_per_chunk = num_layers // (pp * (vpp or 1))
    return vp_stage * (num_layers // (vpp or 1)) + pp_rank * layers_per_chunk


def chunk_layers(shape: ModelShape, layout: RankLayout, vp_stage: int) -> range:
    """Global layer indices held by one chunk, in local order."""
    per_chunk = shape.num_layers // (layout.pp * layout.num_chunks)
    start = layer_offset(shape.num_layers, layout.pp, layout.vpp, layout.pp_rank, vp_stage)
    return range(start, start + per_chunk)


@dataclass(frozen=True)
class SlicePiece:
    """One contiguous block of a HF tensor that lands in one megatron local shard.

    ``local[vp_stage][megatron_name].narrow(dim, local_start, length)`` equals
    ``hf[hf_name].narrow(dim, hf_start, length)``. ``transform`` names why the block is where it is
    (``replicate``, ``row_split``, ``column_split``, ``vocab_pad``, ``qkv_interleave``, ``gate_up``).
    ``primary`` is False for the tied-embedding copy on the last stage: it is loaded but not exported.
    """

    hf_name: str
    vp_stage: int
    megatron_name: str
    dim: int
    hf_start: int
    local_start: int
    length: int
    transform: str
    primary: bool = True

    @property
    def is_expert(self) -> bool:
        """A block of one routed expert: held per EP rank (its copies live on expert-DP ranks, not DP ranks)."""
        return ".mlp.experts." in self.megatron_name


def _megatron_rank_sizes(shape: ModelShape, layout: RankLayout) -> dict[str, int]:
    """Dim symbol -> its size on one actor rank (megatron splits heads and rows evenly, no replication; experts
    by EP, each expert's rows by expert TP)."""
    return even_split_sizes(shape, layout.tp, layout.ep, layout.expert_tp)


def _local_experts(shape: ModelShape, layout: RankLayout) -> range:
    """Global indices of the experts this rank holds (megatron numbers them 0.. locally, in this order)."""
    per_rank = shape.num_experts // layout.ep
    return range(layout.ep_rank * per_rank, (layout.ep_rank + 1) * per_rank)


def _megatron_name(
    part: Part, kind: str, layout: RankLayout, local: int, local_expert: int | None, sparse: bool
) -> str:
    """``part``'s ``kind`` in local layer ``local`` (of local expert ``local_expert`` for an expert part);
    ``sparse``: the layer is an MoE layer (TE fuses the pre-MLP norm only into a dense MLP)."""
    if part.expert:
        return f"decoder.layers.{local}." + part.megatron_expert_param(kind, local_expert, layout.grouped_experts)
    return f"decoder.layers.{local}." + part.megatron_param(kind, layout.te_norms, sparse)


def _part_pieces(shape: ModelShape, layout: RankLayout, part: Part, kind: str, layer: int, local: int, vp_stage: int):
    """The pieces of one part of one layer: ``part.megatron_split`` applied to its rows in the HF tensor; an
    expert part: the same per expert this EP rank holds, split by expert TP."""
    if part.expert:
        pieces = []
        for local_expert, expert in enumerate(_local_experts(shape, layout)):
            pieces += _split_pieces(shape, layout, part, kind, layer, local, vp_stage, (expert, local_expert))
        return pieces
    return _split_pieces(shape, layout, part, kind, layer, local, vp_stage, None)


def _split_pieces(shape, layout: RankLayout, part: Part, kind: str, layer: int, local: int, vp_stage: int, expert):
    """``part``'s pieces in one megatron parameter; ``expert``: (global, local) expert index or None."""
    global_expert, local_expert = expert if expert else (None, None)
    tp, r, d = layout.tp, layout.tp_rank, shape.head_dim
    if part.expert:  # each expert is split by expert TP
        tp, r = layout.expert_tp, layout.etp_rank
    hf_name, offset = shape.family.hf_slot(part, kind, layer, full_sizes(shape), global_expert)
    mg = _megatron_name(part, kind, layout, local, local_expert, shape.is_moe_layer(layer))
    local_sizes = _megatron_rank_sizes(shape, layout)
    # parts before this one in its megatron parameter (stacked along rows there)
    before = [p for p, k in layer_parts(shape, layer) if k == kind and p.megatron == part.megatron]
    before = before[: before.index(part)]
    if part.megatron_split == "replicate":  # norms [n]; the MoE router [E, h]: whole on every rank
        rows = dims_size(part.kind_dims(kind), local_sizes)[0]
        return [SlicePiece(hf_name, vp_stage, mg, 0, offset, 0, rows, "replicate")]
    if part.megatron_split == "columns":  # a part split on columns is alone in its HF tensor's rows
        cols = local_sizes[part.dims[1]]
        return [SlicePiece(hf_name, vp_stage, mg, 1, r * cols, 0, cols, "column_split")]
    if part.megatron_split == "rows":  # [this rank's rows of each stacked part], e.g. fc1 = [gate shard; up shard]
        rows = local_sizes[part.dims[0]]
        local_start = sum(local_sizes[p.dims[0]] for p in before)
        return [SlicePiece(hf_name, vp_stage, mg, 0, offset + r * rows, local_start, rows, "gate_up")]
    # qkv_groups: per KV group g, rows [q heads of g; k_g; v_g] (grouped interleave); the groups split across TP
    qpg = shape.num_heads // shape.num_kv_heads  # query heads per KV group
    group_rows = (qpg + 2) * d
    heads_per_group = {"q": qpg, "k": 1, "v": 1}
    start_in_group = {"q": 0, "k": qpg * d, "v": (qpg + 1) * d}[part.name]
    rows = heads_per_group[part.name] * d
    groups_per_rank = shape.num_kv_heads // tp
    pieces = []
    for j in range(groups_per_rank):
        g = r * groups_per_rank + j
        local_start = j * group_rows + start_in_group
        pieces.append(SlicePiece(hf_name, vp_stage, mg, 0, offset + g * rows, local_start, rows, "qkv_interleave"))
    return pieces


def _megatron_layer_pieces(shape: ModelShape, layout: RankLayout, vp_stage: int) -> list[SlicePiece]:
    pieces: list[SlicePiece] = []
    for local, layer in enumerate(chunk_layers(shape, layout, vp_stage)):
        for part, kind in layer_parts(shape, layer):
            pieces += _part_pieces(shape, layout, part, kind, layer, local, vp_stage)
    return pieces


def _vocab_piece(shape: ModelShape, layout: RankLayout, vp_stage: int, hf_name: str, mg_name: str, primary: bool):
    """Rows [r*Vp/TP, (r+1)*Vp/TP) of the padded vocab; only the real rows (< V) come from HF."""
    rows = padded_vocab_size(shape.vocab_size, layout.tp) // layout.tp
    start = layout.tp_rank * rows
    length = min(start + rows, shape.vocab_size) - start
    if length <= 0:  # this rank holds padding rows only
        return []
    return [SlicePiece(hf_name, vp_stage, mg_name, 0, start, 0, length, "vocab_pad", primary)]


def rank_pieces(shape: ModelShape, layout: RankLayout) -> list[SlicePiece]:
    """Everything this rank holds, as HF -> megatron slice pieces (all chunks, in chunk order)."""
    check_actor_split(shape, layout.tp, layout.pp, layout.vpp)
    check_expert_split(shape, layout.ep, layout.expert_tp)
    family = shape.family
    pieces: list[SlicePiece] = []
    for vp_stage in range(layout.num_chunks):
        first, last = layout.is_first_chunk(vp_stage), layout.is_last_chunk(vp_stage)
        if first:
            pieces += _vocab_piece(shape, layout, vp_stage, family.embed, "embedding.word_embeddings.weight", True)
        pieces += _megatron_layer_pieces(shape, layout, vp_stage)
        if last:
            h = shape.hidden_size
            pieces.append(
                SlicePiece(family.final_norm, vp_stage, "decoder.final_layernorm.weight", 0, 0, 0, h, "replicate")
            )
            if not shape.tie_word_embeddings:
                pieces += _vocab_piece(shape, layout, vp_stage, family.lm_head, "output_layer.weight", True)
            elif not first:  # tied: megatron keeps a copy of the embedding on the last stage
                pieces += _vocab_piece(shape, layout, vp_stage, family.embed, "output_layer.weight", False)
    return pieces


def local_param_shapes(shape: ModelShape, layout: RankLayout) -> dict[tuple[int, str], tuple[int, ...]]:
    """(vp_stage, megatron name) -> local shape of every parameter this rank holds."""
    tp, h = layout.tp, shape.hidden_size
    vocab_rows = padded_vocab_size(shape.vocab_size, tp) // tp
    local_sizes = _megatron_rank_sizes(shape, layout)
    num_local_experts = local_sizes["experts"]
    out: dict[tuple[int, str], tuple[int, ...]] = {}
    for vp in range(layout.num_chunks):
        first, last = layout.is_first_chunk(vp), layout.is_last_chunk(vp)
        if first:
            out[(vp, "embedding.word_embeddings.weight")] = (vocab_rows, h)
        for local, layer in enumerate(chunk_layers(shape, layout, vp)):
            for part, kind in layer_parts(shape, layer):  # stacked parts add their rows to one parameter
                rows, *rest = dims_size(part.kind_dims(kind), local_sizes)
                for local_expert in range(num_local_experts) if part.expert else (None,):
                    key = (vp, _megatron_name(part, kind, layout, local, local_expert, shape.is_moe_layer(layer)))
                    out[key] = (out.get(key, (0,))[0] + rows, *rest)
        if last:
            out[(vp, "decoder.final_layernorm.weight")] = (h,)
            if not shape.tie_word_embeddings or not first:
                out[(vp, "output_layer.weight")] = (vocab_rows, h)
    return out


def num_covered(pieces: list[SlicePiece], local_shapes: dict[tuple[int, str], tuple[int, ...]]) -> dict:
    """(vp_stage, megatron name) -> number of local elements the pieces fill (the rest is padding)."""
    covered: dict[tuple[int, str], int] = {}
    for p in pieces:
        key = (p.vp_stage, p.megatron_name)
        local_shape = local_shapes[key]
        other = math.prod(s for i, s in enumerate(local_shape) if i != p.dim)
        covered[key] = covered.get(key, 0) + p.length * other
    return covered
