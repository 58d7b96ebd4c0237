"""What a step and a run report: rewards, lengths, throughput, phase seconds, weight-sync bytes, the
engine-vs-actor log-prob check, and the run summary (summary.json)."""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist

from modelspec import TokenBatch
from planner import Plan, StepLengths
from planner.report import routing_headroom
from rl.batching import Sample
from rl.evaluation import eval_summary
from telemetry.memory_timeline import (
    FIGURES_KEY,
    PEAK_METRIC,
    PHASES,
    TAGS,
    MemoryTimeline,
    memory_figures,
    phase_drift,
    phase_peaks,
    phase_samples,
    prediction_errors,
    released_bytes,
    steady_peak,
    steady_steps,
    wake_window_phases,
)
from telemetry.tracking import RunWriter
from weight_sync import SyncPlan, SyncResult


@dataclass(frozen=True)
class LogprobGapRule:
    """When the run warns on the |engine - actor| log-prob of the step's sampled tokens (all ranks): the 99th
    percentile above ``p99`` or any token above ``max``. A warning, not a stop: in bf16 the gap grows with
    rounding as the policy sharpens (a healthy vLLM run reached p99 0.106 at step 38), so no threshold tells
    rounding from a wrong layout; the stop is weight_sync.check_every's bit-exact check (weight_sync/reference.py)."""

    p99: float
    max: float


# Per model dtype (the defaults of trainer.max_logprob_gap_p99 / trainer.max_logprob_gap), from
# `python -m tools.logprob_gap --corrupt` on memory_cpu's model (docs/DESIGN.md has the table). bf16,
# ~3.9k sampled tokens, p99 / max: native engine 0.016 / 0.024, vLLM 0.016 / 0.024; with one layer's down_proj
# column halves swapped in the engine (a TP shard in the other rank's slot, one layer of eight): p99 0.42
# (native) and 1.79 (vLLM), max 0.63 and 2.5. float32: p99 9.5e-7. bf16 in the loop (tiny_cpu, 40 steps per
# engine, weights moving): step p99 up to 0.106 (vLLM, step 38), so the bf16 band overlaps a wrong layout's.
LOGPROB_GAP_RULE = {
    "float32": LogprobGapRule(p99=1e-3, max=1e-2),
    "bfloat16": LogprobGapRule(p99=0.1, max=3.0),
    "float16": LogprobGapRule(p99=0.05, max=1.5),
}
GAP_P99, GAP_MAX = "rollout/engine_actor_logprob_diff_p99", "rollout/engine_actor_logprob_diff_max"


class LogprobGapWatch:
    """Says when a step's engine-vs-actor log-prob gap is beyond ``rule``, once per new high (of p99 or max)."""

    def __init__(self, rule: LogprobGapRule, dtype: str) -> None:
        self.rule, self.dtype = rule, dtype
        self.highest = (rule.p99, rule.max)

    def check(self, step: int, metrics: dict[str, float]) -> str | None:
        p99, top = metrics.get(GAP_P99, 0.0), metrics.get(GAP_MAX, 0.0)
        if p99 <= self.highest[0] and top <= self.highest[1]:
            return None
        self.highest = (max(p99, self.highest[0]), max(top, self.highest[1]))
        return (
            f"warning: step {step}: engine vs actor log-prob gap p99 {p99:.3g}, max {top:.3g}, a new high beyond "
            f"trainer.max_logprob_gap_p99={self.rule.p99:g} / trainer.max_logprob_gap={self.rule.max:g} "
            f"({self.dtype}); {self.dtype} rounding can do this, a wrong layout stops the run at "
            "weight_sync.check_every's check"
        )


class NonFiniteError(RuntimeError):
    """A reward, log-prob, loss or grad norm is NaN/inf: the step stops before the optimizer applies it, so the
    weights, Adam's moments and the last checkpoint stay the last good ones."""


