"""The colocated RL loop: one GRPO step per iteration, its phases named and ordered as in docs/DESIGN.md.

Every rank runs :func:`run_rank`. The actor (megatron-core, TP x PP x DP) and the rollout engine
(rollout TP x replicas) share each rank's device; :func:`rl_step` is the paper-level view of a step.
Building the rank (:mod:`rl.setup`), batching (:mod:`rl.batching`), the rollout across replicas
(:mod:`rl.sampling`) and the metrics (:mod:`rl.metrics`) live beside it.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from rl.batching import Sample, make_batch, pack_sequences
from rl.config import RunConfig
from rl.losses import sft_loss
from rl.metrics import check_logprob_gap, engine_actor_logprob_gap, logprob_gap_tolerance, step_metrics, summarize
from rl.sampling import generate_samples, sampling_seed
from rl.setup import RankContext, setup
from rl.weight_sync import SyncResult
from rollout import SamplingParams


def rl_step(ctx: RankContext, step: int) -> tuple[dict[str, float], SyncResult]:
    """One RL step, per rank, in the design's phase order."""
    cfg, actor, engine, phase = ctx.cfg, ctx.actor, ctx.engine, ctx.phase
    problems = ctx.task.sample(cfg.trainer.prompts_per_step)  # the same prompts on every rank
    params = SamplingParams.from_config(cfg.rollout, seed=sampling_seed(cfg.trainer.seed, step, ctx.replica))
    with phase("rollout", step):
        samples = generate_samples(engine, ctx.tokenizer, ctx.task, problems, params, ctx.mesh, ctx.rank)
    with phase("engine_sleep", step):
        engine.sleep(["weights", "kv_cache"])
    for what in ("params", "grads", "optimizer"):
        with phase(f"onload_{what}", step):
            if ctx.offloaded(what):
                actor.onload(what)
    batch, rewards = make_batch(
        samples,
        cfg.rollout.n_samples_per_prompt,
        ctx.dims.dp,
        ctx.dims.dp_rank,
        ctx.tokenizer.pad_token_id or 0,
        ctx.dims.device,
    )
    with phase("old_logprob", step):
        batch["old_logprobs"] = actor.compute_logprobs(batch, phase="old_logprob")
    # the worst engine-vs-actor gap over all ranks; too large: stop before training on wrong log-probs
    gap = engine_actor_logprob_gap(batch, sample_offset=ctx.dims.dp_rank * batch["input_ids"].shape[0])
    check_logprob_gap(gap, step, logprob_gap_tolerance(cfg.trainer.max_logprob_gap, cfg.model.dtype), cfg.model.dtype)
    ctx.logprob_gaps.append(gap.value)
    with phase("onload_ref", step):
        if ctx.offloaded("ref_params"):
            ctx.ref_actor.onload("params")
    with phase("ref_logprob", step):
        if ctx.ref_actor is not None:
            batch["ref_logprobs"] = ctx.ref_actor.compute_logprobs(batch, phase="ref_logprob")
    with phase("offload_ref", step):
        if ctx.offloaded("ref_params"):
            ctx.ref_actor.offload("params")
    with phase("train", step):
        for _ in range(cfg.trainer.ppo_epochs):
            train_metrics = actor.train_step(batch, ctx.loss)
    for what in ("optimizer", "grads"):
        with phase(f"offload_{what}", step):
            if ctx.offloaded(what):
                actor.offload(what)
    with phase("wake_weights", step):
        engine.wake_up(cfg.rollout.wake_tags("wake_weights"))
    with phase("weight_sync", step):
        sync = ctx.sync_weights()
    with phase("offload_params", step):
        if ctx.offloaded("params"):
            actor.offload("params")
    with phase("wake_kv_cache", step):
        if tags := cfg.rollout.wake_tags("wake_kv_cache"):
            engine.wake_up(tags)
    num_train_tokens = int(batch["loss_mask"].sum()) * ctx.dims.dp
    return step_metrics(samples, rewards, num_train_tokens, train_metrics, ctx.phase_seconds, sync, gap.value), sync


def sft_warmup(ctx: RankContext) -> list[float]:
    """Optional supervised warm-up on the task's format examples (trainer.sft_warmup_steps); its losses."""
    losses, tok = [], ctx.tokenizer
    for _ in range(ctx.cfg.trainer.sft_warmup_steps):
        examples = ctx.task.format_examples(ctx.cfg.trainer.prompts_per_step * ctx.cfg.rollout.n_samples_per_prompt)
        samples = [
            Sample(i, tok(e.prompt).input_ids, tok(e.answer).input_ids + [tok.eos_token_id], [], "stop", 0.0)
            for i, e in enumerate(examples)
        ]
        batch = pack_sequences(samples[ctx.dims.dp_rank :: ctx.dims.dp], pad_id=tok.pad_token_id or 0)
        metrics = ctx.actor.train_step({k: v.to(ctx.dims.device) for k, v in batch.items()}, sft_loss)
        losses.append(float(metrics["sft_loss"]))
    return losses


def run_rank(cfg: RunConfig, run_dir: str) -> None:
    """Everything one rank does for a run: set up, warm up, hand the engine the weights, then the steps."""
    import warnings

    from tqdm import tqdm

    # megatron-core warns at import about missing Apex / Transformer Engine / CUDA env vars; on CPU that is expected
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    ctx = setup(cfg, Path(run_dir))
    warmup_losses = sft_warmup(ctx)
    if ctx.rank == 0 and warmup_losses:
        print(f"supervised warm-up: loss {warmup_losses[0]:.3f} -> {warmup_losses[-1]:.3f}", flush=True)
    ctx.sync_weights()  # the engine starts from the actor's weights
    for what in ("optimizer", "grads", "params"):
        if ctx.offloaded(what):
            ctx.actor.offload(what)
    rewards, syncs = [], []
    progress = tqdm(range(cfg.trainer.steps), desc=cfg.exp, disable=ctx.rank != 0, dynamic_ncols=True)
    for step in progress:
        metrics, sync = rl_step(ctx, step)
        syncs.append(sync)
        rows = ctx.timeline.take_rows()
        gathered: list | None = [None] * ctx.mesh.world_size if ctx.rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if ctx.writer is not None:
            step_rows = [r for per_rank in gathered for r in per_rank]
            ctx.writer.log_timeline(step_rows)
            peaks = ctx.writer.log_step(step, metrics, step_rows)
            rewards.append(metrics["reward/mean"])
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", peak_mib=f"{max(peaks.values()) / 2**20:.0f}")
    if ctx.writer is not None:
        ctx.writer.finish(summarize(ctx, rewards, ctx.writer.read_rows(), syncs, warmup_losses))
    dist.barrier()
