"""The colocated RL loop: one GRPO step per iteration, its phases named and ordered as in docs/DESIGN.md.

Every rank runs :func:`run_rank`; :func:`rl_step` is the paper-level view of a step. The actor
(megatron-core, TP x PP x DP) and the engine (rollout TP x replicas) share each rank's device. Building
the rank (:mod:`run.setup`), batching, the rollout across replicas (:mod:`rl.generation`), metrics and
checkpoints (:mod:`run.save_and_stop`) live beside it. A checkpoint is written right after ``train``, when the
actor is resident and the engine asleep (no extra device memory), and completed after the step is logged;
SIGUSR1 / SIGTERM act at the next boundary every rank agrees on (docs/DESIGN.md, "Checkpoints, resume,
preemption")."""

from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from checkpointing.checkpoint import StopRequest, capture_rank_state, restore_rank_state
from colocation.phases import EVAL_PHASE
from rl.evaluation import eval_record, evaluate
from rl.generation import generate_samples, sampling_seed
from rollout import SamplingParams
from run.config import RunConfig
from run.memory_plan import LaunchPlan
from run.preflight import nothing_left
from run.save_and_stop import (
    StopBeforeTrain,
    finish_checkpoint,
    save_and_stop,
    stops_on_storage_faults,
)
from run.setup import RankContext, first_forward_backward, setup, start_rollout
from run.warmup import StopDuringWarmup, exit_during_warmup, resume_or_warm_up
from telemetry.memory_timeline import EXPORT_PHASE, SAVE_PHASE
from telemetry.metrics import (
    ROUTING_MISMATCH,
    LogprobGapWatch,
    RoutingWatch,
    RunFacts,
    check_finite,
    closing_lines,
    engine_actor_logprob_gap,
    log_rows_after_last_step,
    log_step,
    logprob_gap_rule,
    non_finite_stops,
    step_metrics,
    summarize,
    unreplayed_gap_metrics,
)
from telemetry.tracking import SUMMARY_FILE
from weight_sync import SyncResult


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one step changes beyond the actor's and the engine's own state."""

    metrics: dict[str, float]  # the step's record (metrics.jsonl, W&B)
    sync: SyncResult  # its weight sync
    logprob_gap: float  # the largest |actor - engine| log-prob of a sampled token, over all ranks
    pending_save: Path | None  # the checkpoint begun after train (None: this step does not save), completed in log
    stop_after_step: bool  # every rank agreed (after train) to stop once this step is saved


def rl_step(ctx: RankContext, step: int) -> StepResult:
    """One RL step, per rank, in the table's phase order (colocation/phases.py; the step's log phase follows it
    in :func:`run_rank`)."""
    cfg, shared = ctx.cfg, ctx.device
    actor, ref_actor, engine, phase = shared.actor, shared.ref_actor, shared.engine, shared.phase
    device = ctx.dims.device  # the default group's: a collective's tensors live there (CUDA under NCCL)
    stop_agreed = lambda: ctx.stop.agreed(device)  # noqa: E731 (a collective at a phase boundary)
    seed = sampling_seed(ctx.sampling_base_seed, step, ctx.replica)
    params = SamplingParams.from_config(cfg.rollout, seed=seed, return_routed_experts=cfg.returns_routed_experts)
    replay = cfg.algorithm.routing_replay  # MoE: the actor's passes route as the engine did
    eval_metrics = {}
    if cfg.eval.runs_at(step, cfg.trainer.steps):
        with phase(EVAL_PHASE, step):  # the step boundary: the engine awake with the weights of `step` steps
            eval_metrics = evaluate_at_boundary(ctx, step)
    with phase("rollout", step):  # every line of the step is inside a phase: the timeline sees all its memory
        problems = ctx.task.sample(cfg.trainer.prompts_per_step)  # the same prompts on every rank
        samples = generate_samples(engine, ctx.tokenizer, ctx.task, problems, params, ctx.mesh, ctx.rank)
    # the table's hand-offs between the phases named here enter by themselves: phase() enters each before
    # the next named phase, hand_offs() up to one (engine_sleep, the onloads here)
    shared.hand_offs(step, until="old_logprob")
    if stop_agreed():
        raise StopBeforeTrain
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
    if stop_agreed():
        raise StopBeforeTrain
    with phase("train", step), non_finite_stops(step, "train"):
        for _ in range(cfg.trainer.ppo_epochs):
            train_metrics = actor.train_step(batch, ctx.loss, replay_routing=replay)
    stop_after_step, pending_save = stop_agreed(), None
    if cfg.trainer.saves_after(step) or stop_after_step:
        with phase(SAVE_PHASE, step):  # everything resident, the engine asleep: no extra device memory
            pending_save = ctx.checkpointer.save_actor(actor, completed_steps=step + 1)
    if cfg.trainer.exports_after(step):
        with phase(EXPORT_PHASE, step):  # the params resident (the optimizer's states are not read)
            ctx.checkpointer.export_actor(actor, completed_steps=step + 1)
    with phase("weight_sync", step):  # after the offloads and the engine's weights' wake
        sync = shared.sync_weights()
    shared.hand_offs(step, until="log")  # the params' offload, the KV cache's wake
    num_train_tokens = int(batch.loss_mask.sum()) * ctx.dims.dp
    seconds = ctx.timeline.step_phase_seconds(step)
    metrics = step_metrics(samples, rewards, num_train_tokens, train_metrics, seconds, sync, gap)
    metrics.update(eval_metrics)
    metrics.update(routing_metrics)
    # the sampled tokens in one number: a resumed run must sample exactly what the uninterrupted one did
    metrics["rollout/response_tokens_crc32"] = float(zlib.crc32(repr([s.response_ids for s in samples]).encode()))
    return StepResult(
        metrics=metrics, sync=sync, logprob_gap=gap.value, pending_save=pending_save, stop_after_step=stop_after_step
    )


def evaluate_at_boundary(ctx: RankContext, completed_steps: int) -> dict[str, float]:
    """The eval phase's figures (rl/evaluation.py) with the engine's current weights: those after
    ``completed_steps`` steps (collective)."""
    figures = evaluate(ctx.engine, ctx.tokenizer, ctx.task, ctx.eval_problems, ctx.cfg, ctx.mesh, ctx.rank)
    return {**eval_record(figures), "eval/completed_steps": float(completed_steps)}


def evaluate_after_last_step(ctx: RankContext) -> None:
    """The eval at the boundary no step follows (eval.every > 0): its own record (``trainer/step`` = the
    number of steps), with the rows sampled since the last step's record."""
    steps = ctx.cfg.trainer.steps
    if not ctx.cfg.eval.runs_at(steps, steps):
        log_rows_after_last_step(ctx.timeline, ctx.writer)  # the end of the last step's log phase
        return
    with ctx.device.phase(EVAL_PHASE, steps):
        metrics = evaluate_at_boundary(ctx, steps)
    metrics.update({f"time/{k}": v for k, v in ctx.timeline.step_phase_seconds(steps).items()})
    log_step(ctx.timeline, ctx.writer, steps, metrics)


