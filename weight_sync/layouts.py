"""Who holds what, per global rank: the actor's shards and the engine's parameters on the colocated mesh.

Thin glue over each side's own layout module: ``megatron_backend.layout`` says what an actor rank
holds, ``rollout.layout`` what an engine rank needs; the :class:`~modelspec.ColocatedMesh` says which
actor and engine coordinates global rank r has (the same device).
"""

from __future__ import annotations

from megatron_backend import layout as actor_layout
from modelspec import ColocatedMesh, ModelShape
from rollout import layout as engine_layout


def actor_rank_layout(mesh: ColocatedMesh, rank: int, te_norms: bool = False) -> actor_layout.RankLayout:
    """Global rank ``rank``'s place in the actor's dense and expert grids, as megatron's layout takes it."""
    c = mesh.actor_coords(rank)
    return actor_layout.RankLayout(
        mesh.actor_tp,
        mesh.actor_pp,
        mesh.actor_vpp,
        c.tp_rank,
        c.pp_rank,
        te_norms=te_norms,
        ep=mesh.actor_ep,
        etp=mesh.actor_expert_tp,
        ep_rank=c.ep_rank,
        etp_rank=c.etp_rank,
        grouped_experts=te_norms,  # Transformer Engine: its norms fused and its grouped experts
    )


def actor_sources(shape: ModelShape, mesh: ColocatedMesh, te_norms: bool = False) -> dict[int, list]:
    """Global rank -> the megatron slice pieces its actor shard holds."""
    return {
        rank: actor_layout.rank_pieces(shape, actor_rank_layout(mesh, rank, te_norms))
        for rank in range(mesh.world_size)
    }


def engine_destinations(shape: ModelShape, mesh: ColocatedMesh) -> dict[int, list]:
    """Global rank -> the vLLM parameter layouts its engine rank needs."""
    return {
        rank: engine_layout.vllm_param_layouts(
            shape, mesh.rollout_tp, mesh.rollout_tp_rank(rank), engine_layout.engine_expert_split(mesh, rank)
        )
        for rank in range(mesh.world_size)
    }
