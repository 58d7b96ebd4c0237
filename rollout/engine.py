"""The one rollout-engine protocol, its sampling parameters and its outputs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from configs.rollout import RolloutConfig

SEED_BITS = 62  # vLLM gives sample i of a request seed + i: stay well inside int64


def derive_seed(*parts: int) -> int:
    """A well-mixed seed from integers, e.g. ``derive_seed(trainer_seed, step, replica)`` for one generate
    call: different for every step and replica, equal on every rank of one replica (same inputs)."""

    words = np.random.SeedSequence([int(p) & (2**64 - 1) for p in parts]).generate_state(2, np.uint32)
    return ((int(words[0]) << 32) | int(words[1])) >> (64 - SEED_BITS)


FINISH_REASONS = ("stop", "length")  # vLLM's names: a stop token / eos was sampled, or max_tokens reached


@dataclass
class SamplingParams:
    """How to sample (vLLM's names). ``temperature=0`` is greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 32
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False  # when False the checkpoint's eos_token_id also stops a sample
    seed: int | None = None
    # MoE: each completion carries the experts every token was routed to (Completion.routed_experts); an engine
    # that cannot return them refuses (vLLM's CPU build: rollout.vllm_engine.routed_experts_unsupported)
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be -1 (off) or >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens} must be >= 1")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @classmethod
    def from_config(cls, cfg: RolloutConfig, **overrides) -> SamplingParams:
        values = dict(
            n=cfg.n_samples_per_prompt,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_tokens=cfg.max_new_tokens,
            ignore_eos=cfg.ignore_eos,
            seed=cfg.seed,
        )
        values.update(overrides)
        return cls(**values)


@dataclass
class Completion:
    """One sample: response token ids, the model's log-prob of each (log_softmax of the raw logits, before
    temperature / top-k / top-p, as vLLM's default ``logprobs_mode="raw_logprobs"``), why it ended."""

    prompt_index: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    # with SamplingParams.return_routed_experts, an MoE model's routing: [num_moe_layers, num_routed_tokens, top_k]
    # int16, the top-k expert ids (in the engine's top-k order) of every token the engine ran through the model:
    # the prompt's and every sampled token but the last (num_routed_tokens = len(prompt) + len(token_ids) - 1),
    # as vLLM's ``CompletionOutput.routed_experts`` [seq_len, layers, top_k] holds them (layers first here)
    routed_experts: torch.Tensor | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What ``rl`` needs from a rollout engine (native or vLLM)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """prompts (token ids) -> per prompt, ``params.n`` completions in sample order."""
        ...

    def sleep(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Release the memory of ``tags`` (``weights``, ``kv_cache``)."""
        ...

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Take back the memory of ``tags``; released weights must be reloaded before generating."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full (unsharded) tensors under Hugging Face names, as vLLM's ``model.load_weights``; each rank
        keeps its own slices. Any non-empty subset of the tensors may be passed. (The gather-and-reload path: what
        other stacks do, kept as a baseline and for tensors the planned sync cannot write.)"""
        ...

    def begin_weight_update(self) -> dict[str, torch.Tensor]:
        """Start a planned weight sync: this rank's destination tensors under vLLM's names, in vLLM's
        *loaded* layout (before any post-load processing such as the CPU build's weight repacking),
        writable in place. The weights must be awake. Every rank of the engine calls it."""
        ...

    def finish_weight_update(self) -> None:
        """The tensors from ``begin_weight_update`` are written: make them the live weights (e.g. run the
        engine's post-load processing again, refresh derived copies, reset the prefix cache)."""
        ...

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameter tensors under vLLM's names, for reading (checksums, tests)."""
        ...

    def memory(self) -> dict[str, int]:
        """Resident bytes per memory-saver tag: ``{"weights": ..., "kv_cache": ...}``."""
        ...