def run_facts(ctx: RankContext) -> RunFacts:
    """What summary.json says about the run beside its measurements."""
    shared = ctx.device
    return RunFacts(
        exp=ctx.cfg.exp,
        wake_strategy=ctx.cfg.rollout.wake_strategy,
        world_size=ctx.mesh.world_size,
        peak_method=ctx.timeline.peak_method,
        plan=shared.plan,
        kv_cache=dataclasses.asdict(ctx.kv_choice) if ctx.kv_choice is not None else None,
        actor_optimizer=shared.actor.optimizer_name,
        sync_plan=shared.weight_sync.plan,
        t0=ctx.t0,
    )


def report_end_of_finished_steps(ctx: RankContext, run_dir: Path) -> None:
    """A run resumed with every step done (stopped after its last checkpoint, before its final eval and
    summary): say what follows. The final export was written inside the last step, before its checkpoint was
    complete, unless trainer.export_* changed since: then it is missing and ``make export`` writes it from the
    checkpoint (the loop exports only inside a step)."""
    from checkpointing.checkpoint import HF_DIR, step_dir_name

    steps = ctx.cfg.trainer.steps
    if ctx.rank != 0:
        return
    print(
        f"{ctx.resumed_from}: all {steps} steps done; the run's end follows: its final eval (eval.every) and {SUMMARY_FILE}"
    )
    export = run_dir / HF_DIR / step_dir_name(steps)
    if ctx.cfg.trainer.exports_after(steps - 1) and not export.is_dir():
        print(
            f"warning: {export} (trainer.export_*) is missing: `make export RUN={run_dir}` writes it from the checkpoint"
        )


