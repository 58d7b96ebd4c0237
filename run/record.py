"""The run's record beside its files: each step's on rank 0's progress bar, with the warnings its metrics may
raise, and at the run's end summary.json and its closing lines (:func:`telemetry.metrics.summarize`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from tqdm import tqdm

from run.setup import RankContext
from telemetry.metrics import LogprobGapWatch, RoutingWatch, RunFacts, closing_lines, logprob_gap_rule, summarize
from weight_sync import SyncResult

if TYPE_CHECKING:
    from run.loop import StepResult


class RunRecord:
    """The rewards of every step (rank 0: the resumed run's first), the weight syncs and log-prob gaps of this
    attempt's, and rank 0's progress bar with the MoE-routing and log-prob-gap watches. A context manager: the bar
    closes on leaving (before a stop's line)."""

    def __init__(self, ctx: RankContext):
        cfg = ctx.cfg
        self.rewards = [m["reward/mean"] for m in ctx.writer.previous_metrics] if ctx.writer is not None else []
        self.syncs: list[SyncResult] = []
        self.logprob_gaps: list[float] = []
        # tqdm's default lock holds a named semaphore (for bars shared with child processes; a rank's never is)
        # that a rank ended by os._exit (a storage or numeric fault) or by the launcher's SIGKILL cannot release:
        # the launcher's resource tracker would then print its leak warnings after the run's last line
        tqdm.set_lock(threading.RLock())
        self.progress = tqdm(
            total=cfg.trainer.steps, initial=ctx.start_step, desc=cfg.exp, disable=ctx.rank != 0, dynamic_ncols=True
        )
        self.routing = RoutingWatch(ctx.plan if ctx.rank == 0 else None)  # MoE: routing the plan does not fit
        self.gap_watch = LogprobGapWatch(logprob_gap_rule(cfg.trainer, cfg.model.dtype), cfg.model.dtype)

    def __enter__(self) -> RunRecord:
        return self

    def __exit__(self, *exc) -> None:
        self.progress.close()

    def add(self, step: int, result: StepResult) -> None:
        """Step ``step``'s, once its record is written."""
        self.syncs.append(result.sync)
        self.logprob_gaps.append(result.logprob_gap)
        if result.peak_bytes is None:  # not rank 0
            return
        self.rewards.append(result.metrics["reward/mean"])
        self.progress.update()
        self.progress.set_postfix(reward=f"{self.rewards[-1]:.3f}", peak_mib=f"{result.peak_bytes / 2**20:.0f}")
        for warning in (self.routing.check(step, result.metrics), self.gap_watch.check(step, result.metrics)):
            if warning:
                self.progress.write(warning)

    def finish(self, ctx: RankContext) -> None:
        """Rank 0: summary.json from the run's files and this record, then the closing lines."""
        writer = ctx.writer
        if writer is None:
            return
        rows, evals = writer.read_rows(), writer.read_metrics()
        facts = run_facts(ctx)
        summary = summarize(facts, self.rewards, rows, evals, self.syncs, self.logprob_gaps, ctx.warmup_losses)
        print("\n".join(closing_lines(writer.finish(summary), writer.run_dir)), flush=True)


def run_facts(ctx: RankContext) -> RunFacts:
    """What summary.json says about the run beside its measurements."""
    shared = ctx.shared
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
