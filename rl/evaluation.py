"""Evaluation: the policy's answers to a fixed set of problems, greedy by default (``eval.*``).

The one evaluation both the loop (the step table's ``eval`` phase, colocation/phases.py) and ``make eval``
(tools/eval.py) run: the eval problems (:func:`eval_problems`) spread over the engine replicas like a
rollout (rl/generation.py), scored by the task's reward, gathered on every rank (:func:`evaluate`); and, in
``make eval``, the actor's teacher-forced log-prob of the reference answers (:func:`reference_logprob_mean`).

The problems: ``eval.data.path`` (a GSM8K-style ``.jsonl`` / ``.parquet`` with ``question`` / ``answer``,
every record in file order), else the training task's own: for ``digit_sum`` every ``a+b=`` of its range
once ((max_operand + 1)^2 problems, all of which training also draws: the figure is greedy accuracy on the
training distribution, not generalisation), for ``gsm8k`` every record of ``data.path``. ``eval.max_problems``
keeps the first ones. Training's sampling is untouched: the eval has its own sampling parameters and seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rl.batching import Sample, pack_sequences
from rl.data import Gsm8kTask, Problem
from rl.generation import generate_samples
from rollout import SamplingParams


@dataclass(kw_only=True)
class EvalDataConfig:
    """The eval problems (``eval.data.*``)."""

    # a local .jsonl / .parquet with question / answer fields (scored by data.task's reward); null: the
    # training task's own problems (digit_sum: every problem of its range; gsm8k: data.path's records)
    path: str | None = None


@dataclass(kw_only=True)
class EvalConfig:
    """Evaluation in the loop and in ``make eval`` (``eval.*``). The loop evaluates at the step boundaries
    ``every`` steps apart and after the last step (``every=0``: never), and before the first step with
    ``before_train``; ``make eval`` evaluates once with the same settings."""

    every: int = 0
    before_train: bool = False
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    n_samples: int = 1  # samples per problem; > 1 (with temperature > 0): pass@n_samples too
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int | None = None  # null: rollout.max_new_tokens
    max_problems: int | None = None  # null: every eval problem
    seed: int = 0  # the eval's sampling seed (the same at every evaluation, so they compare)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every={self.every} must be >= 0 (0: no evaluation during training)")
        if self.n_samples < 1:
            raise ValueError(f"eval.n_samples={self.n_samples} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"eval.temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError(
                f"eval.n_samples={self.n_samples} with eval.temperature=0 samples the same greedy answer "
                f"{self.n_samples} times; set eval.temperature > 0 for pass@{self.n_samples}, or eval.n_samples=1"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"eval.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"eval.max_new_tokens={self.max_new_tokens} must be >= 1, or null for rollout's")
        if self.max_problems is not None and self.max_problems < 1:
            raise ValueError(f"eval.max_problems={self.max_problems} must be >= 1, or null for all")

    @property
    def enabled(self) -> bool:
        """Whether the loop evaluates at all."""
        return self.every > 0 or self.before_train

    def runs_at(self, boundary: int, steps: int) -> bool:
        """Whether the loop evaluates at the step boundary ``boundary`` (the weights after ``boundary``
        completed steps; 0: before training, ``steps``: after the last step)."""
        if boundary == 0:
            return self.before_train
        return self.every > 0 and (boundary % self.every == 0 or boundary == steps)


def eval_problems(cfg) -> list[Problem]:
    """The run's eval problems (``cfg``: a RunConfig), in a fixed order: see the module doc."""
    if cfg.eval.data.path is not None:
        problems = Gsm8kTask(cfg.eval.data.path).problems
    elif cfg.data.task == "digit_sum":
        n = cfg.data.max_operand
        problems = [Problem(prompt=f"{a}+{b}=", answer=str(a + b)) for a in range(n + 1) for b in range(n + 1)]
    else:
        problems = Gsm8kTask(cfg.data.path).problems
    return problems[: cfg.eval.max_problems]


def eval_sampling(cfg, replica: int):
    """The eval's SamplingParams (``cfg``: a RunConfig): its own temperature / top_p / n, the rollout's stops."""

    ev = cfg.eval
    return SamplingParams.from_config(
        cfg.rollout,
        n=ev.n_samples,
        temperature=ev.temperature,
        top_p=ev.top_p,
        top_k=-1,
        max_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens,
        seed=ev.seed * 1_000_003 + replica,
    )


