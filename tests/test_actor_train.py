"""The RL train step on CPU gloo: loss goes down; one step at TP=2 and at PP=2 equals one step at TP=1.

One 2-rank launch re-initializes megatron's parallel state for each layout (TP=1 runs as DP=2 on
identical data, so its DP average equals the single-replica step).
"""

from __future__ import annotations

import pytest
import torch

from modelspec import TokenBatch
from tests.dist import run_ranks
from tests.numeric import assert_close_across_layouts

# Adam's first step moves a weight by lr * g / (|g| + eps). Where a gradient is rounding noise (terms that cancel to
# |g| ~ eps), the layouts' different roundings of g move it differently, by up to ~lr * |dg| / eps. Measured, TP 2
# against TP 1, the largest weight difference at eps 1e-8 (megatron's), 1e-7, 1e-6, 1e-4: 1.95e-7 (over the 16 ulps
# of the weights' scale, 1.61e-7: it failed on 2026-11-29's machine), 2.9e-8, 1.1e-8, 3.7e-9. An eps far above the
# gradients' rounding keeps it under an ulp, so the weights compare the layouts' math alone
ADAM_EPS = 1e-4

NUM_SEQS, SEQ_LEN, PROMPT_LEN = 4, 16, 8


def _batch(vocab_size: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (NUM_SEQS, SEQ_LEN), generator=gen)
    loss_mask = torch.zeros(NUM_SEQS, SEQ_LEN - 1)
    loss_mask[:, PROMPT_LEN - 1 :] = 1.0
    loss_mask[1, -3:] = 0.0  # a shorter response: token-mean and seq-mean-token-sum differ
    return TokenBatch(input_ids=input_ids, loss_mask=loss_mask)


def _train_layouts(rank, world_size, model_dirs):
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.advantages import grpo_advantages
    from rl.losses import PolicyLoss, PolicyLossConfig

    loss_fn = PolicyLoss(PolicyLossConfig(kl_coef=0.1, kl_estimator="k3", loss_agg="seq-mean-token-sum"))
    # descent: no KL pulling back, wide clip range so a few Adam steps keep improving the surrogate
    descent_loss_fn = PolicyLoss(PolicyLossConfig(clip_eps_low=0.5, clip_eps_high=0.5, loss_agg="token-mean"))

    def make_batch(actor):
        batch = _batch(actor.shape.vocab_size)
        batch.old_logprobs = actor.compute_logprobs(batch)
        batch.ref_logprobs = batch.old_logprobs - 0.05
        batch.advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), group_size=2)
        return batch

    results = {}
    for name, family, tp, pp, vpp, lr, num_steps in [
        ("tp1", "qwen2", 1, 1, None, 1e-5, 1),
        ("tp2", "qwen2", 2, 1, None, 1e-5, 1),
        ("pp2", "qwen2", 1, 2, None, 1e-5, 1),
        ("pp2vpp2", "qwen2", 1, 2, 2, 1e-5, 1),
        # tied embeddings: the last stage's output_layer copy must get the same update (embedding grads
        # all-reduced between first and last stage by megatron's finalize_model_grads)
        ("llama_tp1", "llama", 1, 1, None, 1e-5, 2),
        ("llama_pp2", "llama", 1, 2, None, 1e-5, 2),
        ("tp2_descent", "qwen2", 2, 1, None, 1e-3, 3),
    ]:
        hf_dir = model_dirs[family]
        dims = initialize_model_parallel(tp=tp, pp=pp, vpp=vpp)
        config = ActorConfig(tp=tp, pp=pp, vpp=vpp, micro_batch_size=1 if vpp else 2, lr=lr, grad_clip=1.0)
        actor = Actor(hf_dir, config, dims)
        for group in actor.optimizer.param_groups:
            group["eps"] = ADAM_EPS
        batch = make_batch(actor)
        losses, metrics = [], None
        for _ in range(num_steps):
            metrics = actor.train_step(batch, descent_loss_fn if name.endswith("descent") else loss_fn)
            losses.append(metrics["loss"])
        after = actor.compute_logprobs(batch)
        state = actor.export_hf(dst=0)
        results[name] = dict(losses=losses, metrics=metrics, logprobs_after=after, state=state)
    return results if rank == 0 else None


