"""Reading a checkpoint's tensors by logical part (q, k, gate, ...), wherever the family keeps them."""

from __future__ import annotations

import torch

from modelspec import ModelShape
from modelspec.families import FAMILIES
from modelspec.family import Part, full_sizes

DENSE_FAMILIES = tuple(name for name, family in FAMILIES.items() if not family.moe)
MOE_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.moe)


def hf_part(hf: dict[str, torch.Tensor], shape: ModelShape, part: Part, layer: int, kind: str = "weight"):
    """The full rows of one part of layer ``layer``: a whole tensor (Llama's q_proj) or rows of a fused one
    (Phi-3's qkv_proj [q; k; v]), where the family says."""
    sizes = full_sizes(shape)
    name, offset = shape.family.hf_slot(part, kind, layer, sizes)
    return hf[name][offset : offset + sizes[part.dims[0]]]
