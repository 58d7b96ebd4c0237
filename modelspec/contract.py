"""The actor <-> loss contract: the batch the actor runs and what a loss function receives for each micro-batch.

A :class:`TokenBatch` is B right-padded sequences, identical on every TP/PP rank of one DP group; the step
fills in what each phase computes (``old_logprobs``, ``ref_logprobs``), and the actor hands a loss function
the rows of one micro-batch as a :class:`TokenBatch` too (with ``entropy`` when the loss uses it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class BatchTotals:
    """Denominators of the whole (DP-local) batch, handed to the loss of each micro-batch, so that
    summing micro-batch losses gives the whole batch's loss whatever the split."""

    num_tokens: float
    num_seqs: int


@dataclass(kw_only=True)
class TokenBatch:
    """B sequences of S tokens (prompt + response, right-padded) and what is known of each target position
    ``t`` (predicting ``input_ids[:, t+1]``). Optional fields are None until a phase computes them."""

    input_ids: torch.Tensor  # [B, S] int64
    loss_mask: torch.Tensor | None = None  # [B, S-1] fp32: 1 where the target is a response token
    seq_lens: torch.Tensor | None = None  # [B] int64 real tokens per row (None: every row S)
    engine_logprobs: torch.Tensor | None = None  # [B, S-1] fp32: the engine's log-prob of each sampled token
    advantages: torch.Tensor | None = None  # [B] or [B, S-1] fp32
    sample_index: torch.Tensor | None = None  # [B] int64: which of the step's samples each row is
    old_logprobs: torch.Tensor | None = None  # [B, S-1] fp32: the actor's before training (old_logprob)
    ref_logprobs: torch.Tensor | None = None  # [B, S-1] fp32: the reference actor's (ref_logprob)
    entropy: torch.Tensor | None = None  # [b, S-1] fp32 with gradient: a micro-batch's, for a loss that uses it
    # MoE: the experts the engine routed input token t to, per MoE layer: [B, S, num_moe_layers, top_k] int16,
    # -1 where it did not (the last token, padding); routing replay and the routing-mismatch metric read it
    routed_experts: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(**{name: value.to(device) for name, value in self.tensors().items()})

    def select(self, index: torch.Tensor, device: torch.device) -> TokenBatch:
        """Rows ``index`` [b] of every tensor, on ``device``."""
        return TokenBatch(**{name: v[index.to(v.device)].to(device) for name, v in self.tensors().items()})


# (logprobs [b, S-1] fp32, the micro-batch's TokenBatch, totals) -> (scalar loss, metrics). A loss with a true
# ``uses_entropy`` attribute also gets ``micro_batch.entropy`` [b, S-1] fp32, with its gradient.
LossFn = Callable[[Any, TokenBatch, BatchTotals], tuple[Any, dict]]
