"""Log-probs and entropy from vocab-parallel logits, without gathering the full vocab on any rank.

Each TP rank holds logits [N, V_local] for vocab rows [vocab_start, vocab_start + V_local) of the
padded vocab. Rows >= the real vocab size are padding and are masked out (their logits would
otherwise take probability mass). Reductions over the vocab are an all-reduce of the max, of the
sum of exp and of the target logit over the TP group (passed explicitly; None = no TP).

:func:`fused_logprobs_entropy` is what the actor uses: log-probs and entropy of selected rows (the
response tokens) chunk by chunk, with a backward that recomputes each chunk's softmax from the
logits and the saved log-sum-exp, so no [tokens, vocab] fp32 tensor lives for the whole
micro-batch. :func:`vocab_parallel_logprobs` (all rows at once, softmax kept for backward) and
:func:`vocab_parallel_entropy` are the unfused references the tests pin it against.
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


class _FusedLogprobEntropy(torch.autograd.Function):
    """Log-prob of ``target`` and entropy at ``rows`` of ``logits``, ``chunk_tokens`` rows at a time.

    Forward per chunk: gather the chunk's rows, fp32, mask vocab padding, all-reduce max / sum-exp /
    target logit / sum p*l over TP -> logprob, entropy and lse [chunk]. Saved for backward: the logits
    (the model's output, no copy), rows, target, lse and entropy [M] (and with ``keep_softmax`` each
    chunk's fp32 softmax, what plain autograd would keep). Backward per chunk, no collectives (lse and
    H are global): p = exp(l - lse); d logprob / d l = onehot - p; d H / d l = -p (l - lse + H).
    """

    @staticmethod
    def forward(ctx, logits, rows, target, vocab_start, vocab_size, tp_group, chunk_tokens, keep_softmax):
        # logits [N, V_local] (model dtype); rows [M] int64 row indices; target [M] global token ids
        num_rows, num_local = rows.shape[0], logits.shape[-1]
        step = max(1, chunk_tokens or num_rows)
        pad = _pad_mask(num_local, vocab_start, vocab_size, logits.device)
        logprob = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logprob)
        lse = torch.empty_like(logprob)
        kept = []
        for start in range(0, num_rows, step):
            idx = rows[start : start + step]
            block = logits.index_select(0, idx).float()  # [n, V_local] fp32: the only full-width temporary
            if pad is not None:
                block.masked_fill_(pad, float("-inf"))
            block_max = _all_reduce(block.max(dim=-1).values, dist.ReduceOp.MAX, tp_group)  # [n]
            block.sub_(block_max.unsqueeze(-1))  # shifted logits
            exp = torch.exp(block)  # [n, V_local]
            sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group)  # [n]
            local_target = target[start : start + step] - vocab_start
            in_range = (local_target >= 0) & (local_target < num_local)
            safe = torch.where(in_range, local_target, torch.zeros_like(local_target))
            target_shifted = torch.where(in_range, block.gather(-1, safe.unsqueeze(-1)).squeeze(-1), 0.0)
            target_shifted = _all_reduce(target_shifted, dist.ReduceOp.SUM, tp_group)
            # sum_v exp * shifted (padding columns: 0 * -inf = nan -> 0)
            weighted = block.mul_(exp)
            if pad is not None:
                weighted.nan_to_num_(nan=0.0)
            weighted = _all_reduce(weighted.sum(dim=-1), dist.ReduceOp.SUM, tp_group)
            log_sum_exp = torch.log(sum_exp)
            logprob[start : start + step] = target_shifted - log_sum_exp
            entropy[start : start + step] = log_sum_exp - weighted / sum_exp
            lse[start : start + step] = log_sum_exp + block_max
            if keep_softmax:
                kept.append(exp.div_(sum_exp.unsqueeze(-1)))
            del block, exp, weighted
        ctx.save_for_backward(logits, rows, target, lse, entropy)
        ctx.kept = kept
        ctx.step, ctx.vocab_start, ctx.vocab_size = step, vocab_start, vocab_size
        ctx.set_materialize_grads(False)  # an unused output (entropy as a metric) costs no backward work
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 8
        logits, rows, target, lse, entropy = ctx.saved_tensors
        kept, step = ctx.kept, ctx.step
        num_local = logits.shape[-1]
        pad = _pad_mask(num_local, ctx.vocab_start, ctx.vocab_size, logits.device)
        grad_logits = torch.zeros_like(logits)  # [N, V_local] in the logits' dtype
        for i, start in enumerate(range(0, rows.shape[0], step)):
            idx = rows[start : start + step]
            if kept:
                probs = kept[i]
                kept[i] = None
            else:
                probs = logits.index_select(0, idx).float()  # [n, V_local]
                if pad is not None:
                    probs.masked_fill_(pad, float("-inf"))
                probs.sub_(lse[start : start + step].unsqueeze(-1)).exp_()  # softmax, padding columns 0
            if grad_entropy is not None:
                # dH/dl = -p (log p + H) (xlogy: 0 log 0 = 0 on padding columns)
                grad = torch.special.xlogy(probs, probs)
                grad.addcmul_(probs, entropy[start : start + step].unsqueeze(-1))
                grad.mul_(-grad_entropy[start : start + step].unsqueeze(-1))
                if grad_logprob is not None:
                    grad.addcmul_(probs, -grad_logprob[start : start + step].unsqueeze(-1))
            else:
                grad = probs.mul_(-grad_logprob[start : start + step].unsqueeze(-1))
            if grad_logprob is not None:  # d logprob / d l = onehot(target) - p
                g_lp = grad_logprob[start : start + step]
                local_target = target[start : start + step] - ctx.vocab_start
                in_range = (local_target >= 0) & (local_target < num_local)
                safe = torch.where(in_range, local_target, torch.zeros_like(local_target))
                grad.scatter_add_(-1, safe.unsqueeze(-1), (g_lp * in_range).unsqueeze(-1))
            grad_logits.index_add_(0, idx, grad.to(grad_logits.dtype))
            del probs, grad
        ctx.kept = None
        return grad_logits, None, None, None, None, None, None, None


def fused_logprobs_entropy(
    logits: torch.Tensor,
    rows: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    tp_group=None,
    chunk_tokens: int | None = 1024,
    keep_softmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target) [M], entropy [M]) fp32 at ``rows`` [M] of ``logits`` [..., V_local], differentiable.

    ``chunk_tokens`` rows are processed at a time (None: all M together). The backward recomputes
    each chunk's softmax unless ``keep_softmax`` (then [M, V_local] fp32 stays alive until backward,
    as an unfused autograd graph would keep it). Rows not in ``rows`` get zero gradient.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return _FusedLogprobEntropy.apply(flat, rows, target, vocab_start, vocab_size, tp_group, chunk_tokens, keep_softmax)
