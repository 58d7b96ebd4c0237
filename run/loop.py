"""The colocated RL loop: one GRPO step per iteration, its phases named and ordered as in docs/DESIGN.md.

Every rank runs :func:`run_rank`, a rank's life on one screen; :func:`rl_step` is the paper-level view of a step.
The actor (megatron-core, TP x PP x DP) and the engine (rollout TP x replicas) share each rank's device. Building
the rank (:mod:`run.setup`), the warm-up (:mod:`run.warmup`), batching, the rollout across replicas
(:mod:`rl.generation`), the stops and their checkpoints (:mod:`run.save_and_stop`) and the run's record
(:mod:`run.record`) live beside it. A checkpoint is written right after ``train``, when the actor is resident and
the engine asleep (no extra device memory), and completed in the step's ``log`` phase; SIGUSR1 / SIGTERM act at
the next boundary every rank agrees on, and every such stop leaves through one exit
(:func:`run.save_and_stop.exit_at_stop`; docs/DESIGN.md, "Checkpoints, resume, preemption")."""

from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from checkpointing.checkpoint import StopRequest, capture_rank_state, restore_rank_state
from colocation.phases import EVAL_PHASE
from rl.evaluation import eval_record, evaluate
from rl.generation import generate_samples, sampling_seed
from rollout import SamplingParams
from run.config import RunConfig
from run.memory_plan import LaunchPlan
from run.record import RunRecord
from run.save_and_stop import AgreedStop, exit_at_stop, finish_checkpoint, stop_at, stops_on_storage_faults
from run.setup import RankContext, first_forward_backward, setup, start_rollout
from run.warmup import nothing_left_to_do, resume_or_warm_up
from telemetry.memory_timeline import EXPORT_PHASE, SAVE_PHASE
from telemetry.metrics import (
    ROUTING_MISMATCH,
    check_finite,
    engine_actor_logprob_gap,
    log_rows_after_last_step,
    log_step,
    non_finite_stops,
    step_metrics,
    unreplayed_gap_metrics,
)
from weight_sync import SyncResult


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one step changes beyond the actor's and the engine's own state."""

    metrics: dict[str, float]  # the step's record (metrics.jsonl, W&B)
    sync: SyncResult  # its weight sync
    logprob_gap: float  # the largest |actor - engine| log-prob of a sampled token, over all ranks
    peak_bytes: int | None  # the step's memory peak over all ranks (rank 0; None on the others)
    pending_save: Path | None  # the checkpoint begun after train, unless the step stops (then completed by the stop)
    stopping: bool  # every rank agreed (after train or at the step's end) to stop after this step


def rl_step(ctx: RankContext, step: int, start_state: dict) -> StepResult:
    """One RL step, per rank, in the table's phase order (colocation/phases.py), every line inside a phase.
    ``start_state``: this rank's RNGs and data cursor at the step's start, what a stop before ``train`` saves."""
    cfg, shared = ctx.cfg, ctx.shared
    actor, ref_actor, engine, phase = shared.actor, shared.ref_actor, shared.engine, shared.phase
    device = ctx.dims.device  # the default group's: a collective's tensors live there (CUDA under NCCL)
    seed = sampling_seed(ctx.sampling_base_seed, step, ctx.replica)
    params = SamplingParams.from_config(cfg.rollout, seed=seed, return_routed_experts=cfg.returns_routed_experts)
    replay = cfg.algorithm.routing_replay  # MoE: the actor's passes route as the engine did
    eval_metrics = {}
    if cfg.eval.runs_at(step, cfg.trainer.steps):
        with phase(EVAL_PHASE, step):  # the step boundary: the engine awake with the weights of `step` steps
            eval_metrics = evaluate_at_boundary(ctx, step)
    with phase("rollout", step):
        problems = ctx.task.sample(cfg.trainer.prompts_per_step)  # the same prompts on every rank
        samples = generate_samples(engine, ctx.tokenizer, ctx.task, problems, params, ctx.mesh, ctx.rank)
    # the table's hand-offs between the phases named here enter by themselves: phase() enters each before
    # the next named phase, hand_offs() up to one (engine_sleep, the onloads here)
    shared.hand_offs(step, until="old_logprob")
    if ctx.stop.agreed(device):  # the step abandoned: the training state is still its start
        raise stop_at(ctx, step, start_state)
    with phase("old_logprob", step):  # the batch, the actor's pass, then the engine-vs-actor check
        batch, rewards = ctx.make_batch(samples)
        response = batch.loss_mask
        check_finite(
            step, "rollout", {"reward": rewards, "engine log-prob": batch.engine_logprobs}, response, device=device
        )
        routing_metrics = {}
        if replay:  # the actor's own routing first: the mismatch below, and the gap it would have had
            own = actor.compute_logprobs(batch, phase="old_logprob", response_only=True)
            routing_metrics = unreplayed_gap_metrics(
                engine_actor_logprob_gap(dataclasses.replace(batch, old_logprobs=own))
            )
        batch.old_logprobs = actor.compute_logprobs(
            batch, phase="old_logprob", response_only=True, replay_routing=replay
        )
        if batch.routed_experts is not None:  # recorded by the pass without replay
            routing_metrics[ROUTING_MISMATCH] = actor.take_routing_mismatch()
        check_finite(step, "old_logprob", {"old log-prob": batch.old_logprobs}, response, device=device)
        # the engine-vs-actor gap over all ranks (p99, max): a metric and a warning (rounding moves it too);
        # wrong weights stop the run at the weight sync's reference check (weight_sync/reference.py)
        gap = engine_actor_logprob_gap(batch)
    with phase("ref_logprob", step):
        if ref_actor is not None:
            batch.ref_logprobs = ref_actor.compute_logprobs(
                batch, phase="ref_logprob", response_only=True, replay_routing=replay
            )
            check_finite(step, "ref_logprob", {"ref log-prob": batch.ref_logprobs}, response, device=device)
    shared.hand_offs(step, until="train")
    if ctx.stop.agreed(device):
        raise stop_at(ctx, step, start_state)
    with phase("train", step), non_finite_stops(step, "train"):
        for _ in range(cfg.trainer.ppo_epochs):
            train_metrics = actor.train_step(batch, ctx.loss, replay_routing=replay)
    stop_after_step, pending_save = ctx.stop.agreed(device), None
    if cfg.trainer.saves_after(step) or stop_after_step:
        with phase(SAVE_PHASE, step):  # everything resident, the engine asleep: no extra device memory
            pending_save = ctx.checkpointer.save_actor(actor, completed_steps=step + 1)
    if cfg.trainer.exports_after(step):
        with phase(EXPORT_PHASE, step):  # the params resident (the optimizer's states are not read)
            ctx.checkpointer.export_actor(actor, completed_steps=step + 1)
    with phase("weight_sync", step):  # after the offloads and the engine's weights' wake
        sync = shared.sync_weights()
    with phase("log", step):  # the step's record, then its checkpoint completed (after the record is on disk)
        num_train_tokens = int(batch.loss_mask.sum()) * ctx.dims.dp
        seconds = ctx.timeline.step_phase_seconds(step)  # every phase before this one
        metrics = step_metrics(samples, rewards, num_train_tokens, train_metrics, seconds, sync, gap)
        metrics.update(eval_metrics)
        metrics.update(routing_metrics)
        # the sampled tokens in one number: a resumed run must sample exactly what the uninterrupted one did
        metrics["rollout/response_tokens_crc32"] = float(zlib.crc32(repr([s.response_ids for s in samples]).encode()))
        peak_bytes = log_step(ctx.timeline, ctx.writer, step, metrics)
        stopping = stop_after_step or ctx.stop.agreed(device)  # or at the step's end (the engine is awake again)
        if pending_save is not None and not stopping:
            rank_state = capture_rank_state(ctx.task)
            finish_checkpoint(
                ctx.checkpointer, ctx.writer, pending_save, rank_state, ctx.rl_state(step + 1, rank_state)
            )
    return StepResult(
        metrics=metrics, sync=sync, logprob_gap=gap.value, peak_bytes=peak_bytes, pending_save=pending_save,
        stopping=stopping,
    )  # fmt: skip


def evaluate_at_boundary(ctx: RankContext, completed_steps: int) -> dict[str, float]:
    """The eval phase's figures (rl/evaluation.py) with the engine's current weights: those after
    ``completed_steps`` steps (collective)."""
    figures = evaluate(ctx.engine, ctx.tokenizer, ctx.task, ctx.eval_problems, ctx.cfg, ctx.mesh, ctx.rank)
    return {**eval_record(figures), "eval/completed_steps": float(completed_steps)}


@stops_on_storage_faults
def run_rank(cfg: RunConfig, run_dir: str, launch: LaunchPlan | None = None) -> int:
    """Everything one rank does for a run: set up (resuming if there is a checkpoint), warm up, hand the engine the
    weights, the steps, the run's end. A stop every rank agrees on is raised where they agree and leaves here, by
    one exit. ``launch``: the launch's memory plan (run/main.py; None: made at the engine start, for callers outside
    run.main). Returns the exit code (0; PREEMPTED_EXIT_CODE after a stop)."""
    stop = StopRequest(int(os.environ.get("RANK", "0"))).install()  # before the slow setup: a signal then still counts
    ctx = setup(cfg, Path(run_dir), stop, launch)
    if nothing_left_to_do(ctx, Path(run_dir)):
        return 0
    try:
        ctx = resume_or_warm_up(ctx)
        if ctx.resumed_state is None and ctx.stop.agreed(ctx.dims.device):  # signalled during setup or warm-up
            raise stop_at(ctx, 0)
        if ctx.dims.device.type == "cpu":  # before the launch measurement (plan_and_build_engine), while onloaded
            first_forward_backward(ctx)
        ctx = start_rollout(ctx)  # the engine starts, sized with the actor offloaded, and takes the actor's weights
        if ctx.stop.agreed(ctx.dims.device):  # signalled while the engine started (vLLM's start can take minutes)
            raise stop_at(ctx, ctx.start_step)
        if ctx.resumed_rank_state is not None:  # every RNG and the data cursor exactly as when the checkpoint was taken
            restore_rank_state(ctx.resumed_rank_state, ctx.task)
        with RunRecord(ctx) as record:
            for step in range(ctx.start_step, cfg.trainer.steps):
                result = rl_step(ctx, step, capture_rank_state(ctx.task))
                record.add(step, result)
                if result.stopping:
                    raise stop_at(ctx, step + 1, pending=result.pending_save)
    except AgreedStop as stopped:
        return exit_at_stop(ctx, stopped)
    ctx.shared.order.finish()  # the last step ran every phase of the table
    evaluate_after_last_step(ctx)
    record.finish(ctx)
    dist.barrier()
    return 0


def evaluate_after_last_step(ctx: RankContext) -> None:
    """The eval at the boundary no step follows (eval.every > 0): its own record (``trainer/step`` = the
    number of steps), with the rows sampled since the last step's record."""
    steps = ctx.cfg.trainer.steps
    if not ctx.cfg.eval.runs_at(steps, steps):
        log_rows_after_last_step(ctx.timeline, ctx.writer)  # the end of the last step's log phase
        return
    with ctx.shared.phase(EVAL_PHASE, steps):
        metrics = evaluate_at_boundary(ctx, steps)
    metrics.update({f"time/{k}": v for k, v in ctx.timeline.step_phase_seconds(steps).items()})
    log_step(ctx.timeline, ctx.writer, steps, metrics)
