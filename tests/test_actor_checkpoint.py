"""The actor's distributed checkpoint (megatron-core dist_checkpointing, torch_dist) on CPU gloo ranks.

Params and Adam moments saved at one layout load at another (TP=2 -> TP=1, PP=2 -> PP=1, VPP on the
way): the next training step from the loaded state equals the next step of the run that never stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelspec import TokenBatch
from tests.dist import run_ranks
from tests.numeric import assert_close_across_layouts, ulp_tolerance

NUM_SEQS, SEQ_LEN, PROMPT_LEN = 4, 12, 6


def _batch(vocab_size: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (NUM_SEQS, SEQ_LEN), generator=gen)
    loss_mask = torch.zeros(NUM_SEQS, SEQ_LEN - 1)
    loss_mask[:, PROMPT_LEN - 1 :] = 1.0
    return TokenBatch(input_ids=input_ids, loss_mask=loss_mask)


def _clear_moments(optimizer) -> None:
    stack = [optimizer]  # megatron: ChainedOptimizer -> MegatronOptimizer -> torch optimizer
    while stack:
        opt = stack.pop()
        if hasattr(opt, "chained_optimizers"):
            stack.extend(opt.chained_optimizers)
        else:
            (opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer).state.clear()


def _save_then_load_elsewhere(rank, world_size, hf_dir, ckpt_dir, save_layout, load_layout, dtype="float32"):
    """Train 2 steps at ``save_layout``, save, train 1 more (the reference); load at ``load_layout``,
    train the same step; also that step from a fresh optimizer (which must differ)."""
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.advantages import grpo_advantages
    from rl.losses import PolicyLoss, PolicyLossConfig

    loss_fn = PolicyLoss(PolicyLossConfig(clip_eps_low=0.5, clip_eps_high=0.5, loss_agg="token-mean"))

    def build(layout):
        tp, pp, vpp, ep = (*layout, 1)[:4]  # (tp, pp, vpp[, ep])
        dims = initialize_model_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep)
        # an MoE model trains with its router's aux and z losses
        config = ActorConfig(
            tp=tp, pp=pp, vpp=vpp, ep=ep, micro_batch_size=1 if vpp else 2, lr=1e-3, moe_aux_loss_coef=1e-2
        )
        return Actor(hf_dir, config, dims, dtype=dtype)

    def step(actor):
        batch = _batch(actor.shape.vocab_size)
        batch.old_logprobs = actor.compute_logprobs(batch)
        batch.advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), group_size=2)
        return actor.train_step(batch, loss_fn)

    actor = build(save_layout)
    step(actor)
    step(actor)
    saved = actor.export_hf(dst=0)
    actor.save_checkpoint(ckpt_dir)
    reference = step(actor)
    reference_state = actor.export_hf(dst=0)

    fresh = build(load_layout)  # starts from the HF weights: loading must replace them
    fresh.load_checkpoint(ckpt_dir)
    loaded = fresh.export_hf(dst=0)
    resumed = step(fresh)
    resumed_state = fresh.export_hf(dst=0)

    no_moments = build(load_layout)
    no_moments.load_checkpoint(ckpt_dir)
    _clear_moments(no_moments.optimizer)  # same params, Adam restarted: what losing the optimizer state costs
    step(no_moments)
    restarted_state = no_moments.export_hf(dst=0)
    if rank != 0:
        return None
    return dict(
        saved=saved,
        loaded=loaded,
        reference=reference,
        resumed=resumed,
        reference_state=reference_state,
        resumed_state=resumed_state,
        restarted_state=restarted_state,
    )


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


# Another layout sums the third step's gradients in another order (last bits). Adam then divides by
# sqrt(v): an element whose gradient nearly cancels turns that into a larger share of its step (measured:
# 31 ulps of the tensor's largest weight on a k_proj bias, 1.37e-6 on another CPU). 256 ulps of each
# tensor's scale (~7e-6 at 0.22) stays 200x under what losing Adam's moments moves weights by (~lr = 1e-3).
ADAM_RESUME_ULPS = 256


def _check(result: dict, same_layout: bool) -> None:
    assert _max_diff(result["saved"], result["loaded"]) == 0.0  # params: bit-exact through any layout
    for key in ("loss", "grad_norm"):
        if same_layout:
            assert result["resumed"][key] == result["reference"][key], key
        else:  # the loss is a mean of ratio x advantage terms with |advantage| <= 1: terms of scale 1
            scale = max(1.0, abs(result["reference"][key]))
            assert_close_across_layouts(result["resumed"][key], result["reference"][key], key, scale=scale)
    restarted_diff = _max_diff(result["restarted_state"], result["reference_state"])
    # lr 1e-3: losing Adam's moments moves weights by ~1e-3; the resumed moments keep them within float noise
    assert restarted_diff > 10 * ulp_tolerance(1.0, ulps=ADAM_RESUME_ULPS), restarted_diff
    if same_layout:
        assert _max_diff(result["resumed_state"], result["reference_state"]) == 0.0
    else:
        assert_close_across_layouts(
            result["resumed_state"], result["reference_state"], "resumed weight", ulps=ADAM_RESUME_ULPS
        )


SCENARIOS = {  # name -> (family, save layout (tp, pp, vpp), load layout)
    "tp2_same": ("qwen2", (2, 1, None), (2, 1, None)),
    # TP=2 -> TP=1 (then DP=2): the vocab padding differs (256 vs 128 rows) and is cut on load
    "tp2_to_tp1": ("qwen2", (2, 1, None), (1, 1, None)),
    # Llama has tied embeddings: at PP=2 the last stage's output layer is a copy of the first's embedding
    "pp2vpp2_to_pp1": ("llama", (1, 2, 2), (1, 1, None)),
    # DP=2 (megatron's DistributedOptimizer) -> TP=2, DP=1 (its FP32Optimizer): the one model-space format
    "dp2_to_tp2": ("qwen2", (1, 1, None), (2, 1, None)),
}


MOE_SCENARIOS = {  # (family, save layout (tp, pp, vpp, ep), load layout)
    # each EP rank writes its own experts (megatron's expert-sharded ShardedTensors)
    "qwen3_moe_ep2_same": ("qwen3_moe", (1, 1, None, 2), (1, 1, None, 2)),
    # EP=2 -> EP=1 (each rank all experts, DP=2): the experts reshard on load
    "mixtral_ep2_to_ep1": ("mixtral", (1, 1, None, 2), (1, 1, None, 1)),
}


def _all_scenarios(rank, world_size, model_dirs, root, scenarios):
    return {
        name: _save_then_load_elsewhere(rank, world_size, model_dirs[family], f"{root}/{name}", save, load)
        for name, (family, save, load) in scenarios.items()
    }


@pytest.mark.numeric
def test_checkpoint_reloads_bit_exact_and_reshards_tp_and_pp(tiny_model_dirs, tmp_path):
    results = run_ranks(_all_scenarios, 2, tiny_model_dirs, str(tmp_path), SCENARIOS)[0]
    for name, result in results.items():
        _check(result, same_layout=name.endswith("_same"))


@pytest.mark.numeric
def test_moe_checkpoint_at_ep2_reloads_bit_exact_and_reshards_experts(tiny_model_dirs, tmp_path):
    results = run_ranks(_all_scenarios, 2, tiny_model_dirs, str(tmp_path), MOE_SCENARIOS)[0]
    for name, result in results.items():
        assert "moe/load_balancing_loss" in result["reference"], result["reference"]
        _check(result, same_layout=name.endswith("_same"))


@pytest.mark.gpu
def test_megatron_optimizer_checkpoint_round_trip(tiny_model_dirs, tmp_path):
    """CUDA: megatron-core's optimizer with TE's FusedAdam (step per group) through the same save/load, in bf16:
    TE before 2.12 has no attention backend for float32 packed sequences (run/preflight.py refuses it)."""
    hf_dir, ckpt_dir = tiny_model_dirs["qwen2"], str(tmp_path / "gpu")
    result = run_ranks(_save_then_load_elsewhere, 1, hf_dir, ckpt_dir, (1, 1, None), (1, 1, None), "bfloat16")[0]
    result = {
        k: ({n: t.cpu() for n, t in v.items()} if k.endswith(("state", "saved", "loaded")) else v)
        for k, v in result.items()
    }
    _check(result, same_layout=True)


def _old_torch_adamw_checkpoint(actor, directory: str, step: float) -> None:
    """A checkpoint as the torch AdamW path CPU runs used before megatron's optimizer wrote it (its code, kept
    here as the format's definition): AdamW over the model params, moments as ShardedTensors of each param
    (megatron's ``optim_state_to_sharding_state``), ``common_step`` once, the groups in the common part."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    from megatron_backend.dist_checkpoint import _in_process_results_queue, model_sharded_state_dict

    Path(directory).mkdir(parents=True, exist_ok=True)
    _in_process_results_queue()
    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW([{"params": params, "weight_decay": 0.0}], lr=1e-3)
    gen = torch.Generator().manual_seed(7)
    for p in params:  # moments of a run that trained: nonzero, the same on every rank holding the param
        optimizer.state[p] = {
            "step": torch.tensor(step),
            "exp_avg": torch.randn(p.shape, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(p.shape, generator=gen) * 1e-6,
        }
    model_sd = model_sharded_state_dict(actor.chunks)
    state = optimizer.state_dict()
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_sd, params), exclude_keys=("step",))
    state["state"]["common_step"] = torch.tensor(step)
    dist_checkpointing.save({"model": model_sd, "optimizer": state}, directory)


