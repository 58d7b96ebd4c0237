"""The step's table (colocation/phases.py) is what the loop runs, the planner plans, the timeline reads and the
wake strategies take back; a phase out of the table's order stops the step."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

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
from telemetry.memory_timeline import read_timeline_csv

REPO = Path(__file__).resolve().parent.parent

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
    from configs.rollout import WAKE_TAGS
    from planner import PHASES as PLANNED
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
    from configs import RolloutConfig

    with pytest.raises(ValueError, match="rollout.wake_strategy='lazy' is not one of"):
        RolloutConfig(wake_strategy="lazy")


# ---------------------------------------------------------------- a phase added by a table edit alone
# The actor's params leave the device while the reference actor runs: two hand-off phases, written into a copy
# of colocation/phases.py's table and nothing else. The run (loop, timeline, charts) and the planner follow.
ADDED_PHASES = {
    'Phase(name="onload_ref"': 'Phase(name="offload_params_for_ref", what="the actor\'s params to host during '
    'the reference pass", drops=moved("actor_params"), hand_off=True),',
    'Phase(name="train"': 'Phase(name="onload_params_for_train", what="the actor\'s params back for train", '
    'adds=moved("actor_params"), hand_off=True),',
}


def _table_with_added_phases(tmp_path):
    """A copy of the colocation package whose table has ADDED_PHASES, each before the phase it names; the
    directory to put first on sys.path."""
    import shutil

    import colocation

    root = tmp_path / "edited"
    package = root / "colocation"
    shutil.copytree(Path(colocation.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    table = (package / "phases.py").read_text()
    for before, line in ADDED_PHASES.items():
        assert table.count(f"        {before}") == 1, before
        table = table.replace(f"        {before}", f"        {line}\n        {before}")
    (package / "phases.py").write_text(table)
    return root


def _python(root, *args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """``python -P`` (no cwd on sys.path) with the edited table first: every rank it spawns imports it too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, "-P", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


PLAN_PHASES = """
import json, colocation.phases
from planner import make_plan
from run.compose import compose
from run.memory_plan import plan_inputs
plan = make_plan(plan_inputs(compose("tiny_cpu", ["algorithm.kl_coef=0.01"])))
print(json.dumps({"table": colocation.phases.__file__,
                  "phases": {p.name: p.components["actor_params"] for p in plan.phases}}))
"""


def test_a_hand_off_added_to_the_table_alone_is_run_by_the_loop_and_walked_by_the_planner(tmp_path):
    root = _table_with_added_phases(tmp_path)
    # the planner: the new phases in the table's place, and no actor params beside the reference pass
    plain, edited = (json.loads(_python(r, "-c", PLAN_PHASES).stdout) for r in (tmp_path, root))
    assert edited["table"].startswith(str(root)) and not plain["table"].startswith(str(root))
    names = list(edited["phases"])
    assert names[names.index("old_logprob") + 1 : names.index("train")] == [
        "offload_params_for_ref", "onload_ref", "ref_logprob", "offload_ref", "onload_params_for_train",
    ]  # fmt: skip
    assert plain["phases"]["ref_logprob"] > 0 and edited["phases"]["ref_logprob"] == 0
    assert edited["phases"]["old_logprob"] == edited["phases"]["train"] == plain["phases"]["train"] > 0
    # the loop: one step of the run; every rank entered the new phases in order, the params on host between
    run_dir = tmp_path / "run"
    overrides = ["trainer.steps=1", "trainer.sft_warmup_steps=0", "trainer.prompts_per_step=4"]
    overrides += ["actor.micro_batch_size=16", "algorithm.kl_coef=0.01", "wandb.mode=disabled", "trainer.save_every=0"]
    _python(root, "-m", "run.main", "--exp", "tiny_cpu", "--run-dir", str(run_dir), *overrides, timeout=900)
    rows = read_timeline_csv(run_dir / "memory_timeline.csv")
    for rank in (0, 1):
        entered = [r["phase"] for r in sorted(rows, key=lambda r: r["t_s"]) if r["rank"] == rank and r["step"] == 0]
        entered = [p for i, p in enumerate(entered) if i == 0 or entered[i - 1] != p]
        assert entered[entered.index("old_logprob") + 1 : entered.index("train")] == names[
            names.index("old_logprob") + 1 : names.index("train")
        ], rank
        params = {r["phase"]: r["tag/actor_params"] for r in rows if r["rank"] == rank and r["step"] == 0}
        assert params["ref_logprob"] == 0 and params["old_logprob"] > 0 and params["train"] > 0, rank
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "offload_params_for_ref" in summary["memory_plan"]["phases"]  # the run's own plan has it too
