"""Engine expert parallel in the native engine (``rollout.ep``): a replica of ep ranks, each holding E / ep whole
experts, fed by the planned weight sync from actor shards (megatron's layout, built in memory from the tiny
checkpoint: no megatron model), then greedy log-probs against transformers. One spawned world of 2 ranks serves
both actor layouts: (tp, pp, ep) = (1, 1, 2) and (1, 2, 1)."""

from __future__ import annotations

import itertools

import pytest

from tests.dist import run_ranks
from tests.family_helpers import MOE_FAMILIES
from tests.rollout_helpers import MAX_NEW_TOKENS, PROMPTS, hf_greedy, max_abs_diff

ROLLOUT_EP = 2
TRAIN_LAYOUTS = [(1, 1, 2), (1, 2, 1)]  # actor (tp, pp, ep)


def _ranks(rank: int, world_size: int, model_dirs: dict) -> dict:
    import torch
    import torch.distributed as dist

    from configs.rollout import RolloutConfig
    from modelspec import ColocatedMesh, ModelShape
    from rollout import SamplingParams, make_engine
    from rollout.layout import assemble_local
    from rollout.native import iter_safetensors
    from tests.test_weight_sync_moe import _shards
    from weight_sync import WeightSyncConfig
    from weight_sync.layouts import actor_sources, engine_destinations
    from weight_sync.transfers import min_sync_bytes

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))  # the one replica: rollout.ep ranks
    out = {}
    for (tp, pp, ep), family in itertools.product(TRAIN_LAYOUTS, MOE_FAMILIES):
        mesh = ColocatedMesh(world_size=world_size, actor_tp=tp, actor_pp=pp, actor_ep=ep, rollout_ep=ROLLOUT_EP)
        assert mesh.num_replicas == 1
        shape = ModelShape.from_pretrained(model_dirs[family])
        hf = dict(iter_safetensors(model_dirs[family]))
        cfg = RolloutConfig(ep=ROLLOUT_EP, cpu_capacity_gb=0.25, activation_reserve_mb=16)
        engine = make_engine(cfg, model_dirs[family], group=group, device="cpu", load=False)
        sync = WeightSyncConfig(verify=True).build(shape, mesh, rank, dtype="float32")
        result = sync(_shards(shape, mesh, hf, rank), engine.begin_weight_update())
        engine.finish_weight_update()
        greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
        params = engine.named_parameters()
        layouts = engine_destinations(shape, mesh)[rank]
        out[(tp, pp, ep), family] = dict(
            greedy=[(c[0].token_ids, c[0].logprobs) for c in greedy],
            verified=result.verified and result.num_checked > 0,
            exact=all(torch.equal(params[p.name], assemble_local(p, hf)) for p in layouts),
            w13_experts={n: t.shape[0] for n, t in params.items() if n.endswith("w13_weight")},
            bytes_moved=sync.plan.bytes_moved,
            min_bytes=min_sync_bytes(actor_sources(shape, mesh), engine_destinations(shape, mesh), 4),
        )
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model_dirs):
    return run_ranks(_ranks, ROLLOUT_EP, {f: tiny_model_dirs[f] for f in MOE_FAMILIES}, timeout_s=600)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("train", TRAIN_LAYOUTS, ids=["train_ep2", "train_pp2"])
def test_native_engine_expert_parallel_after_sync_matches_transformers(ranks, tiny_model_dirs, train, family):
    reference = hf_greedy(tiny_model_dirs[family])
    for r in (rank_result[train, family] for rank_result in ranks):
        assert r["verified"] and r["exact"]
        assert set(r["w13_experts"].values()) == {4 // ROLLOUT_EP}  # E / ep whole experts per rank
        assert r["bytes_moved"] == r["min_bytes"]
        for (hf_tokens, hf_lps), (tokens, lps) in zip(reference, r["greedy"]):
            assert tokens == hf_tokens
            assert max_abs_diff(lps, hf_lps) < 1e-4
