"""``make validate-plan``: the memory plan against runs it was not fitted to, one JSON line per configuration.

Runs (or reads, when ``runs/validation/<name>/`` holds a finished run of the same spec) every configuration
of :data:`tools.plan_runs.VALIDATION_SET` (3 steps each, as users run them: warm-up, checkpoints and W&B as the
experiment has them), plans each run again with the calibration
the planner loads, and prints per configuration::

    {"config", "max_abs_relative_error", "worst_phase", "passed", "failures",
     "phases": {name: {"predicted_bytes", "measured_bytes", "relative_error",
                       "predicted_rise_bytes", "measured_rise_bytes", "peak_ok", "rise_ok"}}}

measured = the phase's steady-state peak (median over steps 1.., worst rank), RSS over the probe's
baseline on CPU. predicted = the model: the run's plan evaluated at the lengths each steady step recorded
(metrics.jsonl's ``lengths/*``: the longest prompt, response and row, the means), median over those steps. A phase
passes when its predicted peak is within 10% of the measured one (or 8 MiB), its predicted rise above its starting
level within 20% of the measured rise (or 8 MiB), and the launch plan (the longest prompt, ``max_new_tokens``
responses: a bound) is not exceeded by more than the peak's allowance (``launch_planned_bytes``, ``bound_ok``;
failure ``<phase> launch bound``). Exit 1 when any phase fails. ``--table`` adds a readable table on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from tools.plan_runs import (
    VALIDATION_SET,
    check,
    cuda_validation_set,
    ensure_run,
    measured_phases,
    model_phases,
    plan_for,
    predicted_phases,
    print_results,
    run_dir_for,
    select_specs,
)

SET_NAME = "validation"


def validation_set():
    """The CPU set (VALIDATION_SET), or on a GPU node the CUDA set for its GPU's preset (cuda_validation_set)."""
    # first use: keeps torch (~1 s) out of `import tools.validate_plan` (its argument parsing and input checks)
    import torch

    if not torch.cuda.is_available():
        return VALIDATION_SET
    # first use: keeps torch (~1 s) out of `import tools.validate_plan` (its argument parsing and input checks)
    from tools.calibrate import cuda_preset

    return cuda_validation_set(cuda_preset())


def validate(names: list[str] | None = None, rerun: bool = False, calibration=None, mutate=None) -> list[dict]:
    """One result per validation configuration (runs what is missing)."""
    results = []
    for spec in select_specs(validation_set(), names):
        run_dir = ensure_run(spec, run_dir_for(spec, SET_NAME), rerun=rerun)
        plan = plan_for(spec, calibration, run_dir)  # with the runtime level the run measured at launch
        model, bound = model_phases(plan, run_dir, mutate), predicted_phases(plan, mutate)
        results.append(check(spec.name, model, measured_phases(run_dir), bound))
    return results


def format_rows(results: list[dict]) -> str:
    lines = [f"{'config':<34}{'phase':<18}{'pred MiB':>9}{'meas MiB':>9}{'error':>8}{'rise p/m MiB':>15}  ok"]
    for r in results:
        for name, p in r["phases"].items():
            rise = f"{p['predicted_rise_bytes'] / 2**20:.1f}/{p['measured_rise_bytes'] / 2**20:.1f}"
            ok = ("" if p["peak_ok"] else " PEAK") + ("" if p["rise_ok"] else " RISE")
            lines.append(
                f"{r['config']:<34}{name:<18}{p['predicted_bytes'] / 2**20:>9.1f}{p['measured_bytes'] / 2**20:>9.1f}"
                f"{p['relative_error']:>+8.1%}{rise:>15}  {ok or 'yes'}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="validation configurations to run (default: all)")
    parser.add_argument("--rerun", action="store_true", help="run again even where a finished run exists")
    parser.add_argument("--table", action="store_true", help="also print a readable table on stderr")
    args = parser.parse_args(argv)
    try:
        select_specs(validation_set(), args.only)
    except ValueError as e:
        parser.error(str(e))
    start = time.monotonic()
    results = validate(args.only, args.rerun)
    failed = print_results(results, format_rows(results) if args.table else None)
    print(
        f"validate-plan: {len(results) - len(failed)}/{len(results)} configurations within tolerance "
        f"({time.monotonic() - start:.0f} s){'; failed: ' + ', '.join(failed) if failed else ''}",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