def _resume_old_format(rank, world_size, hf_dir, root):
    """Write the old format at TP=2 (DP=1); load it at TP=2 (FP32Optimizer) and TP=1 x DP=2
    (DistributedOptimizer), save again in today's format: rank 0 returns both checkpoints' full tensors."""
    from megatron.core import dist_checkpointing

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel

    old_dir = f"{root}/old"
    dims = initialize_model_parallel(tp=2, pp=1)
    _old_torch_adamw_checkpoint(Actor(hf_dir, ActorConfig(tp=2), dims, train=False), old_dir, step=3.0)
    out = {}
    for tp in (2, 1):
        dims = initialize_model_parallel(tp=tp, pp=1)
        actor = Actor(hf_dir, ActorConfig(tp=tp, lr=1e-3), dims)
        actor.load_checkpoint(old_dir)
        actor.save_checkpoint(f"{root}/tp{tp}")
        out[actor.optimizer_name] = f"{root}/tp{tp}"
    plain = {name: dist_checkpointing.load_plain_tensors(d) for name, d in out.items()}  # collective
    common = {name: dist_checkpointing.load_common_state_dict(d) for name, d in out.items()}
    old = dist_checkpointing.load_plain_tensors(old_dir)
    if rank != 0:
        return None
    return dict(
        old=old,
        new=plain,
        steps={name: float(c["optimizer"]["state"]["common_step"]) for name, c in common.items()},
    )


