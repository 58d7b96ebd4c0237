"""Samples -> this DP rank's training batch (``modelspec.TokenBatch``): right-padded tokens, the loss mask,
GRPO advantages.

Shapes (B sequences of this DP rank, S = longest prompt + response):
``input_ids`` [B, S] int64; ``seq_lens`` [B] int64 (prompt + response tokens of each row: what the
actor packs when ``actor.remove_padding``); ``loss_mask`` [B, S-1] (1 where the target
``input_ids[:, t+1]`` is a response token); ``engine_logprobs`` [B, S-1] (the engine's log-prob of
each sampled token, 0 elsewhere; :func:`make_batch` refuses a sample whose engine log-probs are missing or
of another count than its response); ``advantages`` [B]; MoE, when the engine returned them:
``routed_experts`` [B, S, num_moe_layers, top_k] int16 (the engine's experts for input token t, -1 where it
did not route it: the last token, padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_backend.packing import balanced_bins
from modelspec import TokenBatch
from rl.advantages import grpo_advantages


@dataclass
class Sample:
    """One completion of one prompt, as every rank holds it after the rollout."""

    problem_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # the engine's log-prob of each response token
    finish_reason: str
    reward: float
    # MoE: [num_moe_layers, len(prompt) + len(response) - 1, top_k] (rollout.Completion.routed_experts)
    routed_experts: torch.Tensor | None = None


def pack_sequences(samples: list[Sample], pad_id: int) -> TokenBatch:
    """input_ids [B, S] = prompt + response, right-padded; seq_lens [B]; loss_mask [B, S-1] on response targets."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq_len = max(lengths)
    input_ids = torch.full((len(samples), seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), seq_len - 1), dtype=torch.float32)
    engine_logprobs = torch.zeros((len(samples), seq_len - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        tokens = s.prompt_ids + s.response_ids
        input_ids[i, : len(tokens)] = torch.tensor(tokens)
        # target position t predicts input_ids[t + 1]; response tokens start at len(prompt)
        loss_mask[i, len(s.prompt_ids) - 1 : len(tokens) - 1] = 1.0
        if s.response_logprobs:
            engine_logprobs[i, len(s.prompt_ids) - 1 : len(tokens) - 1] = torch.tensor(s.response_logprobs)
    routed = None
    if samples and all(s.routed_experts is not None for s in samples):
        num_layers, _, top_k = samples[0].routed_experts.shape
        routed = torch.full((len(samples), seq_len, num_layers, top_k), -1, dtype=torch.int16)
        for i, s in enumerate(samples):  # token t's routing, for every token but the last
            routed[i, : s.routed_experts.shape[1]] = s.routed_experts.permute(1, 0, 2)
    return TokenBatch(
        input_ids=input_ids,
        seq_lens=torch.tensor(lengths, dtype=torch.long),
        loss_mask=loss_mask,
        engine_logprobs=engine_logprobs,
        routed_experts=routed,
    )


def balanced_dp_shares(lengths: list[int], dp: int) -> list[list[int]]:
    """Split sequence indices over ``dp`` ranks: equal counts, token sums as even as greedy
    longest-first gets them (megatron_backend.packing.balanced_bins); deterministic on every rank."""
    if len(lengths) % dp:
        raise ValueError(f"{len(lengths)} sequences do not split evenly over {dp} DP ranks")
    return balanced_bins(lengths, dp, max_count=len(lengths) // dp)


def make_batch(
    samples: list[Sample],
    group_size: int,
    dp: int,
    dp_rank: int,
    pad_id: int,
    device: torch.device,
    balance_tokens: bool = False,
) -> tuple[TokenBatch, torch.Tensor]:
    """This DP rank's share of the step, and the rewards of all samples [N] for the metrics.

    Advantages are computed over all samples first (GRPO groups are adjacent in ``samples``), so the
    share need not hold whole groups: ``balance_tokens`` (``actor.balance_dp_tokens``) gives every rank
    as many sequences and about as many tokens (:func:`balanced_dp_shares`); otherwise rank r takes the
    r-th contiguous slice (whole groups).
    """
    for index, s in enumerate(samples):  # the log-prob gap check and the loss compare against these
        if len(s.response_logprobs) != len(s.response_ids):
            raise ValueError(
                f"sample {index}: the engine returned {len(s.response_logprobs)} log-probs for {len(s.response_ids)} "
                "response tokens; it must return the log-prob of every sampled token (rollout engine bug)"
            )
        routed_tokens = len(s.prompt_ids) + len(s.response_ids) - 1
        if s.routed_experts is not None and s.routed_experts.shape[1] != routed_tokens:
            raise ValueError(
                f"sample {index}: the engine returned routed experts for {s.routed_experts.shape[1]} tokens, not the "
                f"{routed_tokens} it ran (prompt and every sampled token but the last; rollout engine bug)"
            )
    rewards = torch.tensor([s.reward for s in samples])
    advantages = grpo_advantages(rewards, group_size=group_size)
    per_rank = len(samples) // dp
    if balance_tokens and dp > 1:
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        share = balanced_dp_shares(lengths, dp)[dp_rank]
    else:
        share = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    batch = pack_sequences([samples[i] for i in share], pad_id=pad_id)
    batch.advantages = advantages[share]
    batch.sample_index = torch.tensor(share)  # [B]: which of the step's samples each row is
    # the routing stays in host memory ([B, S, layers, k] int16: 768 B a token on Qwen3-30B-A3B); each forward
    # moves one micro-batch's share, layer by layer (megatron_backend/routing_replay.py)
    routed, batch.routed_experts = batch.routed_experts, None
    batch = batch.to(device)
    batch.routed_experts = routed
    return batch, rewards
