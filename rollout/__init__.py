"""Rollout engines behind one protocol; never imports ``megatron_backend``.

``make_engine(cfg, model_path, ...)`` builds the engine ``rollout.engine`` names: ``native`` (plain torch,
CPU or CUDA) or ``vllm`` (vLLM's CUDA or CPU build; imported lazily).
"""

from __future__ import annotations

from typing import Any

from configs.rollout import RolloutConfig
from modelspec import ColocatedMesh
from rollout.engine import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutConfig", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(
    cfg: RolloutConfig,
    model_path: str,
    *,
    mesh: ColocatedMesh | None = None,
    rank: int = 0,
    group: Any = None,
    **kwargs: Any,
) -> RolloutEngine:
    """The engine of ``cfg.engine`` for the HF checkpoint at ``model_path``, on global ``rank`` of ``mesh``.

    native: ``group`` is the process group of this rank's replica, its rollout TP x EP ranks (None for one rank); kwargs
    ``device``, ``dtype``, ``load``, ``shape`` (the run's :class:`~modelspec.ModelShape`; None: read it). vllm: runs inside the training ranks (external_launcher; vLLM makes its
    own TP / DP groups from ``mesh``, ``group`` is not used); kwargs ``dtype``, ``load``, ``device`` and
    ``shape`` and EngineArgs fields.
    """
    if cfg.engine == "native":
        # import cycle: rollout.native imports this package (rollout) while it loads
        from rollout.native import NativeEngine

        return NativeEngine(cfg, model_path, group=group, **kwargs)
    # import cycle: rollout.vllm_engine imports this package (rollout) while it loads
    from rollout.vllm_engine import VllmEngine

    return VllmEngine(cfg, model_path, mesh=mesh, rank=rank, **kwargs)
