"""A composed :class:`~rl.config.RunConfig` as the memory planner's inputs: the one place that knows both.

``make plan`` (tools/plan.py) prints the plan; ``make run`` prints it too when this machine lacks the
experiment's devices (rl/main.py); ``make sweep`` / ``make sweep-local`` check every grid point with it.
"""

from __future__ import annotations

from planner import PlanInputs, device_preset
from planner.devices import MIB

# Prompts are data, not config: without rollout.max_model_len (which bounds prompt + response) plan for this
# many prompt tokens (at most the checkpoint's max_position_embeddings - max_new_tokens).
DEFAULT_PROMPT_TOKENS = 512


def plan_inputs(cfg, prompt_tokens: int | None = None) -> PlanInputs:
    """A composed RunConfig -> the planner's inputs for one rank (adapt here when rl/config.py changes)."""
    rollout, actor = cfg.rollout, cfg.actor
    device = device_preset(cfg.cluster.device, ranks_per_node=cfg.cluster.procs_per_node)
    on_cuda = device.kind == "cuda"
    shape = cfg.model.shape()  # model.path's config.json, else model.architecture
    if prompt_tokens is None:
        # the engine's max_model_len bounds prompt + response
        longest = rollout.max_model_len or shape.max_position_embeddings
        prompt_tokens = longest - rollout.max_new_tokens
        if not rollout.max_model_len:
            prompt_tokens = min(DEFAULT_PROMPT_TOKENS, prompt_tokens)
    util = rollout.gpu_memory_utilization
    return PlanInputs(
        shape=shape,
        device=device,
        dtype=cfg.model.dtype,
        actor_tp=actor.tp,
        actor_pp=actor.pp,
        actor_vpp=actor.vpp,
        actor_dp=cfg.dp,
        # megatron_backend.actor: megatron's optimizer on CUDA, distributed when DP > 1; torch AdamW on CPU
        distributed_optimizer=on_cuda and cfg.dp > 1,
        offload_params=actor.offload.params,
        offload_grads=actor.offload.grads,
        offload_optimizer=actor.offload.optimizer,
        micro_batch_size=actor.micro_batch_size,
        remove_padding=actor.remove_padding,
        max_tokens_per_micro_batch=actor.max_tokens_per_micro_batch,
        max_tokens_per_forward_micro_batch=actor.max_tokens_per_forward_micro_batch,
        recompute=actor.recompute,
        recompute_method=actor.recompute_method,
        recompute_num_layers=actor.recompute_num_layers,
        recompute_modules=tuple(actor.recompute_modules or ("core_attn",)),
        logprob_chunk_tokens=actor.logprob_chunk_tokens,
        entropy_grad=cfg.algorithm.entropy_coef > 0,
        entropy_recompute=actor.entropy_recompute,
        attention="flash" if on_cuda else "unfused",  # Transformer Engine on CUDA, megatron's local spec on CPU
        reference_model=cfg.algorithm.kl_coef > 0,
        offload_ref_params=actor.offload.ref_params,
        sequences_per_step=cfg.trainer.prompts_per_step * rollout.n_samples_per_prompt,
        prompt_tokens=max(1, prompt_tokens),
        response_tokens=rollout.max_new_tokens,
        engine=rollout.engine,
        rollout_tp=rollout.tp,
        wake_strategy=rollout.wake_strategy,
        gpu_memory_utilization=None if util == "auto" else float(util),
        kv_cache_bytes=getattr(rollout, "kv_cache_bytes", None),
        engine_capacity_bytes=int(rollout.cpu_capacity_gb * 2**30),
        max_num_seqs=rollout.max_num_seqs,
        **({"vllm_max_batched_tokens": rollout.max_num_batched_tokens} if rollout.max_num_batched_tokens else {}),
        max_model_len=rollout.max_model_len,
        block_size=rollout.block_size,
        native_activation_reserve_bytes=rollout.activation_reserve_mb * MIB,
        sync_bucket_bytes=cfg.weight_sync.bucket_mb * MIB,
    )
