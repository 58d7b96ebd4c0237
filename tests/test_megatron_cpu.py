"""megatron-core's GPTModel on CPU gloo: TP and PP through its own pipeline schedule (real processes)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist import run_ranks

SEQ_LEN, MICRO_BATCH, NUM_MICROBATCHES = 16, 2, 4


def random_batches(vocab_size: int, seed: int, num: int = NUM_MICROBATCHES) -> list[torch.Tensor]:
    """``num`` micro-batches of random tokens [MICRO_BATCH, SEQ_LEN + 1] (inputs and next-token labels)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (MICRO_BATCH, SEQ_LEN + 1), generator=gen) for _ in range(num)]


def lm_forward_step(data_iterator, model):
    """megatron's forward_step_func: mean next-token cross entropy of one micro-batch from ``random_batches``."""
    tokens = next(data_iterator)
    position_ids = torch.arange(SEQ_LEN).unsqueeze(0).expand(tokens.shape[0], -1)
    per_token_loss = model(tokens[:, :-1], position_ids, attention_mask=None, labels=tokens[:, 1:])

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return per_token_loss, loss_func


def _train_once(rank: int, world_size: int, tp: int, pp: int, vpp):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_backend.model import build_gpt_chunks, padded_vocab_size
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ModelShape

    dims = initialize_model_parallel(tp=tp, pp=pp, vpp=vpp)
    hf = ModelShape.from_pretrained("tiny:qwen2")
    chunks = build_gpt_chunks(hf, dims)
    batches = random_batches(hf.vocab_size, seed=0)  # identical batches on every rank

    def run(forward_only: bool) -> float:
        iterators = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        outputs = get_forward_backward_func()(
            forward_step_func=lm_forward_step,
            data_iterator=iterators,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=NUM_MICROBATCHES,
            seq_length=SEQ_LEN,
            micro_batch_size=MICRO_BATCH,
            forward_only=forward_only,
        )
        return sum(o["loss"].item() for o in outputs) / NUM_MICROBATCHES if outputs else float("nan")

    loss_before = run(forward_only=False)
    params = [p for chunk in chunks for p in chunk.parameters()]
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
    # vocab-parallel embedding rows of padded vocab (and of unused tokens) legitimately get no grad
    no_grad = [n for n, p in named if "word_embeddings" not in n and (p.grad is None or p.grad.abs().sum() == 0)]
    emb_rows_with_grad = sum(int((p.grad.abs().sum(dim=1) > 0).sum()) for n, p in named if "word_embeddings" in n)
    num_used_tokens = len(torch.unique(torch.cat([b[:, :-1].flatten() for b in batches])))
    with torch.no_grad():
        for p in params:
            p -= 0.5 * p.grad
    loss_after = run(forward_only=True)
    return dict(
        pp_rank=dims.pp_rank,
        tp_rank=dims.tp_rank,
        loss_before=loss_before,
        loss_after=loss_after,
        num_params=len(params),
        no_grad=no_grad,
        emb_rows_with_grad=emb_rows_with_grad,
        num_used_tokens=num_used_tokens,
        vocab=padded_vocab_size(hf.vocab_size, tp),
    )


@pytest.mark.parametrize("tp,pp,vpp,world", [(2, 2, None, 4), (1, 2, 2, 2)], ids=["tp2xpp2", "pp2xvpp2"])
def test_gpt_model_forward_backward_through_pipeline_schedule(tp, pp, vpp, world):
    results = run_ranks(_train_once, world, tp, pp, vpp)
    for r in results:
        assert r["num_params"] > 0 and not r["no_grad"], r
    first = [r for r in results if r["pp_rank"] == 0]
    assert sum(r["emb_rows_with_grad"] for r in first) == first[0]["num_used_tokens"]
    last = [r for r in results if r["pp_rank"] == pp - 1]
    assert len(last) == tp
    for r in last:
        # random init: cross entropy over the padded vocab is close to ln(V)
        assert abs(r["loss_before"] - math.log(r["vocab"])) < 0.5, r
        assert r["loss_after"] < r["loss_before"] - 1e-3, r  # the gradient step went downhill
    assert len({round(r["loss_before"], 6) for r in last}) == 1  # TP ranks agree on the loss


def test_cpu_compat_is_narrow():
    """Only the listed megatron modules see the proxy, and only without CUDA."""
    import importlib

    from megatron_backend import cpu_compat

    active = cpu_compat.apply()
    assert active == (not torch.cuda.is_available())
    for name in cpu_compat.PATCHED_MODULES:
        module = importlib.import_module(name)
        assert (module.torch is not torch) == active
    assert importlib.import_module("megatron.core.models.gpt.gpt_model").torch is torch
    if active:
        from megatron.core.transformer.utils import get_default_causal_mask

        mask = get_default_causal_mask(3)
        assert mask.device.type == "cpu" and mask.tolist() == [
            [False, True, True],
            [False, False, True],
            [False, False, False],
        ]
