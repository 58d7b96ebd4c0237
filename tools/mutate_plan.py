"""Can the plan's validation fail? Mutate one term of the model and re-check it against the stored runs.

For each term (params, grads, Adam states, activations, logits, attention scores, engine weights, engine
activations, KV bytes per token, sync bucket; of a mixture of experts the routed experts a rank holds, the actor's
dispatched copies and expert activations) doubled, each transient zeroed, and the runtime level (the one
each run measured at launch) and every fitted constant of the calibration scaled by 0.5 and 1.5, the
validation set's runs (``runs/validation/<name>/``, from ``make validate-plan``; nothing is run here) are
planned again with the mutation and checked as ``make validate-plan`` checks them (the model at each run's recorded
lengths, and the launch plan's bound). Prints one JSON line per
mutation (term, factor, the checks it fails that the unmutated plan passes, the largest move of a prediction
as a fraction of that check's allowance) and a table.

A mutation that moves some check's prediction by more than that check's allowance must fail some check: exit 1
when one does not (a check that cannot fail). One that moves no prediction that far is too small to be seen at
this tolerance: listed with its largest move in MiB, not counted as uncaught.

Component terms scale that component in every phase (and in the level the phase starts from); function
terms (attention scores, engine activations, KV bytes per token) scale the planner's function, so what
depends on them (the KV cache the native engine sizes by sequences, the vLLM reserve) follows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from unittest import mock

import planner.plan as plan_module
import planner.sizes as sizes_module
from planner.calibration import load
from tools.plan_runs import (
    FLOOR_BYTES,
    PEAK_TOLERANCE,
    RISE_TOLERANCE,
    VALIDATION_SET,
    check,
    launch_runtime_of,
    measured_phases,
    model_phases,
    plan_for,
    predicted_phases,
    run_dir_for,
)
from tools.validate_plan import SET_NAME

# term -> ("component", name) | ("function", planner.plan attributes, "|"-separated) | ("constant", calibration name)
# | ("launch", None): the runtime level the run measured at launch
TERMS = {
    "params": ("component", "actor_params"),
    "grads": ("component", "actor_grads"),
    "adam_states": ("component", "optimizer"),
    "activations": ("component", "activations"),
    "logits": ("component", "logits"),
    # Not a term: the attention alone. Packed sequences (every validation run) keep no [s, s] scores on CPU
    # (megatron_backend/model.py): their attention is per-token activations, in the term above; doubled alone it
    # moves long_sequences 0.86 of an allowance. The scores of padded rows (unfused_attention_bytes) no run checks.
    "engine_weights": ("component", "engine_weights"),
    "engine_activations": ("function", "engine_activation_bytes|native_engine_activation_bytes"),
    "kv_bytes_per_token": ("function", "kv_bytes_per_token"),
    "sync_bucket": ("component", "sync_bucket"),
    "launch_runtime": ("launch", None),
    # mixture of experts (no move on a dense run): the routed experts a rank holds (E / ep; x2 at EP=2 is a plan
    # that ignores expert parallelism), the dispatched copies and expert activations per token in the actor's
    # passes. Not a term: the engine's MoE working set, which moves memory_cpu_moe's checks 0.08 of an allowance
    # when doubled (a layer at a time beside a 200 MiB KV cache)
    "experts_per_rank": ("experts", None),
    "moe_activations": ("function", "sizes:moe_activation_bytes_per_token|sizes:moe_forward_bytes_per_token"),
}
TRANSIENTS = ("activations", "logits", "engine_activations", "sync_bucket")


def fitted_constants(device_kind: str = "cpu") -> list[str]:
    """The calibration's constants that are fitted (source ``fit``): each is a mutation term."""
    return [name for name, c in load(device_kind).constants.items() if c.source == "fit"]


