"""Routing replay (R3): the native engine returns each token's routed experts; the actor's MoE layers route the
engine's tokens to those experts (megatron's RouterReplay) in every pass, and count where their own routing
differs; the run's config refuses replay where nothing can be replayed."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist import run_ranks
from tests.family_helpers import MOE_FAMILIES

PROMPTS = [[3, 17, 42, 5, 9], [11, 12, 13], [100, 7, 7, 7, 8, 1, 2]]


def hf_routing(model, tokens: list[int]) -> torch.Tensor:
    """transformers' top-k experts of every token: [num_moe_layers, len(tokens), k] (layers in model order)."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.view(len(tokens), -1).topk(k, dim=-1).indices for logits in out.router_logits])


def set_mismatch(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many [..., k] rows differ as sets."""
    return int((a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1).sum())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_native_engine_returns_the_routing_of_every_token_it_ran(tiny_model_dirs, family):
    from transformers import AutoModelForCausalLM

    from configs.rollout import RolloutConfig
    from rollout.engine import SamplingParams
    from rollout.native import NativeEngine

    path = tiny_model_dirs[family]
    engine = NativeEngine(RolloutConfig(cpu_capacity_gb=0.25, activation_reserve_mb=16, max_num_seqs=4), path)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=7, return_routed_experts=True)
    results = engine.generate(PROMPTS, params)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    shape = engine.shape
    for prompt, samples in zip(PROMPTS, results):
        for c in samples:
            ran = prompt + c.token_ids[:-1]  # the prompt and every sampled token but the last
            assert c.routed_experts.shape == (len(shape.moe_layers), len(ran), shape.moe_top_k)
            assert set_mismatch(c.routed_experts.long(), hf_routing(model, ran)) == 0
    # without the flag nothing is recorded
    assert all(c.routed_experts is None for s in engine.generate(PROMPTS, SamplingParams(max_tokens=3)) for c in s)


def test_native_engine_refuses_routing_of_a_dense_model(tiny_model_dirs):
    from configs.rollout import RolloutConfig
    from rollout.engine import SamplingParams
    from rollout.native import NativeEngine

    engine = NativeEngine(RolloutConfig(cpu_capacity_gb=0.25, activation_reserve_mb=16), tiny_model_dirs["qwen3"])
    with pytest.raises(ValueError, match="no MoE layers"):
        engine.generate(PROMPTS, SamplingParams(max_tokens=2, return_routed_experts=True))


def test_count_mismatch_counts_response_tokens_by_set():
    from megatron_backend.routing_replay import count_mismatch

    own = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]])
    engine = torch.tensor([[1, 0], [2, 1], [3, 2], [-1, -1], [0, 2]])
    counted = torch.tensor([True, True, False, True, True])
    # row 0: same set in another order; row 1 differs; row 2 differs but is not a response token; row 3 was not
    # routed by the engine; row 4 equal: 1 of 3 compared
    assert count_mismatch(own, engine, counted).tolist() == [1.0, 3.0]


def test_partial_router_replay_follows_the_target_and_routes_the_rest():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron_backend.routing_replay import PartialRouterReplay

    before = list(RouterReplay.global_router_replay_instances)
    replay = PartialRouterReplay()
    RouterReplay.global_router_replay_instances.remove(replay)
    assert RouterReplay.global_router_replay_instances == before
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.3, 0.2, 0.1]])
    replay.set_target_indices(torch.tensor([[3, 2], [-1, -1]]))
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, idx = replay.get_replay_topk(scores, 2, default_compute_topk=lambda s, k, **_: torch.topk(s, k, dim=1))
    assert idx.tolist() == [[3, 2], [0, 1]]  # row 0 replayed, row 1 (not routed by the engine) its own top-k
    assert torch.equal(probs, scores.gather(1, idx))
    assert replay.get_recorded_indices().tolist() == [[1, 2], [0, 1]]  # the actor's own choice, for comparison


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_micro_batch_carries_the_routing_in_the_routers_token_order(packed):
    from megatron_backend.packing import build_micro_batch, sequence_lengths
    from modelspec import TokenBatch

    lens = torch.tensor([5, 3])
    routed = torch.arange(2 * 5 * 1 * 2).view(2, 5, 1, 2)  # [B, S, layers, k]: distinct values per token
    loss_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]], dtype=torch.float32)
    batch = TokenBatch(input_ids=torch.ones(2, 5, dtype=torch.long), seq_lens=lens, loss_mask=loss_mask)
    batch.routed_experts = routed
    mb = build_micro_batch(batch, [0, 1], sequence_lengths(batch), packed, torch.device("cpu"), response_only=True)
    if packed:  # [T]: row 0's 5 tokens then row 1's 3
        expected = torch.cat([routed[0], routed[1, :3]])
        counted = [0, 0, 1, 1, 0, 0, 1, 0]
    else:  # megatron's [S, b]: token s of row j at s * b + j
        expected = routed.transpose(0, 1).flatten(0, 1)
        counted = [0, 0, 0, 1, 1, 0, 1, 0, 0, 0]
    assert torch.equal(mb.routed_experts, expected)
    assert mb.routing_counted.int().tolist() == counted


def _replay_ranks(rank: int, world_size: int, hf_dir: str, tp: int, ep: int) -> dict:
    """Actor at TP x EP (TP 2: sequence parallel, each TP rank routing its share of the tokens): the engine's routing (transformers' top-k of the same weights) recorded; passes without
    and with replay before and after perturbing the routers; each pass's routing as the routers applied it."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from transformers import AutoModelForCausalLM

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.packing import build_micro_batch, sequence_lengths
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import TokenBatch
    from rl.advantages import grpo_advantages
    from rl.losses import PolicyLoss, PolicyLossConfig

    dims = initialize_model_parallel(tp=tp, pp=1, ep=ep)
    actor = Actor(hf_dir, ActorConfig(tp=tp, ep=ep, micro_batch_size=4, lr=1e-3), dims)
    gen = torch.Generator().manual_seed(1 + dims.dp_rank)  # each DP (and EP) rank its own share
    lens = torch.tensor([12, 10, 11, 8])  # 41 tokens: one pad token at TP 2
    input_ids = torch.randint(0, actor.shape.vocab_size, (4, 12), generator=gen)
    loss_mask = (torch.arange(11)[None] >= 4) & (torch.arange(11)[None] < lens[:, None] - 1)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k, num_layers = actor.shape.moe_top_k, len(actor.shape.moe_layers)
    routed = torch.full((4, 12, num_layers, k), -1, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        routed[i, : n - 1] = hf_routing(hf, input_ids[i, : n - 1].tolist()).permute(1, 0, 2)
    routed[0, :3] = -1  # tokens the engine did not route: they route as the actor does
    batch = TokenBatch(input_ids=input_ids, seq_lens=lens, loss_mask=loss_mask.float())
    batch.routed_experts = routed
    batch.advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), group_size=2)
    mb = build_micro_batch(batch, [0, 1, 2, 3], sequence_lengths(batch), True, dims.device, True, pad_to=tp)
    share = mb.routed_experts.shape[0] // tp  # the tokens this TP rank's routers see (all at TP 1)
    mb.routed_experts = mb.routed_experts[dims.tp_rank * share : (dims.tp_rank + 1) * share]
    mb.routing_counted = mb.routing_counted[dims.tp_rank * share : (dims.tp_rank + 1) * share]

    routers = [m for m in actor.chunks[0].modules() if isinstance(m, TopKRouter)]
    applied: list[torch.Tensor] = []  # per router call: its routing map [N, E]
    for router in routers:
        router.register_forward_hook(lambda _m, _i, out: applied.append(out[1].detach().clone()))

    def routing_of_last_pass() -> torch.Tensor:
        """[N, layers, E] bool: the routing the last forward applied, per MoE layer."""
        maps = torch.stack(applied[-num_layers:], dim=1)
        applied.clear()
        return maps

    out = {"engine": torch.zeros(mb.routed_experts.shape[0], num_layers, actor.shape.num_experts, dtype=torch.bool)}
    out["engine"].scatter_(2, mb.routed_experts.long().clamp(min=0), True)
    out["engine_routed"] = (mb.routed_experts >= 0).all(dim=-1).all(dim=-1)  # [N]
    out["first_tokens"] = slice(0, 3) if dims.tp_rank == 0 else slice(0, 0)  # row 0's unrouted first 3 tokens
    out["counted"] = mb.routing_counted
    out["logprobs_same_weights"] = actor.compute_logprobs(batch, response_only=True)
    out["mismatch_same_weights"] = actor.take_routing_mismatch()
    out["own_same_weights"] = routing_of_last_pass()
    with torch.no_grad():  # the same perturbation on every rank: the router is replicated over TP and EP
        noise = torch.Generator().manual_seed(99)
        for router in routers:
            router.weight.add_(0.5 * torch.randn(router.weight.shape, generator=noise))
    out["logprobs_perturbed"] = actor.compute_logprobs(batch, response_only=True)
    out["mismatch_perturbed"] = actor.take_routing_mismatch()
    out["own_perturbed"] = routing_of_last_pass()
    out["logprobs_replayed"] = actor.compute_logprobs(batch, response_only=True, replay_routing=True)
    out["replayed"] = routing_of_last_pass()
    batch.old_logprobs = out["logprobs_replayed"]
    loss = PolicyLoss(PolicyLossConfig(clip_eps_low=0.5, clip_eps_high=0.5))
    out["train_metrics"] = actor.train_step(batch, loss, replay_routing=True)
    out["trained_replayed"] = routing_of_last_pass()
    actor.train_step(batch, loss)
    out["trained_own"] = routing_of_last_pass()
    mine = {id(r.router_replay) for r in routers}
    out["actions_after"] = [r.router_replay.router_replay_action for r in routers]
    out["targets_after"] = [r.router_replay.target_topk_idx for r in routers]
    out["in_global_list"] = any(id(i) in mine for i in RouterReplay.global_router_replay_instances)
    with pytest.raises(ValueError, match="no routed_experts"):
        actor.compute_logprobs(TokenBatch(input_ids=input_ids), replay_routing=True)
    return out