def check_finite(
    step: int, phase: str, quantities: dict[str, torch.Tensor], loss_mask: torch.Tensor, *, device: torch.device
) -> None:
    """Every rank stops together (one all-reduce) when any rank holds a non-finite value of a quantity;
    tensors of ``loss_mask``'s shape [B, S-1] are checked on response tokens only, others everywhere.
    ``device``: the default group's (CUDA under NCCL, which takes no host tensor; tests/test_collective_devices.py)."""
    mask = loss_mask > 0
    bad = torch.tensor(
        [float(not torch.isfinite(t[mask] if t.shape == mask.shape else t).all()) for t in quantities.values()],
        device=device,
    )
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    names = [name for name, flag in zip(quantities, bad.tolist()) if flag]
    if names:
        raise NonFiniteError(f"step {step}, phase {phase}: {', '.join(names)} not finite (NaN/inf); {STOPPED}")


STOPPED = "stopped before the optimizer applied it (the last checkpoint is the last good one)"


@contextmanager
def non_finite_stops(step: int, phase: str):
    """The actor's own check (loss, grad norm: ``FloatingPointError`` before its optimizer step) as one line."""
    try:
        yield
    except FloatingPointError as exc:
        reason = str(exc).removesuffix("; the optimizer step was not applied")  # STOPPED says it
        raise NonFiniteError(f"step {step}, phase {phase}: {reason}; {STOPPED}") from None


def gap_distribution(gaps: torch.Tensor, token_threshold: float = 0.1) -> dict:
    """``gaps`` [N]: |actor - engine| per sampled token -> num_tokens, mean, p99, max and the fraction of
    tokens above ``token_threshold``."""
    if gaps.numel() == 0:
        return dict(num_tokens=0, mean=0.0, p99=0.0, max=0.0, frac_above=0.0)
    ordered = gaps.double().sort().values
    n = ordered.numel()
    return dict(
        num_tokens=n,
        mean=float(ordered.mean()),
        p99=float(ordered[max(0, math.ceil(0.99 * n) - 1)]),
        max=float(ordered[-1]),
        frac_above=float((ordered > token_threshold).double().mean()),
    )


@dataclass(frozen=True)
class LogprobGap:
    """The distribution of |actor - engine| log-prob over every rank's response tokens, and where the
    largest is (``value``: that largest)."""

    value: float = 0.0
    rank: int = -1
    sample: int = -1  # index in the step's samples (all prompts x n, prompt-major)
    response_token: int = -1  # position within that sample's response
    token_id: int = -1
    actor_logprob: float = 0.0
    engine_logprob: float = 0.0
    mean: float = 0.0
    p99: float = 0.0
    num_tokens: int = 0

    def describe(self) -> str:
        return (
            f"old_logprobs vs engine_logprobs over {self.num_tokens} tokens: mean {self.mean:.3g}, p99 {self.p99:.3g}, "
            f"max {self.value:.3g} at rank {self.rank}, sample {self.sample}, response token {self.response_token} "
            f"(token id {self.token_id}): actor {self.actor_logprob:.6g}, engine {self.engine_logprob:.6g}"
        )


def engine_actor_logprob_gap(batch: TokenBatch) -> LogprobGap:
    """The distribution of |actor - engine| log-prob over every rank's response tokens (gathered over the
    world) and its worst token.

    ``batch``: this DP rank's ``input_ids`` [B, S], ``loss_mask`` / ``old_logprobs`` / ``engine_logprobs``
    [B, S-1], ``sample_index`` [B] (row i is that sample of the step: rl.batching.make_batch). The two
    agree up to the dtype's rounding (same weights): a metric and a warning (:class:`LogprobGapWatch`).
    """
    mask = batch.loss_mask > 0
    local = LogprobGap()
    gap = (batch.old_logprobs - batch.engine_logprobs).abs().masked_fill(~mask, -1.0)  # [B, S-1]
    if mask.any():
        flat = int(gap.argmax())
        row, col = divmod(flat, gap.shape[1])
        first_response = int(mask[row].nonzero()[0])  # target position of the response's first token
        local = LogprobGap(
            value=float(gap[row, col]),
            rank=dist.get_rank() if dist.is_initialized() else 0,
            sample=int(batch.sample_index[row]),
            response_token=col - first_response,
            token_id=int(batch.input_ids[row, col + 1]),
            actor_logprob=float(batch.old_logprobs[row, col]),
            engine_logprob=float(batch.engine_logprobs[row, col]),
        )
    values = gap[mask].float()  # [tokens of this rank]
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (asdict(local), values.cpu()))
        local = max((LogprobGap(**g) for g, _ in gathered), key=lambda g: (g.value, -g.rank))
        values = torch.cat([v for _, v in gathered])
    stats = gap_distribution(values)
    return replace(local, mean=stats["mean"], p99=stats["p99"], num_tokens=stats["num_tokens"])


