"""Vocab-parallel log-probs/entropy (TP=2, padded vocab) against full-vocab torch; RL losses; GRPO."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from modelspec import TokenBatch
from tests.dist import run_ranks
from tests.numeric import assert_close_across_layouts

VOCAB, PADDED = 99, 128  # real vocab, padded to 64 per rank at TP=2 (the last 29 columns are padding)


def _logits_and_target():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, PADDED, generator=gen) * 4  # [B, T, V_padded]
    logits[..., VOCAB:] = 50.0  # padding columns would dominate if they were not masked
    target = torch.randint(0, VOCAB, (3, 5), generator=gen)
    return logits, target


def _vocab_parallel(rank, world_size):
    import torch.distributed as dist

    from megatron_backend.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs

    dist.init_process_group("gloo")
    logits, target = _logits_and_target()
    rows = PADDED // world_size
    local = logits[..., rank * rows : (rank + 1) * rows].clone().requires_grad_(True)  # [B, T, 64]
    logprobs = vocab_parallel_logprobs(local, target, rank * rows, VOCAB, dist.group.WORLD)
    (logprobs * torch.arange(15.0).view(3, 5)).sum().backward()
    entropy = vocab_parallel_entropy(local.detach(), rank * rows, VOCAB, dist.group.WORLD, chunk_tokens=4)
    return logprobs.detach(), local.grad, entropy


@pytest.mark.numeric
def test_vocab_parallel_logprobs_entropy_and_grad_match_full_vocab():
    results = run_ranks(_vocab_parallel, 2)
    logits, target = _logits_and_target()
    full = logits[..., :VOCAB].clone().requires_grad_(True)
    log_softmax = torch.log_softmax(full, dim=-1)
    expected = log_softmax.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    (expected * torch.arange(15.0).view(3, 5)).sum().backward()
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1).detach()
    grad = torch.cat([results[0][1], results[1][1]], dim=-1)  # [B, T, 128]
    for logprobs, _, entropy in results:  # the vocab split into 2 shards: another summation order
        assert_close_across_layouts(logprobs, expected.detach(), "log-probs")
        assert_close_across_layouts(entropy, expected_entropy, "entropy")
    assert_close_across_layouts(grad[..., :VOCAB], full.grad, "grad")
    assert not grad[..., VOCAB:].any()  # padding columns get no gradient


ROWS = torch.tensor([0, 2, 3, 6, 7, 8, 11, 14])  # response targets among the 15 flattened positions


def _fused_vocab_parallel(rank, world_size, chunk_tokens, keep_softmax):
    import torch.distributed as dist

    from megatron_backend.logprobs import fused_logprobs_entropy

    dist.init_process_group("gloo")
    logits, target = _logits_and_target()
    rows = PADDED // world_size
    local = logits[..., rank * rows : (rank + 1) * rows].clone().requires_grad_(True)  # [B, T, 64]
    logprobs, entropy = fused_logprobs_entropy(
        local, ROWS, target.reshape(-1)[ROWS], rank * rows, VOCAB, dist.group.WORLD, chunk_tokens, keep_softmax
    )
    weights = torch.arange(1.0, 1.0 + len(ROWS))
    (logprobs * weights + 0.3 * entropy * weights.flip(0)).sum().backward()
    return logprobs.detach(), entropy.detach(), local.grad


@pytest.mark.numeric
@pytest.mark.parametrize("chunk_tokens,keep_softmax", [(3, False), (None, True)])
def test_fused_chunked_logprobs_entropy_grads_match_unchunked_full_vocab(chunk_tokens, keep_softmax):
    """TP=2, padded vocab: chunked log-prob + entropy at selected rows, and their gradients (recomputed
    per chunk in backward), equal full-vocab torch autograd; unselected rows and padding get no grad."""
    results = run_ranks(_fused_vocab_parallel, 2, chunk_tokens, keep_softmax)
    logits, target = _logits_and_target()
    full = logits[..., :VOCAB].reshape(-1, VOCAB).clone().requires_grad_(True)  # [15, 99]
    log_softmax = torch.log_softmax(full[ROWS], dim=-1)
    expected = log_softmax.gather(-1, target.reshape(-1)[ROWS].unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    weights = torch.arange(1.0, 1.0 + len(ROWS))
    (expected * weights + 0.3 * expected_entropy * weights.flip(0)).sum().backward()
    grad = torch.cat([results[0][2], results[1][2]], dim=-1).reshape(-1, PADDED)  # [15, 128]
    for logprobs, entropy, _ in results:  # vocab shards and token chunks: another summation order
        assert_close_across_layouts(logprobs, expected.detach(), "log-probs")
        assert_close_across_layouts(entropy, expected_entropy.detach(), "entropy")
    assert_close_across_layouts(grad[:, :VOCAB], full.grad, "grad")
    assert full.grad[ROWS].abs().min() > 0
    assert not grad[:, VOCAB:].any()  # padding columns
    others = torch.ones(15, dtype=torch.bool)
    others[ROWS] = False
    assert not grad[others].any()  # rows not asked for


def test_chunked_entropy_equals_unchunked_single_rank():
    from megatron_backend.logprobs import vocab_parallel_entropy

    logits, _ = _logits_and_target()
    chunked = vocab_parallel_entropy(logits, 0, VOCAB, None, chunk_tokens=2)
    unchunked = vocab_parallel_entropy(logits, 0, VOCAB, None, chunk_tokens=None)
    assert torch.equal(chunked, unchunked) and chunked.shape == (3, 5)


def test_ppo_dual_clip_kl_and_aggregation():
    from rl.losses import BatchTotals, PolicyLoss, PolicyLossConfig, kl_penalty, ppo_clip_per_token

    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 10.0, 1.0]]))  # ratios 1.5, 0.5, 10, 1
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = ppo_clip_per_token(new, old, adv, 0.2, 0.2, dual_clip_c=3.0)
    # A>0: max(-1.5, -1.2) = -1.2 (clipped); max(-0.5, -0.8) = -0.5; A<0, ratio 10: min(10, 3) = 3 (dual-clip)
    assert torch.allclose(loss, torch.tensor([[-1.2, -0.5, 3.0, 1.0]]))
    assert clipped.tolist() == [[True, False, True, False]]
    no_dual, _ = ppo_clip_per_token(new, old, adv, 0.2, 0.2, dual_clip_c=None)
    assert no_dual[0, 2] == 10.0
    ref = torch.log(torch.tensor([[1.0, 1.0, 1.0, 2.0]]))
    assert torch.allclose(kl_penalty(new, ref, "k1"), new - ref)
    k3 = kl_penalty(new, ref, "k3")
    assert (k3 >= 0).all() and torch.allclose(k3, torch.exp(ref - new) - 1 - (ref - new))

    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    batch = TokenBatch(
        input_ids=torch.zeros(2, 5, dtype=torch.long),  # the loss reads no tokens
        loss_mask=mask,
        old_logprobs=torch.zeros(2, 4),
        advantages=torch.tensor([1.0, 2.0]),
    )
    logprobs = torch.zeros(2, 4)
    totals = BatchTotals(num_tokens=6.0, num_seqs=2)
    token_mean, _ = PolicyLoss(PolicyLossConfig(loss_agg="token-mean"))(logprobs, batch, totals)
    seq_mean, _ = PolicyLoss(PolicyLossConfig(loss_agg="seq-mean-token-sum"))(logprobs, batch, totals)
    assert token_mean.item() == pytest.approx(-(4 * 1 + 2 * 2) / 6)
    assert seq_mean.item() == pytest.approx(-(4 * 1 + 2 * 2) / 2)
    # micro-batches summed with batch totals give the whole-batch loss
    halves = [batch.select(torch.tensor([i]), torch.device("cpu")) for i in range(2)]
    parts = [PolicyLoss(PolicyLossConfig())(logprobs[i : i + 1], halves[i], totals)[0] for i in range(2)]
    assert sum(parts).item() == pytest.approx(token_mean.item())
    with pytest.raises(ValueError, match="dual_clip_c"):
        PolicyLossConfig(dual_clip_c=0.5)
    with pytest.raises(ValueError, match="loss_agg"):
        PolicyLossConfig(loss_agg="mean")


def test_grpo_advantages():
    from rl.advantages import grpo_advantages

    rewards = torch.tensor([1.0, 0.0, 1.0, 2.0, 2.0, 2.0])  # group 2 is constant
    adv = grpo_advantages(rewards, group_size=3)
    groups = adv.view(2, 3)
    assert torch.allclose(groups.sum(1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(groups[0], torch.tensor([1.0, -2.0, 1.0]) / 3 / (torch.tensor([1.0, 0, 1]).std() + 1e-6))
    assert torch.equal(groups[1], torch.zeros(3))  # no signal in a constant group
    assert torch.allclose(
        grpo_advantages(rewards, 3, normalize_by_std=False).view(2, 3)[0], torch.tensor([1.0, -2.0, 1.0]) / 3
    )
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(rewards, group_size=4)


def test_bench_entropy_chunked_peak_is_lower():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench_entropy", "--tokens", "1024", "--vocab", "32768"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["max_abs_entropy_diff"] < 1e-5
    # unchunked holds [N, V] fp32 temporaries (>= the logits' size); chunked only [256, V] ones
    assert result["peak_extra_bytes_unchunked"] > result["logits_bytes"]
    assert result["peak_extra_bytes_chunked"] < result["peak_extra_bytes_unchunked"] / 2
