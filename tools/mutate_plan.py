"""Can the plan's validation fail? Mutate one term of the model and re-check it against the stored runs.

For each term (params, grads, Adam states, activations, logits, attention scores, engine weights, engine
activations, KV bytes per token, sync bucket) doubled, and each transient zeroed, the validation set's runs
(``runs/validation/<name>/``, from ``make validate-plan``; nothing is run here) are planned again with the
mutation and checked as ``make validate-plan`` checks them. Prints one JSON line per mutation (term, factor,
the checks it fails that the unmutated plan passes) and a table; exit 1 when some mutation fails no new
check (a check that cannot fail).

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
from tools.plan_runs import VALIDATION_SET, check, measured_phases, plan_for, predicted_phases, run_dir_for
from tools.validate_plan import SET_NAME

# term -> ("component", name) | ("function", planner.plan attribute)
TERMS = {
    "params": ("component", "actor_params"),
    "grads": ("component", "actor_grads"),
    "adam_states": ("component", "optimizer"),
    "activations": ("component", "activations"),
    "logits": ("component", "logits"),
    "attention_scores": ("function", "unfused_attention_bytes"),
    "engine_weights": ("component", "engine_weights"),
    "engine_activations": ("function", "engine_activation_bytes"),
    "kv_bytes_per_token": ("function", "kv_bytes_per_token"),
    "sync_bucket": ("component", "sync_bucket"),
}
TRANSIENTS = ("activations", "logits", "attention_scores", "engine_activations", "sync_bucket")
MUTATIONS = [(term, 2.0) for term in TERMS] + [(term, 0.0) for term in TRANSIENTS]


@contextlib.contextmanager
def _scaled_function(name: str, factor: float):
    real = getattr(plan_module, name)
    with mock.patch.object(plan_module, name, lambda *a, **k: round(real(*a, **k) * factor)):
        yield


def evaluate(term: str, factor: float, runs: dict, baseline: frozenset = frozenset()) -> dict:
    """The checks the mutation fails that the unmutated plan passes (``baseline``: what already fails)."""
    kind, target = TERMS[term]
    failures = []
    for spec, measured in runs.items():
        if kind == "function":
            with _scaled_function(target, factor):
                predicted = predicted_phases(plan_for(spec))
        else:

            def mutate(components, target=target):
                return {k: round(v * factor) if k == target else v for k, v in components.items()}

            predicted = predicted_phases(plan_for(spec), mutate)
        result = check(spec.name, predicted, measured)
        failures += [f"{spec.name}: {f}" for f in result["failures"] if f"{spec.name}: {f}" not in baseline]
    return {"term": term, "factor": factor, "failed_checks": failures, "caught": bool(failures)}


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
    baseline = [check(s.name, predicted_phases(plan_for(s)), m) for s, m in runs.items()]
    already = frozenset(f"{r['config']}: {f}" for r in baseline for f in r["failures"])
    if already:  # those checks cannot tell a mutation apart: a mutation counts only by the checks it newly fails
        print(f"note: the unmutated plan already fails: {'; '.join(sorted(already))}", file=sys.stderr)
    results = [evaluate(term, factor, runs, already) for term, factor in MUTATIONS]
    for r in results:
        print(json.dumps(r), flush=True)
    print(f"\n{'term':<20}{'factor':>7}  first failing checks (of {len(runs)} configurations)", file=sys.stderr)
    for r in results:
        shown = "; ".join(r["failed_checks"][:3]) + (
            f" (+{len(r['failed_checks']) - 3})" if len(r["failed_checks"]) > 3 else ""
        )
        print(f"{r['term']:<20}{r['factor']:>7.1f}  {shown or 'NONE: no check fails'}", file=sys.stderr)
    return 0 if all(r["caught"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
