"""RL policy losses on per-token log-probs (no megatron): PPO-clip with dual-clip, KL to a reference.

Tensors are [B, T] over the target positions of a batch (T = sequence length - 1); ``loss_mask``
[B, T] is 1 on response tokens. A loss over micro-batches is made exact for the whole batch by
normalizing with the batch's totals (``BatchTotals``), not the micro-batch's, then summing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelspec import BatchTotals, TokenBatch

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k3")


@dataclass
class PolicyLossConfig:
    """PPO-clip policy loss (``algorithm.*``)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = 3.0  # lower bound on the loss for negative advantages; null disables
    kl_coef: float = 0.0  # 0 disables the KL term (no reference model needed)
    kl_estimator: str = "k3"
    loss_agg: str = "token-mean"
    # entropy bonus: loss -= entropy_coef x entropy (aggregated like the loss); > 0 makes the actor
    # hand the loss the entropy with its gradient (actor.entropy_recompute decides what backward keeps)
    entropy_coef: float = 0.0
    # MoE routing replay (R3): old_logprob, ref_logprob and train route each token the engine routed to the experts
    # the engine chose (megatron_backend.routing_replay); RunConfig refuses it for a dense model or an engine that
    # cannot return its routing
    routing_replay: bool = False

    def __post_init__(self) -> None:
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError("algorithm.clip_eps_low / algorithm.clip_eps_high must be >= 0")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"algorithm.dual_clip_c={self.dual_clip_c} must be > 1, or null to disable dual-clip")
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_coef={self.kl_coef} must be >= 0")
        if self.entropy_coef < 0:
            raise ValueError(f"algorithm.entropy_coef={self.entropy_coef} must be >= 0 (0 disables the entropy bonus)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"algorithm.kl_estimator={self.kl_estimator!r} is not one of {KL_ESTIMATORS}")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"algorithm.loss_agg={self.loss_agg!r} is not one of {LOSS_AGGREGATIONS}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate [B, T]: k1 = log r, k3 = 1/r - 1 + log r with r = pi/ref."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"kl estimator {estimator!r} is not one of {KL_ESTIMATORS}")


def ppo_clip_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss [B, T] and a [B, T] bool of where clipping was active."""
    ratio = torch.exp(logprobs - old_logprobs)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if dual_clip_c is not None:  # dual-clip (Ye et al. 2020): cap the loss at -c * A where A < 0
        capped = torch.minimum(loss, -advantages * dual_clip_c)
        clipped = clipped | ((advantages < 0) & (capped < loss))
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clipped


def aggregate(per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str, totals: BatchTotals) -> torch.Tensor:
    """Reduce [B, T] to a scalar so that summing over micro-batches gives the whole batch's loss.

    token-mean: sum of masked tokens / batch tokens. seq-mean-token-sum: per-sequence token sum,
    averaged over the batch's sequences.
    """
    masked = per_token * loss_mask
    if mode == "token-mean":
        return masked.sum() / max(totals.num_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(totals.num_seqs, 1)
    raise ValueError(f"loss_agg={mode!r} is not one of {LOSS_AGGREGATIONS}")


class PolicyLoss:
    """The actor's loss function: ``(logprobs, micro_batch, totals) -> (loss, metrics)``.

    ``micro_batch`` holds ``loss_mask``, ``old_logprobs``, ``advantages`` ([B, T], or [B] broadcast
    over tokens), with ``kl_coef > 0`` ``ref_logprobs``, and with ``entropy_coef > 0`` ``entropy`` [B, T]
    (differentiable; the actor adds it when ``uses_entropy``). Metrics are already scaled like the loss
    (sums over micro-batches give batch values).
    """

    def __init__(self, config: PolicyLossConfig):
        self.config = config
        self.uses_entropy = config.entropy_coef > 0  # read by the actor (modelspec.contract)

    def __call__(self, logprobs: torch.Tensor, micro_batch: TokenBatch, totals: BatchTotals):
        cfg = self.config
        mask = micro_batch.loss_mask.to(logprobs.dtype)
        advantages = micro_batch.advantages.to(logprobs.dtype)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1).expand_as(logprobs)
        per_token, clipped = ppo_clip_per_token(
            logprobs, micro_batch.old_logprobs, advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c
        )
        pg_loss = aggregate(per_token, mask, cfg.loss_agg, totals)
        metrics = {
            "pg_loss": pg_loss.detach(),
            "clip_frac": (clipped.float() * mask).sum() / max(totals.num_tokens, 1.0),
        }
        loss = pg_loss
        if cfg.kl_coef > 0:
            kl = kl_penalty(logprobs, micro_batch.ref_logprobs, cfg.kl_estimator)
            kl_loss = aggregate(kl, mask, cfg.loss_agg, totals)
            loss = loss + cfg.kl_coef * kl_loss
            metrics["kl"] = kl_loss.detach()
        if cfg.entropy_coef > 0:
            entropy_bonus = aggregate(micro_batch.entropy, mask, cfg.loss_agg, totals)
            loss = loss - cfg.entropy_coef * entropy_bonus
        metrics["loss"] = loss.detach()
        return loss, metrics


def sft_loss(logprobs: torch.Tensor, micro_batch: TokenBatch, totals: BatchTotals) -> tuple[torch.Tensor, dict]:
    """Supervised warm-up: mean negative log-likelihood of the response tokens over the whole batch."""
    mask = micro_batch.loss_mask.to(logprobs.dtype)
    loss = -(logprobs * mask).sum() / max(totals.num_tokens, 1.0)
    return loss, {"sft_loss": loss.detach()}
