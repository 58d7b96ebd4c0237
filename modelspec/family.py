"""A model family as data: the tensors of its Hugging Face checkpoint, what each holds, and its quirks.

One :class:`Family` value per file in :mod:`modelspec.families`. Everything that lays weights out derives
from it: ``megatron_backend/layout.py`` (the actor's shards), ``rollout/layout.py`` (vLLM's parameters,
which the native engine's loader and the weight sync read), ``planner/sizes.py`` (element counts) and
:class:`~modelspec.ModelShape` (``param_count``, the tensor shapes preflight checks).

The shared vocabulary is the decoder layer's logical parts (:class:`Part`: q, k, v, o, gate, up, down and
the norms). A part says its dims (in symbols), which megatron-core parameter holds it and how TP splits it
there, and which vLLM parameter fuses it. A family says which parts it has and where each lives in its
checkpoint (:class:`HfTensor`: a HF tensor stacks one or more parts along its rows; Llama's ``q_proj``
holds [q], Phi-3's ``qkv_proj`` holds [q; k; v]), plus its quirks (qkv bias, config checks, the tiny
checkpoint's sizes). Tied embeddings and RoPE are read from ``config.json`` by ``ModelShape``.

Dim symbols: ``h`` hidden, ``d`` head_dim, ``q`` = q heads x d, ``kv`` = KV heads x d, ``i`` intermediate.
Evaluated with the full sizes they give a HF tensor's shape; with one TP rank's head / row counts they
give that rank's local shape (only ``q``, ``kv`` and ``i`` are ever split).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelspec.shape import ModelShape

# megatron-core's TP splits (megatron_backend/layout.py implements them)
MEGATRON_SPLITS = ("qkv_groups", "rows", "columns", "replicate")
# vLLM's TP splits (rollout/layout.py implements them; rows of a ``kv`` part follow KV-head replication)
VLLM_SPLITS = ("rows", "columns", "replicate")


@dataclass(frozen=True)
class Part:
    """One logical tensor of a decoder layer and where each engine keeps it.

    Parts that name the same ``megatron`` / ``vllm`` module are stacked there along rows in the order of
    :data:`LAYER_PARTS` (megatron's ``qkv_groups`` interleaves them per KV group instead).
    """

    name: str
    dims: tuple[str, ...]  # the weight's dims in symbols (module doc)
    megatron: str  # megatron-core module under ``decoder.layers.<n>.``; its parameter is ``<module>.<kind>``
    megatron_split: str  # one of MEGATRON_SPLITS
    vllm: str  # vLLM module under ``model.layers.<n>.``
    vllm_split: str  # one of VLLM_SPLITS
    megatron_te_name: str | None = None  # a norm's parameter under Transformer Engine's spec (fused into a linear)
    bias_when_qkv_bias: bool = False  # has a bias [dims[0]] when the shape's ``qkv_bias`` is set

    def __post_init__(self) -> None:
        if self.megatron_split not in MEGATRON_SPLITS:
            raise ValueError(
                f"Part {self.name}: megatron_split={self.megatron_split!r} is not one of {MEGATRON_SPLITS}"
            )
        if self.vllm_split not in VLLM_SPLITS:
            raise ValueError(f"Part {self.name}: vllm_split={self.vllm_split!r} is not one of {VLLM_SPLITS}")

    def kind_dims(self, kind: str) -> tuple[str, ...]:
        """The dims of this part's ``weight`` or ``bias`` (a bias has the weight's output rows)."""
        return self.dims if kind == "weight" else self.dims[:1]

    def megatron_param(self, kind: str, te_norms: bool) -> str:
        if te_norms and self.megatron_te_name:
            return self.megatron_te_name
        return f"{self.megatron}.{kind}"


# The decoder layer's parts, in the order vLLM lists its parameters (and stacks fused ones).
Q = Part("q", ("q", "h"), "self_attention.linear_qkv", "qkv_groups", "self_attn.qkv_proj", "rows", None, True)
K = Part("k", ("kv", "h"), "self_attention.linear_qkv", "qkv_groups", "self_attn.qkv_proj", "rows", None, True)
V = Part("v", ("kv", "h"), "self_attention.linear_qkv", "qkv_groups", "self_attn.qkv_proj", "rows", None, True)
O_PROJ = Part("o", ("h", "q"), "self_attention.linear_proj", "columns", "self_attn.o_proj", "columns")
Q_NORM = Part("q_norm", ("d",), "self_attention.q_layernorm", "replicate", "self_attn.q_norm", "replicate")
K_NORM = Part("k_norm", ("d",), "self_attention.k_layernorm", "replicate", "self_attn.k_norm", "replicate")
GATE = Part("gate", ("i", "h"), "mlp.linear_fc1", "rows", "mlp.gate_up_proj", "rows")
UP = Part("up", ("i", "h"), "mlp.linear_fc1", "rows", "mlp.gate_up_proj", "rows")
DOWN = Part("down", ("h", "i"), "mlp.linear_fc2", "columns", "mlp.down_proj", "columns")
INPUT_NORM = Part(
    "input_norm",
    ("h",),
    "input_layernorm",
    "replicate",
    "input_layernorm",
    "replicate",
    megatron_te_name="self_attention.linear_qkv.layer_norm_weight",
)
POST_NORM = Part(
    "post_norm",
    ("h",),
    "pre_mlp_layernorm",
    "replicate",
    "post_attention_layernorm",
    "replicate",
    megatron_te_name="mlp.linear_fc1.layer_norm_weight",
)
LAYER_PARTS = (Q, K, V, O_PROJ, Q_NORM, K_NORM, GATE, UP, DOWN, INPUT_NORM, POST_NORM)
OPTIONAL_PARTS = (Q_NORM, K_NORM)  # a family has both (Qwen3) or neither


@dataclass(frozen=True)
class HfTensor:
    """One HF tensor of every decoder layer: ``<layer prefix><name>.<kind>``, stacking ``parts`` along rows."""

    name: str
    parts: tuple[Part, ...]


def dims_size(dims: tuple[str, ...], sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[s] for s in dims)


def full_sizes(shape: ModelShape) -> dict[str, int]:
    """Dim symbol -> its full (unsharded) size."""
    d = shape.head_dim
    return dict(h=shape.hidden_size, d=d, q=shape.num_heads * d, kv=shape.num_kv_heads * d, i=shape.intermediate_size)


def rank_sizes(shape: ModelShape, q_heads: int, kv_heads: int, intermediate: int) -> dict[str, int]:
    """Dim symbol -> its size on one TP rank holding ``q_heads`` / ``kv_heads`` heads and ``intermediate`` rows."""
    d = shape.head_dim
    return dict(h=shape.hidden_size, d=d, q=q_heads * d, kv=kv_heads * d, i=intermediate)


def _no_config_check(config: dict, source: str) -> None:
    """A family without quirks to reject."""


@dataclass(frozen=True)
class Family:
    """A decoder family: its checkpoint's tensors (module doc) and its quirks."""

    model_type: str  # config.json's model_type
    config_class: str  # transformers' config class, e.g. "Qwen2Config"
    layer_tensors: tuple[HfTensor, ...]  # every HF tensor of one decoder layer
    # q/k/v biases: True, False, or the config key that decides (Llama's and Qwen3's ``attention_bias``)
    qkv_bias: bool | str
    tiny_config: dict  # the tiny test checkpoint's config kwargs (modelspec/tiny.py builds it)
    # a quirk of this family's configs that nothing here implements -> ValueError naming the field
    check_config: Callable[[dict, str], None] = _no_config_check
    layer_prefix: str = "model.layers.{layer}."
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    _slots: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        slots: dict[str, tuple[HfTensor, tuple[Part, ...]]] = {}  # part name -> (its HF tensor, parts before it)
        for tensor in self.layer_tensors:
            for index, part in enumerate(tensor.parts):
                if part.name in slots:
                    raise ValueError(f"family {self.model_type}: part {part.name!r} is in two HF tensors")
                if index and part.dims[1:] != tensor.parts[0].dims[1:]:
                    raise ValueError(f"family {self.model_type}: {tensor.name} stacks parts of other widths")
                if len(tensor.parts) > 1 and "columns" in (part.megatron_split, part.vllm_split):
                    # a slice is a block of rows or of columns, never both: a column-split part stands alone
                    raise ValueError(f"family {self.model_type}: {tensor.name} stacks {part.name}, split on columns")
                slots[part.name] = (tensor, tensor.parts[:index])
        missing = [p.name for p in LAYER_PARTS if p not in OPTIONAL_PARTS and p.name not in slots]
        if missing:
            raise ValueError(f"family {self.model_type}: no HF tensor holds part(s) {missing}")
        if len({p.name in slots for p in OPTIONAL_PARTS}) > 1:
            raise ValueError(f"family {self.model_type}: q_norm and k_norm come together")
        object.__setattr__(self, "_slots", slots)

    def has_qkv_bias(self, config: dict) -> bool:
        if isinstance(self.qkv_bias, bool):
            return self.qkv_bias
        return bool(config.get(self.qkv_bias, False))

    def has_part(self, part: Part) -> bool:
        return part.name in self._slots

    def layer_parts(self, qkv_bias: bool) -> list[tuple[Part, str]]:
        """(part, ``weight`` / ``bias``) of one layer in vLLM's order: per vLLM module, its parts' weights, then
        their biases (only q/k/v have one, when ``qkv_bias``)."""
        present = [part for part in LAYER_PARTS if self.has_part(part)]
        modules = list(dict.fromkeys(part.vllm for part in present))
        out = []
        for module in modules:
            parts = [part for part in present if part.vllm == module]
            out += [(part, "weight") for part in parts]
            out += [(part, "bias") for part in parts if qkv_bias and part.bias_when_qkv_bias]
        return out

    def hf_slot(self, part: Part, kind: str, layer: int, sizes: dict[str, int]) -> tuple[str, int]:
        """(HF tensor name, first row) of ``part``'s ``kind`` in layer ``layer``; ``sizes``: full_sizes(shape)."""
        tensor, before = self._slots[part.name]
        offset = sum(sizes[p.dims[0]] for p in before)
        return f"{self.layer_prefix.format(layer=layer)}{tensor.name}.{kind}", offset


