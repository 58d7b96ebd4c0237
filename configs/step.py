"""What of the configs decides which state each phase of the step moves (colocation/phases.py, the step's table)."""

from __future__ import annotations

from colocation.phases import StepFlags
from configs.actor import ActorConfig
from configs.rollout import RolloutConfig


def step_flags(actor: ActorConfig, rollout: RolloutConfig, *, reference_model: bool) -> StepFlags:
    """The step's flags: the actor's offloads, the engine's wake strategy, and whether a reference actor runs
    (``algorithm.kl_coef > 0``); the run (RunConfig.step_flags) and the planner (planner.plan.step_flags) both ask."""
    return StepFlags(
        offload_params=actor.offload.params,
        offload_grads=actor.offload.grads,
        offload_optimizer=actor.offload.optimizer,
        reference_model=reference_model,
        offload_ref_params=actor.offload.ref_params,
        wake_strategy=rollout.wake_strategy,
    )
