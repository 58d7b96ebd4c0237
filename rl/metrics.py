"""What a step and a run report: rewards, lengths, throughput, phase seconds, weight-sync bytes, and
the run summary (summary.json)."""

from __future__ import annotations

import time

import torch

from rl.batching import Sample
from rl.memory import phase_peaks, window_peak
from rl.weight_sync import SyncResult


def engine_actor_logprob_gap(batch: dict[str, torch.Tensor]) -> float:
    """max |engine log-prob - actor log-prob| over this DP rank's response tokens: the two must agree
    (same weights), so a jump shows a broken weight sync or a layout bug at once."""
    mask = batch["loss_mask"] > 0
    return float((batch["old_logprobs"] - batch["engine_logprobs"])[mask].abs().max()) if mask.any() else 0.0


def step_metrics(
    samples: list[Sample],
    rewards: torch.Tensor,
    num_train_tokens: int,
    train: dict[str, float],
    phase_seconds: dict[str, float],
    sync: SyncResult,
    logprob_gap: float,
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
        "rollout/engine_actor_logprob_diff_max": logprob_gap,
    }
    out.update({f"train/{k}": float(v) for k, v in train.items()})
    out.update({f"time/{k}": v for k, v in phase_seconds.items()})
    return out


def summarize(ctx, rewards: list[float], rows: list[dict], syncs: list[SyncResult], warmup_losses: list[float]) -> dict:
    """summary.json: rewards first/last 5 steps, per-phase peaks, the wake-window peak, weight-sync totals."""
    per_rank_window = {
        r: window_peak([row for row in rows if row["rank"] == r], "wake_weights", "wake_kv_cache")
        for r in range(ctx.mesh.world_size)
    }
    plan = ctx.weight_sync.plan
    return {
        "exp": ctx.cfg.exp,
        "steps": len(rewards),
        "reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])),
        "reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
        "phase_peak_bytes": phase_peaks(rows),
        "wake_window_peak_bytes": max(per_rank_window.values(), default=0),
        "actor_param_bytes": ctx.actor.memory().get("host/actor_params", 0)
        or ctx.actor.memory().get("actor_params", 0),
        "wake_strategy": ctx.cfg.rollout.wake_strategy,
        "weight_sync": {
            "bytes": plan.bytes_moved,  # all ranks, per sync
            "seconds": sum(s.stats.seconds for s in syncs) / max(1, len(syncs)),
            "verified": bool(syncs) and all(s.verified for s in syncs),
            "plan_bytes_moved": plan.bytes_moved,
            "bucket_bytes": plan.bucket_bytes,
        },
        "warmup_sft_loss": warmup_losses[-1] if warmup_losses else None,
        "wall_seconds": time.monotonic() - ctx.t0,
    }