def logprob_gap_rule(trainer, dtype: str) -> LogprobGapRule:
    """``trainer`` (run.config.TrainerConfig): its max_logprob_gap / max_logprob_gap_p99 (warning thresholds),
    each null: the default for the model's dtype."""
    default = LOGPROB_GAP_RULE[dtype]
    return LogprobGapRule(
        p99=default.p99 if trainer.max_logprob_gap_p99 is None else trainer.max_logprob_gap_p99,
        max=default.max if trainer.max_logprob_gap is None else trainer.max_logprob_gap,
    )


# MoE: the fraction of (response token, MoE layer) pairs whose top-k expert set differs between the engine and the
# actor's own routing (megatron_backend.routing_replay), every step the engine returns its routing
ROUTING_MISMATCH = "rollout/moe/routing_mismatch_fraction"


def unreplayed_gap_metrics(gap: LogprobGap) -> dict[str, float]:
    """With routing replay on: the engine-vs-actor gap of the actor's own routing (the step's
    ``rollout/engine_actor_logprob_diff_*`` are then the replayed pass's)."""
    return {
        "rollout/moe/engine_actor_logprob_diff_max_without_replay": gap.value,
        "rollout/moe/engine_actor_logprob_diff_mean_without_replay": gap.mean,
    }


def step_metrics(
    samples: list[Sample],
    rewards: torch.Tensor,
    num_train_tokens: int,
    train: dict[str, float],
    phase_seconds: dict[str, float],
    sync: SyncResult,
    gap: LogprobGap,
) -> dict[str, float]:
    """One step's scalars (metrics.jsonl and W&B)."""
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward/accuracy": float((rewards >= 1.0).float().mean()),
        "response/length_mean": float(lengths.mean()),
        "perf/rollout_tokens_per_s": float(lengths.sum()) / max(phase_seconds.get("rollout", 0.0), 1e-9),
        "perf/train_tokens_per_s": num_train_tokens / max(phase_seconds.get("train", 0.0), 1e-9),
        "weight_sync/bytes_sent": sync.stats.bytes_sent,
        "weight_sync/seconds": sync.stats.seconds,
        REFERENCE_LAYER: sync.reference_layer,
        "rollout/engine_actor_logprob_diff_max": gap.value,
        "rollout/engine_actor_logprob_diff_mean": gap.mean,
        "rollout/engine_actor_logprob_diff_p99": gap.p99,
    }
    out.update({f"train/{k}": float(v) for k, v in train.items()})
    out.update({f"time/{k}": v for k, v in phase_seconds.items()})
    out.update(step_lengths(samples))
    return out


LENGTHS_PREFIX = "lengths/"
# StepLengths' fields a step's samples give (lengths/<field>); its routed_copies_ratio is the train pass's metric
_LENGTH_FIELDS = tuple(f.name for f in fields(StepLengths) if f.name not in ("routed_copies_ratio", "reference_layer"))
# the most routed copies an EP rank's experts received in the train pass, over balanced routing's
# (megatron_backend/model.py::RoutedCopies; MoE actors only)
ROUTED_COPIES_RATIO = "train/moe/routed_copies_max_ratio"
# the layer the step's weight-sync reference check sampled (-1: none), for the plan at the step (StepLengths)
REFERENCE_LAYER = "weight_sync/reference_layer"


