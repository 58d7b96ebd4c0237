"""`make validate-plan` end to end (slow: runs the validation set, 4 short steps each) and the mutation check
over the runs it leaves (tools/mutate_plan.py).

Known failures (docs/plan-validation.md, "What is still wrong") are listed here, not tolerated silently: a
failure anywhere else fails the test. CI runs `make calibrate` on its own machine first (.ci/run), so the
runtime constants are this machine's, fitted on the fit set, which shares no configuration with these."""

from __future__ import annotations

import json

import pytest

MIB = 2**20
# The tolerances (make validate-plan: peak 10%, rise 20%, or 16 MiB) plus what moves between machine
# states with nothing changed: a rank's runtime level moves 10-15 MiB (docs/plan-validation.md), and the
# constants CI fits on its own machine differ from these. A check this far out on an unknown machine is a
# regression; the mutations below must still fail the strict checks.
MACHINE_PEAK, MACHINE_RISE, MACHINE_FLOOR_BYTES = 0.12, 0.25, 20 * MIB


def failures_on_any_machine(line: dict) -> set[str]:
    """The line's checks that fail even with the machine allowance."""

    def out(predicted: int, measured: int, relative: float) -> bool:
        return abs(predicted - measured) > max(relative * abs(measured), MACHINE_FLOOR_BYTES)

    failed = set()
    for name, p in line["phases"].items():
        if out(p["predicted_bytes"], p["measured_bytes"], MACHINE_PEAK):
            failed.add(f"{name} peak")
        if out(p["predicted_rise_bytes"], p["measured_rise_bytes"], MACHINE_RISE):
            failed.add(f"{name} rise")
    return failed


KNOWN_FAILURES: dict[str, set[str]] = {}  # every configuration passes here (docs/plan-validation.md)
# doubled attention scores fail long_sequences' train peak by 4 points beyond its 10% (+14%; its rise, +14%, is
# inside 20%): a machine whose fit under-predicts that train by a few more points would let it through
MAY_BE_UNCAUGHT = {("attention_scores", 2.0)}


@pytest.mark.slow
def test_validate_plan_then_mutations(capsys):
    from tools import mutate_plan, validate_plan

    validate_plan.main([])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) >= 6
    for line in lines:
        assert set(line) >= {"config", "max_abs_relative_error", "worst_phase", "phases"}
        assert failures_on_any_machine(line) <= set(line["failures"])  # the allowance only widens
        new_failures = failures_on_any_machine(line) - KNOWN_FAILURES.get(line["config"], set())
        assert not new_failures, (line["config"], new_failures)
    mutate_plan.main([])
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {(r["term"], r["factor"]) for r in results if not r["caught"]} <= MAY_BE_UNCAUGHT
