"""vLLM's CPU build on the tiny MoE checkpoints: greedy log-probs against transformers, and a weight update
through this repo's layout (FusedMoE's w13 / w2 written in place, vLLM's CPU experts padded and prepacked again
at finish) equal to a fresh engine of the new weights, at TP 1 and TP 2 (experts split by their intermediate
dim). One spawned world per TP size serves every test (see test_vllm_engine.py)."""

from __future__ import annotations

import pytest

from tests.dist import run_ranks
from tests.family_helpers import MOE_FAMILIES
from tests.rollout_helpers import PROMPTS, hf_greedy, max_abs_diff
from tests.test_vllm_engine import GREEDY, KV_MB, NEW_SEED, _build, _tokens_and_logprobs, _write_slices

pytestmark = pytest.mark.vllm


def _ranks(rank: int, world_size: int, checkpoints: dict) -> dict:
    import torch.distributed as dist

    from configs.rollout import RolloutConfig

    dist.init_process_group("gloo")
    cfg = RolloutConfig(engine="vllm", tp=world_size, kv_cache_bytes=KV_MB << 20, max_model_len=128)
    out: dict = {}
    for family, (path_a, path_b) in checkpoints.items():
        engine = _build(cfg, path_a, rank, world_size)
        r = {"greedy": _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))}
        # one layer's experts through the fallback (vLLM's own expert loader, per-expert HF tensors), the rest
        # in place; then the full checkpoint A through load_weights (the gather-and-reload baseline)
        block = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
        fallback = (f"model.layers.1.{block}.experts.routed_experts.w13_weight", "model.norm.weight")
        r["update"] = _write_slices(engine, path_b, world_size, rank, fallback=fallback)
        r["updated"] = _tokens_and_logprobs(engine.generate(PROMPTS, GREEDY))
        fresh = _build(cfg, path_b, rank, world_size)
        r["fresh"] = _tokens_and_logprobs(fresh.generate(PROMPTS, GREEDY))
        out[family] = r
        engine.shutdown()
        fresh.shutdown()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    from modelspec.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("vllm_moe")
    return {
        family: (
            str(write_tiny_model(family, root / family)),
            str(write_tiny_model(family, root / f"{family}_b", seed=NEW_SEED)),
        )
        for family in MOE_FAMILIES
    }


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request, checkpoints):
    return run_ranks(_ranks, request.param, checkpoints, timeout_s=900)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_matches_transformers(ranks, checkpoints, family):
    for rank_result in ranks:
        for (hf_tokens, hf_lps), ((tokens, lps),) in zip(
            hf_greedy(checkpoints[family][0]), rank_result[family]["greedy"]
        ):
            assert tokens == hf_tokens
            assert max_abs_diff(lps, hf_lps) < 1e-5


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_update_through_the_layout_equals_a_fresh_engine(ranks, family):
    for r in (rank_result[family] for rank_result in ranks):
        update = r["update"]
        assert {n: s for n, (s, _) in update["begin"].items()} == update["expected"]  # rollout.layout is vLLM's
        assert update["readable_matches"]
        assert len(update["fell_back"]) == 2
        assert r["updated"] == r["fresh"]  # exactly
        assert r["updated"] != r["greedy"]


