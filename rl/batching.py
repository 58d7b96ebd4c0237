"""Samples -> this DP rank's training batch: right-padded tokens, the loss mask, GRPO advantages.

Shapes (B sequences of this DP rank, S = longest prompt + response):
``input_ids`` [B, S] int64; ``loss_mask`` [B, S-1] (1 where the target ``input_ids[:, t+1]`` is a
response token); ``engine_logprobs`` [B, S-1] (the engine's log-prob of each sampled token, 0
elsewhere); ``advantages`` [B].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def pack_sequences(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids [B, S] = prompt + response, right-padded; loss_mask [B, S-1] on response targets."""
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
    return {"input_ids": input_ids, "loss_mask": loss_mask, "engine_logprobs": engine_logprobs}


def make_batch(
    samples: list[Sample], group_size: int, dp: int, dp_rank: int, pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This DP rank's share of the step (whole GRPO groups: samples of a prompt are adjacent), and the
    rewards of all samples [N] for the metrics."""
    rewards = torch.tensor([s.reward for s in samples])
    advantages = grpo_advantages(rewards, group_size=group_size)
    per_rank = len(samples) // dp
    share = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    batch = pack_sequences(samples[share], pad_id=pad_id)
    batch["advantages"] = advantages[share]
    return {k: v.to(device) for k, v in batch.items()}, rewards