@pytest.mark.numeric
@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 1)], ids=["ep2", "tp2_sequence_parallel"])
def test_actor_replays_the_engines_routing(tiny_model_dirs, tp, ep):
    for out in run_ranks(_replay_ranks, 2, tiny_model_dirs["qwen3_moe"], tp, ep, timeout_s=900):
        engine, routed, counted, first = out["engine"], out["engine_routed"], out["counted"], out["first_tokens"]
        # same weights: the actor routes as transformers does; its log-probs are what replay must reproduce
        assert out["mismatch_same_weights"] == 0.0
        assert torch.equal(out["own_same_weights"][routed], engine[routed])
        # perturbed routers: without replay the actor routes elsewhere on a good share of the response tokens
        assert out["mismatch_perturbed"] > 0.05
        assert not torch.equal(out["own_perturbed"][routed], engine[routed])
        assert (out["logprobs_perturbed"] - out["logprobs_same_weights"]).abs().max() > 1e-3
        # with replay every engine-routed token goes to the engine's experts, forward and train alike; the
        # tokens the engine did not route go where the actor's own router sends them (row 0's first 3, packed
        # first: their context is unrouted too, so exactly as without replay)
        assert not routed[first].any()
        for key in ("replayed", "trained_replayed"):
            assert torch.equal(out[key][routed], engine[routed]), key
            assert torch.equal(out[key][first], out["own_perturbed"][first]), key
        assert not torch.equal(out["trained_own"][routed & counted], engine[routed & counted])
        # nothing of the actor's replay state outlives a pass or sits in megatron's process-global list
        assert out["actions_after"] == [None] * len(out["actions_after"]) and not out["in_global_list"]
        assert all(t is None for t in out["targets_after"])


