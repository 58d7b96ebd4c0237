"""Sampling for the native engine: greedy, or temperature / top-k / top-p with one seeded generator.

Log-probs returned are the model's raw ones (log_softmax of the logits before temperature, top-k and top-p,
as vLLM's default ``logprobs_mode="raw_logprobs"``). Under tensor parallelism every rank continues with
rank 0's tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollout.engine import SamplingParams


class Sampler:
    """logits [B, V] -> (tokens [B], their raw log-probs [B]) for one ``generate`` call."""

    def __init__(
        self, params: SamplingParams, device: torch.device, group: dist.ProcessGroup | None = None, src_rank: int = 0
    ) -> None:
        self.params, self.group, self.src_rank = params, group, src_rank
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = self.params
        logits = logits.float()
        log_normalizer = torch.logsumexp(logits, dim=-1)  # [B]: log p(token) = logit - log_normalizer
        if params.temperature == 0:
            chosen, tokens = logits.max(dim=-1)
            if self.group is None:
                return tokens, chosen - log_normalizer
        else:
            scaled = logits / params.temperature
            if params.top_k > 0 and params.top_k < scaled.shape[-1]:
                kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if params.top_p < 1.0:
                sorted_logits, order = scaled.sort(dim=-1, descending=True)
                probs = sorted_logits.softmax(dim=-1)
                drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
                scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
            probs = scaled.softmax(dim=-1)
            # freed before multinomial's [B, V] exponential draws: CUDA's caching allocator hands them its block
            # (one [B, V] fp32 fewer at the draw); glibc does not (colocation/engines.py, the native profile)
            del scaled
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            del probs
        if self.group is not None:  # every TP rank continues with rank 0's tokens
            dist.broadcast(tokens, src=self.src_rank, group=self.group)
        return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - log_normalizer
