"""megatron-core's optimizer, as the actor builds it on every device, makes torch AdamW's update of the
gradient it is handed (the DP-reduced ``main_grad``, clipped by its global norm); on CPU in CI, on the GPU
where there is one (then TE's FusedAdam steps inside megatron's optimizer)."""

from __future__ import annotations

import math

import pytest
import torch

from modelspec import TokenBatch
from tests.dist import run_ranks


def _one_step(rank, world_size, hf_dir):
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.losses import PolicyLoss, PolicyLossConfig

    dims = initialize_model_parallel(tp=1, pp=1)
    loss_fn = PolicyLoss(PolicyLossConfig())
    actor = Actor(hf_dir, ActorConfig(micro_batch_size=2, lr=1e-4, grad_clip=1.0), dims)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, actor.shape.vocab_size, (4, 16), generator=gen)
    batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(4, 15), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    batch.old_logprobs = actor.compute_logprobs(batch)
    params = dict(actor.models[0].named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    grads = {}
    compute_grads = actor.trainer.compute_grads  # what the train step calls before the optimizer's step

    def capture(*args):  # the reduced gradient the optimizer is handed
        metrics = compute_grads(*args)
        grads.update({name: p.main_grad.detach().clone() for name, p in params.items()})
        return metrics

    actor.trainer.compute_grads = capture
    metrics = actor.train_step(batch, loss_fn)
    # the reference: torch AdamW (megatron's defaults: betas 0.9/0.999, eps 1e-8, no weight decay here)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    coef = min(1.0, 1.0 / (norm + 1e-6))
    reference = {name: t.clone().requires_grad_(True) for name, t in before.items()}
    for name, p in reference.items():
        p.grad = grads[name] * coef
    torch.optim.AdamW(list(reference.values()), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    return dict(
        optimizer=actor.optimizer_name,
        grad_norm=metrics["grad_norm"],
        reference_norm=norm,
        max_diff=max((params[n].detach() - reference[n].detach()).abs().max().item() for n in params),
        max_update=max((params[n].detach() - before[n]).abs().max().item() for n in params),
    )


def test_megatron_optimizer_makes_torch_adamws_update_of_the_clipped_gradient(tiny_model_dirs):
    result = run_ranks(_one_step, 1, tiny_model_dirs["qwen2"])[0]
    assert result["optimizer"] == "megatron-core FP32Optimizer"
    assert abs(result["grad_norm"] - result["reference_norm"]) < 1e-4 * max(1.0, result["reference_norm"])
    assert result["max_update"] > 1e-5  # the step moved the weights (Adam's first step: ~lr)
    assert result["max_diff"] < 1e-6, result


def _offloaded_optimizer_step(rank, world_size, hf_dir, dtype="float32"):
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.losses import PolicyLoss, PolicyLossConfig

    dims = initialize_model_parallel(tp=1, pp=1)
    loss_fn = PolicyLoss(PolicyLossConfig())
    out = {}
    for fraction in (0.0, 0.5):
        config = ActorConfig(micro_batch_size=2, lr=1e-4, grad_clip=1.0, optimizer_offload_fraction=fraction)
        actor = Actor(hf_dir, config, dims, dtype=dtype)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, actor.shape.vocab_size, (4, 16), generator=gen)
        batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(4, 15), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        batch.old_logprobs = actor.compute_logprobs(batch).cpu()
        actor.train_step(batch, loss_fn)
        devices = {t.device.type for t in actor.states.tensors("optimizer")}
        actor.offload("optimizer")  # the device's states only: the hybrid optimizer's host part stays
        actor.onload("optimizer")
        out[fraction] = ({k: v.cpu() for k, v in actor.export_hf().items()}, devices)
    return out


@pytest.mark.gpu
def test_optimizer_offload_fraction_steps_part_of_adam_on_the_host(tiny_model_dirs):
    """actor.optimizer_offload_fraction: megatron's HybridDeviceOptimizer (distributed optimizer, DP=1) makes the
    same update as the all-GPU optimizer, and the actor's offload moves only its device tensors. In bf16: TE before
    2.12 has no attention backend for float32 packed sequences (run/preflight.py refuses it)."""
    out = run_ranks(_offloaded_optimizer_step, 1, tiny_model_dirs["qwen2"], "bfloat16")[0]
    (gpu_state, gpu_devices), (hybrid_state, hybrid_devices) = out[0.0], out[0.5]
    assert gpu_devices == {"cuda"} and hybrid_devices == {"cuda"}
    # the fp32 main params agree to float noise; rounded to bf16 a value may land one bf16 ulp (2^-7 relative) apart
    for k in gpu_state:
        torch.testing.assert_close(hybrid_state[k].float(), gpu_state[k].float(), rtol=2**-7, atol=1e-6, msg=k)


def _offload_with_a_state_aliasing_a_param(rank, world_size, hf_dir):
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.losses import PolicyLoss, PolicyLossConfig

    actor = Actor(hf_dir, ActorConfig(micro_batch_size=2), initialize_model_parallel(tp=1, pp=1))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, actor.shape.vocab_size, (2, 8), generator=gen)
    batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(2, 7), advantages=torch.tensor([1.0, -1.0]))
    batch.old_logprobs = actor.compute_logprobs(batch)
    actor.train_step(batch, PolicyLoss(PolicyLossConfig()))
    inner = actor.optimizer.chained_optimizers[0].optimizer
    param, state = next(iter(inner.state.items()))
    # megatron-core 0.16.1 hybrid_optimizer.py, _sync_sub_optimizers_state_to_hdo (line 326):
    # ``new_state[orig_param]["master_param"] = param``, for a float32 param the param itself
    state["master_param"] = param
    params = actor.states.tensors("params")
    collected = actor.states.tensors("optimizer")
    aliases = sum(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for t in collected for p in params)
    actor.offload("optimizer")
    resident = all(p.untyped_storage().nbytes() > 0 for p in params)
    actor.onload("optimizer")
    return aliases, resident