@pytest.mark.parametrize("tp,replicas", [(1, 2), (2, 2), (1, 4)])
def test_replicas_expert_layout_is_vllms(monkeypatch, tp, replicas):
    """Several vLLM replicas: every engine rank's share of each expert is what vLLM's own FusedMoE parallel
    config gives it (it flattens TP across DP), so rank (replica i, tp rank t) gets rows of m/(R*T)."""
    from vllm.model_executor.layers.fused_moe import config as fused_moe_config

    from modelspec import ColocatedMesh
    from rollout.layout import engine_expert_split

    mesh = ColocatedMesh(world_size=tp * replicas, rollout_tp=tp, rollout_experts_span_replicas=True)
    for rank in range(mesh.world_size):
        monkeypatch.setattr(fused_moe_config, "get_tensor_model_parallel_rank", lambda rank=rank: rank % tp)
        flat = fused_moe_config.FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp(tp, replicas, rank // tp, 1, 0)
        split = engine_expert_split(mesh, rank)
        assert (split.etp, split.etp_rank, split.ep) == (*flat, 1)


@pytest.mark.parametrize("tp,replicas", [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_expert_parallel_layout_is_vllms(monkeypatch, tp, replicas):
    """vLLM's enable_expert_parallel (rollout.ep = tp x replicas): each engine rank holds the whole experts vLLM's
    own FusedMoEParallelConfig.make and ExpertMapManager (determine_expert_map, the default placement) give it,
    renumbered from 0 in that order (the global -> local map FusedMoE.weight_loader applies)."""
    from types import SimpleNamespace

    import torch
    from vllm.config import ParallelConfig
    from vllm.model_executor.layers.fused_moe import config as fused_moe_config
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    from modelspec import ColocatedMesh, ModelShape
    from modelspec.tiny import tiny_hf_config
    from rollout.layout import engine_expert_split

    shape = ModelShape.from_hf_config(tiny_hf_config("qwen3_moe"))
    world = tp * replicas
    parallel = ParallelConfig(enable_expert_parallel=True)
    mesh = ColocatedMesh(world_size=world, rollout_tp=tp, rollout_ep=world, rollout_experts_span_replicas=True)
    for rank in range(world):
        monkeypatch.setattr(fused_moe_config, "get_tensor_model_parallel_rank", lambda rank=rank: rank % tp)
        monkeypatch.setattr(
            fused_moe_config, "get_dp_group", lambda rank=rank: SimpleNamespace(rank_in_group=rank // tp)
        )
        moe = fused_moe_config.FusedMoEParallelConfig.make(tp, 1, replicas, 1, parallel)
        experts = ExpertMapManager(
            max_num_batched_tokens=16,
            top_k=shape.moe_top_k,
            global_num_experts=shape.num_experts,
            num_redundant_experts=0,
            num_expert_group=None,
            moe_parallel_config=moe,
            placement_strategy=parallel.expert_placement_strategy,
            enable_eplb=False,
            num_fused_shared_experts=0,
            rocm_aiter_enabled=False,
        )
        split = engine_expert_split(mesh, rank)
        assert moe.use_ep and (moe.tp_size, moe.ep_size, moe.ep_rank) == (1, split.ep, split.ep_rank)
        assert (split.etp, split.etp_rank) == (1, 0)  # expert TP 1: whole rows
        held = list(split.experts(shape))
        expected = torch.full((shape.num_experts,), -1, dtype=torch.int32)
        expected[held] = torch.arange(len(held), dtype=torch.int32)
        assert experts.local_num_experts == len(held)
        assert torch.equal(experts.expert_map.cpu(), expected), (rank, experts.expert_map)


def test_engine_args_enable_vllms_expert_parallel(checkpoints):
    """rollout.ep > 1: the engine args carry enable_expert_parallel, a real EngineArgs field (it raises on any
    other), next to tensor / data parallel sizes whose product is rollout.ep; refused on CPU in one line."""
    from vllm.engine.arg_utils import EngineArgs

    from configs.rollout import RolloutConfig
    from modelspec import ColocatedMesh
    from rollout.vllm_engine import engine_args

    path = checkpoints["qwen3_moe"][0]
    for tp, world in [(1, 2), (2, 2), (2, 4)]:
        cfg = RolloutConfig(engine="vllm", tp=tp, ep=world, kv_cache_bytes=KV_MB << 20)
        mesh = ColocatedMesh(world_size=world, rollout_tp=tp, rollout_ep=world, rollout_experts_span_replicas=True)
        kwargs = engine_args(cfg, path, mesh, "cuda")
        assert kwargs["enable_expert_parallel"] is True
        assert kwargs["tensor_parallel_size"] * kwargs["data_parallel_size"] == world
        args = EngineArgs(**kwargs)
        assert args.enable_expert_parallel is True
        with pytest.raises(ValueError, match="vLLM's CPU build has no expert parallel") as info:
            engine_args(cfg, path, mesh, "cpu")
        assert "\n" not in str(info.value)
    cfg = RolloutConfig(engine="vllm", tp=2, kv_cache_bytes=KV_MB << 20)
    one = ColocatedMesh(world_size=2, rollout_tp=2, rollout_experts_span_replicas=True)
    assert "enable_expert_parallel" not in engine_args(cfg, path, one, "cpu")


def test_replicas_of_an_moe_model_are_refused_on_cpu_in_one_line(checkpoints):
    """vLLM's CPU build cannot run data-parallel MoE layers (its CPU communicator has no all_gatherv): refused
    before vLLM starts, naming why; one replica (rollout.tp = world) is fine."""
    from configs.rollout import RolloutConfig
    from modelspec import ColocatedMesh
    from rollout.vllm_engine import engine_args

    cfg = RolloutConfig(engine="vllm", tp=1, kv_cache_bytes=KV_MB << 20)
    path = checkpoints["qwen3_moe"][0]
    mesh = ColocatedMesh(world_size=2, rollout_tp=1, rollout_experts_span_replicas=True)
    with pytest.raises(ValueError, match="cannot run an MoE model as 2 engine replicas: vLLM's CPU build") as info:
        engine_args(cfg, path, mesh, "cpu")
    assert "\n" not in str(info.value)
    engine_args(cfg, path, mesh, "cuda")  # on GPU vLLM runs them
    one = ColocatedMesh(world_size=2, rollout_tp=2, rollout_experts_span_replicas=True)
    engine_args(RolloutConfig(engine="vllm", tp=2, kv_cache_bytes=KV_MB << 20), path, one, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_verify_sync_into_two_vllm_replicas_on_gpu(tiny_model_dirs, family):
    """GPU, 2 devices: actor EP 2 -> vLLM TP 1 x 2 replicas (experts split over both replicas' ranks)."""
    import json
    import subprocess
    import sys

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    cmd = [sys.executable, "-m", "tools.verify_sync", "--hf", tiny_model_dirs[family], "--train-ep", "2"]
    proc = subprocess.run([*cmd, "--engine", "vllm"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert out["max_abs_logprob_diff"] <= 1e-4 and out["max_abs_logprob_diff_fresh"] <= 1e-5
    assert out["verified"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_verify_sync_into_vllm_expert_parallel_on_gpu(tiny_model_dirs, family, rollout_tp):
    """GPU, 2 devices: actor EP 2 -> vLLM with enable_expert_parallel over both ranks (rollout.ep = 2; TP 1 x 2
    replicas or one TP 2 replica), each rank receiving 2 of the 4 experts whole."""
    import json
    import subprocess
    import sys

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    cmd = [sys.executable, "-m", "tools.verify_sync", "--hf", tiny_model_dirs[family], "--train-ep", "2"]
    cmd += ["--rollout-tp", str(rollout_tp), "--rollout-ep", "2", "--engine", "vllm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert out["max_abs_logprob_diff"] <= 1e-4 and out["max_abs_logprob_diff_fresh"] <= 1e-5
    assert out["verified"] is True
