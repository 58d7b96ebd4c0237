"""The optional supervised warm-up before RL (``trainer.sft_warmup_steps``): the task's format examples."""

from __future__ import annotations

import sys

import torch.distributed as dist

from checkpointing.checkpoint import StopRequest
from rl.batching import Sample, pack_sequences
from rl.losses import sft_loss
from run.launch import PREEMPTED_EXIT_CODE
from run.setup import RankContext
from telemetry.tracking import RunWriter


class StopDuringWarmup(Exception):
    """SIGUSR1 / SIGTERM agreed before the warm-up's last step (no checkpoint exists before its end)."""

    def __init__(self, done: int):
        self.done = done


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


def resume_or_warm_up(ctx: RankContext) -> list[float] | StopDuringWarmup:
    """The warm-up's losses: the checkpoint's when resuming (every checkpoint is after the warm-up), else
    the warm-up runs now; a :class:`StopDuringWarmup` when a stop signal cut it short."""
    if ctx.resumed_state is not None:
        if ctx.rank == 0:
            print(f"resuming from {ctx.resumed_from} (step {ctx.start_step} of {ctx.cfg.trainer.steps})", flush=True)
        return ctx.resumed_state.warmup_losses
    try:
        losses = sft_warmup(ctx)
    except StopDuringWarmup as stop:
        return stop
    if ctx.rank == 0 and losses:
        print(f"supervised warm-up: loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return losses


def exit_during_warmup(writer: RunWriter | None, stop: StopRequest, cut: StopDuringWarmup, num_steps: int) -> int:
    """A stop during the warm-up (``cut`` after some of its ``num_steps`` steps): no checkpoint can hold a part
    of it (every checkpoint is after the warm-up, and a resume skips it), so exit cleanly at once; a requeue
    starts the run over (resume=auto finds no checkpoint in the run directory)."""
    if writer is not None:
        writer.close()
        print(
            f"stopped by {stop.received or 'a signal to another rank'} during the supervised warm-up (after "
            f"{cut.done} of {num_steps} steps); no checkpoint before the warm-up ends: "
            "run again with the same run directory to start over",
            file=sys.stderr,
            flush=True,
        )
    dist.barrier()
    return PREEMPTED_EXIT_CODE