@stops_on_storage_faults
def run_rank(cfg: RunConfig, run_dir: str, launch: LaunchPlan | None = None) -> int:
    """Everything one rank does for a run: set up (resuming if there is a checkpoint), warm up, hand the
    engine the weights, then the steps. ``launch``: the launch's memory plan (run/main.py; None: made at the
    engine start, for callers outside run.main). Returns the exit code (0; PREEMPTED_EXIT_CODE after a stop)."""
    stop = StopRequest(int(os.environ.get("RANK", "0"))).install()  # before the slow setup: a signal then still counts
    ctx = setup(cfg, Path(run_dir), stop, launch)
    steps = cfg.trainer.steps
    done = nothing_left(ctx.start_step, steps, Path(run_dir)) if ctx.resumed_from is not None else None
    if done is not None:  # the launcher said so before starting the ranks; a rank started otherwise says it too
        if ctx.rank == 0:
            print(done)
        return 0
    if ctx.start_step == steps:  # stopped after its last checkpoint, before its end: the end of the run follows
        report_end_of_finished_steps(ctx, Path(run_dir))
    warmup_losses = resume_or_warm_up(ctx)
    if isinstance(warmup_losses, StopDuringWarmup):  # no checkpoint holds part of a warm-up: exit at once
        return exit_during_warmup(ctx.writer, ctx.stop, warmup_losses, cfg.trainer.sft_warmup_steps)

    def stop_saving(completed_steps: int, rank_state: dict, pending: Path | None = None) -> int:
        state = ctx.rl_state(completed_steps, rank_state, warmup_losses)
        return save_and_stop(
            ctx.checkpointer, ctx.device, ctx.writer, ctx.stop,
            completed_steps=completed_steps, rank_state=rank_state, state=state, pending=pending,
        )  # fmt: skip

    if ctx.resumed_state is None and ctx.stop.agreed(ctx.dims.device):  # signalled during setup or warm-up
        return stop_saving(0, capture_rank_state(ctx.task))
    if ctx.dims.device.type == "cpu":  # before the launch measurement (plan_and_build_engine), while onloaded
        first_forward_backward(ctx)
    ctx = start_rollout(ctx)  # the engine starts, sized with the actor offloaded, and takes the actor's weights
    if ctx.stop.agreed(ctx.dims.device):  # signalled while the engine started (vLLM's start can take minutes)
        return stop_saving(ctx.start_step, capture_rank_state(ctx.task))
    if ctx.resumed_rank_state is not None:  # every RNG and the data cursor exactly as when the checkpoint was taken
        restore_rank_state(ctx.resumed_rank_state, ctx.task)
    rewards = [m["reward/mean"] for m in ctx.writer.previous_metrics] if ctx.writer is not None else []
    syncs, logprob_gaps = [], []  # per step of this attempt
    progress = tqdm(total=steps, initial=ctx.start_step, desc=cfg.exp, disable=ctx.rank != 0, dynamic_ncols=True)
    routing = RoutingWatch(ctx.plan if ctx.rank == 0 else None)  # MoE: routing the plan does not fit
    gap_watch = LogprobGapWatch(logprob_gap_rule(cfg.trainer, cfg.model.dtype), cfg.model.dtype)
    for step in range(ctx.start_step, steps):
        rank_state = capture_rank_state(ctx.task)  # the state at this step's start (a stop before train saves it)
        try:
            result = rl_step(ctx, step)
        except StopBeforeTrain:
            progress.close()
            return stop_saving(step, rank_state)
        syncs.append(result.sync)
        logprob_gaps.append(result.logprob_gap)
        with ctx.device.phase(
            "log", step
        ):  # the step's record, then its checkpoint completed (after the record is on disk)
            peak_bytes = log_step(ctx.timeline, ctx.writer, step, result.metrics)
            # after train (the step saved itself) or at the step's end (the engine is awake again)
            stopping = result.stop_after_step or ctx.stop.agreed(ctx.dims.device)
            if result.pending_save is not None and not stopping:
                rank_state = capture_rank_state(ctx.task)
                state = ctx.rl_state(step + 1, rank_state, warmup_losses)
                finish_checkpoint(ctx.checkpointer, ctx.writer, result.pending_save, rank_state, state)
        if peak_bytes is not None:  # rank 0
            rewards.append(result.metrics["reward/mean"])
            progress.update()
            progress.set_postfix(reward=f"{rewards[-1]:.3f}", peak_mib=f"{peak_bytes / 2**20:.0f}")
            for warning in (routing.check(step, result.metrics), gap_watch.check(step, result.metrics)):
                if warning:
                    progress.write(warning)
        if stopping:
            progress.close()
            return stop_saving(step + 1, capture_rank_state(ctx.task), pending=result.pending_save)
    progress.close()
    ctx.device.order.finish()  # the last step ran every phase of the table
    evaluate_after_last_step(ctx)
    if ctx.writer is not None:
        rows, evals = ctx.writer.read_rows(), ctx.writer.read_metrics()
        summary = ctx.writer.finish(summarize(run_facts(ctx), rewards, rows, evals, syncs, logprob_gaps, warmup_losses))
        print("\n".join(closing_lines(summary, ctx.writer.run_dir)), flush=True)
    dist.barrier()
    return 0
