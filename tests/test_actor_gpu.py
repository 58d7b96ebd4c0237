"""CUDA only: megatron-core's optimizer and the torch AdamW path (the CPU path) make the same update."""

from __future__ import annotations

import pytest
import torch

from modelspec import TokenBatch
from tests.dist import run_ranks


def _one_step(rank, world_size, hf_dir):
    from megatron_backend.actor import Actor
    from megatron_backend.config import ActorConfig
    from megatron_backend.parallel import initialize_model_parallel
    from rl.losses import PolicyLoss, PolicyLossConfig

    dims = initialize_model_parallel(tp=1, pp=1)
    loss_fn = PolicyLoss(PolicyLossConfig())
    states = {}
    for impl in ("megatron", "torch"):
        actor = Actor(hf_dir, ActorConfig(micro_batch_size=2, lr=1e-4, grad_clip=1.0), dims, optimizer_impl=impl)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, actor.shape.vocab_size, (4, 16), generator=gen)
        batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(4, 15), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        batch.old_logprobs = actor.compute_logprobs(batch).cpu()
        metrics = actor.train_step(batch, loss_fn)
        states[impl] = (metrics, {k: v.cpu() for k, v in actor.export_hf().items()})
    return states


@pytest.mark.gpu
def test_megatron_optimizer_matches_torch_adamw_path(tiny_model_dirs):
    states = run_ranks(_one_step, 1, tiny_model_dirs["qwen2"])[0]
    (m_metrics, m_state), (t_metrics, t_state) = states["megatron"], states["torch"]
    assert abs(m_metrics["grad_norm"] - t_metrics["grad_norm"]) < 1e-4 * max(1.0, t_metrics["grad_norm"])
    assert max((m_state[k] - t_state[k]).abs().max().item() for k in m_state) < 1e-6


def _offloaded_optimizer_step(rank, world_size, hf_dir):
    from megatron_backend.actor import Actor
    from megatron_backend.config import ActorConfig
    from megatron_backend.parallel import initialize_model_parallel
    from rl.losses import PolicyLoss, PolicyLossConfig

    dims = initialize_model_parallel(tp=1, pp=1)
    loss_fn = PolicyLoss(PolicyLossConfig())
    out = {}
    for fraction in (0.0, 0.5):
        config = ActorConfig(micro_batch_size=2, lr=1e-4, grad_clip=1.0, optimizer_offload_fraction=fraction)
        actor = Actor(hf_dir, config, dims, optimizer_impl="megatron")
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, actor.shape.vocab_size, (4, 16), generator=gen)
        batch = TokenBatch(input_ids=ids, loss_mask=torch.ones(4, 15), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
        batch.old_logprobs = actor.compute_logprobs(batch).cpu()
        actor.train_step(batch, loss_fn)
        devices = {t.device.type for t in actor._optimizer_tensors()}
        actor.offload("optimizer")  # the device's states only: the hybrid optimizer's host part stays
        actor.onload("optimizer")
        out[fraction] = ({k: v.cpu() for k, v in actor.export_hf().items()}, devices)
    return out


@pytest.mark.gpu
def test_optimizer_offload_fraction_steps_part_of_adam_on_the_host(tiny_model_dirs):
    """actor.optimizer_offload_fraction: megatron's HybridDeviceOptimizer (distributed optimizer, DP=1) makes the
    same update as the all-GPU optimizer, and the actor's offload moves only its device tensors."""
    out = run_ranks(_offloaded_optimizer_step, 1, tiny_model_dirs["qwen2"])[0]
    (gpu_state, gpu_devices), (hybrid_state, hybrid_devices) = out[0.0], out[0.5]
    assert gpu_devices == {"cuda"} and hybrid_devices == {"cuda"}
    assert max((gpu_state[k] - hybrid_state[k]).abs().max().item() for k in gpu_state) < 1e-5