def mutations() -> list[tuple[str, float]]:
    scaled = ["launch_runtime", *fitted_constants()]
    return (
        [(term, 2.0) for term in TERMS if term not in scaled]
        + [(term, 0.0) for term in TRANSIENTS]
        + [(term, factor) for term in scaled for factor in (0.5, 1.5)]
    )


@contextlib.contextmanager
def _scaled_function(names: str, factor: float):
    """Each of ``names`` ("a|b": one term the plan counts with either function) scaled by ``factor``; a name is
    planner.plan's, or ``sizes:<name>`` planner.sizes's (a function the sizes call among themselves)."""
    with contextlib.ExitStack() as stack:
        for name in names.split("|"):
            module, name = (sizes_module, name[len("sizes:") :]) if name.startswith("sizes:") else (plan_module, name)
            real = getattr(module, name)
            stack.enter_context(
                mock.patch.object(module, name, lambda *a, _real=real, **k: round(_real(*a, **k) * factor))
            )
        yield


@contextlib.contextmanager
def _scaled_experts(factor: float):
    """Each actor rank's routed experts scaled by ``factor`` (params, grads and Adam states follow): the rank's
    params gain (factor - 1) x its expert params, which the optimizer shards over the expert-DP group."""
    real_count, real_experts = plan_module.actor_stage_param_count, plan_module.actor_stage_expert_param_count

    def count(*a, **k):
        return real_count(*a, **k) + round((factor - 1) * real_experts(*a, **k))

    with (
        mock.patch.object(plan_module, "actor_stage_param_count", count),
        mock.patch.object(
            plan_module, "actor_stage_expert_param_count", lambda *a, **k: round(factor * real_experts(*a, **k))
        ),
    ):
        yield


def _checked(plan, run_dir, mutate=None) -> tuple[dict, dict]:
    """(the model's phases: the plan at the run's recorded lengths; the launch plan's phases: its bound)."""
    return model_phases(plan, run_dir, mutate), predicted_phases(plan, mutate)


def mutated_phases(term: str, factor: float, spec, run_dir=...) -> tuple[dict, dict]:
    """(the model's phases, the launch plan's) under the mutation; ``run_dir=None``: the launch plan alone, no run."""
    kind, target = TERMS.get(term, ("constant", term))  # a term not listed is a fitted constant's name
    run_dir = run_dir_for(spec, SET_NAME) if run_dir is ... else run_dir
    if kind == "function":
        with _scaled_function(target, factor):
            return _checked(plan_for(spec, run_dir=run_dir), run_dir)
    if kind == "experts":
        with _scaled_experts(factor):
            return _checked(plan_for(spec, run_dir=run_dir), run_dir)
    if kind == "constant":
        calibration = load("cpu")
        scaled = calibration.with_values(**{target: calibration.value(target) * factor})
        return _checked(plan_for(spec, scaled, run_dir), run_dir)
    if kind == "launch":
        launch = launch_runtime_of(run_dir)
        if launch is None:  # a run that measured no launch level: the fitted level is what the plan uses
            calibration = load("cpu")
            name = "runtime_overhead_bytes"
            scaled = calibration.with_values(**{name: calibration.value(name) * factor})
            return _checked(plan_for(spec, scaled), run_dir)
        return _checked(plan_for(spec, run_dir=run_dir, launch_runtime_bytes=round(launch * factor)), run_dir)

    def mutate(components, target=target):
        return {k: round(v * factor) if k == target else v for k, v in components.items()}

    return _checked(plan_for(spec, run_dir=run_dir), run_dir, mutate)


def _largest_move(predicted: dict, mutated: dict, measured: dict) -> tuple[float, int]:
    """(the largest move of a checked prediction as a fraction of that check's allowance, in bytes)."""
    ratio, moved = 0.0, 0
    for name, m in measured.items():
        if name not in predicted or m.peak_bytes <= 0:
            continue
        p, q = predicted[name], mutated[name]
        for before, after, value, rel in (
            (p.peak_bytes, q.peak_bytes, m.peak_bytes, PEAK_TOLERANCE),
            (p.rise_bytes, q.rise_bytes, m.rise_bytes, RISE_TOLERANCE),
        ):
            move = abs(after - before)
            allowance = max(rel * abs(value), FLOOR_BYTES)
            if move / allowance > ratio:
                ratio, moved = move / allowance, move
    return ratio, moved


