"""make bench-step: its bad input refused before any run, its medians over alternating runs (the real runs:
make smoke's bench-step step)."""

from __future__ import annotations

import json

import pytest

from tools import bench_step
from tools.bench_step import RunFigures, medians


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--commits", "no-such-rev", "HEAD"], "'no-such-rev' is not a commit"),
        (["--configs", "a=1", "a=2", "--repeats", "0"], "--repeats must be >= 1"),
        (["--configs", "a=1", "a=2", "--exp", "nope"], "no experiments/conf/exp/nope.yaml"),
        (["--configs", "a=1"], "give two or more sides"),
        (["--configs", "a=1", "a=2", "a=1"], "a side is given twice"),
    ],
)
def test_bad_input_fails_in_one_line_before_any_run(argv, message, monkeypatch):
    ran = []
    monkeypatch.setattr(bench_step, "run_once", lambda *a: ran.append(a))
    with pytest.raises(SystemExit, match=message):
        bench_step.main(argv)
    assert ran == []


def test_neither_commits_nor_configs_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        bench_step.build_parser().parse_args([])
    assert info.value.code == 2 and "one of the arguments --commits --configs is required" in capsys.readouterr().err


def _figures(step: float, system: float, phases: dict[str, float]) -> RunFigures:
    return RunFigures(
        wall_seconds=10 * step,
        user_seconds=5 * step,
        system_seconds=system,
        minor_page_faults=int(1000 * system),
        step_median_seconds=step,
        phase_median_seconds=phases,
    )


def test_medians_are_per_figure_and_a_phase_one_run_lacks_is_the_median_of_the_others():
    runs = [
        _figures(2.0, 9.0, {"train": 1.0, "rollout": 0.5}),
        _figures(1.0, 3.0, {"train": 0.6}),
        _figures(3.0, 6.0, {"train": 1.4, "rollout": 0.7}),
    ]
    m = medians(runs)
    assert (m["runs"], m["step_median_seconds"], m["wall_seconds"], m["system_seconds"]) == (3, 2.0, 20.0, 6.0)
    assert m["minor_page_faults"] == 6000
    assert m["phase_median_seconds"] == {"rollout": pytest.approx(0.6), "train": 1.0}
    assert [r["step_median_seconds"] for r in m["each_run"]] == [2.0, 1.0, 3.0]


def test_three_sides_alternate_their_order_and_each_is_divided_by_the_first(monkeypatch, capsys):
    """A B C, then C B A, then A B C: no side always runs first or last; ``over_first`` is each later side's
    medians over the first side's."""
    order = []
    step_of = {"x=1": 1.0, "x=2": 0.5, "x=3": 2.0}

    def run_once(side, exp, out_dir, common):
        order.append(side.overrides[0])
        return _figures(
            step_of[side.overrides[0]], 4 * step_of[side.overrides[0]], {"train": step_of[side.overrides[0]]}
        )

    monkeypatch.setattr(bench_step, "run_once", run_once)
    assert bench_step.main(["--configs", "x=1", "x=2", "x=3", "--repeats", "3"]) == 0
    assert order == ["x=1", "x=2", "x=3", "x=3", "x=2", "x=1", "x=1", "x=2", "x=3"]
    out = json.loads(capsys.readouterr().out)
    assert list(out["sides"]) == ["x=1", "x=2", "x=3"]
    assert out["over_first"] == {
        "x=2": {"step_median_seconds": 0.5, "wall_seconds": 0.5, "system_seconds": 0.5, "minor_page_faults": 0.5},
        "x=3": {"step_median_seconds": 2.0, "wall_seconds": 2.0, "system_seconds": 2.0, "minor_page_faults": 2.0},
    }
