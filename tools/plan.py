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
from dataclasses import replace
from pathlib import Path

from planner import PlanInputs, device_preset, make_plan, variants
from planner.devices import MIB
from planner.report import format_table, gib, plan_json, verdict

# Prompts are data, not config: without rollout.max_model_len (which bounds prompt + response) plan for this
# many prompt tokens (at most the checkpoint's max_position_embeddings - max_new_tokens).
DEFAULT_PROMPT_TOKENS = 512


def plan_inputs(cfg, prompt_tokens: int | None = None) -> PlanInputs:
    """A composed RunConfig -> the planner's inputs for one rank (adapt here when rl/config.py changes)."""
    rollout, actor = cfg.rollout, cfg.actor
    device = device_preset(cfg.cluster.device, ranks_per_node=cfg.cluster.procs_per_node)
    on_cuda = device.kind == "cuda"
    shape = cfg.model.shape()  # model.path's config.json, else model.architecture
    if prompt_tokens is None:
        # the engine's max_model_len bounds prompt + response
        longest = rollout.max_model_len or shape.max_position_embeddings
        prompt_tokens = longest - rollout.max_new_tokens
        if not rollout.max_model_len:
            prompt_tokens = min(DEFAULT_PROMPT_TOKENS, prompt_tokens)
    util = rollout.gpu_memory_utilization
    return PlanInputs(
        shape=shape,
        device=device,
        dtype=cfg.model.dtype,
        actor_tp=actor.tp,
        actor_pp=actor.pp,
        actor_vpp=actor.vpp,
        actor_dp=cfg.dp,
        # megatron_backend.actor: megatron's optimizer on CUDA, distributed when DP > 1; torch AdamW on CPU
        distributed_optimizer=on_cuda and cfg.dp > 1,
        offload_params=actor.offload.params,
        offload_grads=actor.offload.grads,
        offload_optimizer=actor.offload.optimizer,
        micro_batch_size=actor.micro_batch_size,
        recompute=getattr(actor, "recompute", "none"),
        attention="flash" if on_cuda else "unfused",  # Transformer Engine on CUDA, megatron's local spec on CPU
        reference_model=cfg.algorithm.kl_coef > 0,
        offload_ref_params=actor.offload.ref_params,
        sequences_per_step=cfg.trainer.prompts_per_step * rollout.n_samples_per_prompt,
        prompt_tokens=max(1, prompt_tokens),
        response_tokens=rollout.max_new_tokens,
        engine=rollout.engine,
        rollout_tp=rollout.tp,
        wake_strategy=rollout.wake_strategy,
        gpu_memory_utilization=None if util == "auto" else float(util),
        kv_cache_bytes=getattr(rollout, "kv_cache_bytes", None),
        engine_capacity_bytes=int(rollout.cpu_capacity_gb * 2**30),
        max_num_seqs=rollout.max_num_seqs,
        max_model_len=rollout.max_model_len,
        block_size=rollout.block_size,
        native_activation_reserve_bytes=rollout.activation_reserve_mb * MIB,
        sync_bucket_bytes=cfg.weight_sync.bucket_mb * MIB,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exp", default="tiny_cpu", help="experiment name (experiments/conf/exp/<name>.yaml)")
    parser.add_argument("--json", default=None, help="write the plan as JSON here")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompt length to plan for (default: rollout.max_model_len - max_new_tokens, else "
        f"{DEFAULT_PROMPT_TOKENS} or what max_position_embeddings leaves)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when the plan does not fit")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, as for make run")
    args = parser.parse_args(argv)

    from rl.compose import ConfigError, compose

    try:
        inputs = plan_inputs(compose(args.exp, args.overrides), args.prompt_tokens)
        base_inputs = plan_inputs(compose(args.exp), args.prompt_tokens) if args.overrides else None
    except (ConfigError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    plan = make_plan(inputs)
    side_by_side = variants(inputs)
    title = " ".join([args.exp, *args.overrides])
    print(format_table(plan, side_by_side, title=title))
    result = plan_json(plan, side_by_side)
    result["exp"], result["overrides"] = args.exp, list(args.overrides)
    if plan.kv_cache_source == "auto" and plan.kv_cache_bytes < plan.largest_safe_kv_cache_bytes:
        print(
            f"auto: the KV cache is what {inputs.max_num_seqs} sequences of max_model_len={inputs.engine_max_model_len} "
            f"can use, less than the {gib(plan.largest_safe_kv_cache_bytes)} GiB {plan.kv_limiting_phase} leaves it"
        )
    elif plan.kv_cache_source == "auto":
        print(f"auto: the KV cache fills the room {plan.kv_limiting_phase} leaves it")
    if base_inputs is not None:
        base = make_plan(base_inputs)
        same_kv = make_plan(replace(inputs, kv_cache_bytes=base.kv_cache_bytes, gpu_memory_utilization=None))
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
