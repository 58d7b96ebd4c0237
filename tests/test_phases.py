"""The step's table (colocation/phases.py) is what the loop runs, the planner plans, the timeline reads and the
wake strategies take back; a phase out of the table's order stops the step."""

from __future__ import annotations

import itertools

import pytest

from colocation.phases import (
    ACTOR_STATE,
    ENGINE_STATE,
    PHASES,
    PhaseOrder,
    PhaseOrderError,
    StepFlags,
    phase_names,
    step_phases,
)
from megatron_backend.memory import TAGS as ACTOR_TAGS
from rollout.memory_saver import TAGS as ENGINE_TAGS

ALL_FLAGS = [
    StepFlags(
        offload_params=p,
        offload_grads=g,
        offload_optimizer=o,
        reference_model=r,
        offload_ref_params=rp,
        wake_strategy=w,
    )
    for p, g, o, r, rp, w in itertools.product(*[(True, False)] * 5, ("staged", "all_at_once"))
]


def test_state_names_are_the_memory_ledgers_tags():
    assert ENGINE_STATE == ENGINE_TAGS and ACTOR_STATE == ACTOR_TAGS


@pytest.mark.parametrize("flags", ALL_FLAGS, ids=str)
def test_every_step_ends_where_it_started_and_moves_only_what_is_there(flags):
    resident = set(flags.resident_at_step_start())
    for phase in step_phases(flags):
        assert not set(phase.adds) & resident, f"{phase.name} adds what is resident"
        assert set(phase.drops) <= resident, f"{phase.name} drops what is not resident"
        resident = (resident | set(phase.adds)) - set(phase.drops)
    assert resident == flags.resident_at_step_start()
    # the same phases under every flag: an onload of state that is not offloaded runs and moves nothing
    assert phase_names(flags) == phase_names()


def test_staged_wake_never_holds_the_actors_params_and_the_kv_cache_together():
    resident = set(StepFlags().resident_at_step_start())
    for phase in step_phases(StepFlags()):
        after = (resident | set(phase.adds)) - set(phase.drops)
        assert not {"actor_params", "kv_cache"} <= resident | after, phase.name
        resident = after


def test_the_table_derives_the_wake_tags_the_release_tags_and_the_planned_phases():
    from planner import PHASES as PLANNED
    from rollout.config import WAKE_TAGS
    from telemetry.memory_timeline import EVAL_PHASE, EXPORT_PHASE, RELEASE_TAGS, SAVE_PHASE, TAGS, TIMELINE_PHASES

    assert PLANNED == PHASES and "log" in PHASES and SAVE_PHASE not in PHASES and EVAL_PHASE not in PHASES and EXPORT_PHASE not in PHASES
    assert TIMELINE_PHASES == phase_names() and set(TIMELINE_PHASES) - set(PHASES) == {SAVE_PHASE, EVAL_PHASE, EXPORT_PHASE}
    # the eval runs at the step boundary, before the step's rollout: the engine awake, the actor as a step leaves it
    assert phase_names(evaluates=True)[:2] == (EVAL_PHASE, "rollout")
    assert WAKE_TAGS == {
        "staged": {"wake_weights": ("weights",), "wake_kv_cache": ("kv_cache",)},
        "all_at_once": {"wake_weights": ("weights", "kv_cache"), "wake_kv_cache": ()},
    }
    assert RELEASE_TAGS["engine_sleep"] == ENGINE_TAGS and RELEASE_TAGS["offload_params"] == ("actor_params",)
    assert {t for tags in RELEASE_TAGS.values() for t in tags} == set(TAGS)


def test_phase_order_accepts_the_tables_steps_and_refuses_any_other():
    order = PhaseOrder(StepFlags())
    for step, saves, evaluates in ((0, False, True), (1, True, False), (2, False, False), (3, True, True)):
        for name in phase_names(saves=saves, evaluates=evaluates):
            order.enter(name, step)
    order.finish()
    order.enter("eval", 4)  # the eval after the last step: the boundary no step follows

    with pytest.raises(PhaseOrderError, match="'warmup' is not in the step's table"):
        PhaseOrder(StepFlags()).enter("warmup", 0)
    order = PhaseOrder(StepFlags())
    order.enter("rollout", 0)
    with pytest.raises(PhaseOrderError, match="phase 'onload_params' entered after 'rollout', skipping"):
        order.enter("onload_params", 0)  # engine_sleep skipped
    order = PhaseOrder(StepFlags())
    for name in PHASES[:3]:
        order.enter(name, 0)
    with pytest.raises(PhaseOrderError, match="phase 'engine_sleep' entered after 'onload_params'"):
        order.enter("engine_sleep", 0)  # twice, or out of order
    with pytest.raises(PhaseOrderError, match="step 0 ended without phases"):
        order.enter("rollout", 1)  # step 0 never logged


def test_bad_wake_strategy_names_the_key():
    with pytest.raises(ValueError, match="rollout.wake_strategy='lazy' is not one of"):
        StepFlags(wake_strategy="lazy")
