"""Planner inputs as the planner's tests write them: the configs' fields as dicts (``actor=dict(tp=2)``,
``rollout=dict(...)``, ``offload=dict(...)``) over the tests' defaults, which keep the hand-computed figures."""

from __future__ import annotations

from configs import AUTO, ActorConfig, OffloadConfig, RolloutConfig
from planner import PlanInputs
from planner.speed import SpeedSpec

# unpacked micro-batches of one sequence and the unchunked log-prob pass: the terms the tests compute by hand
TEST_ACTOR = dict(micro_batch_size=1, remove_padding=False, logprob_chunk_tokens=None)
TEST_ROLLOUT = dict(engine="vllm", gpu_memory_utilization=AUTO)
NESTED = ("actor", "rollout", "offload")
# a fixed CPU speed profile (not this machine's probe): step-time figures the tests can compute by hand
CPU_SPEED = SpeedSpec(
    name="cpu",
    kind="cpu",
    flops_per_s={"float32": 5e10, "bfloat16": 1e11},
    memory_bytes_per_s=5e9,
    host_bytes_per_s=5e9,
    intra_node_bytes_per_s=5e9,
    inter_node_bytes_per_s=5e9,
    op_seconds=3e-6,
    cores=2,
)


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
