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

Dim symbols: ``h`` hidden, ``d`` head_dim, ``q`` = q heads x d, ``kv`` = KV heads x d, ``i`` intermediate,
``E`` the number of routed experts (the router's rows, never split), ``m`` one expert's intermediate.
Evaluated with the full sizes they give a HF tensor's shape; with one TP rank's head / row counts they
give that rank's local shape (only ``q``, ``kv``, ``i`` and ``m`` are ever split). A sizes dict also says
how many experts it counts (``experts``: all of them, or one EP rank's share).

Mixture of experts (:class:`MoeSpec`): a sparse layer replaces the dense MLP parts (gate, up, down) by the
router and the expert parts (:data:`MOE_PART_NAMES`, built per family by :func:`moe_parts`). An expert part
(``Part.expert``) has one HF tensor per expert (its name holds ``{expert}``) and, in both engines, one
slice per expert of a parameter with an expert dim (vLLM's FusedMoE ``w13_weight`` [E, 2m, h] / ``w2_weight``
[E, h, m]; megatron-core's experts, :meth:`Part.megatron_expert_param`). Which layers are sparse, the number
of experts, top-k and its normalisation come from config.json (``ModelShape``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelspec.shape import ModelShape

# an HF tensor name's decoder layer (``model.layers.<i>.``); the others are the vocab tensors and the final norm
HF_LAYER = re.compile(r"\.layers\.(\d+)\.")

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
    # one tensor per routed expert: the HF name holds ``{expert}``; ``vllm`` is a FusedMoE parameter stem
    # (``<block>.experts.routed_experts.w13`` -> ``w13_weight`` [E, 2m, h]) whose dim 0 is the expert; splits apply per expert
    expert: bool = False
    # the TE name fuses it into the dense MLP's linear_fc1: megatron's TE spec gives an MoE layer its own norm
    # (gpt_layer_specs.py: ``pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp``)
    te_dense_only: bool = False

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

    def megatron_param(self, kind: str, te_norms: bool, sparse: bool = False) -> str:
        """The parameter under ``decoder.layers.<n>.``; ``sparse``: in an MoE layer."""
        if self.expert:
            raise ValueError(f"part {self.name} is one per expert: use megatron_expert_param")
        if te_norms and self.megatron_te_name and not (sparse and self.te_dense_only):
            return self.megatron_te_name
        return f"{self.megatron}.{kind}"

    def megatron_expert_param(self, kind: str, local_expert: int, grouped_gemm: bool) -> str:
        """megatron-core 0.16's parameter (under ``decoder.layers.<n>.``) holding this expert part of local
        expert ``local_expert`` (experts are numbered per EP rank): SequentialMLP keeps one MLP per expert,
        ``mlp.experts.local_experts.<le>.linear_fc1.weight`` [2m/ETP, h] ([gate shard; up shard]) and
        ``...linear_fc2.weight`` [h, m/ETP]; TEGroupedMLP (Transformer Engine's GroupedLinear) the same
        tensors as ``mlp.experts.linear_fc1.weight<le>`` / ``mlp.experts.linear_fc2.weight<le>``."""
        if not self.expert:
            raise ValueError(f"part {self.name} is not one per expert: use megatron_param")
        if grouped_gemm:
            return f"{self.megatron}.{kind}{local_expert}"
        module = self.megatron.removeprefix("mlp.experts.")
        return f"mlp.experts.local_experts.{local_expert}.{module}.{kind}"

    def vllm_param(self, kind: str) -> str:
        """vLLM's parameter (under ``model.layers.<n>.``): ``<module>.<kind>``; FusedMoE's ``<stem>_<kind>``."""
        return f"{self.vllm}_{kind}" if self.expert else f"{self.vllm}.{kind}"


# megatron-core 0.16's registration order of a decoder layer's modules (TransformerLayer: input_layernorm,
# self_attention (SelfAttention registers linear_proj before linear_qkv, then the q/k norms), pre_mlp_layernorm,
# mlp (MoELayer: the router, then the experts: SequentialMLP's each local expert's fc1 then fc2, TEGroupedMLP's
# fc1 of every expert then fc2), then a dense MLP's fc1 and fc2); read off a built local-spec model
# (tests/test_step_time.py checks the order against one, tests/test_planner_node.py the optimizer's shards that follow)
MEGATRON_LAYER_MODULE_ORDER = (
    "input_layernorm",
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "self_attention.q_layernorm",
    "self_attention.k_layernorm",
    "pre_mlp_layernorm",
    "mlp.router",
    "mlp.experts",
    "mlp.shared_experts",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
# within a module, as its __init__ registers them: Transformer Engine's fused norm first
# (transformer_engine/pytorch/module/layernorm_linear.py), then a linear's weight, then its bias
_MEGATRON_PARAM_SUFFIX_ORDER = {"layer_norm_weight": 0, "layer_norm_bias": 1, "weight": 2, "bias": 3}


def megatron_layer_param_order(name: str) -> tuple:
    """A sort key putting a decoder layer's megatron parameters (names under ``decoder.layers.<n>.``) in the order
    the model registers them (:data:`MEGATRON_LAYER_MODULE_ORDER`)."""
    module = next(
        (i for i, m in enumerate(MEGATRON_LAYER_MODULE_ORDER) if name.startswith(m)), len(MEGATRON_LAYER_MODULE_ORDER)
    )
    if name.startswith("mlp.experts.local_experts."):  # SequentialMLP: expert by expert
        expert, rest = name.removeprefix("mlp.experts.local_experts.").split(".", 1)
        return (module, int(expert), rest)
    if name.startswith("mlp.experts."):  # TEGroupedMLP: linear_fc1.weight<e> ..., then linear_fc2
        stem = name.rstrip("0123456789")
        return (module, stem, int(name[len(stem) :] or 0))
    suffix = name.rsplit(".", 1)[-1]
    return (module, 0, _MEGATRON_PARAM_SUFFIX_ORDER.get(suffix, len(_MEGATRON_PARAM_SUFFIX_ORDER)), name)


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
    te_dense_only=True,
)
LAYER_PARTS = (Q, K, V, O_PROJ, Q_NORM, K_NORM, GATE, UP, DOWN, INPUT_NORM, POST_NORM)
OPTIONAL_PARTS = (Q_NORM, K_NORM)  # a family has both (Qwen3) or neither
DENSE_MLP_PARTS = (GATE, UP, DOWN)  # an MoE family may have none (Mixtral: every layer sparse)
# a sparse layer's MoE parts, in vLLM's order; they take the dense MLP's place in a layer's part order
MOE_PART_NAMES = ("router", "expert_gate", "expert_up", "expert_down")
PART_ORDER = ("q", "k", "v", "o", "q_norm", "k_norm", "gate", "up", "down", *MOE_PART_NAMES, "input_norm", "post_norm")


def moe_parts(vllm_block: str) -> tuple[Part, Part, Part, Part]:
    """The router and expert parts of a sparse layer whose MoE block vLLM calls ``vllm_block`` (``mlp`` in
    Qwen3-MoE, ``block_sparse_moe`` in Mixtral). megatron-core: the router ``mlp.router.weight`` [E, h]
    (replicated over TP and EP) and the experts (:meth:`Part.megatron_expert_param`, split by expert TP).
    vLLM: the gate ``<block>.gate.weight`` [E, h] (replicated) and FusedMoE's ``<block>.experts.routed_experts.w13_weight``
    [E, 2m/T, h] (per expert rows [w1 = gate shard; w3 = up shard]) and ``w2_weight`` [E, h, m/T]: vLLM's TP
    splits every expert by its intermediate dim (its EP, where it has one, splits dim 0)."""
    return (
        Part("router", ("E", "h"), "mlp.router", "replicate", f"{vllm_block}.gate", "replicate"),
        Part(
            "expert_gate",
            ("m", "h"),
            "mlp.experts.linear_fc1",
            "rows",
            f"{vllm_block}.experts.routed_experts.w13",
            "rows",
            expert=True,
        ),
        Part(
            "expert_up",
            ("m", "h"),
            "mlp.experts.linear_fc1",
            "rows",
            f"{vllm_block}.experts.routed_experts.w13",
            "rows",
            expert=True,
        ),
        Part(
            "expert_down",
            ("h", "m"),
            "mlp.experts.linear_fc2",
            "columns",
            f"{vllm_block}.experts.routed_experts.w2",
            "columns",
            expert=True,
        ),
    )


@dataclass(frozen=True)
class HfTensor:
    """One HF tensor of every decoder layer: ``<layer prefix><name>.<kind>``, stacking ``parts`` along rows."""

    name: str
    parts: tuple[Part, ...]


def dims_size(dims: tuple[str, ...], sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[s] for s in dims)


def full_sizes(shape: ModelShape) -> dict[str, int]:
    """Dim symbol -> its full (unsharded) size; ``experts``: all routed experts."""
    return rank_sizes(
        shape,
        shape.num_heads,
        shape.num_kv_heads,
        shape.intermediate_size,
        moe_intermediate=shape.moe_intermediate_size,
        experts=shape.num_experts,
    )


def rank_sizes(
    shape: ModelShape, q_heads: int, kv_heads: int, intermediate: int, *, moe_intermediate: int, experts: int
) -> dict[str, int]:
    """Dim symbol -> its size on one rank holding ``q_heads`` / ``kv_heads`` heads, ``intermediate`` dense MLP
    rows, ``moe_intermediate`` rows of each expert it holds and ``experts`` experts (0 and 0 for a dense model)."""
    d = shape.head_dim
    return dict(
        h=shape.hidden_size,
        d=d,
        q=q_heads * d,
        kv=kv_heads * d,
        i=intermediate,
        E=shape.num_experts,
        m=moe_intermediate,
        experts=experts,
    )


def even_split_sizes(shape: ModelShape, tp: int, ep: int = 1, etp: int | None = None) -> dict[str, int]:
    """Dim sizes on one rank of an even split (megatron-core's: no KV-head replication): heads and dense rows by
    ``tp``, experts by ``ep`` (E / ep each), every expert's rows by expert TP ``etp`` (``tp`` unless set)."""
    return rank_sizes(
        shape,
        shape.num_heads // tp,
        shape.num_kv_heads // tp,
        shape.intermediate_size // tp,
        moe_intermediate=shape.moe_intermediate_size // (etp or tp),
        experts=shape.num_experts // ep,
    )


def _no_config_check(config: dict, source: str) -> None:
    """A family without quirks to reject."""


def check_sliding_window(config: dict, source: str) -> None:
    """ValueError when attention is windowed (shorter than the context): nothing here implements it."""
    window, context = config.get("sliding_window"), config.get("max_position_embeddings")
    if window is not None and context is not None and window < context:
        raise ValueError(
            f"{source}: sliding_window={window} < max_position_embeddings={context}: sliding-window attention "
            "is not implemented here; set sliding_window to null in config.json if no sequence is longer than it"
        )


def every_layer_sparse(config: dict) -> tuple[int, ...]:
    """Mixtral: every decoder layer is an MoE layer."""
    return tuple(range(config["num_hidden_layers"]))


# config.json fields of MoE designs nothing here implements -> (what they are, the values that mean "not used");
# any other value is refused naming the field
UNSUPPORTED_MOE_FIELDS: dict[str, tuple[str, tuple]] = {
    "shared_expert_intermediate_size": ("shared experts", (None, 0)),
    "n_shared_experts": ("shared experts", (None, 0)),
    "num_shared_experts": ("shared experts", (None, 0)),
    "n_group": ("grouped top-k routing", (None, 1)),
    "topk_group": ("grouped top-k routing", (None, 1)),
    "topk_method": ("grouped top-k routing", (None, "greedy")),
    "scoring_func": ("non-softmax router scores", (None, "softmax")),
    "routed_scaling_factor": ("scaled routed outputs", (None, 1.0)),
}


@dataclass(frozen=True)
class MoeSpec:
    """A family's mixture-of-experts layers: the HF tensors of a sparse layer's MoE block and the config
    fields that size it. Routing (as transformers and vLLM do it for both families here): softmax over the
    router's E logits, the top-k experts by probability, their probabilities renormalised to sum to 1 when
    ``norm_topk_prob``; the output is the probability-weighted sum of those experts' SwiGLU MLPs."""

    router: HfTensor  # e.g. ``mlp.gate`` holding (router,)
    experts: tuple[HfTensor, ...]  # one name per expert part, holding ``{expert}``: ``mlp.experts.{expert}.gate_proj``
    intermediate_key: str  # config field of one expert's intermediate size
    norm_topk_prob: bool | str  # True, False, or the config key that decides (Qwen3-MoE's ``norm_topk_prob``)
    sparse_layers: Callable[[dict], tuple[int, ...]] = every_layer_sparse  # config -> sorted MoE layer indices
    num_experts_keys: tuple[str, ...] = ("num_local_experts", "num_experts")  # first present wins
    top_k_key: str = "num_experts_per_tok"

    def __post_init__(self) -> None:
        for tensor in self.experts:
            if "{expert}" not in tensor.name or not all(part.expert for part in tensor.parts):
                raise ValueError(f"MoeSpec: {tensor.name} must hold expert parts and name them by {{expert}}")
        if [p.name for t in (self.router, *self.experts) for p in t.parts] != list(MOE_PART_NAMES):
            raise ValueError(f"MoeSpec: the MoE block's HF tensors must hold {MOE_PART_NAMES} in that order")

    def num_experts(self, config: dict) -> int:
        return int(next((config[k] for k in self.num_experts_keys if config.get(k)), 0))

    def check_config(self, config: dict, source: str) -> None:
        """ValueError naming the config.json field of an MoE design nothing here implements."""
        for key, (what, unused) in UNSUPPORTED_MOE_FIELDS.items():
            if config.get(key) not in unused:
                raise ValueError(
                    f"{source}: {key}={config[key]!r} ({what}) is not implemented here; set it to {unused[1]!r} "
                    "or use a checkpoint with plain top-k softmax routing over routed experts only"
                )
        top_k, experts = config.get(self.top_k_key), self.num_experts(config)
        if not experts or not top_k or not 0 < top_k <= experts:
            raise ValueError(f"{source}: {self.top_k_key}={top_k} must be in [1, {self.num_experts_keys[0]}={experts}]")


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
    moe: MoeSpec | None = None  # its sparse layers (module doc); layer_tensors then describe a dense layer
    layer_prefix: str = "model.layers.{layer}."
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    _slots: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        slots: dict[str, tuple[HfTensor, tuple[Part, ...]]] = {}  # part name -> (its HF tensor, parts before it)
        moe_tensors = (self.moe.router, *self.moe.experts) if self.moe else ()
        for tensor in (*self.layer_tensors, *moe_tensors):
            for index, part in enumerate(tensor.parts):
                if part.expert and tensor not in moe_tensors or part.name in MOE_PART_NAMES and not self.moe:
                    raise ValueError(
                        f"family {self.model_type}: {tensor.name} holds MoE part {part.name}; "
                        "MoE parts belong in its moe=MoeSpec(...)"
                    )
                if part.name in slots:
                    raise ValueError(f"family {self.model_type}: part {part.name!r} is in two HF tensors")
                if index and part.dims[1:] != tensor.parts[0].dims[1:]:
                    raise ValueError(f"family {self.model_type}: {tensor.name} stacks parts of other widths")
                if len(tensor.parts) > 1 and "columns" in (part.megatron_split, part.vllm_split):
                    # a slice is a block of rows or of columns, never both: a column-split part stands alone
                    raise ValueError(f"family {self.model_type}: {tensor.name} stacks {part.name}, split on columns")
                slots[part.name] = (tensor, tensor.parts[:index])
        optional = OPTIONAL_PARTS + (DENSE_MLP_PARTS if self.moe else ())
        missing = [p.name for p in LAYER_PARTS if p not in optional and p.name not in slots]
        if missing:
            raise ValueError(f"family {self.model_type}: no HF tensor holds part(s) {missing}")
        if len({p.name in slots for p in OPTIONAL_PARTS}) > 1:
            raise ValueError(f"family {self.model_type}: q_norm and k_norm come together")
        if len({p.name in slots for p in DENSE_MLP_PARTS}) > 1:
            raise ValueError(f"family {self.model_type}: gate, up and down come together")
        object.__setattr__(self, "_slots", slots)

    def has_qkv_bias(self, config: dict) -> bool:
        if isinstance(self.qkv_bias, bool):
            return self.qkv_bias
        return bool(config.get(self.qkv_bias, False))

    def has_part(self, part: Part) -> bool:
        return part.name in self._slots

    def layer_parts(self, qkv_bias: bool, sparse: bool = False) -> list[tuple[Part, str]]:
        """(part, ``weight`` / ``bias``) of one layer in vLLM's order: per vLLM module, its parts' weights, then
        their biases (only q/k/v have one, when ``qkv_bias``). ``sparse``: an MoE layer (router and experts in
        place of the dense MLP)."""
        # the same two answers for every layer of every plan (make tune plans thousands): made once, a copy handed out
        made = self.__dict__.setdefault("_layer_parts_made", {})
        key = (bool(qkv_bias), bool(sparse))
        if key not in made:
            made[key] = self._make_layer_parts(*key)
        return list(made[key])

    def _make_layer_parts(self, qkv_bias: bool, sparse: bool) -> list[tuple[Part, str]]:
        if sparse and not self.moe:
            raise ValueError(f"family {self.model_type} has no MoE layers")
        mlp = MOE_PART_NAMES if sparse else tuple(p.name for p in DENSE_MLP_PARTS)
        names = [
            n for n in PART_ORDER if n in self._slots and (n in mlp or n not in (*MOE_PART_NAMES, "gate", "up", "down"))
        ]
        present = [self._part(name) for name in names]
        modules = list(dict.fromkeys(part.vllm for part in present))
        out = []
        for module in modules:
            parts = [part for part in present if part.vllm == module]
            out += [(part, "weight") for part in parts]
            out += [(part, "bias") for part in parts if qkv_bias and part.bias_when_qkv_bias]
        return out

    def _part(self, name: str) -> Part:
        tensor, before = self._slots[name]
        return tensor.parts[len(before)]

    def hf_slot(
        self, part: Part, kind: str, layer: int, sizes: dict[str, int], expert: int | None = None
    ) -> tuple[str, int]:
        """(HF tensor name, first row) of ``part``'s ``kind`` in layer ``layer`` (of routed expert ``expert``
        for an expert part); ``sizes``: full_sizes(shape)."""
        if part.expert != (expert is not None):
            raise ValueError(f"part {part.name}: an expert index is needed exactly for expert parts")
        tensor, before = self._slots[part.name]
        offset = sum(sizes[p.dims[0]] for p in before)
        name = tensor.name.format(expert=expert) if part.expert else tensor.name
        return f"{self.layer_prefix.format(layer=layer)}{name}.{kind}", offset

    def sparse_layers(self, config: dict) -> tuple[int, ...]:
        """The MoE layers of a config (as transformers' config class holds it); () for a dense family."""
        return tuple(sorted(self.moe.sparse_layers(config))) if self.moe else ()


def layer_parts(shape: ModelShape, layer: int) -> list[tuple[Part, str]]:
    """(part, kind) of decoder layer ``layer`` of ``shape``'s family (see :meth:`Family.layer_parts`)."""
    return shape.family.layer_parts(shape.qkv_bias, shape.is_moe_layer(layer))


def layer_param_count(shape: ModelShape, sizes: dict[str, int], layer: int) -> int:
    """Parameters of decoder layer ``layer`` whose dims have ``sizes`` (full_sizes or one rank's rank_sizes;
    an expert part counts ``sizes["experts"]`` times)."""
    return sum(
        math.prod(dims_size(part.kind_dims(kind), sizes)) * (sizes["experts"] if part.expert else 1)
        for part, kind in layer_parts(shape, layer)
    )


def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint (full, unsharded) and its shape."""
    family, sizes = shape.family, full_sizes(shape)
    h, v = shape.hidden_size, shape.vocab_size
    out: dict[str, tuple[int, ...]] = {family.embed: (v, h)}
    for layer in range(shape.num_layers):
        for part, kind in layer_parts(shape, layer):
            for expert in range(shape.num_experts) if part.expert else (None,):
                name, offset = family.hf_slot(part, kind, layer, sizes, expert)
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
