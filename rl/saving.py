"""Saving the run at a step boundary: the actor's shards (inside the step, right after ``train``), every
rank's RNG/task state and rank 0's :class:`~rl.checkpoint.RLState`, and the stop a signal asks for.
See docs/DESIGN.md, "Checkpoints, resume, preemption"."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from rl.checkpoint import ACTOR_DIR, RLState, model_sizes
from rl.launch import PREEMPTED_EXIT_CODE
from rl.sampling import sampling_seed
from rl.setup import RankContext


class StopBeforeTrain(Exception):
    """Every rank agreed to stop before this step's ``train``: the training state is still the step's start."""


def save_actor(ctx: RankContext, completed_steps: int) -> Path:
    """Begin the checkpoint after ``completed_steps`` steps: the actor's shards into its temporary directory."""
    tmp = ctx.checkpointer.begin(completed_steps)
    ctx.actor.save_checkpoint(tmp / ACTOR_DIR)
    return tmp


def finish_checkpoint(ctx: RankContext, tmp: Path, completed_steps: int, rank_state: dict, warmup_losses) -> Path:
    """Every rank's RNG/task state, then rank 0's RLState and the rename; then W&B gets the covered steps."""
    state = None
    if ctx.writer is not None:
        state = RLState(
            completed_steps=completed_steps,
            sampling_seed=ctx.sampling_base_seed,
            next_sampling_seeds=[
                sampling_seed(ctx.sampling_base_seed, completed_steps, r) for r in range(ctx.mesh.num_replicas)
            ],
            data_num_prompts_drawn=rank_state["task"]["num_drawn"],
            wandb_run_id=ctx.writer.wandb_run_id,
            wandb_step=ctx.writer.wandb_step + ctx.writer.num_deferred,
            world_size=ctx.mesh.world_size,
            layout=dict(
                actor_tp=ctx.dims.tp,
                actor_pp=ctx.dims.pp,
                actor_vpp=ctx.dims.vpp,
                actor_dp=ctx.dims.dp,
                rollout_tp=ctx.mesh.rollout_tp,
            ),
            model=model_sizes(ctx.actor.shape),
            exp=ctx.cfg.exp,
            warmup_losses=list(warmup_losses),
        )
    path = ctx.checkpointer.finish(tmp, rank_state, state)
    if ctx.writer is not None:
        ctx.writer.flush_wandb()
    return path


def save_and_stop(ctx: RankContext, completed_steps: int, rank_state: dict, warmup_losses, engine_awake: bool) -> int:
    """A stop was agreed: save the state after ``completed_steps`` steps (unless that checkpoint exists),
    close the outputs without a summary, return the exit code job.sbatch requeues on."""
    if ctx.pending_save is not None:
        path = finish_checkpoint(ctx, ctx.pending_save, completed_steps, rank_state, warmup_losses)
    elif ctx.checkpointer.exists(completed_steps):  # resumed from exactly this state and trained nothing since
        path = ctx.checkpointer.root / f"step_{completed_steps:08d}"
    else:
        if engine_awake:
            ctx.engine.sleep(["weights", "kv_cache"])  # the run ends: room for the actor's state on the device
        for what in ("params", "grads", "optimizer"):
            if ctx.offloaded(what):
                ctx.actor.onload(what)  # a no-op for what is resident already
        path = finish_checkpoint(ctx, save_actor(ctx, completed_steps), completed_steps, rank_state, warmup_losses)
    if ctx.writer is not None:
        ctx.writer.close()
        print(
            f"stopped by {ctx.stop.received or 'a signal to another rank'} after {completed_steps} steps; checkpoint "
            f"{path}; run again with the same run directory (resume=auto) to continue",
            file=sys.stderr,
            flush=True,
        )
    dist.barrier()
    return PREEMPTED_EXIT_CODE