def test_offloading_the_optimizer_leaves_the_params_an_optimizer_state_aliases(tiny_model_dirs):
    """A HybridDeviceOptimizer's state holds its params as ``master_param`` (for float32 ones the distributed
    optimizer's shard, a view of DDP's param buffer): the actor's optimizer tensors never include the params'
    storage, so offloading the optimizer cannot take the params away before the weight sync reads them."""
    assert run_ranks(_offload_with_a_state_aliasing_a_param, 1, tiny_model_dirs["qwen2"])[0] == (0, True)


def _offload_refusals(rank, world_size, hf_dir):
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel

    dims = initialize_model_parallel(tp=1, pp=1)
    out = {}
    for dtype in ("float32", "bfloat16"):
        try:
            Actor(hf_dir, ActorConfig(micro_batch_size=2, optimizer_offload_fraction=0.5), dims, dtype=dtype)
            out[dtype] = None
        except ValueError as exc:
            out[dtype] = str(exc)
    return out


def test_optimizer_offload_refuses_what_megatrons_hybrid_optimizer_cannot_run(tiny_model_dirs):
    """megatron-core 0.16.1: the distributed optimizer hands the HybridDeviceOptimizer float32 params as views of
    DDP's buffer, which torch.optim refuses ("can't optimize a non-leaf Tensor"); the precision-aware path the CPU
    offload runs on reads Transformer Engine's version (OptimizerConfig.__post_init__: is_te_min_version). Each is
    refused in one line naming the fields, before megatron builds anything."""
    import importlib.util

    out = run_ranks(_offload_refusals, 1, tiny_model_dirs["qwen2"])[0]
    assert out["float32"].startswith("actor.optimizer_offload_fraction=0.5 with model.dtype=float32"), out
    assert "set model.dtype=bfloat16, or actor.optimizer_offload_fraction=0" in out["float32"]
    if importlib.util.find_spec("transformer_engine") is None:
        assert out["bfloat16"].startswith("actor.optimizer_offload_fraction=0.5 needs Transformer Engine"), out