class RoutingWatch:
    """Says when a step's MoE routing sent one rank's experts more routed copies than the launch plan fits (its
    ``planner.report.routing_headroom``), once per new high: the next such step may run out of device memory. Silent
    for a dense model, EP 1, or a plan that fits any routing."""

    def __init__(self, plan: Plan | None) -> None:

        headroom = None if plan is None else routing_headroom(plan)
        fits = None if headroom is None else headroom.fits_up_to_ratio
        # None where the plan fits any routing, or none (its verdict says so at launch)
        self.limit = fits if fits is not None and fits < headroom.worst_ratio else None
        self.highest = 0.0

    def check(self, step: int, metrics: dict[str, float]) -> str | None:
        ratio = metrics.get(ROUTED_COPIES_RATIO)
        if self.limit is None or ratio is None or ratio <= max(self.limit, self.highest):
            return None
        self.highest = ratio
        return (
            f"warning: step {step}: one rank's experts received {ratio:.2f}x balanced routing's routed copies, beyond "
            f"the {self.limit:.2f}x the plan fits (make plan's MoE routing line): a step routed like it may run out "
            "of device memory; actor.moe_expert_capacity_factor bounds it"
        )


def routing_summary(plan: Plan, records: list[dict]) -> dict | None:
    """summary.json's ``memory_plan.moe_routing``: the plan's routing headroom (planner.report.routing_headroom) and
    the most routed copies any step's train pass sent one rank (``recorded_max_ratio``); None for a dense model or
    EP 1."""

    headroom = routing_headroom(plan)
    if headroom is None:
        return None
    recorded = [r[ROUTED_COPIES_RATIO] for r in records if ROUTED_COPIES_RATIO in r]
    return {**headroom.to_json(), "recorded_max_ratio": max(recorded, default=None)}


def step_lengths(samples: list[Sample]) -> dict[str, float]:
    """The step's token lengths (``lengths/<field>`` of :class:`planner.StepLengths`), over all its samples (every
    rank holds them all after the rollout): the longest is the worst DP rank's, whose batch is padded to its
    longest row (rl/batching.py)."""
    prompts = [len(s.prompt_ids) for s in samples]
    responses = [len(s.response_ids) for s in samples]
    lengths = StepLengths(
        longest_prompt=max(prompts),
        longest_response=max(responses),
        longest_sequence=max(p + r for p, r in zip(prompts, responses, strict=True)),
        mean_prompt=statistics.fmean(prompts),
        mean_response=statistics.fmean(responses),
    )
    return {LENGTHS_PREFIX + k: float(v) for k, v in asdict(lengths).items() if k in _LENGTH_FIELDS}


def recorded_lengths(records: list[dict]) -> dict[int, StepLengths]:
    """step -> :class:`planner.StepLengths` from metrics.jsonl's step records (:func:`step_lengths`, and an MoE
    actor's ``train/moe/routed_copies_max_ratio``); steps recorded before the lengths were are left out."""
    out = {}
    for record in records:
        if "trainer/step" in record and all(LENGTHS_PREFIX + n in record for n in _LENGTH_FIELDS):
            values = {n: record[LENGTHS_PREFIX + n] for n in _LENGTH_FIELDS}
            out[int(record["trainer/step"])] = StepLengths(
                **{n: v if n.startswith("mean") else int(v) for n, v in values.items()},
                routed_copies_ratio=record.get(ROUTED_COPIES_RATIO, 1.0),
                reference_layer=None if REFERENCE_LAYER not in record else int(record[REFERENCE_LAYER]),
            )
    return out


def log_step(timeline: MemoryTimeline, writer: RunWriter | None, step: int, metrics: dict[str, float]) -> int | None:
    """Gather every rank's timeline rows of the step on rank 0 (the one with the ``writer``), which writes them
    and the step's metrics (metrics.jsonl, memory_timeline.csv, W&B). Returns the step's highest measured
    phase peak on rank 0 (None on the others)."""
    rows = _gather_rows(timeline, writer)
    if writer is None:
        return None
    writer.log_timeline(rows)  # the step's, and the end of the last step's log phase
    return max(writer.log_step(step, metrics, [r for r in rows if r["step"] == step]).values())


def log_rows_after_last_step(timeline: MemoryTimeline, writer: RunWriter | None) -> None:
    """Gather the rows sampled since the last :func:`log_step` (the end of the last step's ``log`` phase)
    to rank 0's timeline."""
    rows = _gather_rows(timeline, writer)
    if writer is not None:
        writer.log_timeline(rows)


