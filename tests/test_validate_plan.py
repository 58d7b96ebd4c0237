"""`make validate-plan` end to end (slow: runs the validation set, 4 short steps each) and the mutation check
over the runs it leaves (tools/mutate_plan.py).

Known failures (docs/plan-validation.md, "What is still wrong") are listed here, not tolerated silently: a
failure anywhere else fails the test. CI runs `make calibrate` on its own machine first (.ci/run), so the
runtime constants are this machine's, fitted on the fit set, which shares no configuration with these."""

from __future__ import annotations

import json

import pytest

KNOWN_FAILURES = {
    "tiny_cpu_pp": {"train peak", "train rise"},
    # rollout: machine-dependent (the CI machine's fit over-predicted its rise by > 20%; see the doc)
    "transients_long_vocab": {"train peak", "train rise", "rollout peak", "rollout rise"},
    # the native engine's decode over 262-token contexts holds 45-55 MiB the plan does not count (engine_sleep
    # starts where rollout left the heap); train under-predicted by ~9.5%, at the tolerance's edge (the doc's
    # "What is still wrong")
    "long_sequences": {"rollout peak", "rollout rise", "engine_sleep peak", "train peak"},
}
# caught here (long_sequences: train rise), but through a check at the edge of its tolerance on some machines
MAY_BE_UNCAUGHT = {("attention_scores", 2.0), ("attention_scores", 0.0)}


@pytest.mark.slow
def test_validate_plan_then_mutations(capsys):
    from tools import mutate_plan, validate_plan

    validate_plan.main([])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) >= 6
    for line in lines:
        assert set(line) >= {"config", "max_abs_relative_error", "worst_phase", "phases"}
        new_failures = set(line["failures"]) - KNOWN_FAILURES.get(line["config"], set())
        assert not new_failures, (line["config"], new_failures)
    mutate_plan.main([])
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {(r["term"], r["factor"]) for r in results if not r["caught"]} <= MAY_BE_UNCAUGHT
