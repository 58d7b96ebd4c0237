"""Advantage estimators that need no model: GRPO group-normalized advantages."""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards [num_groups * group_size] (samples of one prompt adjacent) -> advantages, same shape.

    A_i = (r_i - mean(group)) / (std(group) + eps); ``normalize_by_std=False`` keeps only the
    centering (Dr. GRPO). std is the unbiased sample std, as in the GRPO paper and verl.
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} is not a flat multiple of group_size={group_size}")
    grouped = rewards.float().reshape(-1, group_size)  # [num_groups, group_size]
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)
