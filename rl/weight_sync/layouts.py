"""Who holds what, per global rank: the actor grid (megatron order tp-dp-pp) and the engine replicas.

Thin glue over each side's own layout module: ``megatron_backend.layout`` says what an actor rank
holds, ``rollout.layout`` what an engine rank needs. Colocated: global rank r is actor rank r and
engine rank r on the same device.
"""

from __future__ import annotations

from typing import Any

from megatron_backend import layout as actor_layout
from modelspec import ModelShape
from rollout import layout as engine_layout

actor_coords = actor_layout.rank_coords


def actor_sources(
    hf_config: Any, tp: int, pp: int, vpp: int | None, world_size: int, te_norms: bool = False
) -> dict[int, list]:
    shape = actor_layout.ModelShape.from_hf(hf_config)
    out = {}
    for rank in range(world_size):
        tp_rank, pp_rank, _ = actor_coords(rank, tp, pp, world_size)
        layout = actor_layout.RankLayout(tp, pp, vpp, tp_rank, pp_rank, te_norms=te_norms)
        out[rank] = actor_layout.rank_pieces(shape, layout)
    return out


def engine_destinations(hf_config: Any, rollout_tp: int, world_size: int) -> dict[int, list]:
    """Engine rank r is TP rank r % rollout_tp of replica r // rollout_tp."""
    shape = hf_config if isinstance(hf_config, ModelShape) else ModelShape.from_hf_config(hf_config)
    return {rank: engine_layout.vllm_param_layouts(shape, rollout_tp, rank % rollout_tp) for rank in range(world_size)}
