"""``make smoke``: every documented ``make`` target that needs no GPU, once, at its smallest, as a new user runs it.

Each step is the command a user types (``make <target> ...``), with the fewest steps, ranks, repeats and the
smallest model that still run the target's code path. It runs as from a fresh checkout without touching the
clone: tiny checkpoints are built on demand into an empty directory of a scratch directory (``TINY_DIR`` for
make, ``RLMEM_TINY_DIR`` for the processes: the first step to need one builds it, as in a fresh clone) and
runs go under the scratch directory too (``output_dir=``). A step passes when it exits as README says (0;
2 for a GPU experiment on a machine without its GPUs) and prints what README says it prints: a JSON line
with the given keys, or a line matching a pattern, and the files it writes. Every step runs even when one
fails; one line per step (target, seconds, what it printed), the total, exit 1 when any failed. The scratch
directory (each step's output in ``logs/``) is removed after a pass and kept after a failure.

:data:`ELSEWHERE` says where CI runs each documented target that is not a step here, or why nothing can;
``tests/test_smoke.py`` checks that the two cover every target README documents.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# sizes: the fewest RL steps that give a steady step (2, after 2 supervised warm-up steps)
RUN_ARGS = "trainer.steps=2 trainer.sft_warmup_steps=2 output_dir={scratch}/runs"
TINY = "TINY_DIR={scratch}/tiny_models"
HF = "HF={scratch}/tiny_models/qwen2"


@dataclass(frozen=True)
class Step:
    """``make <target> <args>`` (``{scratch}`` and the names earlier steps captured filled in)."""

    target: str
    args: str = ""
    expect: str | None = None  # a regex one output line must match; its named groups are captured for later steps
    json_keys: tuple[str, ...] = ()  # or: a JSON line (the last one) with these keys
    json_true: tuple[str, ...] = ()  # ... whose values are true
    files: tuple[str, ...] = ()  # written by the step (formatted like args)
    exit_code: int = 0
    why: str = ""  # why these sizes, when the smallest that runs the code path is not the documented default
    label: str = field(default="")

    @property
    def name(self) -> str:
        return self.label or self.target

    def command(self, values: dict[str, str]) -> list[str]:
        return ["make", self.target, *shlex.split(self.args.format(**values))]


STEPS: tuple[Step, ...] = (
    Step("help", expect=r"^usage: make <target>"),
    Step("lint", expect=r"^All checks passed!"),
    # first of the steps that use a tiny checkpoint: it builds tiny:qwen2 on demand, as on a fresh clone
    # (where its ranks once raced to write it), then the tiny-models step rewrites it in place
    Step(
        "bench-sync",
        'LAYOUT=tp2-tp1 ARGS="--repeats 1 --hf tiny:qwen2"',
        json_keys=("planned_bytes", "baseline_bytes", "speedup"),
        json_true=("same_outputs",),
        files=("tiny_models/qwen2/model.safetensors",),
        why="2 ranks and the tiny Qwen2 instead of every layout of the ~125 MB models, one repeat",
    ),
    Step(
        "bench-sync",
        "LAYOUT=paper EXP=qwen3_30b_a3b_8xh100",
        json_keys=("planned_bytes", "baseline_bytes", "total_s"),
        json_true=("estimate",),
        label="bench-sync paper",
    ),
    Step("tiny-models", TINY, expect=r"/tiny_models/qwen2$", files=("tiny_models/llama/config.json",)),
    Step(
        "plan",
        "EXP=qwen32b_8xh100 JSON={scratch}/plan.json",
        expect=r"^fits: peak \w+ [\d.]+ GiB",
        files=("plan.json",),
    ),
    Step(
        "run",
        f'ARGS="{RUN_ARGS}"',
        expect=r"^run directory: (?P<run>\S+)",
        files=("{run}/summary.json", "{run}/metrics.jsonl", "{run}/memory_timeline.csv", "{run}/memory_stages.png"),
        why="2 steps after 2 warm-up steps (the default: 40 after 30)",
    ),
    Step(
        "run",
        "EXP=qwen32b_8xh100",
        expect=r"^error: qwen32b_8xh100 needs 8 x H100-80GB",
        exit_code=2,
        label="run (GPU experiment)",
    ),
    Step(
        "tune",
        'EXP=tiny_cpu ARGS="--out {scratch}/tuned_tiny_cpu.yaml --chart {scratch}/tune.png"',
        expect=r"^wrote \S+/tuned_tiny_cpu\.yaml",
        files=("tuned_tiny_cpu.yaml", "tune.png"),
        why="the CPU experiment's layouts on this machine (the GPU experiments' searches take minutes)",
    ),
    Step("report", "RUN={run}", expect=r"^timeline: ", files=("{run}/memory_timeline.png",)),
    Step("compare", 'RUNS="{run} {run}" OUT={scratch}/compare.png', expect=r"^chart: ", files=("compare.png",)),
    Step(
        "export",
        "RUN={run}",
        json_keys=("out", "files", "peak_rss_bytes"),
        files=("{run}/hf/step_00000002/config.json", "{run}/hf/step_00000002/model.safetensors"),
    ),
    Step(
        "sbatch",
        'EXP=tiny_cpu ARGS="trainer.steps=3 output_dir={scratch}/runs"',
        expect=r"^submit with: sbatch (?P<script>\S+)",
        files=("{script}",),
    ),
    Step(
        "sweep",
        'SWEEP=ci_smoke EXP=tiny_cpu SWEEP_ID=smoke/smoke/ci0 ALLOW_INFEASIBLE=1 ARGS="output_dir={scratch}/runs"',
        expect=r"^all points on Slurm: sbatch (?P<array>\S+)",
        files=("{array}",),
        why="render only (SWEEP_ID): creating a W&B sweep needs an API key and the network",
    ),
    Step(
        "bench-entropy",
        'ARGS="--tokens 512 --vocab 8192"',
        json_keys=("peak_extra_bytes_chunked", "peak_extra_bytes_unchunked", "max_abs_entropy_diff"),
    ),
    Step(
        "bench-rollout",
        'ARGS="--batch 4 --max-new-tokens 8 --repeats 1"',
        json_keys=("native_tokens_per_s", "hf_generate_tokens_per_s"),
        json_true=("greedy_outputs_equal",),
    ),
    Step(
        "bench-train",
        'ARGS="--levers remove_padding --repeats 1 --hidden 128 --intermediate 256 --layers 1 --heads 4 '
        '--kv-heads 2 --vocab 512 --seqs 4 --response-max 32"',
        json_keys=("lever", "with_peak_mib", "without_peak_mib", "with_predicted_mib"),
        why="one lever, one repeat, a 1-layer model of hidden 128 (default: 8 levers x 3 repeats, hidden 512)",
    ),
    Step(
        "bench-step",
        "CONFIGS=\"'rollout.wake_strategy=staged' 'rollout.wake_strategy=all_at_once'\" REPEATS=1 "
        'ARGS="trainer.steps=2 trainer.sft_warmup_steps=0 wandb.mode=disabled"',
        json_keys=("sides", "over_first", "machine_speed_seconds"),
        why="one run of each side, 2 steps without warm-up (default: 3 alternating runs of make run's 12 steps)",
    ),
    Step("clean", TINY),
)

# documented targets that are not a step here -> where CI runs them, or why nothing here can
ELSEWHERE: dict[str, str] = {
    "install": ".ci/run (first)",
    "test": ".ci/run",
    "test-procs": ".ci/run (after make test)",
    "test-threads": "not in CI: the numeric tests with pytest and the ranks at other thread counts (~4 min on a slow "
    "CI machine); make test and make test-procs run them once; run it when a numeric path changes",
    "calibrate": "not in CI: its 7 fit runs are ~9 of a slow CI machine's 90 minutes; tests/test_calibrate_cpu.py "
    "checks the fit on timelines made with known constants, and make test-slow validates the committed ones",
    "test-vllm": ".ci/run",
    "test-slow": ".ci/run",
    "test-slurm": ".ci/run (after .ci/slurm-up)",
    "validate-plan": "make test-slow (tests/test_validate_plan.py): the plan with the committed constants "
    "(planner/calibration/cpu.json, fitted on another machine) against this machine's runs",
    "mutate-plan": "make test-slow (tests/test_validate_plan.py), on validate-plan's runs",
    "calibrate-time": "not in CI: a fit of wall-clock seconds, which CI's machines would make noise of; "
    "tests/test_step_time.py checks the fit on rows made with known constants",
    "validate-time": "not in CI: no test asserts a wall-clock time; tests/test_step_time.py checks that the check "
    "catches each constant off by 2x",
    "test-gpu": "needs CUDA (here its tests are only collected and skipped)",
    "gpu-wheels": "make test-procs (tests/test_gpu_kit.py: the loop's imports against the image and the kit; no "
    "download in CI)",
    "gpu-check": "make test-procs (tests/test_gpu_check.py runs its stages with --device cpu); on a GPU: docs/gpu-check.md",
    "smoke": "this",
    # CI's suites run these tools (python -m tools.X) themselves; the make recipe's flags are checked against
    # what each tool declares by tests/test_smoke.py (make -n), so the smoke does not run them a second time
    "parity": "make test-procs (tests/test_parity_cli.py: TP=2 x PP=2, tied embeddings, odd vocab)",
    "verify-sync": "make test-procs (tests/test_weight_sync_dist.py::test_verify_sync_cli_end_to_end)",
    "eval": "make test-slow (tests/test_eval.py: a run's checkpoint and its export, and that they agree)",
    "sweep-local": "make test-slow (tests/test_sweep.py: its points run, the infeasible one skipped)",
}


def output_line(step: Step, output: str, values: dict[str, str]) -> str:
    """The line showing the step printed what it should (captured names go into ``values``); raises
    ValueError naming what is missing."""
    lines = output.splitlines()
    if step.json_keys:
        records = []
        for line in lines:
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        if not records:
            raise ValueError("no JSON line")
        record = records[-1]
        missing = [k for k in step.json_keys if k not in record]
        false = [k for k in step.json_true if record.get(k) is not True]
        if missing or false:
            raise ValueError(f"its JSON line lacks {missing} / has not true {false}")
        return json.dumps({k: record[k] for k in (*step.json_keys, *step.json_true)})
    if step.expect is not None:
        pattern = re.compile(step.expect)
        for line in lines:
            match = pattern.search(line)
            if match:
                values.update(match.groupdict())
                return line.strip()
        raise ValueError(f"no line matches {step.expect!r}")
    return lines[-1].strip() if lines else ""


def run_step(step: Step, index: int, scratch: Path, values: dict[str, str], env: dict[str, str]) -> tuple[bool, str]:
    """(passed, what it printed or why it failed)."""
    try:
        command = step.command(values)
    except KeyError as exc:
        return False, f"needs {exc} from an earlier step that failed"
    log = scratch / "logs" / f"{index:02d}_{step.name.replace(' ', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    output = log.read_text()
    problems = []
    if code != step.exit_code:
        problems.append(f"exit {code}, expected {step.exit_code}")
    try:
        line = output_line(step, output, values)
    except ValueError as exc:
        problems.append(str(exc))
        line = ""
    for name in step.files:
        try:
            path = scratch / name.format(**values)
        except KeyError:
            path = None
        if path is None or not path.exists():
            problems.append(f"did not write {name.format_map(_Missing(values))}")
    if problems:
        tail = "\n".join(output.splitlines()[-25:])
        return False, f"{'; '.join(problems)} (log {log}); its output ends:\n{tail}"
    return True, line


class _Missing(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


# the Makefile's install knobs: a venv installed with other ones (EXTRAS=dev,gpu) must not be reinstalled
INSTALL_VARIABLES = ("PYTHON_BOOT", "VENV", "TORCH_SPEC", "EXTRAS", "VLLM_VERSION")


def step_environment(environ, scratch: Path) -> dict[str, str]:
    """The steps' environment: tiny checkpoints into the scratch directory, and none of the Makefile's knobs
    (``EXP``, ``ARGS``, ...) from ``make smoke``'s command line or the user's shell, which make passes down
    to the steps' own make as environment variables: each step sees the defaults a new user gets."""
    knobs = set(re.findall(r"^(\w+)\s*\?=", (REPO / "Makefile").read_text(), flags=re.M)) - set(INSTALL_VARIABLES)
    drop = knobs | {"MAKEFLAGS", "MAKEOVERRIDES", "MFLAGS", "MAKELEVEL"}
    env = {k: v for k, v in environ.items() if k not in drop}
    env["RLMEM_TINY_DIR"] = str(scratch / "tiny_models")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--only", nargs="*", default=None, help="these targets only (labels or targets)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory after a pass")
    args = parser.parse_args(argv)
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rlmem-smoke-"))
    scratch.mkdir(parents=True, exist_ok=True)
    values = {"scratch": str(scratch)}
    env = step_environment(os.environ, scratch)
    steps = [s for s in STEPS if args.only is None or s.name in args.only or s.target in args.only]
    failed, total_start = [], time.monotonic()
    for index, step in enumerate(steps):
        start = time.monotonic()
        passed, what = run_step(step, index, scratch, values, env)
        seconds = time.monotonic() - start
        print(f"smoke: {step.name:<22} {seconds:6.1f} s  {'ok' if passed else 'FAILED'}: {what}", flush=True)
        if not passed:
            failed.append(step.name)
    total = time.monotonic() - total_start
    print(f"smoke: {len(steps) - len(failed)}/{len(steps)} targets passed in {total:.0f} s", flush=True)
    if failed:
        print(f"smoke: failed: {', '.join(failed)}; outputs kept in {scratch / 'logs'}", file=sys.stderr)
        return 1
    if not args.keep and not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
