"""``make validate-time``: the step-time model (planner/step_time.py) against runs it was not fitted to.

Every configuration of :data:`tools.plan_runs.VALIDATION_SET` (the memory plan's validation runs: run, or read from
``runs/validation/<name>/`` as ``make validate-plan`` leaves them), planned again and timed by the model at each
steady step's recorded lengths with the machine's speeds measured next to the run (tools/calibrate_time.py's rows),
one JSON line per configuration::

    {"config", "predicted_step_s", "measured_step_s", "step_error", "step_ok", "passed", "failures",
     "phases": {name: {"predicted_s", "measured_s", "error", "ok", "bound"}}}

The step is the every-step phases' sum (save_checkpoint, eval and export_hf run on some steps). A step passes within
15%, a phase within 25% or 50 ms. Exit 1 when any fails. ``--table`` adds a readable table on stderr.
``--mutations`` checks the checks instead: which of them catch each fitted constant doubled or halved, and each measured
rate's seconds doubled or zeroed; one that moves no check by its tolerance is too small to see, and only an uncaught one
that is not fails it. The tolerances
are the issue's; CI checks the model's plumbing (tests/test_step_time.py), never a wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from planner.calibration import Calibration, from_json
from planner.calibration import load as load_calibration
from planner.step_time import combined_seconds, scaled_terms
from tools.calibrate_time import REPEATS, run_rows
from tools.plan_runs import VALIDATION_SET, add_repeats_argument, ensure_runs, print_results, select_specs

STEP_TOLERANCE = 0.15
PHASE_TOLERANCE = 0.25
PHASE_FLOOR_SECONDS = 0.05


def check_run(name: str, rows, constants: Calibration, device_kind: str = "cpu") -> dict:
    phases, failures = {}, []
    for phase, raw, measured in rows:
        terms = scaled_terms(raw, constants)
        predicted = combined_seconds(terms, device_kind)
        ok = abs(predicted - measured) <= max(PHASE_TOLERANCE * measured, PHASE_FLOOR_SECONDS)
        phases[phase] = {
            "predicted_s": round(predicted, 4),
            "measured_s": round(measured, 4),
            "error": round(predicted / measured - 1, 3) if measured > 0 else None,
            "ok": ok,
            "bound": max(terms, key=terms.get),
        }
        if not ok:
            failures.append(phase)
    predicted_step = sum(p["predicted_s"] for p in phases.values())
    measured_step = sum(p["measured_s"] for p in phases.values())
    step_error = predicted_step / measured_step - 1
    step_ok = abs(step_error) <= STEP_TOLERANCE
    if not step_ok:
        failures.insert(0, "step")
    return {
        "config": name,
        "predicted_step_s": round(predicted_step, 3),
        "measured_step_s": round(measured_step, 3),
        "step_error": round(step_error, 3),
        "step_ok": step_ok,
        "passed": not failures,
        "failures": failures,
        "phases": phases,
    }


def validation_rows(names: list[str] | None = None, rerun: bool = False, repeats: int = REPEATS) -> dict[str, list]:
    """Each validation configuration's rows (tools/calibrate_time.py ``run_rows``), its runs made where missing."""
    specs = select_specs(VALIDATION_SET, names)
    run_dirs = ensure_runs(specs, "validation", repeats=repeats, rerun=rerun)
    return {spec.name: run_rows(spec, run_dirs[spec.name]) for spec in specs}


def validate(
    names: list[str] | None = None, rerun: bool = False, constants: Calibration | None = None, repeats: int = REPEATS
) -> list[dict]:
    constants = constants or load_calibration("cpu_time")
    return [check_run(name, rows, constants) for name, rows in validation_rows(names, rerun, repeats).items()]


MUTATION_FACTORS = {"fitted": (2.0, 0.5), "measured": (2.0, 0.0)}


def failed_checks(results: list[dict]) -> set[tuple[str, str]]:
    """(configuration, phase or "step") of every check that fails."""
    return {(r["config"], phase) for r in results for phase in r["failures"]}


def largest_move(base: list[dict], mutated: list[dict]) -> float:
    """The most a mutation moved any check's prediction, as a multiple of that check's tolerance (a phase's: 25% of
    its measured seconds or 50 ms; the step's: 15%). Under 1 the mutation is too small to see: no configuration
    measured here could catch it, whatever the model's error."""
    moves = [0.0]
    for b, m in zip(base, mutated, strict=True):
        moves.append(abs(m["predicted_step_s"] - b["predicted_step_s"]) / (STEP_TOLERANCE * b["measured_step_s"]))
        for phase, p in b["phases"].items():
            allowance = max(PHASE_TOLERANCE * p["measured_s"], PHASE_FLOOR_SECONDS)
            moves.append(abs(m["phases"][phase]["predicted_s"] - p["predicted_s"]) / allowance)
    return max(moves)


