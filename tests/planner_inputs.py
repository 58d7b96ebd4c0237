"""Planner inputs as the planner's tests write them: the configs' fields as dicts (``actor=dict(tp=2)``,
``rollout=dict(...)``, ``offload=dict(...)``) over the tests' defaults, which keep the hand-computed figures."""

from __future__ import annotations

from configs import AUTO, ActorConfig, OffloadConfig, RolloutConfig
from planner import PlanInputs

# unpacked micro-batches of one sequence and the unchunked log-prob pass: the terms the tests compute by hand
TEST_ACTOR = dict(micro_batch_size=1, remove_padding=False, logprob_chunk_tokens=None)
TEST_ROLLOUT = dict(engine="vllm", gpu_memory_utilization=AUTO)
NESTED = ("actor", "rollout", "offload")


def make_inputs(*, actor: dict | None = None, rollout: dict | None = None, offload: dict | None = None, **fields):
    """PlanInputs of ``fields`` with an ActorConfig and a RolloutConfig of these fields over TEST_*; the engine's
    max_new_tokens is the planned responses' length unless given."""
    actor_cfg = ActorConfig(**{**TEST_ACTOR, **(actor or {})}, offload=OffloadConfig(**(offload or {})))
    response_tokens = fields.get("response_tokens", PlanInputs.__dataclass_fields__["response_tokens"].default)
    rollout_cfg = RolloutConfig(**{**TEST_ROLLOUT, "max_new_tokens": response_tokens, **(rollout or {})})
    return PlanInputs(actor=actor_cfg, rollout=rollout_cfg, **fields)


def merged(base: dict, *layers: dict) -> dict:
    """``base`` with each of ``layers`` over it, the actor / rollout / offload dicts merged key by key."""
    out = dict(base)
    for layer in layers:
        for key, value in layer.items():
            out[key] = {**out[key], **value} if key in NESTED and key in out else value
    return out