def layer_parts(shape: ModelShape) -> list[tuple[Part, str]]:
    """(part, kind) of one decoder layer of ``shape``'s family (see :meth:`Family.layer_parts`)."""
    return shape.family.layer_parts(shape.qkv_bias)


def layer_param_count(shape: ModelShape, sizes: dict[str, int]) -> int:
    """Parameters of one decoder layer whose dims have ``sizes`` (full_sizes or one TP rank's rank_sizes)."""
    return sum(math.prod(dims_size(part.kind_dims(kind), sizes)) for part, kind in layer_parts(shape))


def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint (full, unsharded) and its shape."""
    family, sizes = shape.family, full_sizes(shape)
    h, v = shape.hidden_size, shape.vocab_size
    out: dict[str, tuple[int, ...]] = {family.embed: (v, h)}
    for layer in range(shape.num_layers):
        for part, kind in layer_parts(shape):
            name, offset = family.hf_slot(part, kind, layer, sizes)
            rows, *rest = dims_size(part.kind_dims(kind), sizes)
            # a fused tensor is as tall as its last part ends (its parts come in any order here)
            out[name] = (max(out.get(name, (0,))[0], offset + rows), *rest)
    out[family.final_norm] = (h,)
    if not shape.tie_word_embeddings:
        out[family.lm_head] = (v, h)
    return out


# Sizes every tiny checkpoint shares (modelspec/tiny.py): hidden 128, 4 q heads / 2 KV heads of head_dim 32, the
# smallest head size vLLM's CPU attention takes (32, 64, 80, 96, 112, 128), so they run in vLLM's CPU build too.
TINY_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
