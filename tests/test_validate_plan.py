"""`make validate-plan` end to end (slow: runs the validation set, 3 steps each as users run them) and the
mutation check over the runs it leaves (tools/mutate_plan.py).

Exactly the documented tolerance (docs/plan-validation.md; tools/plan_runs.py::check: peak 10%, rise 20%, or
8 MiB): no machine allowance, no list of known failures, no mutation allowed to go uncaught. A mutation that
moves no prediction beyond its check's allowance is too small to see and is reported with its size instead.
The constants are the committed ones (planner/calibration/cpu.json, fitted on the fit set, which shares no
configuration with these, on another machine: CI does not refit them); the runtime level is what each run
measured at its own launch."""

from __future__ import annotations

import json


def test_validate_plan_then_mutations(capsys):
    from tools import mutate_plan, validate_plan

    validate_plan.main([])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) >= 6
    for line in lines:
        assert set(line) >= {"config", "max_abs_relative_error", "worst_phase", "phases"}
        assert line["passed"], (line["config"], line["failures"])
    mutate_plan.main([])
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    terms = {r["term"] for r in results}
    assert {"launch_runtime", *mutate_plan.fitted_constants()} <= terms
    uncaught = [(r["term"], r["factor"], r["largest_move_of_allowance"]) for r in results if not r["caught"]]
    assert all(r["caught"] or r["too_small"] for r in results), uncaught