@pytest.mark.numeric
def test_train_step_tp_pp_equal_and_loss_decreases(tiny_model_dirs):
    results = run_ranks(_train_layouts, 2, tiny_model_dirs)[0]
    assert results["tp1"]["metrics"]["grad_norm"] > 0 and results["tp1"]["metrics"]["kl"] > 0
    for name, ref_name in [("tp2", "tp1"), ("pp2", "tp1"), ("pp2vpp2", "tp1"), ("llama_pp2", "llama_tp1")]:
        got, ref = results[name], results[ref_name]
        for key in ("loss", "pg_loss", "kl", "grad_norm", "entropy"):
            # sums of per-token terms of scale ~1 (log-prob ratios, advantages): ulps at max(1, |value|)
            scale = max(1.0, abs(ref["metrics"][key]))
            assert_close_across_layouts(got["metrics"][key], ref["metrics"][key], f"{name} {key}", scale=scale)
        # Adam's first step moves every weight by lr * g / (|g| + ADAM_EPS) (lr = 1e-5): the layouts differ only in
        # rounding it, a few ulps of the tensor's scale (~0.3), far below lr
        assert_close_across_layouts(got["state"], ref["state"], f"{name} weight", ulps=16)
        assert_close_across_layouts(got["logprobs_after"], ref["logprobs_after"], f"{name} log-probs after")
    losses = results["tp2_descent"]["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.05, losses
    print({name: [round(x, 5) for x in r["losses"]] for name, r in results.items()})


def _one_good_step(model_dir, config, dims, dtype="float32"):
    """An actor after one good step (Adam's moments exist), the batch and loss of that step, the weights
    gathered on rank 0 (None elsewhere) and a copy of the optimizer's tensors."""
    from megatron_backend.actor import Actor
    from rl.advantages import grpo_advantages
    from rl.losses import PolicyLoss, PolicyLossConfig

    actor = Actor(model_dir, config, dims, dtype=dtype)
    loss_fn = PolicyLoss(PolicyLossConfig())
    batch = _batch(actor.shape.vocab_size)
    batch.old_logprobs = actor.compute_logprobs(batch)
    batch.advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), group_size=2)
    actor.train_step(batch, loss_fn)
    return actor, batch, loss_fn, actor.export_hf(dst=0), [t.clone() for t in actor.states.tensors("optimizer")]


def _nan_step_is_not_applied(rank, world_size, model_dir):
    """DP=2: one good step, then a step whose advantages on DP rank 1 hold a NaN (a reward went NaN there)."""
    from configs.actor import ActorConfig
    from megatron_backend.parallel import initialize_model_parallel

    dims = initialize_model_parallel(tp=1, pp=1)
    actor, batch, loss_fn, before, moments = _one_good_step(model_dir, ActorConfig(micro_batch_size=2, lr=1e-3), dims)
    if rank == 1:
        batch.advantages[2] = float("nan")
    try:
        actor.train_step(batch, loss_fn)
        error = None
    except FloatingPointError as exc:
        error = str(exc)
    after = actor.export_hf(dst=0)
    unchanged = all(torch.equal(a, b) for a, b in zip(moments, actor.states.tensors("optimizer")))
    return dict(
        error=error,
        moments_unchanged=unchanged,
        params_unchanged=before is None or all(torch.equal(before[k], after[k]) for k in before),
    )


def test_a_nan_loss_on_one_rank_stops_every_rank_before_the_optimizer_step(tiny_model_dirs):
    results = run_ranks(_nan_step_is_not_applied, 2, tiny_model_dirs["qwen2"])
    assert "loss=nan" in results[1]["error"] and "the optimizer step was not applied" in results[1]["error"]
    assert "grad_norm=nan" in results[0]["error"]  # the DP all-reduce carried the NaN into rank 0's gradient
    assert all(r["params_unchanged"] and r["moments_unchanged"] for r in results), results


def _nan_gradient_is_not_applied(rank, world_size, model_dir):
    """A finite loss whose backward puts a NaN into one gradient element on rank 0 (a hook on one weight),
    with each of megatron's optimizers: TP=2 x DP=1 (FP32Optimizer; bf16: Float16OptimizerWithFloat16Params)
    and TP=1 x DP=2 (DistributedOptimizer). One good step first, so Adam's moments exist."""
    from configs.actor import ActorConfig
    from megatron_backend.parallel import initialize_model_parallel

    out = {}
    for tp, dtype in ((2, "float32"), (2, "bfloat16"), (1, "float32")):
        dims = initialize_model_parallel(tp=tp, pp=1)
        config = ActorConfig(tp=tp, micro_batch_size=2, lr=1e-3)
        actor, batch, loss_fn, before, moments = _one_good_step(model_dir, config, dims, dtype)
        if rank == 0:
            weight = actor.chunks[0].decoder.layers[0].mlp.linear_fc2.weight

            def poison(grad):
                grad = grad.clone()
                grad.view(-1)[0] = float("nan")
                return grad

            weight.register_hook(poison)
        try:
            metrics = actor.train_step(batch, loss_fn)
            error = None
        except FloatingPointError as exc:
            metrics, error = None, str(exc)
        after = actor.export_hf(dst=0)
        out[actor.optimizer_name] = dict(
            error=error,
            grad_norm=None if metrics is None else metrics["grad_norm"],
            moments_unchanged=all(torch.equal(a, b) for a, b in zip(moments, actor.states.tensors("optimizer"))),
            params_unchanged=before is None or all(torch.equal(before[k], after[k]) for k in before),
        )
    return out


def test_a_nan_gradient_with_a_finite_loss_stops_the_step_with_every_megatron_optimizer(tiny_model_dirs):
    results = run_ranks(_nan_gradient_is_not_applied, 2, tiny_model_dirs["qwen2"])
    names = {
        "megatron-core FP32Optimizer",
        "megatron-core Float16OptimizerWithFloat16Params",
        "megatron-core DistributedOptimizer",
    }
    for result in results:
        assert set(result) == names
        for name, r in result.items():
            assert r["error"] is not None, (name, r)  # the step was stopped, not applied with NaN weights
            assert "grad_norm=nan" in r["error"] and "loss" not in r["error"], (name, r["error"])
            assert r["params_unchanged"] and r["moments_unchanged"], (name, r)
