"""The weight-sync plan on the MoE families: actor (TP x PP x EP, expert TP following TP) -> the engine's layout
(rollout TP splitting every expert by its intermediate dim; engine expert parallel; vLLM's experts split over
every rank of its replicas), bit-exact and moving the minimum bytes."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_backend.layout import RankLayout, local_param_shapes, rank_pieces
from modelspec import ColocatedMesh, ModelShape
from modelspec.family import hf_tensor_shapes
from rollout.layout import assemble_local
from tests.family_helpers import MOE_FAMILIES
from weight_sync.execute import dst_view
from weight_sync.layouts import actor_sources, engine_destinations
from weight_sync.transfers import min_sync_bytes, plan_sync

WORLD = 4
# (tp, pp, ep, etp): expert TP follows TP unless set (None); tp x ep ranks of a stage split the experts
TRAIN_LAYOUTS = [
    (1, 1, 1, None),
    (1, 1, 2, None),
    (1, 1, 4, None),
    (2, 1, 2, None),
    (1, 2, 2, None),
    (2, 2, 1, None),
    (1, 4, 1, None),
    (2, 1, 2, 1),
]
ROLLOUT_TPS = [1, 2, 4]


def _shards(shape: ModelShape, mesh: ColocatedMesh, hf: dict, rank: int) -> dict:
    c = mesh.actor_coords(rank)
    layout = RankLayout(
        mesh.actor_tp,
        mesh.actor_pp,
        None,
        c.tp_rank,
        c.pp_rank,
        ep=mesh.actor_ep,
        etp=mesh.actor_expert_tp,
        ep_rank=c.ep_rank,
        etp_rank=c.etp_rank,
    )
    shards = {key: torch.zeros(s) for key, s in local_param_shapes(shape, layout).items()}
    for p in rank_pieces(shape, layout):
        shards[(p.vp_stage, p.megatron_name)].narrow(p.dim, p.local_start, p.length).copy_(
            hf[p.hf_name].narrow(p.dim, p.hf_start, p.length)
        )
    return shards


def _check_plan(shape: ModelShape, mesh: ColocatedMesh, hf: dict) -> dict:
    """Plan ``mesh``'s sync, run it in memory: bit-exact, the minimum bytes, no rank receiving more than it
    holds. Returns the destinations."""
    sources, destinations = actor_sources(shape, mesh), engine_destinations(shape, mesh)
    plan = plan_sync(sources, destinations, bucket_bytes=64 << 10, element_bytes=4)
    assert plan.bytes_moved == min_sync_bytes(sources, destinations, 4), mesh
    shards = {rank: _shards(shape, mesh, hf, rank) for rank in range(WORLD)}
    engine = {rank: {p.name: torch.zeros(p.local_shape) for p in destinations[rank]} for rank in range(WORLD)}
    for bucket in plan.buckets:
        for t in bucket:
            dst_view(engine[t.dst_rank], t).copy_(shards[t.src_rank][t.src_key].narrow(t.dim, t.src_start, t.length))
    for rank in range(WORLD):
        for param in destinations[rank]:
            assert torch.equal(engine[rank][param.name], assemble_local(param, hf)), (mesh, param.name)
    # each engine rank gets only its own experts / rows: what it receives is at most what it holds
    received = [sum(t.numel for t in plan.transfers if t.dst_rank == r) for r in range(WORLD)]
    held = [sum(torch.Size(p.local_shape).numel() for p in destinations[r]) for r in range(WORLD)]
    assert all(a <= b for a, b in zip(received, held))
    return destinations


def _random_hf(shape: ModelShape) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(dims, generator=gen) for name, dims in hf_tensor_shapes(shape).items()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("rollout_ep", [2, 4])
def test_plan_into_engine_expert_parallel(family, rollout_ep):
    """rollout.ep (native engine): each engine rank holds E / ep whole experts and receives only those."""
    shape = ModelShape.from_pretrained(f"tiny:{family}")
    hf = _random_hf(shape)
    for tp, pp, ep in [(1, 1, 2), (1, 2, 1), (2, 1, 2)]:
        mesh = ColocatedMesh(world_size=WORLD, actor_tp=tp, actor_pp=pp, actor_ep=ep, rollout_ep=rollout_ep)
        destinations = _check_plan(shape, mesh, hf)
        per_rank = shape.num_experts // rollout_ep
        for rank in range(WORLD):
            w13 = [p for p in destinations[rank] if p.name.endswith("w13_weight")]
            assert w13 and all(p.local_shape[0] == per_rank for p in w13)
            first = mesh.rollout_ep_rank(rank) * per_rank
            experts = {int(s.hf_name.split(".experts.")[1].split(".")[0]) for p in w13 for s in p.slices}
            assert experts == set(range(first, first + per_rank)), (rank, experts)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_plan_into_vllm_replicas_splits_experts_over_every_rank(family):
    """vLLM with R replicas flattens TP across DP in its MoE layers: rank (replica i, tp rank t) holds rows
    [(i*T + t) * m/(R*T), ...) of every expert (FusedMoEParallelConfig.make)."""
    shape = ModelShape.from_pretrained(f"tiny:{family}")
    hf = _random_hf(shape)
    for (tp, pp, ep), rtp in itertools.product([(1, 1, 2), (2, 1, 2)], [1, 2]):
        mesh = ColocatedMesh(
            world_size=WORLD, actor_tp=tp, actor_pp=pp, actor_ep=ep, rollout_tp=rtp, rollout_experts_span_replicas=True
        )
        destinations = _check_plan(shape, mesh, hf)
        for rank in range(WORLD):
            w2 = next(p for p in destinations[rank] if p.name.endswith("w2_weight"))
            assert w2.local_shape[2] == shape.moe_intermediate_size // WORLD
            assert w2.slices[0].hf_start == rank * shape.moe_intermediate_size // WORLD


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_plan_reshards_experts_bit_exact_with_minimum_bytes(family):
    shape = ModelShape.from_pretrained(f"tiny:{family}")
    hf = _random_hf(shape)
    checked = 0
    for (tp, pp, ep, etp), rtp in itertools.product(TRAIN_LAYOUTS, ROLLOUT_TPS):
        mesh = ColocatedMesh(world_size=WORLD, actor_tp=tp, actor_pp=pp, actor_ep=ep, actor_etp=etp, rollout_tp=rtp)
        _check_plan(shape, mesh, hf)
        checked += 1
    assert checked == len(TRAIN_LAYOUTS) * len(ROLLOUT_TPS)
