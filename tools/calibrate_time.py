"""``make calibrate-time``: fit the step-time model's efficiencies and op factors (planner/step_time.py) on the memory
plan's fit set and runs where fixed costs dominate (some on a 16-layer model), with leave-one-configuration-out
uncertainty, and write ``planner/calibration/cpu_time.json``.

Each run of :data:`tools.plan_runs.TIME_FIT_SET` (run, or read from ``runs/calibration/<name>/`` as ``make calibrate``
leaves it) gives one row per every-step phase: the phase's measured seconds (metrics.jsonl ``time/<phase>``, median
over the steady steps 1..) against the model's raw terms (:func:`planner.step_time.raw_terms`: each term's seconds
at efficiency 1 and op factor 1), at each steady step's recorded lengths, median over those steps, with the
machine's speeds as ``tools/speed_probe.py`` measured them just before the run (its ``speed.json``; a run without
one: measured now, once for all). The fit is a
non-negative least squares on relative errors, each efficiency at most 1 (each row over max(its seconds, 50 ms); each run's whole step a row
too, weighted as three phases); a constant whose term no
fit run exercises keeps its file value. Leaving each run out in turn gives each constant's spread, its uncertainty.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from planner.calibration import TIME_CONSTANTS, Constant, from_json, write
from planner.calibration import load as load_calibration
from planner.speed import SpeedSpec
from planner.step_time import COLUMN_CONSTANT, EFFICIENCIES, phase_work, raw_terms
from tools.plan_runs import TIME_FIT_SET, add_repeats_argument, ensure_runs, plan_for, recorded_lengths_of
from tools.speed_probe import measure_cpu_speed

COLUMNS = tuple(c for c, name in COLUMN_CONSTANT.items() if name is not None)  # fitted
MEASURED = tuple(c for c, name in COLUMN_CONSTANT.items() if name is None)  # a measured rate's seconds, as they are
FLOOR_SECONDS = 0.05  # a row's relative error is over at least this (a phase of a few ms is noise)
STEP_ROWS = 3.0
SPEED_FILE = "speed.json"
# runs of each configuration, made in alternating order: this 2-core machine's speed drifts by up to 1.4x within
# minutes, so one run of a configuration can be slow in every phase; the median over three runs' steps leaves it out
REPEATS = 3
PROBED_LATER = (
    "draw_seconds",
    "fresh_bytes_per_s",
    "gemm_seconds_per_weight_byte",
    "gloo_all_reduce_seconds",
    "gloo_exchange_bytes_per_s",
    "host_in_bytes_per_s",
    "gloo_reduce_scatter_bytes_per_s",
    "gloo_all_gather_bytes_per_s",
)  # rates the probe gained after some runs were made


def run_speed(run_dir: Path):
    """The machine's speeds measured just before the run (its speed.json, tools/plan_runs.py writes it), else now
    (once per process: a run made before speed.json existed is timed with today's speeds, the same for every run;
    one made before the probe measured draws, fresh writes, skinny GEMMs or gloo's all-reduce or exchange takes today's)."""
    path = run_dir / SPEED_FILE
    if path.exists():
        # a probe may have measured rates this model does not read (one tried and not kept): left out
        fields = {k: v for k, v in json.loads(path.read_text()).items() if k in SpeedSpec.__dataclass_fields__}
        for name in PROBED_LATER:  # probed before the probe measured it: today's, as for a run without speed.json
            if fields.get(name) is None:
                fields[name] = getattr(_speed_now(), name)
        return SpeedSpec(**fields)
    return _speed_now()


@functools.cache
def _speed_now():
    return measure_cpu_speed()


def measured_seconds(run_dirs: list[Path]) -> dict[str, float]:
    """Each phase's median seconds over the steady steps (1..) of the runs' metrics.jsonl, pooled."""
    rows = [
        json.loads(line)
        for run_dir in run_dirs
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steady = [r for r in rows if r.get("trainer/step", 0) >= 1]
    names = {k.removeprefix("time/") for r in steady for k in r if k.startswith("time/")}
    return {n: statistics.median(r[f"time/{n}"] for r in steady if f"time/{n}" in r) for n in names}


def run_rows(spec, run_dirs: list[Path]) -> list[tuple[str, dict[str, float], float]]:
    """(phase, raw terms, measured seconds) per every-step phase of a configuration's runs (its repeats): each a
    median over every steady step of every run, a step's raw terms at its recorded lengths and its run's measured
    speeds."""
    per_step, plans = [], []  # (the step's work, its run's plan inputs and speeds)
    for run_dir in run_dirs:
        plan = plan_for(spec, None, run_dir)
        speed = run_speed(run_dir)
        lengths = [v for step, v in sorted(recorded_lengths_of(run_dir).items()) if step >= 1] or [None]
        per_step += [phase_work(plan, lengths_) for lengths_ in lengths]
        plans += [(plan.inputs, speed)] * len(lengths)
    measured = measured_seconds(run_dirs)
    rows = []
    for name in per_step[0]:
        if name not in measured:
            continue
        raws = [raw_terms(works[name], *at) for works, at in zip(per_step, plans, strict=True)]
        raw = {c: statistics.median(r.get(c, 0.0) for r in raws) for c in COLUMNS + MEASURED}
        rows.append((name, raw, measured[name]))
    return rows


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """min ||a x - b|| with x >= 0 (Lawson and Hanson's active set)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max(initial=-1) <= 1e-12:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            negative = passive & (z <= 0)
            alpha = np.min(x[negative] / (x[negative] - z[negative]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit(rows_by_run: dict[str, list], prior) -> dict[str, float]:
    """Coefficient per column (1 / efficiency, or the op factor); columns no row exercises keep the prior's."""
    rows = [row for rows in rows_by_run.values() for row in rows]
    used = [c for c in COLUMNS if any(raw[c] > 0 for _, raw, _ in rows)]
    weight = [1 / max(seconds, FLOOR_SECONDS) for *_, seconds in rows]
    # each run's step (its phases summed) is a row too, weighted as STEP_ROWS phases: the step is what a search ranks
    for run_rows_ in rows_by_run.values():
        step = {c: sum(raw[c] for _, raw, _ in run_rows_) for c in COLUMNS + MEASURED}
        seconds = sum(m for *_, m in run_rows_)
        rows.append(("step", step, seconds))
        weight.append(STEP_ROWS / seconds)
    weight = np.array(weight)
    a = np.array([[raw[c] for c in used] for _, raw, _ in rows]) * weight[:, None]
    # the measured rates' seconds are known: what the fitted terms explain is the rest
    b = np.array([seconds - sum(raw[c] for c in MEASURED) for _, raw, seconds in rows]) * weight
    # an efficiency is at most 1 (no term runs above its datasheet or probed peak): its coefficient 1 / efficiency
    # is 1 + x with x >= 0, the 1 moved to the measured side
    floor = np.array([1.0 if COLUMN_CONSTANT[c] in EFFICIENCIES else 0.0 for c in used])
    x = nnls(a, b - a @ floor) + floor
    out = {c: _prior_coefficient(prior, c) for c in COLUMNS}
    out.update(dict(zip(used, x.tolist(), strict=True)))
    return out


def _prior_coefficient(prior, column: str) -> float:
    name = COLUMN_CONSTANT[column]
    value = prior.value(name)
    return 1 / value if name in EFFICIENCIES else value


def _as_constant(column: str, coefficient: float) -> float:
    name = COLUMN_CONSTANT[column]
    if name in EFFICIENCIES:
        return 1 / coefficient if coefficient > 0 else float("inf")
    return coefficient


def calibrate(rerun: bool = False, repeats: int = REPEATS) -> dict:
    prior = load_calibration("cpu_time")
    run_dirs = ensure_runs(TIME_FIT_SET, "calibration", repeats=repeats, rerun=rerun)
    rows_by_run = {spec.name: run_rows(spec, run_dirs[spec.name]) for spec in TIME_FIT_SET}
    full = fit(rows_by_run, prior)
    loo = [fit({k: v for k, v in rows_by_run.items() if k != left}, prior) for left in rows_by_run]
    constants = {}
    exercised = {c for rows in rows_by_run.values() for _, raw, _ in rows for c in COLUMNS if raw[c] > 0}
    for column in COLUMNS:
        name = COLUMN_CONSTANT[column]
        if column not in exercised or (name in EFFICIENCIES and not full[column] > 0):  # 1 / 0: no efficiency
            constants[name] = prior[name]
            continue
        value = _as_constant(column, full[column])
        spread = [_as_constant(column, f[column]) for f in loo if f[column] > 0 or name not in EFFICIENCIES]
        uncertainty = max((abs(v - value) for v in spread), default=value)
        if len(spread) < len(loo):  # a fit without some run drove it to zero: as uncertain as it is large
            uncertainty = max(uncertainty, value)
        constants[name] = Constant(
            name=name,
            value=round(value, 6),
            uncertainty=round(uncertainty, 6),
            source="fit",
            reference="make calibrate-time (tools/calibrate_time.py) on the fit set in provenance.runs; "
            "uncertainty: the largest change when one run is left out",
            unit=prior[name].unit,
        )
    return {
        "constants": constants,
        "rows": {k: [(n, s) for n, _, s in v] for k, v in rows_by_run.items()},
        "runs": list(rows_by_run),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rerun", action="store_true", help="run the fit set again")
    add_repeats_argument(parser, REPEATS)
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the fit here instead of planner/calibration/cpu_time.json (`make validate-time "
        "ARGS='--constants FILE'` checks it)",
    )
    args = parser.parse_args(argv)
    if args.out is not None and not args.out.parent.is_dir():  # before the fit's runs, not after them
        parser.error(f"--out {args.out}: no directory {args.out.parent}; make it, or write the fit elsewhere")
    result = calibrate(args.rerun, args.repeats)
    prior = load_calibration("cpu_time")
    for name in TIME_CONSTANTS:
        c = result["constants"][name]
        print(json.dumps({"constant": name, "value": c.value, "uncertainty": c.uncertainty, "source": c.source}))
    if not args.dry_run:
        calibration = replace(
            from_json(prior.to_json()),
            constants=result["constants"],
            provenance={"runs": result["runs"], "tool": "tools/calibrate_time.py"},
        )
        print(f"wrote {write(calibration, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
