"""A rank's start before RL: what a resumed run has left to do, and the optional supervised warm-up
(``trainer.sft_warmup_steps``) on the task's format examples."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from checkpointing.checkpoint import HF_DIR, step_dir_name
from rl.batching import Sample, pack_sequences
from rl.losses import sft_loss
from run.preflight import nothing_left
from run.save_and_stop import StopDuringWarmup
from run.setup import RankContext
from telemetry.tracking import SUMMARY_FILE


def nothing_left_to_do(ctx: RankContext, run_dir: Path) -> bool:
    """Whether a resumed run has nothing left (the launcher said so before starting the ranks; a rank started
    otherwise says it too). One resumed with every step done (stopped after its last checkpoint, before its final
    eval and summary) has its end left: rank 0 says so. Its final export was written inside the last step, before
    its checkpoint was complete, unless trainer.export_* changed since: then ``make export`` writes it from the
    checkpoint (the loop exports only inside a step)."""
    steps = ctx.cfg.trainer.steps
    done = nothing_left(ctx.start_step, steps, run_dir) if ctx.resumed_from is not None else None
    if ctx.rank != 0:
        return done is not None
    if done is not None:
        print(done)
    elif ctx.start_step == steps:
        print(
            f"{ctx.resumed_from}: all {steps} steps done; the run's end follows: its final eval (eval.every) and "
            f"{SUMMARY_FILE}"
        )
        export = run_dir / HF_DIR / step_dir_name(steps)
        if ctx.cfg.trainer.exports_after(steps - 1) and not export.is_dir():
            print(
                f"warning: {export} (trainer.export_*) is missing: `make export RUN={run_dir}` writes it from the "
                "checkpoint"
            )
    return done is not None


def sft_warmup(ctx: RankContext) -> list[float]:
    """Optional supervised warm-up on the task's format examples (trainer.sft_warmup_steps); its losses.
    A stop signal is honoured before every warm-up step (one all-reduce each): :class:`StopDuringWarmup`."""
    losses, tok, num_steps = [], ctx.tokenizer, ctx.cfg.trainer.sft_warmup_steps
    if ctx.rank == 0 and num_steps:
        print(f"supervised warm-up: {num_steps} steps", flush=True)
    for done in range(num_steps):
        if ctx.stop.agreed(ctx.dims.device):
            raise StopDuringWarmup(done)
        examples = ctx.task.format_examples(ctx.cfg.trainer.prompts_per_step * ctx.cfg.rollout.n_samples_per_prompt)
        samples = [
            Sample(i, tok(e.prompt).input_ids, tok(e.answer).input_ids + [tok.eos_token_id], [], "stop", 0.0)
            for i, e in enumerate(examples)
        ]
        batch = pack_sequences(samples[ctx.dims.dp_rank :: ctx.dims.dp], pad_id=tok.pad_token_id or 0)
        metrics = ctx.actor.train_step(batch.to(ctx.dims.device), sft_loss)
        losses.append(float(metrics["sft_loss"]))
    return losses


def resume_or_warm_up(ctx: RankContext) -> RankContext:
    """``ctx`` with the warm-up's losses: the checkpoint's when resuming (every checkpoint is after the warm-up),
    else the warm-up runs now (:class:`StopDuringWarmup` when a stop signal cuts it short)."""
    if ctx.resumed_state is not None:
        if ctx.rank == 0:
            print(f"resuming from {ctx.resumed_from} (step {ctx.start_step} of {ctx.cfg.trainer.steps})", flush=True)
        return dataclasses.replace(ctx, warmup_losses=ctx.resumed_state.warmup_losses)
    losses = sft_warmup(ctx)
    if ctx.rank == 0 and losses:
        print(f"supervised warm-up: loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return dataclasses.replace(ctx, warmup_losses=losses)