def test_a_torch_adamw_checkpoint_resumes_with_its_moments_in_megatrons_optimizer(tiny_model_dirs, tmp_path):
    result = run_ranks(_resume_old_format, 2, tiny_model_dirs["qwen2"], str(tmp_path))[0]
    old = {k: v for k, v in result["old"].items() if k.startswith("optimizer.state.exp_avg")}
    assert len(old) > 10 and all(v.abs().max() > 0 for v in old.values())
    assert set(result["new"]) == {"megatron-core FP32Optimizer", "megatron-core DistributedOptimizer"}
    for name, tensors in result["new"].items():
        assert result["steps"][name] == 3.0, name
        new = {k: v for k, v in tensors.items() if k.startswith("optimizer.state.exp_avg")}
        assert set(new) == set(old), name
        for k in old:  # carried over bit for bit (vocab-padded rows: as many as TP pads to, cut on load)
            rows = min(len(old[k]), len(new[k]))
            assert torch.equal(new[k][:rows], old[k][:rows]), (name, k)


class _FusedAdamSteps:
    """The step count of TE's FusedAdam before 2.19 (transformer_engine/pytorch/optimizers/fused_adam.py, ``step``:
    ``if len(group["params"]) == 0: continue`` before ``group["step"] += 1``; 2.19 advances empty groups too, TE
    commit 734ce31): one ``step`` per param group, an empty group's left behind."""

    def __init__(self, param_groups):
        self.param_groups, self.state = param_groups, {}

    def step(self):
        for group in self.param_groups:
            if group["params"]:
                group["step"] = group.get("step", 0) + 1


def _steps_after_resume_with_an_empty_group(rank, world_size, hf_dir):
    """DP=2 (megatron's DistributedOptimizer): a rank whose shard lies inside the embedding has
    an empty param group (no norm or bias in it); the resumed step count is set, one step taken, the count read."""
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.dist_checkpoint import _common_step, _inner_optimizers, _set_common_step
    from megatron_backend.parallel import initialize_model_parallel

    actor = Actor(hf_dir, ActorConfig(micro_batch_size=1), initialize_model_parallel(tp=1, pp=1))
    empty = [not g["params"] for opt in _inner_optimizers(actor) for g in opt.optimizer.param_groups]
    for opt in _inner_optimizers(actor):
        opt.optimizer = _FusedAdamSteps(opt.optimizer.param_groups)
    _set_common_step(actor, 3.0)
    for opt in _inner_optimizers(actor):
        opt.optimizer.step()
    return any(empty), _common_step(actor)


