"""Train-phase levers on CPU gloo: packing (THD) equals the padded path, any micro-batch split gives the
same gradient, recomputation changes nothing numerically; the micro-batch partition and config checks.

Real megatron-core on 2 ranks (TP=2, with and without sequence parallelism; PP=2 with variable-length p2p;
DP=2), tiny Qwen2 (vocab 128).
"""

from __future__ import annotations

import pytest
import torch

from modelspec import TokenBatch
from tests.dist import run_ranks
from tests.numeric import assert_close_across_layouts

LENGTHS = [30, 9, 22, 5, 17, 26, 12, 30]  # prompt + response; padded width 30
OTHER_DP_LENGTHS = [28, 5, 7, 30, 11, 6, 19, 8]  # DP rank 1: fewer tokens (4 budgeted micro-batches alone, not 5)
PROMPT_LEN = 4


def _batch(vocab_size: int, lengths=LENGTHS, seed: int = 0) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    num, width = len(lengths), max(lengths)
    input_ids = torch.randint(3, vocab_size, (num, width), generator=gen)
    loss_mask = torch.zeros(num, width - 1)
    for i, n in enumerate(lengths):
        input_ids[i, n:] = 0  # padding
        loss_mask[i, PROMPT_LEN - 1 : n - 1] = 1.0
    return TokenBatch(
        input_ids=input_ids,
        seq_lens=torch.tensor(lengths),
        loss_mask=loss_mask,
        advantages=torch.randn(num, generator=gen),
    )


def _grads(actor) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": p.main_grad.detach().clone()
        for i, model in enumerate(actor.models)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


# name -> ActorConfig overrides; "padded" is the reference
VARIANTS = {
    "padded": dict(remove_padding=False, micro_batch_size=2),
    "packed": dict(remove_padding=True, micro_batch_size=2),
    "packed_budget": dict(remove_padding=True, max_tokens_per_micro_batch=36),  # 5 balanced bins
    "padded_budget": dict(remove_padding=False, max_tokens_per_micro_batch=100),  # 3 rows of 30
    "unchunked": dict(remove_padding=True, micro_batch_size=4, logprob_chunk_tokens=None),
    "full_recompute": dict(recompute="full", logprob_chunk_tokens=7),
    "selective_recompute": dict(recompute="selective", recompute_modules=["core_attn", "mlp"]),
    "block_recompute": dict(recompute="full", recompute_method="block", recompute_num_layers=1),
    "entropy_kept": dict(entropy_recompute=False, max_tokens_per_micro_batch=64),
    # megatron's sequence parallelism on a dense model (odd packed lengths: padded to a multiple of TP)
    "sequence_parallel": dict(remove_padding=True, micro_batch_size=2, sequence_parallel=True),
}


# layout -> (tp, pp, the variants that exercise it)
LAYOUTS = {
    # vocab-parallel chunked log-prob/entropy, packing under TP, recomputation
    "tp2": (
        2,
        1,
        ("padded", "packed", "packed_budget", "unchunked", "entropy_kept", "selective_recompute", "sequence_parallel"),
    ),
    # variable-shape p2p between stages (packed THD rows, budgeted padded micro-batches)
    "pp2": (1, 2, ("padded", "packed_budget", "padded_budget", "block_recompute")),
    # DP ranks with different lengths agree on the number of budgeted micro-batches
    "dp2": (1, 1, ("padded", "packed_budget", "full_recompute")),
}


def _levers(rank, world_size, model_dir):
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.losses import PolicyLoss, PolicyLossConfig

    loss_fn = PolicyLoss(PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01))
    out = {}
    for layout, (tp, pp, names) in LAYOUTS.items():
        dims = initialize_model_parallel(tp=tp, pp=pp)
        results = {}
        for name in names:
            overrides = VARIANTS[name]
            config = ActorConfig(tp=tp, pp=pp, lr=1e-4, **{"micro_batch_size": 1, **overrides})
            actor = Actor(model_dir, config, dims)
            # each DP rank its own lengths: their micro-batch counts must still agree
            lengths = LENGTHS if dims.dp_rank == 0 else OTHER_DP_LENGTHS
            batch = _batch(actor.shape.vocab_size, lengths, seed=dims.dp_rank)
            logprobs, entropy = actor.compute_logprobs(batch, with_entropy=True)
            batch.old_logprobs = logprobs + 0.01 * torch.randn(logprobs.shape, generator=torch.Generator())
            batch.ref_logprobs = logprobs - 0.05
            metrics = actor.compute_grads(batch, loss_fn)
            results[name] = dict(logprobs=logprobs, entropy=entropy, grads=_grads(actor), metrics=metrics)
        out[layout] = results
    return out


