"""Log-probs and entropy from vocab-parallel logits, without gathering the full vocab on any rank.

Each TP rank holds logits [N, V_local] for vocab rows [vocab_start, vocab_start + V_local) of the
padded vocab. Rows >= the real vocab size are padding and are masked out (their logits would
otherwise take probability mass). Reductions over the vocab are an all-reduce of the max, of the
sum of exp and of the target logit over the TP group (passed explicitly; None = no TP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _pad_mask(num_local: int, vocab_start: int, vocab_size: int, device) -> torch.Tensor | None:
    """[V_local] True where the column is vocab padding (global index >= vocab_size)."""
    if vocab_start + num_local <= vocab_size:
        return None
    return torch.arange(vocab_start, vocab_start + num_local, device=device) >= vocab_size


class _VocabParallelLogprob(torch.autograd.Function):
    """logprob[n] = logits[n, target[n]] - logsumexp_v logits[n, v], the vocab split across TP."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, tp_group):
        # logits [N, V_local] (any float dtype; computed in fp32), target [N] global token ids
        logits = logits.float()
        pad = _pad_mask(logits.shape[-1], vocab_start, vocab_size, logits.device)
        if pad is not None:
            logits = logits.masked_fill(pad, float("-inf"))
        logits_max = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, tp_group)  # [N]
        exp = torch.exp(logits - logits_max.unsqueeze(-1))  # [N, V_local]
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group)  # [N]
        local_target = target - vocab_start
        in_range = (local_target >= 0) & (local_target < logits.shape[-1])
        safe = torch.where(in_range, local_target, torch.zeros_like(local_target))
        target_logit = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1) - logits_max
        target_logit = _all_reduce(torch.where(in_range, target_logit, 0.0), dist.ReduceOp.SUM, tp_group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [N, V_local], reused in backward
        ctx.save_for_backward(softmax, safe, in_range)
        return target_logit - torch.log(sum_exp)

    @staticmethod
    def backward(ctx, grad_out):
        softmax, safe, in_range = ctx.saved_tensors
        # d logprob / d logits = onehot(target) - softmax (padding columns: softmax 0 -> grad 0)
        grad = -softmax * grad_out.unsqueeze(-1)
        grad.scatter_add_(-1, safe.unsqueeze(-1), (grad_out * in_range).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_size: int, tp_group=None
) -> torch.Tensor:
    """logits [..., V_local] + target [...] -> log p(target) [...] in fp32, differentiable."""
    shape = target.shape
    out = _VocabParallelLogprob.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_start, vocab_size, tp_group
    )
    return out.reshape(shape)


@torch.no_grad()
def vocab_parallel_entropy(
    logits: torch.Tensor, vocab_start: int, vocab_size: int, tp_group=None, chunk_tokens: int | None = 1024
) -> torch.Tensor:
    """Entropy [...] of softmax over the (TP-split) vocab, ``chunk_tokens`` rows at a time.

    H = logsumexp(l) - sum_v softmax(l)_v * l_v. Only a [chunk_tokens, V_local] fp32 temporary lives at
    once; ``chunk_tokens=None`` does all rows together (the unchunked reference).
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V_local]
    num_tokens = flat.shape[0]
    step = num_tokens if not chunk_tokens else chunk_tokens
    pad = _pad_mask(flat.shape[-1], vocab_start, vocab_size, flat.device)
    out = torch.empty(num_tokens, dtype=torch.float32, device=flat.device)
    for start in range(0, num_tokens, max(step, 1)):
        block = flat[start : start + step].float()  # [n, V_local]
        if pad is not None:
            block = block.masked_fill(pad, float("-inf"))
        block_max = _all_reduce(block.max(dim=-1).values, dist.ReduceOp.MAX, tp_group)  # [n]
        shifted = block - block_max.unsqueeze(-1)  # [n, V_local]
        del block
        exp = torch.exp(shifted)  # [n, V_local]
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group)
        # sum_v exp * shifted, in place; padding columns are 0 * -inf = nan -> 0
        weighted = shifted.mul_(exp)
        if pad is not None:
            weighted.nan_to_num_(nan=0.0)
        weighted = _all_reduce(weighted.sum(dim=-1), dist.ReduceOp.SUM, tp_group)
        out[start : start + step] = torch.log(sum_exp) - weighted / sum_exp
        del shifted, exp
    return out.reshape(logits.shape[:-1])