def test_resumed_step_count_skips_empty_param_groups(tmp_path):
    """dist_checkpoint sets and reads the step as megatron's ChainedOptimizer._synchronize_steps does (groups with
    params only): an empty group's step is never compared, so the save after a resume does not refuse."""
    from modelspec.tiny import write_tiny_model

    # the (tied) embedding, 16384 x 128, outweighs the two layers: one DP rank's half lies inside it
    hf_dir = write_tiny_model(
        "qwen2", tmp_path / "big_vocab", vocab_size=16384, num_hidden_layers=2, tie_word_embeddings=True
    )
    results = run_ranks(_steps_after_resume_with_an_empty_group, 2, str(hf_dir))
    assert any(empty for empty, _ in results), results  # the case this test is for
    assert [step for _, step in results] == [4.0, 4.0]


class _NoStream:  # the CUDA streams and events HybridDeviceOptimizer asks for (hybrid_optimizer.py)
    def wait_stream(self, stream):
        pass

    def record_event(self):
        return self

    def wait(self, stream):
        pass

    def synchronize(self):
        pass


def _hybrid_optimizer_steps(rank, world_size):
    """megatron's HybridDeviceOptimizer built on CPU params (its host sub-optimizers: torch AdamW, one per param);
    a step as HDO.step ends it (each sub-optimizer steps, then _sync_sub_optimizers_state_to_hdo): HDO.step itself
    copies device grads to host and cannot run without CUDA."""
    import contextlib
    from types import SimpleNamespace

    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megatron_backend.dist_checkpoint import _common_step, _set_common_step

    torch.cuda.current_stream, torch.cuda.Stream = (lambda device=None: _NoStream()), _NoStream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    hdo = HybridDeviceOptimizer(
        params, cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True
    )
    hdo.cpu_copys_map_gpu_param.update({p: p for p in params})  # each host param is its own device copy here

    def step():
        for p in params:
            p.grad = torch.randn_like(p)
        for sub in hdo.sub_optimizers:
            sub.step()
        hdo._sync_sub_optimizers_state_to_hdo()

    actor = SimpleNamespace(optimizer=SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=hdo)]))
    step()
    _set_common_step(actor, 5.0)  # as a resume does
    step()
    return _common_step(actor)


def test_a_hybrid_optimizers_step_count_is_its_sub_optimizers(tmp_path):
    """actor.optimizer_offload_fraction > 0: the step a resume sets reaches the Adams that step (the
    HybridDeviceOptimizer's sub-optimizers), so they continue from it and the next save reads one count."""
    assert run_ranks(_hybrid_optimizer_steps, 1)[0] == 6.0


def _hybrid_optimizer_states_to_load_into(rank, world_size):
    """A fresh HybridDeviceOptimizer (megatron gives it ``init_state_fn=None``) as the resume's template finds it."""
    import contextlib
    from types import SimpleNamespace

    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megatron_backend.dist_checkpoint import _optimizer_tensors

    torch.cuda.current_stream, torch.cuda.Stream = (lambda device=None: _NoStream()), _NoStream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    hdo = HybridDeviceOptimizer(
        params,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        pin_cpu_grads=False,
    )
    hdo.cpu_copys_map_gpu_param.update({p: p for p in params})  # each host param is its own device copy here
    opt = SimpleNamespace(init_state_fn=None, optimizer=hdo, config=None, sharded_state_dict=lambda *a, **k: {})
    actor = SimpleNamespace(optimizer=SimpleNamespace(chained_optimizers=[opt]))
    _optimizer_tensors(actor, {}, is_loading=True)
    return [sorted(hdo.state[p]) for p in params]


def test_a_fresh_hybrid_optimizer_gets_states_to_load_into():
    """Resume with actor.optimizer_offload_fraction > 0: megatron's CPU offload has no state allocator
    (optimizer/__init__.py: ``init_state_fn = None``); the template's optimizer states come from one step of the
    HybridDeviceOptimizer, as megatron's DistributedOptimizer.load_state_dict makes them (``dummy_step``), with the
    keys its precision-aware load reads (_get_main_param_and_optimizer_states: ``master_param`` -> ``param``)."""
    keys = ["exp_avg", "exp_avg_sq", "master_param", "step"]
    assert run_ranks(_hybrid_optimizer_states_to_load_into, 1)[0] == [keys, keys]
