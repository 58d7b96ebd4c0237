"""`make validate-plan` end to end (slow: runs the validation set, a few short steps each) and the mutation
check over the runs it leaves (tools/mutate_plan.py): every term doubled or transient zeroed fails a check."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_validate_plan_then_every_mutation_fails_a_check(capsys):
    from tools import mutate_plan, validate_plan

    assert validate_plan.main([]) == 0, capsys.readouterr().err[-3000:]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) >= 6
    for line in lines:
        assert set(line) >= {"config", "max_abs_relative_error", "worst_phase", "phases"}
        assert line["passed"], line["failures"]
    assert mutate_plan.main([]) == 0, capsys.readouterr().err[-3000:]