def mutations(rows_by_config: dict[str, list], constants: Calibration) -> list[dict]:
    """Which checks catch a wrong term: each fitted constant doubled and halved, each measured rate's seconds (the
    GEMM table's, the draws', gloo's buckets, exchange and the actor's all-reduces, the counted ops') doubled and
    zeroed, on the same rows. A mutation is caught when a check that passed fails; ``caught_by`` names them.
    ``too_small``: it moves no check by its tolerance (:func:`largest_move`, ``largest_move_of_tolerance``), so that
    no check can catch it."""
    from planner.step_time import COLUMN_CONSTANT

    def results(constants_, scale: dict[str, float]) -> list[dict]:
        out = []
        for name, rows in rows_by_config.items():
            scaled = [(phase, {c: v * scale.get(c, 1.0) for c, v in raw.items()}, m) for phase, raw, m in rows]
            out.append(check_run(name, scaled, constants_))
        return out

    base = results(constants, {})
    baseline = failed_checks(base)

    def judged(mutation: str, kind: str, mutated: list[dict]) -> dict:
        caught = sorted(failed_checks(mutated) - baseline)
        move = largest_move(base, mutated)
        return {
            "mutation": mutation,
            "kind": kind,
            "caught_by": [" ".join(c) for c in caught],
            "largest_move_of_tolerance": round(move, 2),
            "too_small": move < 1,
        }

    out = []
    fitted = sorted({name for name in COLUMN_CONSTANT.values() if name is not None})
    for name in fitted:
        for factor in MUTATION_FACTORS["fitted"]:
            mutated = constants.with_values(**{name: constants.value(name) * factor})
            out.append(judged(f"{name} x{factor:g}", "fitted", results(mutated, {})))
    for column in sorted(c for c, name in COLUMN_CONSTANT.items() if name is None):
        for factor in MUTATION_FACTORS["measured"]:
            out.append(judged(f"{column} x{factor:g}", "measured", results(constants, {column: factor})))
    return out


def format_rows(results: list[dict]) -> str:
    lines = [f"{'config':<34}{'phase':<18}{'pred s':>9}{'meas s':>9}{'error':>8}  {'bound':<17}ok"]
    for r in results:
        step = f"{r['config']:<34}{'STEP':<18}{r['predicted_step_s']:>9.3f}{r['measured_step_s']:>9.3f}"
        lines.append(f"{step}{r['step_error']:>+8.1%}  {'':<17}{'yes' if r['step_ok'] else 'NO'}")
        for name, p in r["phases"].items():
            if max(p["predicted_s"], p["measured_s"]) < 0.02:
                continue  # a few ms either way
            error = f"{p['error']:>+8.1%}" if p["error"] is not None else f"{'':>8}"
            lines.append(
                f"{'':<34}{name:<18}{p['predicted_s']:>9.3f}{p['measured_s']:>9.3f}{error}  {p['bound']:<17}"
                f"{'yes' if p['ok'] else 'NO'}"
            )
    return "\n".join(lines)


def _constants_file(path: Path, parser: argparse.ArgumentParser) -> Calibration:
    """The CPU step-time constants in ``path`` (every one of them: planner.calibration checks), or argparse's one-line
    error before any run."""
    try:
        constants = from_json(json.loads(path.read_text()), str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--constants {path}: not a calibration file ({type(e).__name__}: {e})")
    if constants.device_kind != "cpu_time":
        parser.error(
            f"--constants {path}: device_kind {constants.device_kind!r}, not the CPU step-time constants ('cpu_time'); "
            "`python -m tools.calibrate_time --out FILE` writes them"
        )
    return constants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="validation configurations (default: all)")
    parser.add_argument("--rerun", action="store_true", help="run again even where a finished run exists")
    parser.add_argument("--table", action="store_true", help="also print a readable table on stderr")
    parser.add_argument(
        "--mutations",
        action="store_true",
        help="instead: each fitted constant x2 and x0.5, each measured rate's seconds x2 and x0, and the checks that "
        "catch each (one JSON line per mutation; exit 1 when one that moves a check by its tolerance goes uncaught)",
    )
    parser.add_argument(
        "--constants",
        type=Path,
        default=None,
        help="check this calibration file instead of planner/calibration/cpu_time.json (a refit that "
        "`python -m tools.calibrate_time --out FILE` wrote, say, on another machine's runs)",
    )
    add_repeats_argument(parser, REPEATS)
    args = parser.parse_args(argv)
    try:
        select_specs(VALIDATION_SET, args.only)
    except ValueError as e:
        parser.error(str(e))
    constants = load_calibration("cpu_time") if args.constants is None else _constants_file(args.constants, parser)
    if args.mutations:
        found = mutations(validation_rows(args.only, args.rerun, args.repeats), constants)
        for m in found:
            print(json.dumps(m), flush=True)
        small = [m["mutation"] for m in found if not m["caught_by"] and m["too_small"]]
        missed = [m["mutation"] for m in found if not m["caught_by"] and not m["too_small"]]
        print(
            f"validate-time --mutations: {len(found) - len(small) - len(missed)}/{len(found)} caught"
            f"{'; too small to see (no check moved by its tolerance): ' + ', '.join(small) if small else ''}"
            f"{'; uncaught: ' + ', '.join(missed) if missed else ''}",
            file=sys.stderr,
        )
        return 1 if missed else 0
    results = validate(args.only, args.rerun, constants, repeats=args.repeats)
    failed = print_results(results, format_rows(results) if args.table else None)
    steps_ok = sum(r["step_ok"] for r in results)
    print(
        f"validate-time: {steps_ok}/{len(results)} steps within {STEP_TOLERANCE:.0%}, "
        f"{len(results) - len(failed)}/{len(results)} configurations with every phase within tolerance"
        f"{'; failed: ' + ', '.join(failed) if failed else ''}",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
