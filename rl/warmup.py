"""The optional supervised warm-up before RL (``trainer.sft_warmup_steps``): the task's format examples."""

from __future__ import annotations

from rl.batching import Sample, pack_sequences
from rl.losses import sft_loss
from rl.setup import RankContext


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


def resume_or_warm_up(ctx: RankContext) -> list[float]:
    """The warm-up's losses: the checkpoint's when resuming (every checkpoint is after the warm-up), else
    the warm-up runs now."""
    if ctx.resumed_state is not None:
        if ctx.rank == 0:
            print(f"resuming from {ctx.resumed_from} (step {ctx.start_step} of {ctx.cfg.trainer.steps})", flush=True)
        return ctx.resumed_state.warmup_losses
    losses = sft_warmup(ctx)
    if ctx.rank == 0 and losses:
        print(f"supervised warm-up: loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return losses
