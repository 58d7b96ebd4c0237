"""``make plan EXP=<name> [ARGS="<overrides>"] [JSON=<path>]``: the memory plan of an experiment, no GPU needed.

Composes the experiment like ``make run`` (same overrides, same checks), maps it onto the planner's
inputs (:func:`plan_inputs`, the one place that knows both), prints a table of every phase and writes
the JSON (keys in :func:`planner.report.plan_json`). With ARGS it also plans the changed run with the
KV cache the experiment gets without them, so ``auto`` re-sizing cannot hide what the change costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from planner import make_plan, variants
from planner.plan import with_kv_cache
from planner.report import format_table, gib, plan_json, recommend_optimizer_offload_fraction, verdict
from run.compose import ConfigError, compose

# plan_inputs lives in run/ so run.main can plan too
from run.memory_plan import DEFAULT_PROMPT_TOKENS, PromptLength, data_prompt_length, plan_inputs

__all__ = ["main", "plan_inputs"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exp", default="tiny_cpu", help="experiment name (experiments/conf/exp/<name>.yaml)")
    parser.add_argument("--json", default=None, help="write the plan as JSON here")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompt length to plan for (default: the task's longest prompt, tokenized; without the data or the "
        f"tokenizer here: rollout.max_model_len - max_new_tokens, else {DEFAULT_PROMPT_TOKENS} or what "
        "max_position_embeddings leaves)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when the plan does not fit")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, as for make run")
    args = parser.parse_args(argv)

    try:
        cfg = compose(args.exp, args.overrides)
        if args.prompt_tokens is not None:
            prompt = PromptLength(args.prompt_tokens, f"--prompt-tokens {args.prompt_tokens}")
        else:
            prompt = data_prompt_length(cfg)  # the task's longest prompt, as the run's own plan (run/setup.py)
        inputs = plan_inputs(cfg, prompt.tokens)
        base_inputs = plan_inputs(compose(args.exp), prompt.tokens) if args.overrides else None
    except (ConfigError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if prompt.tokens is None:
        print(f"prompts: {prompt.source}: planned with the max_model_len bound, {inputs.prompt_tokens} prompt tokens\n")
    else:
        print(f"prompts: {prompt.source} (as the run plans)\n")
    plan = make_plan(inputs)
    side_by_side = variants(inputs)
    title = " ".join([args.exp, *args.overrides])
    print(format_table(plan, side_by_side, title=title))
    result = plan_json(plan, side_by_side)
    result["exp"], result["overrides"] = args.exp, list(args.overrides)
    result["prompt_tokens"], result["prompt_source"] = inputs.prompt_tokens, prompt.source
    result["prompt_from_data"] = prompt.tokens is not None and args.prompt_tokens is None
    if plan.kv_cache_source == "auto" and plan.kv_cache_bytes < plan.largest_safe_kv_cache_bytes:
        print(
            f"auto: the KV cache is what {inputs.rollout.max_num_seqs} sequences of max_model_len={inputs.engine_max_model_len} "
            f"can use, less than the {gib(plan.largest_safe_kv_cache_bytes)} GiB {plan.kv_limiting_phase} leaves it"
        )
    elif plan.kv_cache_source == "auto":
        print(f"auto: the KV cache fills the room {plan.kv_limiting_phase} leaves it")
    if inputs.on_cuda:
        fraction = recommend_optimizer_offload_fraction(inputs)
        result["recommended_optimizer_offload_fraction"] = fraction
        if fraction is None:
            print("no actor.optimizer_offload_fraction leaves headroom beyond the uncertainty")
        elif fraction != inputs.actor.optimizer_offload_fraction:
            print(
                f"actor.optimizer_offload_fraction={fraction} is the smallest that leaves headroom beyond the "
                f"uncertainty (configured: {inputs.actor.optimizer_offload_fraction})"
            )
    if base_inputs is not None:
        base = make_plan(base_inputs)
        same_kv = make_plan(with_kv_cache(inputs, base.kv_cache_bytes))
        window, base_window = same_kv.wake_window_peak, base.wake_window_peak
        print(
            f"\nagainst {args.exp} as composed: largest safe KV cache {gib(base.largest_safe_kv_cache_bytes)} -> "
            f"{gib(plan.largest_safe_kv_cache_bytes)} GiB; wake window peak {base_window.name} "
            f"{gib(base_window.predicted_bytes)} -> {window.name} {gib(window.predicted_bytes)} GiB; "
            f"peak {base.peak_phase} {gib(base.peak_bytes)} -> {same_kv.peak_phase} {gib(same_kv.peak_bytes)} GiB"
        )
        print(
            f"with the KV cache {args.exp} gets without the overrides ({gib(base.kv_cache_bytes)} GiB): {verdict(same_kv)}"
        )
        result["with_experiment_kv_cache"] = {
            "kv_cache_bytes": base.kv_cache_bytes,
            "fits": same_kv.fits,
            "peak_phase": same_kv.peak_phase,
            "peak_bytes": same_kv.peak_bytes,
            "overflows": [{"phase": o.phase, "over_bytes": o.over_bytes} for o in same_kv.overflows],
            "verdict": verdict(same_kv),
        }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if args.check and not plan.fits else 0


if __name__ == "__main__":
    sys.exit(main())
