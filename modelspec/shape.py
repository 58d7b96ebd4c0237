"""The model contract: one :class:`ModelShape` per Hugging Face checkpoint, parsed once.

Every package that needs the model's sizes (the megatron actor's layout, vLLM's layout, the native
engine, the config checks, the planner) takes a ``ModelShape``; nobody else reads ``config.json``.
The families it accepts, their tensors and quirks, are data in :mod:`modelspec.families` (one file each).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelspec.families import FAMILIES
from modelspec.family import Q_NORM, Family, full_sizes, layer_param_count

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
ROPE_TYPES = ("default", "llama3")
# Shipped architectures: each <name>.json is a checkpoint's config.json exactly as published on Hugging
# Face (no weights), so config checks and the memory planner need no download (see its README.md).
ARCHITECTURES_DIR = Path(__file__).resolve().parent / "architectures"
ARCH_PREFIX = "arch:"


def list_architectures() -> list[str]:
    """Names accepted by :meth:`ModelShape.from_architecture` (and ``arch:<name>`` paths)."""
    return sorted(p.stem for p in ARCHITECTURES_DIR.glob("*.json"))


@dataclass(frozen=True)
class RopeParams:
    """RoPE as the checkpoint declares it. ``rope_type="llama3"`` carries Llama 3.1's frequency scaling."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, c: dict) -> RopeParams:
        """From a config as transformers' config class holds it (``to_dict()``): v5 keeps RoPE under
        ``rope_parameters``; the class folds a v4 ``rope_scaling`` / ``rope_theta`` into it (rope_scaling wins)."""
        params = c.get("rope_parameters") or c.get("rope_scaling") or {}
        rope_type = params.get("rope_type", params.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"RoPE type {rope_type!r} (config.json's rope_scaling / rope_parameters) is not implemented here "
                f"(supported: {', '.join(ROPE_TYPES)}); remove it or use a checkpoint without it"
            )
        theta = params.get("rope_theta", c.get("rope_theta"))
        return cls(
            theta=float(theta if theta is not None else 10000.0),
            rope_type=rope_type,
            factor=float(params.get("factor", 8.0 if rope_type == "llama3" else 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )


def _supported_model_type(config: dict, source: str) -> str:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        where = f" ({source})" if source else ""
        raise ValueError(
            f"model_type {model_type!r} is not supported{where}; supported families: {SUPPORTED_MODEL_TYPES}"
        )
    return model_type


def _as_transformers_reads_it(config: dict, source: str) -> dict:
    """config.json through transformers' own config class (what ``AutoConfig.from_pretrained`` does with the
    file): its class defaults (``tie_word_embeddings``, sizes) and its RoPE normalization (a v4 ``rope_scaling``
    added to a v5 ``rope_parameters`` replaces it) apply, so this project and transformers read one model."""
    # first use: at the top transformers would load with `import checkpointing.checkpoint, configs ...`, which do not need it
    from transformers import CONFIG_MAPPING

    model_type = _supported_model_type(config, source)
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(config)).to_dict()
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{source or 'config.json'}: transformers rejects this config ({exc})") from None


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder of one of :data:`FAMILIES` (h hidden, I intermediate, d head_dim, V vocab).

    ``qkv_bias`` and ``qk_norm`` are the family's answers for this config (its data decides them, see
    :attr:`family`), kept as fields for megatron's TransformerConfig and for readers.

    Mixture of experts (a family with ``moe``; all zero / empty for a dense model): ``num_experts`` routed
    experts E, ``moe_top_k`` of them per token, each a SwiGLU MLP of ``moe_intermediate_size`` m, their
    softmax probabilities renormalised over the top-k when ``norm_topk_prob``; ``moe_layers`` the sparse
    layers' indices (the others have the dense MLP of ``intermediate_size``)."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rms_norm_eps: float = 1e-6
    rope: RopeParams = field(default_factory=RopeParams)
    max_position_embeddings: int = 2048
    eos_token_id: int | None = None
    num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    source: str = ""  # where it was read from, for error messages

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "") -> ModelShape:
        """From a transformers config object, or a config.json dict (read through transformers' config class)."""
        c = _as_transformers_reads_it(config, source) if isinstance(config, dict) else config.to_dict()
        model_type = _supported_model_type(c, source)
        family = FAMILIES[model_type]
        family.check_config(c, source or "config.json")
        heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        moe = family.moe
        moe_fields = {}
        if moe:
            norm = moe.norm_topk_prob
            moe_fields = dict(
                num_experts=moe.num_experts(c),
                moe_top_k=int(c[moe.top_k_key]),
                moe_intermediate_size=int(c[moe.intermediate_key]),
                norm_topk_prob=norm if isinstance(norm, bool) else bool(c.get(norm, False)),
                moe_layers=family.sparse_layers(c),
            )
        return cls(
            model_type=model_type,
            num_layers=c["num_hidden_layers"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab_size=c["vocab_size"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=family.has_qkv_bias(c),
            qk_norm=family.has_part(Q_NORM),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope=RopeParams.from_hf(c),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            eos_token_id=eos,
            source=source,
            **moe_fields,
        )

    @classmethod
    def from_architecture(cls, name: str) -> ModelShape:
        """From a shipped architecture (``modelspec/architectures/<name>.json``), e.g. ``Qwen2.5-7B-Instruct``."""
        config_file = ARCHITECTURES_DIR / f"{name}.json"
        if not config_file.is_file():
            raise ValueError(f"architecture {name!r} is not shipped; choose one of {list_architectures()}")
        return cls.from_hf_config(json.loads(config_file.read_text()), source=f"{ARCH_PREFIX}{name}")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelShape:
        """From a HF checkpoint directory (its config.json), ``tiny:<family>`` or ``arch:<name>`` (no files needed)."""
        # import cycle: modelspec.tiny imports this module at its top
        from modelspec.tiny import TINY_PREFIX, tiny_hf_config

        text = str(path)
        if text.startswith(TINY_PREFIX):
            return cls.from_hf_config(tiny_hf_config(text[len(TINY_PREFIX) :]).to_dict(), source=text)
        if text.startswith(ARCH_PREFIX):
            return cls.from_architecture(text[len(ARCH_PREFIX) :])
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} does not exist; point model.path at a HF checkpoint directory")
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_file} is not valid JSON ({exc})") from None
        return cls.from_hf_config(config, source=str(path))

    @property
    def num_query_groups(self) -> int:
        return self.num_kv_heads

    @property
    def family(self) -> Family:
        """This model's family: its HF tensors and quirks (:mod:`modelspec.families`)."""
        return FAMILIES[self.model_type]

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Decoder layer ``layer`` is sparse (router + experts) rather than a dense MLP."""
        return layer in self.moe_layers

    def param_count(self) -> int:
        """Parameters of the full (unsharded) model."""
        return self._param_count

    @functools.cached_property  # the shape is frozen; make tune asks once per layout (~50k for a 30B MoE)
    def _param_count(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        sizes = full_sizes(self)
        return sum(layer_param_count(self, sizes, layer) for layer in range(self.num_layers)) + embeddings + h

    def active_param_count(self) -> int:
        """Parameters one token runs through: every parameter but the experts it is not routed to."""
        per_expert = 3 * self.hidden_size * self.moe_intermediate_size
        return self.param_count() - len(self.moe_layers) * (self.num_experts - self.moe_top_k) * per_expert