def _gather_rows(timeline: MemoryTimeline, writer: RunWriter | None) -> list[dict]:
    """The rows every rank sampled since it last gave them, on rank 0 (the one with the writer; collective)."""
    rows = timeline.take_rows()
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    return [r for per_rank in gathered for r in per_rank] if gathered is not None else []


def memory_summary(rows: list[dict], world_size: int) -> dict:
    """The measured memory of a run (summary.json, ``make report``): peaks, hand-offs, drift.

    Steady-state figures are medians over the steps after the first (telemetry.memory_timeline.steady_steps), per rank.
    ``tag_bytes`` is each ledger tag's largest value per rank: what the memory is expected to be made of.
    """
    ranks = range(world_size)
    window = wake_window_phases()
    return {
        "measured_metric": PEAK_METRIC,
        "phase_peak_bytes": phase_peaks(rows),  # max over ranks and steps
        "wake_window_peak_bytes": {str(r): steady_peak(rows, window, r) for r in ranks},
        "rollout_peak_bytes": {str(r): steady_peak(rows, ("rollout",), r) for r in ranks},
        "tag_bytes": {
            str(r): {t: max((int(x[f"tag/{t}"]) for x in rows if x["rank"] == r), default=0) for t in TAGS}
            for r in ranks
        },
        "released_bytes": released_bytes(rows),
        "phase_drift": phase_drift(rows),
    }


def time_summary(rows: list[dict], rank: int = 0) -> dict:
    """Where a step's time goes, on ``rank``'s clock, over the steady steps (telemetry.memory_timeline.steady_steps): the
    median seconds of each phase (its entry sample to its exit sample) and of a whole step (its first
    sample to its last: the work between phases included, and its ``log`` phase)."""
    samples = {k: v for k, v in phase_samples(rows).items() if k[0] == rank}
    steady = set(steady_steps({"step": step, "phase": phase} for (_, step, phase) in samples))
    # a whole step runs the table's first every-step phase; the eval after the last step is a boundary, no step
    whole_steps = {step for (_, step, phase) in samples if phase == PHASES[0]}
    per_phase: dict[str, list[float]] = {}
    step_span: dict[int, tuple[float, float]] = {}
    for (_, step, phase), phase_rows in samples.items():
        first, last = phase_rows[0]["t_s"], phase_rows[-1]["t_s"]
        if step in steady:
            per_phase.setdefault(phase, []).append(last - first)
        if step in whole_steps:
            start, end = step_span.get(step, (first, last))
            step_span[step] = (min(start, first), max(end, last))
    return {
        "phase_median_seconds": {phase: statistics.median(v) for phase, v in per_phase.items()},
        "step_median_seconds": statistics.median(e - s for step, (s, e) in step_span.items() if step in steady),
    }


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What summary.json says about the run beside what it measured: the config's choices, the plan made
    before the engine started (run.memory_plan) and the sync's."""

    exp: str
    wake_strategy: str
    world_size: int
    peak_method: str  # a key of telemetry.memory_timeline.PEAK_METHODS
    plan: Plan | None
    kv_cache: dict | None  # the KV-cache choice (run.memory_plan.KvCacheChoice as a dict)
    actor_optimizer: str  # the megatron-core optimizer class that stepped
    sync_plan: SyncPlan
    t0: float  # time.monotonic() at the rank's start


