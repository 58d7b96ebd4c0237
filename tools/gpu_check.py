"""``make gpu-check``: the one prepared run a lent GPU gets (docs/gpu-check.md says how to call it).

A lent GPU comes for 15 minutes of device time in all, on an image with torch and transformers but without
megatron-core, hydra or omegaconf and without a network. ``make gpu-wheels`` (tools/gpu_kit.py) brings what is
missing as wheels in ``.gpu-wheels/``; this module installs them offline (``pip --no-index --no-deps --target``,
beside the image's own packages) and runs the stages below, each in its own process with its own time box, the
next one run even when one fails or runs out of time, in an order that yields the constants first:

1. ``main_0.5b``: the main job on the GPU, native engine, bf16: a Qwen2.5-0.5B-shaped model with random weights
   written on the device (modelspec/architectures/, no download), SFT warm-up steps then GRPO steps, a checkpoint,
   an HF export and an eval at the end; its summary.json (measured per-phase device peaks, seconds per phase).
2. ``main_1.5b``: the same on a Qwen2.5-1.5B shape, without the checkpoint: the run the fit does not see.
3. ``fit``: the constants one GPU without vLLM can measure (tools/calibrate.py::fit_one_run: the runtime level,
   the activation factor) from the 0.5B run, the plan under them checked phase by phase on the 1.5B run, the
   device's total as ``cudaMemGetInfo`` reports it beside the planner preset's; writes the proposed ``cuda.json``
   with its provenance (device, driver, torch, date).
4. ``sync``: the 0.5B run's weight sync (bytes, seconds) beside the device's own copy bandwidth for those bytes.
5. ``moe``: an MoE actor (a small Qwen3-MoE, EP=1) for a step on the same image (no Transformer Engine).
6. ``tests``: the gpu-marked tests (those that need two GPUs skip, saying so).

It writes at most 8 files to ``--out`` ($OUT on the device machine): ``gpu_check.json`` (every stage: passed,
failed with its last lines, timed out or skipped, with its results), the proposed calibration, the runs'
summary.json and memory charts, and the runs' records (``runs.tar.gz``: per-step phase seconds for
``make calibrate-time``). ``--device cpu`` runs the same stages on CPU with small shapes: CI runs that
(tests/test_gpu_check.py), so a broken kit is found here, not in the 15 minutes.

This module imports only the standard library at the top: the driver runs before the kit is installed; each
stage imports the project in its own process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import json as _json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools.plan_runs import RunSpec, check, ensure_run, measured_phases, model_phases, plan_for, predicted_phases

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float  # its time box on a GPU (the whole check fits BUDGET_S)
    what: str


# The boxes from the lent H200 (2026-11-30, docs/gpu-check.md): a main job's first step came 85 s after its stage
# started (the random model written on the device 25 s, the run's start 20 s, imports and build 25 s, two SFT
# steps 15 s), then 9 s a step, the checkpoint 14 s, the export 4 s; a 1.5B step ~12 s.
STAGES = (
    Stage("main_0.5b", 140, "the main job, Qwen2.5-0.5B shape, bf16, native engine, checkpoint + export + eval"),
    Stage("main_1.5b", 120, "the main job, Qwen2.5-1.5B shape, bf16, native engine (the fit does not see it)"),
    Stage("fit", 25, "runtime level and activation factor from the 0.5B run, the plan checked on the 1.5B run"),
    Stage("sync", 15, "the weight sync's bytes and seconds beside the device's copy bandwidth"),
    Stage("moe", 60, "an MoE actor (small Qwen3-MoE, EP=1) for one step"),
    Stage("tests", 60, "the gpu-marked tests"),
)
# 7 minutes: with the machine's start (~35 s measured) and the kit's install, a call of 480 s leaves ~6 of the
# session's 15 minutes for a second, shorter try
BUDGET_S = 420.0
MIN_STAGE_S = 10.0  # a stage with less left is reported skipped, not started
OUT_FILES = 8  # what the device tool brings back from $OUT

# The run's shape per size; on CPU the same architecture, small (the plumbing, not the numbers).
ARCHITECTURES = {"0.5b": "Qwen2.5-0.5B-Instruct", "1.5b": "Qwen2.5-1.5B-Instruct"}
CPU_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_window_layers=2,
    vocab_size=128,
)
EXP = "qwen2.5_0.5b_1xh200"
MOE_EXP = "tiny_cpu_moe"
# modelspec/tiny.py's families, built in seconds: on a GPU 16 experts of a 512-wide Qwen3-MoE, on CPU the tiny one
MOE_FAMILY = {"cuda": "qwen3_moe_memory", "cpu": "qwen3_moe"}


def run_overrides(size: str, device: str, preset: str, model_dir: Path) -> list[str]:
    """The main job's hydra overrides of :data:`EXP`: the native engine in bf16, a short warm-up and a few GRPO
    steps; the 0.5B run ends with a checkpoint, an HF export and an eval; short answers so the rollout fits its
    time box (random weights rarely stop on their own)."""
    on_gpu = device == "cuda"
    common = [
        f"model.path={model_dir}",
        f"model.architecture={'arch:' + ARCHITECTURES[size] if on_gpu else 'null'}",
        "model.dtype=bfloat16",
        "rollout.engine=native",
        f"cluster.device={preset}",
        "cluster.procs_per_node=1",
        "wandb.mode=disabled",
        "resume=never",
        "trainer.sft_warmup_steps=1" if on_gpu else "trainer.sft_warmup_steps=2",
        "trainer.steps=3" if on_gpu else "trainer.steps=2",  # step 0 warms up; the medians are of the steps after
        "trainer.prompts_per_step=32" if on_gpu else "trainer.prompts_per_step=4",
        "rollout.n_samples_per_prompt=8" if on_gpu else "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=64" if on_gpu else "rollout.max_new_tokens=6",
        "rollout.max_model_len=256" if on_gpu else "rollout.max_model_len=64",
        "rollout.max_num_seqs=256" if on_gpu else "rollout.max_num_seqs=8",
        # on the lent H200 without TE, 4 sequences per micro-batch took 147 ms each in train (64 of them: 9.4 s)
        "actor.micro_batch_size=16" if on_gpu else "actor.micro_batch_size=4",
    ]
    if not on_gpu:  # the experiment sizes the KV cache from the GPU's memory ("auto")
        common += ["rollout.gpu_memory_utilization=0.5", "rollout.cpu_capacity_gb=1.0"]
    if size == "0.5b":
        last = "3" if on_gpu else "2"
        return [
            *common,
            f"trainer.save_every={last}",
            "trainer.export_at_end=true",
            f"eval.every={last}",
            "eval.max_problems=64" if on_gpu else "eval.max_problems=4",
        ]
    return [*common, "trainer.save_every=0"]


# ---------------------------------------------------------------- the stages (each in its own process)
def _spec(size: str, device: str, preset: str, work: Path):

    return RunSpec(f"gpu_check_{size}", EXP, tuple(run_overrides(size, device, preset, work / f"model_{size}")))


def _preset(device: str) -> str:
    if device == "cpu":
        return "cpu"
    # first use: keeps torch (~1 s) out of `import tools.gpu_check` (its argument parsing and input checks)
    from tools.calibrate import cuda_preset

    return cuda_preset()


def stage_main(size: str, device: str, work: Path) -> dict:

    # first use: keeps torch (~1 s) out of `import tools.gpu_check` (its argument parsing and input checks)
    from modelspec.tiny import write_random_model

    preset = _preset(device)
    start = time.monotonic()
    shape = {} if device == "cuda" else CPU_SHAPE
    write_random_model(ARCHITECTURES[size], work / f"model_{size}", device=device, dtype="bfloat16", **shape)
    written_s = time.monotonic() - start
    spec = _spec(size, device, preset, work)
    run_dir = ensure_run(spec, work / f"run_{size}", rerun=True, timeout_s=3600)
    summary = _json.loads((run_dir / "summary.json").read_text())
    metrics = [_json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [m for m in metrics if "time/train" in m and "train/num_tokens" in m]
    tokens = sum(m["train/num_tokens"] for m in rl)
    return {
        "run_dir": str(run_dir),
        "model_written_s": round(written_s, 1),
        "wall_s": summary.get("wall_seconds"),
        "step_median_s": summary["time"]["step_median_seconds"],
        "phase_median_s": summary["time"]["phase_median_seconds"],
        "phase_peak_bytes": summary["memory"]["phase_peak_bytes"],
        "plan": {name: p for name, p in summary["memory_plan"]["phases"].items()},
        "train_tokens_per_s": round(tokens / sum(m["time/train"] for m in rl), 1) if rl else None,
        "weight_sync": summary.get("weight_sync"),
        "eval": summary.get("eval"),
        "exported": sorted(p.name for p in (run_dir / "hf").glob("step_*")) if (run_dir / "hf").is_dir() else [],
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("*")) if size == "0.5b" else [],
    }


def stage_fit(device: str, work: Path, out: Path) -> dict:

    # first use: keeps torch (~1 s) out of `import tools.gpu_check` (its argument parsing and input checks)
    from planner.calibration import Constant, load, write
    from tools.calibrate import device_description, fit_one_run, library_versions

    kind = "cuda" if device == "cuda" else "cpu"
    preset = _preset(device)
    fit_spec, check_spec = _spec("0.5b", device, preset, work), _spec("1.5b", device, preset, work)
    fit_dir, check_dir = work / "run_0.5b", work / "run_1.5b"
    values, evidence = fit_one_run(fit_spec, fit_dir, kind)
    base = load(kind)
    constants = dict(base.constants)
    for name, (value, uncertainty) in values.items():
        constants[name] = Constant(
            name,
            value,
            uncertainty,
            "fit",
            "make gpu-check (tools/gpu_check.py, calibrate.fit_one_run)",
            constants[name].unit,
        )
    device_info = device_description(kind) if kind == "cuda" else {"kind": "cpu", "machine": platform.machine()}
    if kind == "cuda":
        # first use: keeps torch (~1 s) out of `import tools.gpu_check` (its argument parsing and input checks)
        import torch

        from planner.devices import CUDA_PRESETS

        free, total = torch.cuda.mem_get_info()
        # the preset's total is an estimate from NVML's (planner/devices.py): this reading sources it
        device_info["preset_total_bytes"] = CUDA_PRESETS[preset].total_bytes
        device_info.update(
            mem_get_info_total_bytes=total,
            mem_get_info_free_bytes=free,
            driver=_nvidia_driver(),
            torch=torch.__version__,
        )
    calibration = type(base)(
        kind,
        constants,
        {
            "runs": [{"name": fit_spec.name, **fit_spec.key()}],
            "checked_on": {"name": check_spec.name, **check_spec.key()},
            "evidence": evidence,
            "versions": library_versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": device_info,
        },
    )
    proposal = write(calibration, out / f"{kind}.json")
    plan = plan_for(check_spec, calibration, check_dir)
    result = check(check_spec.name, model_phases(plan, check_dir), measured_phases(check_dir), predicted_phases(plan))
    return {
        "fitted": {name: {"value": v, "uncertainty": u} for name, (v, u) in values.items()},
        "proposal": proposal.name,
        "device": device_info,
        "check_1.5b": result,
    }


def _nvidia_driver() -> str | None:
    try:
        # optional: pynvml is imported where it is used, not every install has it
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # noqa: BLE001 - the report says why, the stage goes on
        return f"unknown ({exc})"


def stage_sync(device: str, work: Path) -> dict:

    # first use: keeps torch (~1 s) out of `import tools.gpu_check` (its argument parsing and input checks)
    import torch

    summary = json.loads((work / "run_0.5b" / "summary.json").read_text())
    # one GPU: the sync moves nothing across ranks (weight_sync.bytes 0) and copies every engine weight in place
    nbytes = int(summary["memory"]["tag_bytes"]["0"]["weights"])
    sync_s = summary["time"]["phase_median_seconds"]["weight_sync"]
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    copy_s = statistics.median(times[1:])  # the first one warms up
    return {
        "engine_weight_bytes": nbytes,
        "weight_sync_phase_s": sync_s,
        "sync_gbps": round(nbytes / sync_s / 1e9, 2) if sync_s else None,
        "device_copy_gbps": round(nbytes / copy_s / 1e9, 2) if copy_s else None,
        "cross_rank": summary["weight_sync"],
    }


def stage_moe(device: str, work: Path) -> dict:
    # first use: keeps torch (~1 s) out of `import tools.gpu_check` (its argument parsing and input checks)
    from modelspec.tiny import write_tiny_model

    model_dir = write_tiny_model(MOE_FAMILY[device], work / "model_moe")
    spec = RunSpec(
        "gpu_check_moe",
        MOE_EXP,
        (
            f"model.path={model_dir}",
            "model.dtype=bfloat16",
            f"cluster.device={_preset(device)}",
            "cluster.procs_per_node=1",
            "actor.ep=1",
            "wandb.mode=disabled",
            "resume=never",
            "trainer.steps=1",
            "trainer.sft_warmup_steps=0",
            "trainer.prompts_per_step=8",
            "trainer.save_every=0",
            *(
                ()
                if device == "cuda"
                else ("rollout.n_samples_per_prompt=2", "actor.micro_batch_size=16", "trainer.ppo_epochs=1")
            ),
        ),
    )
    run_dir = ensure_run(spec, work / "run_moe", rerun=True, timeout_s=3600)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "run_dir": str(run_dir),
        "step_median_s": summary["time"]["step_median_seconds"],
        "phase_peak_bytes": summary["memory"]["phase_peak_bytes"],
        "actor_optimizer": summary.get("actor_optimizer"),
    }


def stage_tests(device: str, work: Path) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs", "tests"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode not in (0, 5):  # 5: nothing collected/selected ran (every one skipped is 0)
        raise RuntimeError("\n".join(lines[-40:]))
    return {"summary": lines[-1] if lines else "", "skipped": [ln for ln in lines if ln.startswith("SKIPPED")][:20]}


def run_stage(name: str, device: str, work: Path, out: Path) -> dict:
    if name.startswith("main_"):
        return stage_main(name.removeprefix("main_"), device, work)
    return {
        "fit": lambda: stage_fit(device, work, out),
        "sync": lambda: stage_sync(device, work),
        "moe": lambda: stage_moe(device, work),
        "tests": lambda: stage_tests(device, work),
    }[name]()


# ---------------------------------------------------------------- the driver
def install_kit(wheels: Path, site: Path) -> dict:
    """The kit's wheels into ``site`` beside the image's packages (``--no-deps``: the image has the rest)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"gpu-check: {wheels} holds no wheels; run `make gpu-wheels` here first and carry it")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(site),
        *map(str, found),
    ]
    start = time.monotonic()
    subprocess.run(cmd, check=True)
    return {"wheels": [p.name for p in found], "seconds": round(time.monotonic() - start, 1)}


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def check_all(out: Path, work: Path, device: str, budget_s: float, names: list[str], env: dict) -> dict:
    """Every stage in order, each time-boxed in its own process; the report of each."""
    start = time.monotonic()
    report: dict = {"device": device, "budget_s": budget_s, "stages": {}}
    scale = budget_s / BUDGET_S
    for stage in STAGES:
        if stage.name not in names:
            continue
        left = budget_s - (time.monotonic() - start)
        box = min(stage.budget_s * scale, left) if device == "cuda" else left
        entry: dict = {"what": stage.what}
        if box < MIN_STAGE_S:
            entry.update(status="skipped", why=f"{left:.0f} s of the {budget_s:.0f} s budget left")
            report["stages"][stage.name] = entry
            continue
        result_file = work / f"stage_{stage.name}.json"
        result_file.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "tools.gpu_check",
            "--stage",
            stage.name,
            "--device",
            device,
            "--work",
            str(work),
            "--out",
            str(out),
        ]
        t0 = time.monotonic()
        print(f"gpu-check: {stage.name} ({stage.what}; {box:.0f} s) ...", file=sys.stderr, flush=True)
        # its own process group: a stage out of time is stopped with the run it started (on the lent H200 a main
        # job outlived its stage and shared the GPU with the next stage's, which then measured both)
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=box)
            if proc.returncode == 0 and result_file.exists():
                entry.update(status="passed", results=json.loads(result_file.read_text()))
            else:
                entry.update(status="failed", exit=proc.returncode, tail=_tail(output))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            entry.update(status="timed_out", tail=_tail(output))
        entry["seconds"] = round(time.monotonic() - t0, 1)
        (work / f"stage_{stage.name}.log").write_text(output)
        print(f"gpu-check: {stage.name} {entry['status']} in {entry['seconds']} s", file=sys.stderr, flush=True)
        report["stages"][stage.name] = entry
    report["seconds"] = round(time.monotonic() - start, 1)
    return report


