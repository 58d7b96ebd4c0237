"""The model contract, a leaf package (imports nothing else from this project).

- :mod:`modelspec.shape`: :class:`ModelShape` (parsed once from a HF checkpoint) and RoPE parameters;
- :mod:`modelspec.family`, :mod:`modelspec.families`: a model family as data (its HF tensors, the megatron and
  vLLM parameters they become, its quirks, its tiny checkpoint), one file per family;
- :mod:`modelspec.mesh`: :class:`ColocatedMesh`, every rank's actor and rollout coordinates, and the one layout
  check (``ColocatedMesh.check``: can both sides split this model);
- :mod:`modelspec.dtypes`: dtype names and their torch dtypes;
- :mod:`modelspec.contract`: the batch the actor runs and what it hands a loss function (:class:`TokenBatch`,
  :class:`BatchTotals`, ``LossFn``);
- :mod:`modelspec.tiny`: the tiny test checkpoints, built in-process.

The step's phase table, engine memory behaviour and the allocator calls live in :mod:`colocation`.
"""

from modelspec.contract import BatchTotals, LossFn, TokenBatch
from modelspec.dtypes import DTYPE_NAMES, element_bytes, torch_dtype
from modelspec.mesh import ColocatedMesh
from modelspec.shape import SUPPORTED_MODEL_TYPES, ModelShape, RopeParams

__all__ = [
    "DTYPE_NAMES",
    "SUPPORTED_MODEL_TYPES",
    "BatchTotals",
    "ColocatedMesh",
    "LossFn",
    "ModelShape",
    "RopeParams",
    "TokenBatch",
    "element_bytes",
    "torch_dtype",
]
