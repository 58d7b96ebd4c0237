"""The engine-vs-actor log-prob gap: the worst token over every rank, a metric and a warning (never a stop)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from modelspec import TokenBatch
from run.config import TrainerConfig
from telemetry.metrics import (
    LOGPROB_GAP_RULE,
    LogprobGap,
    LogprobGapRule,
    LogprobGapWatch,
    engine_actor_logprob_gap,
    gap_distribution,
    logprob_gap_rule,
)
from tests.dist import run_ranks


def _batch(
    num_seqs: int = 3, seq_len: int = 8, prompt_len: int = 3, seed: int = 0, first_sample: int = 0
) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(num_seqs, seq_len - 1)
    loss_mask[:, prompt_len - 1 :] = 1.0  # response targets start at the last prompt position
    engine = -torch.rand(num_seqs, seq_len - 1, generator=gen) * loss_mask
    return TokenBatch(
        input_ids=torch.randint(0, 50, (num_seqs, seq_len), generator=gen),
        loss_mask=loss_mask,
        engine_logprobs=engine,
        old_logprobs=engine + 1e-7 * loss_mask,
        sample_index=torch.arange(first_sample, first_sample + num_seqs),  # a contiguous DP share
    )


def test_the_worst_response_token_is_found_and_named():
    batch = _batch(first_sample=10)
    batch.old_logprobs[1, 5] += 0.25  # sequence 1, target position 5 = its 4th response token
    batch.old_logprobs[2, 0] += 9.0  # a prompt position: not sampled by the engine, ignored
    gap = engine_actor_logprob_gap(batch)
    assert gap.value == pytest.approx(0.25, abs=1e-6) and gap.num_tokens == 3 * 5
    assert (gap.sample, gap.response_token, gap.token_id) == (11, 3, int(batch.input_ids[1, 6]))
    assert gap.mean == pytest.approx((0.25 + 14 * 1e-7) / 15, rel=1e-3)
    assert "sample 11, response token 3" in gap.describe()
    metrics = {"rollout/engine_actor_logprob_diff_p99": gap.p99, "rollout/engine_actor_logprob_diff_max": gap.value}
    warning = LogprobGapWatch(logprob_gap_rule(TrainerConfig(), "float32"), "float32").check(7, metrics)
    assert warning.startswith("warning: step 7: engine vs actor log-prob gap") and "max 0.25" in warning
    raised = logprob_gap_rule(TrainerConfig(max_logprob_gap=0.5, max_logprob_gap_p99=0.5), "float32")
    assert LogprobGapWatch(raised, "float32").check(7, metrics) is None  # raised bars
    # a token-balanced DP share is not contiguous: the batch names each row's sample
    batch.sample_index = torch.tensor([4, 0, 9])
    assert engine_actor_logprob_gap(batch).sample == 0


def _metrics(gap: LogprobGap) -> dict[str, float]:
    return {"rollout/engine_actor_logprob_diff_p99": gap.p99, "rollout/engine_actor_logprob_diff_max": gap.value}


def test_a_bf16_gap_beyond_the_rule_warns_once_per_new_high_and_does_not_stop():
    """Defect 9: the healthy bf16 vLLM run's step 38 (p99 0.106 > 0.1, the sync exact) stopped the run with
    LogprobGapError; now it is a warning, printed again only at a new high."""
    watch = LogprobGapWatch(LOGPROB_GAP_RULE["bfloat16"], "bfloat16")
    step38 = LogprobGap(value=0.153, mean=0.00561, p99=0.106, num_tokens=1030)
    assert watch.check(37, _metrics(dataclasses.replace(step38, p99=0.05))) is None  # within the rule
    line = watch.check(38, _metrics(step38))
    assert line == (
        "warning: step 38: engine vs actor log-prob gap p99 0.106, max 0.153, a new high beyond "
        "trainer.max_logprob_gap_p99=0.1 / trainer.max_logprob_gap=3 (bfloat16); bfloat16 rounding can do this, "
        "a wrong layout stops the run at weight_sync.check_every's check"
    )
    assert watch.check(39, _metrics(dataclasses.replace(step38, p99=0.104))) is None  # not a new high
    assert watch.check(40, _metrics(dataclasses.replace(step38, p99=0.12))).startswith("warning: step 40:")


def test_one_rare_outlier_passes_in_bf16_a_shifted_distribution_warns():
    """The bf16 rule: kernel noise (small gaps, one token of 1000 at 1.5 nats) is quiet; a broad shift of the
    distribution (every token off by ~0.3-0.6 nat) warns on the p99 though no token reaches the max bound."""
    gen = torch.Generator().manual_seed(0)
    rule = LOGPROB_GAP_RULE["bfloat16"]
    noise = torch.rand(1000, generator=gen) * 0.05
    noise[123] = 1.5
    stats = gap_distribution(noise)
    assert stats["max"] == pytest.approx(1.5) and stats["p99"] < 0.05 and stats["num_tokens"] == 1000
    kernel = _batch(num_seqs=100, seq_len=13, prompt_len=3)  # 10 response tokens per sequence
    per_token = torch.zeros(100, 12)  # [B, S-1]: the noise at the response targets
    per_token[:, 2:] = noise.view(100, 10)
    kernel.old_logprobs = kernel.engine_logprobs + per_token
    assert LogprobGapWatch(rule, "bfloat16").check(0, _metrics(engine_actor_logprob_gap(kernel))) is None
    shifted = dataclasses.replace(
        kernel, old_logprobs=kernel.engine_logprobs + kernel.loss_mask * (0.3 + per_token / 5)
    )
    gap = engine_actor_logprob_gap(shifted)
    assert gap.value < rule.max
    assert re.search(r"p99 0\.3\d*, max", LogprobGapWatch(rule, "bfloat16").check(0, _metrics(gap)))
    assert rule.p99 > LOGPROB_GAP_RULE["float32"].p99 and rule.max > rule.p99
    assert logprob_gap_rule(TrainerConfig(max_logprob_gap_p99=0.5), "bfloat16") == LogprobGapRule(p99=0.5, max=rule.max)


def _gap_on_ranks(rank: int, world_size: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    batch = _batch(seed=rank, first_sample=rank * 3)
    if rank == 1:  # only this DP rank's share is wrong
        batch.old_logprobs[0, 4] -= 2.0
    return engine_actor_logprob_gap(batch).describe()


def test_every_rank_sees_the_gap_of_one():
    messages = run_ranks(_gap_on_ranks, 2)
    assert messages[0] == messages[1]  # the same gathered distribution on every rank
    assert "rank 1, sample 3, response token 2" in messages[0]


def test_a_non_finite_reward_or_logprob_names_step_phase_and_quantity():
    from telemetry.metrics import NonFiniteError, check_finite, non_finite_stops

    cpu = torch.device("cpu")
    loss_mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    logprobs = torch.tensor([[float("nan"), -1.0, -2.0], [0.0, -0.5, float("inf")]])  # non-finite only off-response
    check_finite(
        3, "old_logprob", {"old log-prob": logprobs, "reward": torch.tensor([1.0, 0.0])}, loss_mask, device=cpu
    )
    with pytest.raises(NonFiniteError, match=r"^step 3, phase rollout: reward not finite \(NaN/inf\); stopped before"):
        check_finite(
            3,
            "rollout",
            {"engine log-prob": logprobs, "reward": torch.tensor([1.0, float("nan")])},
            loss_mask,
            device=cpu,
        )
    logprobs[1, 1] = float("-inf")
    with pytest.raises(NonFiniteError, match="step 4, phase old_logprob: old log-prob not finite"):
        check_finite(4, "old_logprob", {"old log-prob": logprobs}, loss_mask, device=cpu)
    with pytest.raises(NonFiniteError, match="step 5, phase train: grad_norm=nan is not finite"):
        with non_finite_stops(5, "train"):
            raise FloatingPointError("grad_norm=nan is not finite; the optimizer step was not applied")


def test_missing_or_miscounted_engine_logprobs_are_refused_not_zero_filled():
    from rl.batching import Sample, make_batch

    def samples(logprobs_of_second):
        return [
            Sample(0, [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], "stop", 1.0),
            Sample(0, [1, 2], [6, 7], logprobs_of_second, "stop", 0.0),
        ]

    batch, _ = make_batch(samples([-0.5, -0.6]), 2, 1, 0, 0, torch.device("cpu"))
    assert batch.engine_logprobs[1, 1:3].tolist() == pytest.approx([-0.5, -0.6])
    with pytest.raises(ValueError, match="sample 1: the engine returned 0 log-probs for 2 response tokens"):
        make_batch(samples([]), 2, 1, 0, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="sample 1: the engine returned 1 log-probs for 2 response tokens"):
        make_batch(samples([-0.5]), 2, 1, 0, 0, torch.device("cpu"))


def test_bad_gap_bounds_fail_naming_the_key():
    for key in ("max_logprob_gap", "max_logprob_gap_p99"):
        with pytest.raises(ValueError, match=rf"trainer.{key}=0 must be > 0"):
            TrainerConfig(**{key: 0})


def test_the_bf16_rule_is_quiet_on_the_synced_engine_and_warns_on_a_swapped_shard(capfd):
    """The real pair in bf16 (``tools.logprob_gap --corrupt`` on memory_cpu's model: a megatron actor, the native
    engine filled by the weight sync, then one layer's down_proj column halves swapped, a TP shard in the
    other rank's slot): the warning is quiet on what the sync gives and prints on the layout error. (On the 128-wide
    tests' tiny qwen2 the same swap moves the p99 to only 0.09: too small a model to show a layout error.)"""
    import json

    from tools.logprob_gap import main

    assert main(["--engine", "native", "--dtype", "bfloat16", "--num-prompts", "16", "--corrupt"]) == 0
    out = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    rule = LOGPROB_GAP_RULE["bfloat16"]

    def gap(stats: dict) -> LogprobGap:
        return LogprobGap(value=stats["max"], mean=stats["mean"], p99=stats["p99"], num_tokens=stats["num_tokens"])

    watch = LogprobGapWatch(rule, "bfloat16")
    assert watch.check(0, _metrics(gap(out["synced"]))) is None
    assert watch.check(0, _metrics(gap(out["corrupt"]))).startswith("warning: step 0:")