@pytest.mark.numeric
def test_packing_budgets_and_recompute_match_the_padded_path(tiny_model_dirs):
    per_rank = run_ranks(_levers, 2, tiny_model_dirs["qwen2"])
    for rank, out in enumerate(per_rank):
        for layout, results in out.items():
            ref = results["padded"]
            # (at TP=2 rank 1's vocab rows of the 128-token model are all padding: no embedding/output grad)
            assert all(g.abs().max() > 0 for k, g in ref["grads"].items() if ".decoder." in k)
            mask = ref["logprobs"] != 0
            assert mask.sum() > 50  # response targets were computed
            for name, got in results.items():
                where = f"rank {rank} {layout} {name}"
                # log-probs: packed and chunked equal the padded, unchunked path up to summation order
                assert_close_across_layouts(got["logprobs"], ref["logprobs"], f"{where} log-probs")
                assert_close_across_layouts(got["entropy"], ref["entropy"], f"{where} entropy")
                # the same batch split any way gives the same gradient (loss normalized by batch totals); a
                # gradient sums over every token of the batch, in another grouping per variant: more ulps
                assert_close_across_layouts(got["grads"], ref["grads"], f"{where} grad", ulps=1024)
                for key in ("loss", "pg_loss", "kl", "entropy"):
                    scale = max(1.0, abs(ref["metrics"][key]))  # means of per-token terms of scale ~1
                    assert_close_across_layouts(got["metrics"][key], ref["metrics"][key], f"{where} {key}", scale=scale)
            counts = {name: r["metrics"]["num_micro_batches"] for name, r in results.items()}
            assert counts["padded"] == 4 and counts["packed_budget"] != counts["padded"], counts
    # DP=2: ranks with different lengths run the same number of budgeted micro-batches
    for name in ("packed_budget",):
        counts = [out["dp2"][name]["metrics"]["num_micro_batches"] for out in per_rank]
        assert counts[0] == counts[1], (name, counts)


def test_partition_respects_the_budget_and_balances():
    from megatron_backend.packing import partition

    lengths = [30, 9, 22, 5, 17, 26, 12, 30, 3, 14]
    groups = partition(lengths, micro_batch_size=2, max_tokens=48)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) <= 48 and len(groups) == 4  # 168 tokens: 4 bins of <= 48
    assert max(loads) - min(loads) <= max(lengths)
    # a sequence longer than the budget runs alone
    assert [g for g in partition([100, 5, 5], 1, max_tokens=50) if 0 in g] == [[0]]
    # at least min_count micro-batches (DP agreement, interleaved PP)
    assert len(partition(lengths, 2, max_tokens=1000, min_count=3)) == 3
    assert len(partition(lengths, 5, min_count=4)) == 4
    # padded: rows of the padded width per budget
    padded = partition(lengths, 1, max_tokens=95, packed=False, padded_len=30)
    assert [len(g) for g in padded] == [3, 3, 2, 2]
    assert partition(lengths, 5) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        partition(lengths, 3)


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batch_pads_the_model_tokens_to_a_multiple_of_tp(packed):
    """Sequence parallelism splits the model's token dim over TP: the micro-batch pads it (a pad sequence when
    packed, pad columns when padded) and its rows still point at the same tokens."""
    from megatron_backend.packing import build_micro_batch, sequence_lengths

    batch = _batch(128, lengths=[13, 6, 9])  # 28 real tokens, padded width 13
    lengths = sequence_lengths(batch)
    plain = build_micro_batch(batch, [0, 1, 2], lengths, packed, torch.device("cpu"), response_only=True)
    padded = build_micro_batch(batch, [0, 1, 2], lengths, packed, torch.device("cpu"), True, pad_to=8)
    assert plain.num_model_tokens == (28 if packed else 39) and padded.num_model_tokens == (32 if packed else 48)
    assert padded.input_ids.numel() == padded.num_model_tokens
    assert torch.equal(padded.input_ids.flatten()[padded.rows], plain.input_ids.flatten()[plain.rows])
    assert torch.equal(padded.targets, plain.targets) and torch.equal(padded.dense_index, plain.dense_index)
    if packed:  # the pad tokens are one more sequence, positions from 0, attending only to themselves
        assert padded.packed_seq_params.cu_seqlens_q.tolist() == [0, 13, 19, 28, 32]
        assert padded.position_ids[0, 28:].tolist() == [0, 1, 2, 3]


def test_balanced_dp_shares():
    from rl.batching import balanced_dp_shares

    lengths = [40, 38, 5, 6, 7, 30, 31, 4]
    shares = balanced_dp_shares(lengths, 2)
    assert sorted(shares[0] + shares[1]) == list(range(8)) and all(len(s) == 4 for s in shares)
    loads = [sum(lengths[i] for i in s) for s in shares]
    contiguous = [sum(lengths[:4]), sum(lengths[4:])]
    assert max(loads) - min(loads) < max(contiguous) - min(contiguous)
    assert max(loads) - min(loads) <= 4
    with pytest.raises(ValueError, match="DP ranks"):
        balanced_dp_shares(lengths[:7], 2)


def test_lever_config_validation():
    from configs.actor import ActorConfig
    from megatron_backend.model import recompute_kwargs

    for kwargs, key in [
        (dict(max_tokens_per_micro_batch=0), "actor.max_tokens_per_micro_batch"),
        (dict(max_tokens_per_forward_micro_batch=-4), "actor.max_tokens_per_forward_micro_batch"),
        (dict(logprob_chunk_tokens=0), "actor.logprob_chunk_tokens"),
        (dict(recompute="all"), "actor.recompute="),
        (dict(recompute="full", recompute_method="every"), "actor.recompute_method"),
        (dict(recompute="selective", recompute_num_layers=2), "actor.recompute_num_layers"),
        (dict(recompute="selective", recompute_modules=["moe"]), "actor.recompute_modules"),
        (dict(recompute="none", recompute_modules=["mlp"]), "actor.recompute_modules"),
    ]:
        with pytest.raises(ValueError, match=key):
            ActorConfig(**kwargs)
    assert ActorConfig(max_tokens_per_micro_batch=1000).forward_max_tokens == 2000
    assert (
        ActorConfig(max_tokens_per_micro_batch=1000, max_tokens_per_forward_micro_batch=1500).forward_max_tokens == 1500
    )
    assert ActorConfig().forward_max_tokens is None
    assert recompute_kwargs("none") == {}
    assert recompute_kwargs("full") == dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    assert recompute_kwargs("selective", modules=["mlp"])["recompute_modules"] == ["mlp"]