RUNS = ("0.5b", "1.5b", "moe")
RECORD_MAX_BYTES = 1 << 20  # a run's files above this (checkpoints, exports, models) stay on the device
RUNS_ARCHIVE = "runs.tar.gz"


def archive_runs(work: Path, dest: Path) -> list[str]:
    """The runs' records (metrics.jsonl, summary.json, the spec, speed.json, run.log, the config) in one archive:
    ``make calibrate-time`` fits cuda_time.json from the phase seconds of each step, which the summaries keep only as
    medians. Folders (checkpoints, hf, models) and files over :data:`RECORD_MAX_BYTES` stay behind."""
    members = []
    with tarfile.open(dest, "w:gz") as tar:
        for n in RUNS:
            run_dir = work / f"run_{n}"
            if not run_dir.is_dir():
                continue
            for path in sorted(run_dir.iterdir()):
                if path.is_file() and path.stat().st_size <= RECORD_MAX_BYTES:
                    tar.add(path, arcname=f"run_{n}/{path.name}")
                    members.append(f"run_{n}/{path.name}")
    return members


def collect(out: Path, work: Path) -> list[str]:
    """The runs' summaries and charts beside the report and the proposal, and the runs' records in one archive
    (at most :data:`OUT_FILES` in all)."""
    picks = [(work / f"run_{n}" / "summary.json", f"summary_{n}.json") for n in RUNS]
    picks += [(work / f"run_{n}" / "memory_stages.png", f"memory_stages_{n}.png") for n in ("0.5b", "1.5b")]
    copied = []
    for src, name in picks:
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    if archive_runs(work, out / RUNS_ARCHIVE):
        copied.append(RUNS_ARCHIVE)
    else:
        (out / RUNS_ARCHIVE).unlink(missing_ok=True)
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check/out"), help="the report's folder")
    parser.add_argument("--work", default=None, help="scratch folder for models and runs (default: <out>/../work)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--wheels", default=None, help="install this folder's wheels first (the device: .gpu-wheels)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall time for all stages")
    parser.add_argument("--stages", nargs="+", default=[s.name for s in STAGES], choices=[s.name for s in STAGES])
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # one stage, in its own process
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out.parent / f"{out.name}_work"
    if args.budget_s <= 0:
        parser.error(f"--budget-s={args.budget_s} must be > 0")
    device = args.device
    if args.stage is not None:
        result = run_stage(args.stage, device, work, out)
        (work / f"stage_{args.stage}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(REPO)]
    kit = None
    if args.wheels:
        site = work / "site"
        kit = install_kit(Path(args.wheels), site)
        paths.append(str(site))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))
    if device == "auto":
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
            capture_output=True,
            text=True,
            env=env,
        )
        device = "cuda" if probe.stdout.strip() == "True" else "cpu"
    report = check_all(out, work, device, args.budget_s, args.stages, env)
    report["kit"] = kit
    report["python"] = sys.version.split()[0]
    report["files"] = ["gpu_check.json", *sorted(p.name for p in out.glob("*.json") if p.name != "gpu_check.json")]
    report["files"] += collect(out, work)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    names = sorted(p.name for p in out.iterdir())
    if len(names) > OUT_FILES:
        print(f"gpu-check: {len(names)} files in {out}, the device tool brings back {OUT_FILES}", file=sys.stderr)
    failed = [n for n, s in report["stages"].items() if s["status"] != "passed"]
    print(
        json.dumps(
            {
                "device": device,
                "seconds": report["seconds"],
                "failed": failed,
                "stages": {n: s["status"] for n, s in report["stages"].items()},
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