def widest_planned_move(term: str, factor: float) -> tuple[float, str]:
    """How far the mutation moves the validation set's launch plans (no run needed), in allowances of each check, the
    unmutated prediction standing for the measurement, and where. More than 2 allowances (the band's width) moves some
    check out of tolerance wherever its unmutated prediction sits within it: the set can see the term."""
    widest, where = 0.0, ""
    for spec in VALIDATION_SET:
        unmutated = predicted_phases(plan_for(spec))
        move, _ = _largest_move(unmutated, mutated_phases(term, factor, spec, run_dir=None)[0], unmutated)
        if move > widest:
            widest, where = move, spec.name
    return widest, where


def evaluate(term: str, factor: float, runs: dict, baseline: frozenset = frozenset()) -> dict:
    """The checks the mutation fails that the unmutated plan passes (``baseline``: what already fails), and how far
    it moves the predictions."""
    failures, ratio, moved = [], 0.0, 0
    for spec, measured in runs.items():
        predicted, bound = mutated_phases(term, factor, spec)
        run_dir = run_dir_for(spec, SET_NAME)
        unmutated = model_phases(plan_for(spec, run_dir=run_dir), run_dir)
        r, m = _largest_move(unmutated, predicted, measured)
        if r > ratio:
            ratio, moved = r, m
        result = check(spec.name, predicted, measured, bound)
        failures += [f"{spec.name}: {f}" for f in result["failures"] if f"{spec.name}: {f}" not in baseline]
    return {
        "term": term,
        "factor": factor,
        "failed_checks": failures,
        "caught": bool(failures),
        "largest_move_of_allowance": round(ratio, 3),
        "largest_move_bytes": moved,
        "too_small": not failures and ratio <= 1.0,  # moves no prediction beyond its check's allowance
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    runs = {}
    for spec in VALIDATION_SET:
        run_dir = run_dir_for(spec, SET_NAME)
        if not (run_dir / "summary.json").exists():
            print(f"error: {run_dir} has no finished run; run `make validate-plan` first", file=sys.stderr)
            return 2
        runs[spec] = measured_phases(run_dir)
    baseline = []
    for s, m in runs.items():
        model, bound = _checked(plan_for(s, run_dir=run_dir_for(s, SET_NAME)), run_dir_for(s, SET_NAME))
        baseline.append(check(s.name, model, m, bound))
    already = frozenset(f"{r['config']}: {f}" for r in baseline for f in r["failures"])
    if already:  # those checks cannot tell a mutation apart: a mutation counts only by the checks it newly fails
        print(f"note: the unmutated plan already fails: {'; '.join(sorted(already))}", file=sys.stderr)
    results = [evaluate(term, factor, runs, already) for term, factor in mutations()]
    for r in results:
        print(json.dumps(r), flush=True)
    print(f"\n{'term':<32}{'factor':>7}  first failing checks (of {len(runs)} configurations)", file=sys.stderr)
    for r in results:
        shown = "; ".join(r["failed_checks"][:3]) + (
            f" (+{len(r['failed_checks']) - 3})" if len(r["failed_checks"]) > 3 else ""
        )
        if not shown:
            size = f"largest move {r['largest_move_bytes'] / 2**20:.1f} MiB, {r['largest_move_of_allowance']:.2f} of its allowance"
            shown = f"too small to see: {size}" if r["too_small"] else f"NONE: no check fails ({size})"
        print(f"{r['term']:<32}{r['factor']:>7.1f}  {shown}", file=sys.stderr)
    return 0 if all(r["caught"] or r["too_small"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