def test_routing_replay_config_is_refused_in_one_line():
    from configs.actor import ActorConfig
    from configs.rollout import RolloutConfig
    from rl.losses import PolicyLossConfig
    from run.config import ModelConfig, RunConfig, TrainerConfig
    from run.launch import ClusterConfig

    def run_config(
        path: str, engine: str, replay: bool = True, capacity_factor: float | None = None, gap: float | None = 3.0
    ) -> RunConfig:
        return RunConfig(
            model=ModelConfig(path=path),
            trainer=TrainerConfig(max_logprob_gap=gap, max_logprob_gap_p99=gap),
            actor=ActorConfig(moe_expert_capacity_factor=capacity_factor),
            rollout=RolloutConfig(engine=engine),
            algorithm=PolicyLossConfig(routing_replay=replay),
            cluster=ClusterConfig(num_nodes=1, procs_per_node=1),
        )

    with pytest.raises(ValueError, match=r"^algorithm.routing_replay=true but tiny:qwen3 has no MoE layers"):
        run_config("tiny:qwen3", "native")
    with pytest.raises(ValueError, match=r"^algorithm.routing_replay=true but rollout.engine=vllm cannot return"):
        run_config("tiny:qwen3_moe", "vllm")
    assert run_config("tiny:qwen3_moe", "native").returns_routed_experts
    # megatron's capacity factor drops routed copies: not with replayed routing, and not on a dense model
    with pytest.raises(ValueError, match=r"^algorithm.routing_replay=true with actor.moe_expert_capacity_factor=1.0"):
        run_config("tiny:qwen3_moe", "native", capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"^actor.moe_expert_capacity_factor=1.0 but tiny:qwen3 has no MoE layers"):
        run_config("tiny:qwen3", "native", replay=False, capacity_factor=1.0)
    assert run_config("tiny:qwen3_moe", "native", replay=False, capacity_factor=1.0).actor.moe_expert_capacity_factor
    # its dropped copies move the actor's log-probs off the engine's: only the gap's warning reacts (defect 9), so
    # the thresholds are not required
    assert (
        run_config("tiny:qwen3_moe", "native", replay=False, capacity_factor=1.0, gap=None).trainer.max_logprob_gap
        is None
    )
    with pytest.raises(ValueError, match=r"^actor.moe_expert_capacity_factor=0 must be > 0"):
        ActorConfig(moe_expert_capacity_factor=0)


