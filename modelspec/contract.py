"""The actor <-> loss contract: what a loss function receives for each micro-batch.

Batches are dicts of tensors, identical on every TP/PP rank of one DP group:
``input_ids`` [B, S] int64 right-padded prompt + response; ``loss_mask`` [B, S-1] (1 where the target
``input_ids[:, t+1]`` is a response token); for training whatever the loss reads (``old_logprobs``,
``ref_logprobs`` [B, S-1] fp32, ``advantages`` [B] or [B, S-1]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchTotals:
    """Denominators of the whole (DP-local) batch, handed to the loss of each micro-batch, so that
    summing micro-batch losses gives the whole batch's loss whatever the split."""

    num_tokens: float
    num_seqs: int


# (logprobs [b, S-1] fp32, micro_batch dict, totals) -> (scalar loss, metrics). A loss with a true
# ``uses_entropy`` attribute also gets ``micro_batch["entropy"]`` [b, S-1] fp32, with its gradient.
LossFn = Callable[[Any, dict, BatchTotals], tuple[Any, dict]]
