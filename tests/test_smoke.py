"""`make smoke` covers every `make` target README documents (a new target cannot be forgotten), and CI runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.smoke import ELSEWHERE, STEPS, Step, output_line, step_environment

REPO = Path(__file__).resolve().parent.parent


def documented_targets() -> set[str]:
    return set(re.findall(r"\bmake ([a-z][a-z-]*)", (REPO / "README.md").read_text()))


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), flags=re.M))


def test_every_documented_target_is_a_smoke_step_or_says_where_ci_runs_it():
    smoked = {s.target for s in STEPS}
    assert not smoked & set(ELSEWHERE), "a target is both a step and elsewhere"
    missing = documented_targets() - smoked - set(ELSEWHERE)
    assert not missing, f"README documents {sorted(missing)}: add a step to tools/smoke.py STEPS (or ELSEWHERE)"
    unknown = (smoked | set(ELSEWHERE)) - makefile_targets()
    assert not unknown, f"not Makefile targets: {sorted(unknown)}"


def test_ci_runs_the_smoke_and_what_elsewhere_says_it_runs():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make smoke\b", ci, flags=re.M)
    for target, where in ELSEWHERE.items():
        if where.startswith(".ci/run"):
            assert re.search(rf"^make {re.escape(target)}\b", ci, flags=re.M), f"{target}: .ci/run does not run it"


def test_a_step_fails_on_a_missing_line_or_json_key():
    values: dict[str, str] = {}
    step = Step("run", expect=r"^run directory: (?P<run>\S+)")
    assert output_line(step, "noise\nrun directory: /r/1\n", values) == "run directory: /r/1"
    assert values == {"run": "/r/1"}
    with pytest.raises(ValueError, match="no line matches"):
        output_line(step, "Traceback ...\n", values)
    step = Step("verify-sync", json_keys=("max_abs_logprob_diff",), json_true=("verified",))
    assert output_line(step, '{"max_abs_logprob_diff": 0.0, "verified": true}', values)
    with pytest.raises(ValueError, match="not true"):
        output_line(step, '{"max_abs_logprob_diff": 0.0, "verified": false}', values)
    with pytest.raises(ValueError, match="no JSON line"):
        output_line(step, "done\n", values)


def test_steps_get_no_make_knob_from_the_smokes_command_line_or_shell(tmp_path):
    """`make smoke ARGS="--only run"` exports ARGS to the steps' make: each step must see the defaults."""
    env = step_environment({"ARGS": "--only run", "EXP": "memory_cpu", "MAKEFLAGS": "ARGS=x", "EXTRAS": "dev,gpu"}, tmp_path)
    assert env == {"EXTRAS": "dev,gpu", "RLMEM_TINY_DIR": str(tmp_path / "tiny_models")}


# Targets the smoke leaves to a suite that runs the tool itself (ELSEWHERE): the suite does not go through make,
# so here the recipe is expanded (`make -n`) and every flag it passes must be one the tool declares.
RECIPES = {
    "parity": (("HF=d", "TP=2", "PP=2", "VPP=2", "EP=2", "ETP=1"), "tools/parity.py"),
    "verify-sync": (
        ("HF=d", "TRAIN_TP=2", "TRAIN_PP=2", "TRAIN_EP=2", "TRAIN_ETP=1", "ROLLOUT_TP=2", "ROLLOUT_EP=2"),
        "tools/verify_sync.py",
    ),
    "sweep-local": (("SWEEP=s.yaml", "EXP=tiny_cpu"), "tools/sweep/__main__.py"),
    "eval": (("HF=d", "STEP=3", "EXP=tiny_cpu"), "tools/eval.py"),
}


@pytest.mark.parametrize("target", sorted(RECIPES))
def test_a_target_left_to_a_suite_passes_only_flags_its_tool_declares(target):
    import subprocess

    variables, source = RECIPES[target]
    assert target in ELSEWHERE and target not in {s.target for s in STEPS}
    out = subprocess.run(["make", "-n", target, *variables], cwd=REPO, capture_output=True, text=True, check=True)
    line = next(line for line in out.stdout.splitlines() if " -m tools." in line)
    flags = set(re.findall(r"(?<!\S)(--[a-z][a-z-]*)", line))
    assert len(flags) >= 2, line
    declared = set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z-]*)\"", (REPO / source).read_text()))
    assert flags <= declared, (target, sorted(flags - declared), line)