@pytest.mark.vllm
def test_vllm_cpu_build_refuses_routed_experts_in_one_line(tiny_model_dirs):
    from configs.rollout import RolloutConfig
    from rollout.vllm_engine import VllmEngine

    cfg = RolloutConfig(engine="vllm", kv_cache_bytes=16 << 20, max_model_len=128)
    launcher_keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    launcher_before = {key: os.environ.get(key) for key in launcher_keys}
    with pytest.raises(
        ValueError, match=r"^enable_return_routed_experts: vLLM cannot return routed experts on vLLM's CPU"
    ):
        VllmEngine(cfg, tiny_model_dirs["qwen3_moe"], dtype="float32", enable_return_routed_experts=True)
    # refused before the launcher's variables are set: later runs spawned from this process inherit them
    assert {key: os.environ.get(key) for key in launcher_keys} == launcher_before


@pytest.mark.vllm
def test_vllm_engine_args_carry_return_routed_experts(tiny_model_dirs):
    """The flag reaches vLLM's own EngineArgs (its real dataclass) and its aux-output config."""
    from vllm.engine.arg_utils import EngineArgs

    from configs.rollout import RolloutConfig
    from modelspec import ColocatedMesh
    from rollout.vllm_engine import engine_args

    cfg = RolloutConfig(engine="vllm", kv_cache_bytes=16 << 20, max_model_len=128)
    mesh = ColocatedMesh(world_size=1, rollout_tp=1)
    kwargs = engine_args(cfg, tiny_model_dirs["qwen3_moe"], mesh, "cuda", enable_return_routed_experts=True)
    args = EngineArgs(**kwargs)
    assert args.enable_prefix_caching and args.aux_output_config.enable_return_routed_experts