def eval_metrics(samples: list[Sample], num_problems: int, n_samples: int) -> dict[str, float]:
    """``samples``: every sample of every eval problem (prompt-major) -> accuracy (the fraction of samples
    with the full reward), reward_mean, response_length (tokens), pass@n_samples (n_samples > 1: the fraction
    of problems with at least one fully rewarded sample), num_problems, num_samples."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    correct = rewards >= 1.0
    out = {
        "accuracy": float(correct.double().mean()),
        "reward_mean": float(rewards.mean()),
        "response_length": float(lengths.mean()),
        "num_problems": float(num_problems),
        "num_samples": float(len(samples)),
    }
    if n_samples > 1:
        out[f"pass@{n_samples}"] = float(correct.view(num_problems, n_samples).any(dim=1).double().mean())
    return out


def evaluate(engine, tokenizer, task, problems: list[Problem], cfg, mesh, rank: int) -> dict[str, float]:
    """Every eval problem through the (awake) engine, spread over its replicas, scored by ``task``'s reward:
    :func:`eval_metrics` on every rank (collective)."""

    params = eval_sampling(cfg, mesh.replica(rank))
    samples = generate_samples(engine, tokenizer, task, problems, params, mesh, rank)
    return eval_metrics(samples, len(problems), params.n)


def reference_samples(tokenizer, problems: list[Problem]) -> list[Sample]:
    """Each problem's prompt followed by its reference answer's tokens and end-of-sequence (the answer
    format the digit task's warm-up teaches), as samples whose response is the reference."""
    return [
        Sample(
            i, tokenizer(p.prompt).input_ids, tokenizer(p.answer).input_ids + [tokenizer.eos_token_id], [], "stop", 0.0
        )
        for i, p in enumerate(problems)
    ]


def reference_logprob_mean(actor, tokenizer, problems: list[Problem], dims, micro_batch_size: int) -> tuple[float, int]:
    """The actor's mean log-prob of the reference answers' tokens, teacher-forced (prompt + answer + EOS
    through ``compute_logprobs``, the mean over the answer tokens of all problems), and that token count.
    Each DP rank scores every dp-th problem; the sums are gathered (collective, every rank gets the mean)."""
    share = reference_samples(tokenizer, problems)[dims.dp_rank :: dims.dp]
    total, count = 0.0, 0
    if share:
        # whole micro-batches (actor.micro_batch_size rows each): repeats of the first row, their loss mask zero
        num_rows = -(-len(share) // micro_batch_size) * micro_batch_size
        batch = pack_sequences(share + [share[0]] * (num_rows - len(share)), pad_id=tokenizer.pad_token_id or 0)
        batch.loss_mask[len(share) :] = 0
        batch = batch.to(dims.device)
        logprobs = actor.compute_logprobs(batch, phase="reference_logprob", response_only=True)  # [B, S-1]
        mask = batch.loss_mask > 0
        total, count = float(logprobs[mask].double().sum()), int(mask.sum())
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dims.dp_rank, total, count))
    per_dp = {dp_rank: (t, c) for dp_rank, t, c in gathered}  # the TP / PP ranks of one DP rank agree
    total = sum(t for t, _ in per_dp.values())
    count = sum(c for _, c in per_dp.values())
    return total / max(1, count), count


def eval_record(metrics: dict[str, float]) -> dict[str, float]:
    """:func:`evaluate`'s figures under their metric names (metrics.jsonl, W&B): ``eval/<name>``."""
    return {f"eval/{k}": v for k, v in metrics.items()}


def eval_summary(records: list[dict]) -> dict | None:
    """summary.json's ``eval``: the first and the last evaluation (each with ``completed_steps``: the weights
    after that many steps), how many ran and the seconds they took (rank 0's eval phases), from the run's
    metrics records; None when the run evaluated nothing."""
    evals = [r for r in records if "eval/accuracy" in r]
    if not evals:
        return None

    def one(record: dict) -> dict:
        figures = {k.removeprefix("eval/"): v for k, v in record.items() if k.startswith("eval/")}
        return {"completed_steps": record["eval/completed_steps"], **figures}

    seconds = [r.get("time/eval", 0.0) for r in evals]
    return {
        "first": one(evals[0]),
        "last": one(evals[-1]),
        "num_evals": len(evals),
        "seconds_total": sum(seconds),
        "seconds_mean": sum(seconds) / len(seconds),
    }