def summarize(
    facts: RunFacts,
    rewards: list[float],
    rows: list[dict],
    evals: list[dict],
    syncs: list[SyncResult],
    logprob_gaps: list[float],
    warmup_losses: list[float],
) -> dict:
    """summary.json: rewards first/last 5 steps, the evals' first and last (rl.evaluation.eval_summary of the
    ``evals`` records), the measured memory (:func:`memory_summary`), weight-sync totals."""

    plan, sync_plan = facts.plan, facts.sync_plan
    return {
        "exp": facts.exp,
        "steps": len(rewards),
        "reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])),
        "reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
        "eval": eval_summary(evals),
        "memory": memory_summary(rows, facts.world_size),
        "memory_peak_method": facts.peak_method,
        # the plan made before the engine started (run.memory_plan): what it predicted per phase, and the error
        "memory_plan": None
        if plan is None
        else {
            "peak_phase": plan.peak_phase,
            "peak_bytes": plan.peak_bytes,
            "fits": plan.fits,
            # the runtime level measured at launch, before the first step (run/setup.py; None: the fitted level)
            "launch_runtime_bytes": plan.inputs.launch_runtime_bytes,
            "kv_cache": facts.kv_cache,
            # the launch plan is a bound (the longest prompt, max_new_tokens responses): measured <= planned
            "phases": prediction_errors(plan, rows),
            # the model: the plan at each step's recorded lengths (metrics.jsonl's lengths/*), median over steps
            "phases_at_recorded_lengths": prediction_errors(plan, rows, lengths=recorded_lengths(evals)),
            # MoE at EP > 1: how unevenly the steps routed, beside how unevenly the plan fits
            "moe_routing": routing_summary(plan, evals),
        },
        # the figures a sweep compares, planned and measured alike (tools/sweep's table and chart; W&B's sweep views)
        FIGURES_KEY: memory_figures(plan, rows),
        "wake_strategy": facts.wake_strategy,
        "actor_optimizer": facts.actor_optimizer,
        "engine_actor_logprob_diff_max": max(logprob_gaps, default=0.0),
        "weight_sync": {
            "bytes": sync_plan.bytes_moved,  # all ranks, per sync
            "seconds": sum(s.stats.seconds for s in syncs) / max(1, len(syncs)),
            "verified": bool(syncs) and all(s.verified for s in syncs),
            "plan_bytes_moved": sync_plan.bytes_moved,
            "bucket_bytes": sync_plan.bucket_bytes,
        },
        "warmup_sft_loss": warmup_losses[-1] if warmup_losses else None,
        "time": time_summary(rows),
        "wall_seconds": time.monotonic() - facts.t0,
    }


def closing_lines(summary: dict, run_dir) -> list[str]:
    """What ``make run`` prints when it ends (rank 0): the rewards, the measured peak, the plan's largest error, the
    files (everything from ``summary``, as summary.json has it)."""
    mib = 2**20
    lines = [f"done: {summary['steps']} steps in {summary['wall_seconds']:.0f} s"]
    if summary.get("reward_first5") is not None:
        lines[0] += f"; reward {summary['reward_first5']:.3f} (first 5 steps) -> {summary['reward_last5']:.3f} (last 5)"
    final = (summary.get("eval") or {}).get("last")
    if final:
        lines.append(f"eval after {final['completed_steps']:.0f} steps: accuracy {final['accuracy']:.3f}")
    peaks = (summary.get("memory") or {}).get("phase_peak_bytes") or {}
    if peaks:
        phase = max(peaks, key=peaks.get)
        lines.append(
            f"memory: peak {peaks[phase] / mib:.0f} MiB in {phase} ({summary['memory_peak_method']}, worst rank)"
        )
    errors = (summary.get("memory_plan") or {}).get("phases") or {}
    if errors:
        worst = max(errors, key=lambda p: abs(errors[p]["relative_error"]))
        lines.append(
            f"memory plan vs measured: largest error {errors[worst]['relative_error']:+.1%} ({worst}) over "
            f"{len(errors)} phases (summary.json memory_plan)"
        )
    routing = (summary.get("memory_plan") or {}).get("moe_routing")
    if routing and routing["recorded_max_ratio"] is not None:
        fits = routing["fits_up_to_ratio"]
        if fits is None:
            room = "no routing (its verdict says why)"
        else:
            room = "any routing" if fits >= routing["worst_ratio"] else f"up to {fits:.2f}x"
        lines.append(
            f"MoE routing: at most {routing['recorded_max_ratio']:.2f}x balanced routing's copies on one rank; the plan "
            f"fits {room} (summary.json memory_plan.moe_routing)"
        )
    lines.append(
        f"files: {run_dir}/ summary.json metrics.jsonl memory_timeline.csv memory_stages.png memory_timeline.png"
    )
    return lines