@pytest.mark.vllm
def test_vllm_routed_experts_become_layers_first():
    """vLLM's own CompletionOutput (its real fields) -> Completion.routed_experts [layers, tokens, k]."""
    import numpy as np
    from vllm.outputs import CompletionOutput

    from rollout.vllm_engine import routed_experts_of

    rows = np.arange(6 * 3 * 2, dtype=np.int32).reshape(6, 3, 2)  # prompt 4 + 3 sampled - 1 = 6 tokens
    out = CompletionOutput(
        index=0, text="", token_ids=[5, 6, 7], cumulative_logprob=None, logprobs=None, routed_experts=rows
    )
    routed = routed_experts_of(out, prompt_len=4, moe_layers=(0, 1, 2))
    assert routed.shape == (3, 6, 2) and routed.dtype == torch.int16
    assert torch.equal(routed.permute(1, 0, 2).long(), torch.from_numpy(rows).long())
    with pytest.raises(RuntimeError, match="for 5 tokens"):
        routed_experts_of(out, prompt_len=3, moe_layers=(0, 1, 2))


def _vllm_gpu_routing(rank: int, world_size: int, hf_dir: str) -> list:
    import torch.distributed as dist

    from configs.rollout import RolloutConfig
    from modelspec import ColocatedMesh
    from rollout.engine import SamplingParams
    from rollout.vllm_engine import VllmEngine

    dist.init_process_group("gloo")
    cfg = RolloutConfig(engine="vllm", kv_cache_bytes=64 << 20, max_model_len=128)
    mesh = ColocatedMesh(world_size=1, rollout_tp=1)
    engine = VllmEngine(cfg, hf_dir, mesh, rank, dtype="float32", enable_return_routed_experts=True)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=7, return_routed_experts=True)
    results = engine.generate(PROMPTS, params)
    engine.shutdown()
    return [[(c.token_ids, c.routed_experts) for c in samples] for samples in results]


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_gpu_returns_the_routing_of_every_token_it_ran(tiny_model_dirs):
    """vLLM on CUDA (Model Runner V2, prefix caching): the same contract as the native engine's."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs["qwen3_moe"]
    (results,) = run_ranks(_vllm_gpu_routing, 1, path, timeout_s=900)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, samples in zip(PROMPTS, results):
        for token_ids, routed in samples:
            ran = prompt + token_ids[:-1]
            assert routed.shape[1] == len(ran)
            assert set_mismatch(routed.long(), hf_routing(model, ran)) == 0


def _perturbed_engine_ranks(rank: int, world_size: int, hf_dir: str, noise_std: float) -> dict:
    """A native engine whose routers are perturbed (an engine that routes otherwise than the actor, as a
    lower-precision or stale engine would) samples; the actor (EP=2) scores the samples with and without replay."""
    from configs.actor import ActorConfig
    from configs.rollout import RolloutConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.batching import Sample, make_batch
    from rollout.engine import SamplingParams
    from rollout.native import NativeEngine

    dims = initialize_model_parallel(tp=1, pp=1, ep=2)
    actor = Actor(hf_dir, ActorConfig(ep=2, micro_batch_size=8), dims, train=False)
    engine = NativeEngine(RolloutConfig(cpu_capacity_gb=0.25, activation_reserve_mb=16, max_num_seqs=32), hf_dir)
    noise = torch.Generator().manual_seed(5)
    params = engine.begin_weight_update()
    for name in sorted(params):
        if name.endswith(".gate.weight") and params[name].dim() == 2:  # the MoE routers [E, h]
            params[name].add_(noise_std * torch.randn(params[name].shape, generator=noise))
    engine.finish_weight_update()
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, actor.shape.vocab_size, (6,), generator=gen).tolist() for _ in range(8)]
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True, return_routed_experts=True)
    samples = [
        Sample(i, prompts[i], c.token_ids, c.logprobs, c.finish_reason, 0.0, c.routed_experts)
        for i, per_prompt in enumerate(engine.generate(prompts, sampling))
        for c in per_prompt
    ]
    batch, _ = make_batch(samples, group_size=2, dp=dims.dp, dp_rank=dims.dp_rank, pad_id=0, device=dims.device)
    mask = batch.loss_mask > 0
    out = {}
    for replay in (False, True):
        logprobs = actor.compute_logprobs(batch, response_only=True, replay_routing=replay)
        gap = (logprobs - batch.engine_logprobs).abs()[mask]
        out[replay] = (float(gap.max()), float(gap.mean()))
    out["mismatch"] = actor.take_routing_mismatch()
    return out


@pytest.mark.parametrize("noise_std", [0.2])
def test_replay_narrows_the_gap_to_an_engine_that_routes_otherwise(tiny_model_dirs, noise_std):
    for out in run_ranks(_perturbed_engine_ranks, 2, tiny_model_dirs["qwen3_moe"], noise_std, timeout_s=900):
        print(
            f"router noise {noise_std}: mismatch {out['mismatch']:.3f}, gap max/mean without replay "
            f"{out[False][0]:.3g}/{out[False][1]:.3g}, with {out[True][0]:.3g}/{out[True][1]:.3g}"
        )
        assert out["mismatch"] > 0.01
        assert out[True][1] < out[False][1]


def test_vllm_routed_experts_keep_the_rows_of_the_moe_layers(monkeypatch):
    """vLLM 0.32's buffer, built by its own RoutedExpertsCapturer (model_executor/layers/fused_moe/
    routed_experts_capturer.py): one row per decoder layer (``get_total_num_hidden_layers``), each MoE layer writing
    at its decoder index (``MoERunner.layer_id``: ``extract_layer_index`` of its name), a dense layer's row left zero.
    routed_experts_of keeps the MoE layers' rows in order, as rl/batching.py and ActorRouting index them. (vLLM's CPU
    build cannot return routed experts: the capturer runs here on CPU tensors, outside a model.)"""
    capturer_module = pytest.importorskip("vllm.model_executor.layers.fused_moe.routed_experts_capturer")
    from types import SimpleNamespace

    from modelspec import ModelShape
    from modelspec.tiny import tiny_hf_config
    from rollout.vllm_engine import routed_experts_of

    config = tiny_hf_config("qwen3_moe")
    shape = ModelShape.from_hf_config(config)
    assert shape.moe_layers == (0, 1, 3)  # layer 2 is dense (mlp_only_layers)
    model_config = SimpleNamespace(  # vLLM's ModelConfig answers these from the same config.json fields
        get_total_num_hidden_layers=lambda: config.num_hidden_layers,
        get_num_experts=lambda: config.num_experts,
        get_num_experts_per_tok=lambda: config.num_experts_per_tok,
        hf_text_config=config,
    )
    parallel_config = SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1)
    vllm_config = SimpleNamespace(model_config=model_config, parallel_config=parallel_config)
    capturer = capturer_module.RoutedExpertsCapturer(16, vllm_config)
    monkeypatch.setattr(capturer_module, "get_forward_context", lambda: SimpleNamespace(dp_metadata=None))
    prompt, sampled = [5, 6, 7], [8, 9, 10]
    tokens = len(prompt) + len(sampled) - 1
    gen = torch.Generator().manual_seed(0)
    k = config.num_experts_per_tok
    routed = {
        layer: torch.stack([torch.randperm(config.num_experts, generator=gen)[:k] for _ in range(tokens)])
        for layer in shape.moe_layers
    }
    for layer, experts in routed.items():  # what each MoE layer's router hook does in a forward
        capturer.capture(layer, experts)
    out = SimpleNamespace(routed_experts=capturer.snapshot_routing_data(tokens).numpy(), token_ids=sampled)
    got = routed_experts_of(out, len(prompt), shape.moe_layers)
    assert torch.equal(got.long(), torch.stack([routed[layer] for layer in shape.moe_layers]))
