"""The planner's declared runs and how a plan is checked against one: shared by ``make calibrate``
(tools/calibrate.py), ``make validate-plan`` (tools/validate_plan.py) and tools/mutate_plan.py.

A :class:`RunSpec` is an experiment plus overrides, run as users run it, only shorter (:data:`SHORT_RUN`:
3 steps; the experiment's own SFT warm-up, W&B mode and checkpoints, a save after every step where the
experiment saves at all, so every steady step follows one) into ``runs/<set>/<name>/`` by ``python -m run.main --run-dir``; an existing run
directory whose ``spec.json`` matches is read instead (``--rerun`` runs it again). The fit set and the
validation set share no configuration (``tests/test_plan_runs.py``).

From a run directory: :func:`measured_phases` reads ``memory_timeline.csv`` (per phase, the steady-state
median over steps 1.. of its peak and of its rise above the level it started at, worst rank) and
:func:`predicted_phases` plans the run again from its spec (the same ``plan_inputs`` the run used, with
the task's longest prompt) and gives each phase's predicted peak and predicted rise (the peak minus what
is resident when the phase starts), with the runtime level the run measured at launch (its summary.json).
:func:`check` compares them: peaks within 10% (or 8 MiB), rises within 20% (or 8 MiB).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rl.data import longest_prompt_tokens

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
PEAK_TOLERANCE = 0.10  # relative, of the measured peak
RISE_TOLERANCE = 0.20  # relative, of the measured rise
FLOOR_BYTES = 8 * MIB  # absolute allowance where the relative one is smaller (RSS moves by a few MiB)
# runs as users run them, only shorter: 3 steps (steps 1-2 are the steady ones); the experiment's own warm-up,
# W&B mode and checkpoints (RunSpec.all_overrides saves after every step where the experiment saves)
SHORT_RUN = ("trainer.steps=3", "resume=never")
SAVE_EVERY_STEP = "trainer.save_every=1"


@functools.cache
def _experiment_saves(exp: str, overrides: tuple[str, ...]) -> bool:
    # first use: keeps torch (~1 s) out of `import tools.plan_runs` (its argument parsing and input checks)
    from run.compose import compose

    return compose(exp, list(overrides)).trainer.save_every > 0


@dataclass(frozen=True)
class RunSpec:
    name: str
    exp: str
    overrides: tuple[str, ...] = ()
    why: str = ""
    # calibrate fits the transient constants (train and rollout rises) on this run too; False: the level only
    fits_transients: bool = True

    @property
    def all_overrides(self) -> tuple[str, ...]:
        """The run's overrides: shorter, and where the experiment writes checkpoints, one after every step (a
        save's leftovers then sit under every steady step, as under most steps of the experiment's full run)."""
        saves = (SAVE_EVERY_STEP,) if _experiment_saves(self.exp, self.overrides) else ()
        return (*SHORT_RUN, *saves, *self.overrides)

    def key(self) -> dict:
        return {"exp": self.exp, "overrides": list(self.all_overrides)}


# The transient terms are fitted per planned token, and the plan assumes every response runs to max_new_tokens;
# after the experiment's SFT warm-up the tiny models end most answers early (vocab_mid_batches' train rise:
# 56.7 MB measured, 143 MB planned), so the runs that fit them decode to the end.
IGNORE_EOS = "rollout.ignore_eos=true"

# Fit set: what `make calibrate` fits the CPU constants on.
FIT_SET = (
    RunSpec("memory_cpu", "memory_cpu", (), "the runtime beside the tensors, with ~120 MB states (native engine)"),
    RunSpec(
        "tiny_cpu_short_batches",
        "tiny_cpu",
        ("rollout.max_new_tokens=12", "actor.micro_batch_size=32", "trainer.prompts_per_step=16", IGNORE_EOS),
        "what megatron's local (CPU) layer keeps per token beyond the fused count: activations dominate",
    ),
    RunSpec(
        "tiny_cpu_vllm",
        "tiny_cpu",
        (
            "rollout.engine=vllm",
            "rollout.max_new_tokens=32",
            "trainer.prompts_per_step=8",
            "actor.micro_batch_size=8",
            IGNORE_EOS,
        ),
        "vLLM's CPU runtime beside its tensors; its actor (the same with either engine) gives the train fit a row at "
        "8-sequence micro-batches of ~38-token rows: the workspace against the per-token factor",
    ),
    RunSpec(
        "tiny_cpu_pp_long_responses",
        "tiny_cpu_pp",
        ("rollout.max_new_tokens=16", "actor.micro_batch_size=16"),
        "4 ranks, PP=2, the tiny Llama: the lowest runtime level (~10 MiB under the 2-rank runs), so that the "
        "fitted runtime sits between the levels the shapes have, not at one end. Its rises stay out of the "
        "transient fits: a pipeline schedule's train rise is ~4 MiB under the 3-term count, which would pull the "
        "2-rank runs' workspace below zero",
        fits_transients=False,
    ),
    RunSpec(
        "vocab_mid_batches",
        "tiny_cpu",
        (
            "model.path=tiny:qwen2_vocab",
            "rollout.max_new_tokens=16",
            "actor.micro_batch_size=64",
            "trainer.prompts_per_step=16",
            IGNORE_EOS,
        ),
        "large tensors (16k vocabulary): the activation terms where they are mostly big allocations",
    ),
    RunSpec(
        "vocab_half_rollout",
        "tiny_cpu",
        (
            "model.path=tiny:qwen2_vocab",
            "rollout.max_new_tokens=32",
            "actor.micro_batch_size=32",
            "trainer.prompts_per_step=8",
            IGNORE_EOS,
        ),
        "a second rollout where the native engine's working set is large (the sampler's [64, 16384] draws, half "
        "vocab_mid_batches' sequences): without it the engine factor rests on that one run (left out, the others' "
        "1-2 MB working sets fit it at 0.17)",
    ),
    RunSpec(
        "tiny_cpu_long_rows",
        "tiny_cpu",
        ("rollout.max_new_tokens=64", "trainer.prompts_per_step=8", "actor.micro_batch_size=16", IGNORE_EOS),
        "the train terms at ~70-token rows and 16-sequence micro-batches (the others: 8-20 tokens, 32-64 sequences), "
        "so the train fit's three unknowns have more rows than unknowns and rows that tell them apart",
    ),
)


# The step-time fit's runs (make calibrate-time): the fit set, and more where a fixed cost the others barely see
# dominates a phase, so that its constant is pinned by the fit and not left to the others' few percent (the memory
# fit, make calibrate, does not read them). The first two were chosen after the validation set's one_sequence_decode
# and micro_batches_of_one first ran (docs/plan-validation.md, 2026-11-30 evening), and unlike them in sizes; the
# rest from the fit's own leave-one-out on a second VM (2026-12-01, day): a 16-layer model, so that the layer count
# varies, and a second compute-heavy run; deep_vllm after memory_cpu_vllm's validated rollout was read at -50%
# (vLLM's constant rested on one fit run; docs/plan-validation.md says so), and the two TP=1 vLLM runs from the fit's
# terms after that (the TP=2 runs could not tell vLLM's cost per step from its collectives').
TIME_FIT_SET = FIT_SET + (
    RunSpec(
        "two_sequences_decode",
        "tiny_cpu",
        (
            "rollout.tp=1",
            "trainer.prompts_per_step=4",
            "rollout.n_samples_per_prompt=1",
            "rollout.max_new_tokens=128",
            "actor.micro_batch_size=2",
            IGNORE_EOS,
        ),
        "the native engine's fixed cost per layer step: two TP=1 replicas decode two sequences each for 128 steps",
    ),
    RunSpec(
        "micro_batches_of_two",
        "tiny_cpu",
        ("trainer.prompts_per_step=2", "actor.micro_batch_size=2", "rollout.max_new_tokens=24", IGNORE_EOS),
        "megatron's fixed cost per micro-batch: 8 micro-batches of two ~28-token rows per pass",
    ),
    RunSpec(
        "deep_layers",
        "tiny_cpu",
        (
            "model.path=tiny:qwen2_deep",
            "rollout.max_new_tokens=32",
            "trainer.prompts_per_step=8",
            "actor.micro_batch_size=16",
            IGNORE_EOS,
        ),
        "the fixed costs per layer apart from those per pass and per phase: 16 layers, four times the others' tiny "
        "model (added when a refit on a second VM's runs left the actor's op factors and the engine's per-layer ops "
        "unpinned: no fit run varied the layer count)",
    ),
    RunSpec(
        "deep_decode",
        "tiny_cpu",
        (
            "model.path=tiny:qwen2_deep",
            "rollout.tp=1",
            "trainer.prompts_per_step=4",
            "rollout.n_samples_per_prompt=1",
            "rollout.max_new_tokens=96",
            "actor.micro_batch_size=4",
            IGNORE_EOS,
        ),
        "the native engine's fixed cost per layer step at 16 layers, without gloo (TP=1): a second run beside "
        "two_sequences_decode (deep_layers' TP=2 layer steps are gloo's)",
    ),
    RunSpec(
        "deep_micro_batches",
        "tiny_cpu",
        (
            "model.path=tiny:qwen2_deep",
            "trainer.prompts_per_step=2",
            "actor.micro_batch_size=2",
            "rollout.max_new_tokens=24",
            IGNORE_EOS,
        ),
        "micro_batches_of_two at 16 layers: the actor's ops per layer apart from its cost per micro-batch",
    ),
    RunSpec(
        "deep_vllm",
        "tiny_cpu",
        (
            "model.path=tiny:qwen2_deep",
            "rollout.engine=vllm",
            "rollout.max_new_tokens=32",
            "trainer.prompts_per_step=8",
            "actor.micro_batch_size=8",
            IGNORE_EOS,
        ),
        "tiny_cpu_vllm at 16 layers: vLLM's cost per layer step apart from its cost per step (without it vLLM's "
        "constant rests on tiny_cpu_vllm alone)",
    ),
    RunSpec(
        "vllm_decode",
        "tiny_cpu",
        (
            "rollout.engine=vllm",
            "rollout.tp=1",
            "trainer.prompts_per_step=4",
            "rollout.n_samples_per_prompt=1",
            "rollout.max_new_tokens=96",
            "actor.micro_batch_size=2",
            IGNORE_EOS,
        ),
        "vLLM's cost per step without collectives: two TP=1 engines decode two sequences each for 96 steps (the "
        "vLLM runs above are TP=2, where its cost per step and its all-reduces' ops come together)",
    ),
    RunSpec(
        "deep_vllm_decode",
        "tiny_cpu",
        (
            "model.path=tiny:qwen2_deep",
            "rollout.engine=vllm",
            "rollout.tp=1",
            "trainer.prompts_per_step=4",
            "rollout.n_samples_per_prompt=1",
            "rollout.max_new_tokens=96",
            "actor.micro_batch_size=4",
            IGNORE_EOS,
        ),
        "vllm_decode at 16 layers: vLLM's cost per layer step apart from its cost per step, without collectives",
    ),
    RunSpec(
        "memory_cpu_double_batch",
        "memory_cpu",
        ("trainer.prompts_per_step=8",),
        "a second run where the actor's FLOPs dominate train: memory_cpu at twice its sequences (without it the "
        "compute efficiency rests on memory_cpu alone)",
    ),
)


def cuda_fit_set(device: str) -> tuple[RunSpec, ...]:
    """What `make calibrate` fits the CUDA constants on, on a GPU node whose GPUs are the planner preset
    ``device``: memory_cpu's 122 MB model (built here, no download) on one GPU, then two. Each run isolates
    one constant, fitted in this order on the level residual (measured - planned, phases without transients)."""
    on = (f"cluster.device={device}",)
    return (
        RunSpec(
            "cuda_runtime",
            "memory_cpu",
            (*on, "cluster.procs_per_node=1"),
            "runtime_overhead_bytes: one GPU, no communicator, the native engine (no CUDA graphs)",
        ),
        RunSpec(
            "cuda_vllm",
            "memory_cpu",
            (*on, "cluster.procs_per_node=1", "rollout.engine=vllm"),
            "vllm_cuda_graph_bytes: what vLLM keeps beside its weights and KV cache, asleep or awake",
        ),
        RunSpec(
            "cuda_tp2",
            "memory_cpu",
            (*on, "cluster.procs_per_node=2", "actor.tp=2", "rollout.tp=2"),
            "nccl_bytes_per_communicator: two GPUs, three communicators per rank (actor TP, engine TP, world)",
        ),
    )


def cuda_validation_set(device: str) -> tuple[RunSpec, ...]:
    """What `make validate-plan` checks on a GPU node whose GPUs are the planner preset ``device`` (never fitted
    on): memory_cpu's 122 MB model (built here, no download) on 1, 2 and 4 GPUs, each configuration putting a
    different set of communicators (planner/comms.py) and engine reserves under the plan."""
    on = (f"cluster.device={device}",)
    return (
        RunSpec(
            "cuda_vllm_resident",
            "memory_cpu",
            (
                *on,
                "cluster.procs_per_node=1",
                "rollout.engine=vllm",
                "actor.offload.params=false",
                "actor.offload.grads=false",
                "actor.offload.optimizer=false",
                "rollout.wake_strategy=all_at_once",
            ),
            "one GPU, nothing offloaded, vLLM (CUDA graphs) woken all at once: no communicator",
        ),
        RunSpec(
            "cuda_tp2_vllm",
            "memory_cpu",
            (*on, "cluster.procs_per_node=2", "actor.tp=2", "rollout.engine=vllm", "rollout.tp=2"),
            "two GPUs: megatron TP and MODEL_PARALLEL, vLLM's TP PyNccl, custom all-reduce and symmetric memory",
        ),
        RunSpec(
            "cuda_dp2_vllm_replicas",
            "memory_cpu",
            (*on, "cluster.procs_per_node=2", "actor.tp=1", "rollout.engine=vllm", "rollout.tp=1"),
            "two GPUs: megatron DP with the distributed optimizer, two vLLM replicas (its DP PyNccl), p2p-free sync",
        ),
        RunSpec(
            "cuda_tp2_pp2_vllm",
            "memory_cpu",
            (*on, "cluster.procs_per_node=4", "actor.tp=2", "actor.pp=2", "rollout.engine=vllm", "rollout.tp=2"),
            "four GPUs: megatron PP's send/recv, the weight sync's point-to-point between stages and replicas",
        ),
    )


# Validation set: never fitted on.
VALIDATION_SET = (
    RunSpec("tiny_cpu", "tiny_cpu", (), "the default experiment"),
    RunSpec("tiny_cpu_pp", "tiny_cpu_pp", (), "actor TP=2 x PP=2, 4 ranks, rollout TP=4"),
    RunSpec("memory_cpu_vllm", "memory_cpu", ("rollout.engine=vllm",), "vLLM's CPU build as the engine"),
    RunSpec(
        "memory_cpu_resident_all_at_once",
        "memory_cpu",
        (
            "actor.offload.params=false",
            "actor.offload.grads=false",
            "actor.offload.optimizer=false",
            "rollout.wake_strategy=all_at_once",
        ),
        "nothing offloaded, weights and KV cache woken together",
    ),
    RunSpec(
        "memory_cpu_reference_reshard",
        "memory_cpu",
        ("algorithm.kl_coef=0.05", "actor.tp=2", "rollout.tp=1"),
        "a reference actor (KL); actor TP=2 -> two engine replicas of TP=1: the sync stages 64 MiB buckets",
    ),
    RunSpec(
        "transients_long_vocab",
        "tiny_cpu",
        (
            "model.path=tiny:qwen2_vocab",
            "rollout.max_new_tokens=24",
            "actor.micro_batch_size=128",
            "actor.logprob_chunk_tokens=null",
        ),
        "transients dominate: 16k vocab, unchunked logits, long responses, 128-sequence micro-batches",
    ),
    RunSpec(
        "long_sequences",
        "tiny_cpu",
        (
            "rollout.max_new_tokens=384",
            "rollout.max_model_len=512",  # tiny:qwen2's 256 positions would end rows at 256 tokens
            "rollout.ignore_eos=true",
            "trainer.prompts_per_step=8",
            "actor.micro_batch_size=32",
        ),
        "long sequences: 390-token rows, where megatron's unfused [s, s] attention scores are a quarter of train's peak "
        "(the one check that sees them: at 262-token rows they were 18%, and zeroing them could stay within 10%)",
    ),
    RunSpec(
        "memory_cpu_moe",
        "memory_cpu",
        (
            "model.path=tiny:qwen3_moe_memory",
            "actor.ep=2",
            "trainer.prompts_per_step=16",
            "actor.micro_batch_size=32",
            "rollout.max_new_tokens=32",
            "rollout.ignore_eos=true",
        ),
        "mixture of experts at memory_cpu's sizes: a Qwen3-MoE of 123 MB, 92% routed experts (16 per layer, top-2), "
        "actor EP=2 (each rank's 8 experts, their grads and Adam states); 32-sequence micro-batches of ~40-token rows, "
        "so that the dispatched copies and expert activations are ~40% of train's rise and ~75% of old_logprob's "
        "(doubled, they move those checks 1.9 and 2.8 allowances); two native replicas holding every expert",
    ),
    RunSpec(
        "memory_cpu_bf16",
        "memory_cpu",
        ("model.dtype=bfloat16",),
        "bf16, what users run: megatron's Float16Optimizer with fp32 main params beside the bf16 params, bf16 engine "
        "weights and KV cache; memory_cpu's sizes keep each state >= 60 MB (issue 40, defect 10: no bf16 run had been "
        "checked, and one measured ~120 MiB over its plan in every phase)",
    ),
    RunSpec(
        "one_sequence_decode",
        "tiny_cpu",
        (
            "rollout.tp=1",
            "trainer.prompts_per_step=2",
            "rollout.n_samples_per_prompt=1",
            "rollout.max_new_tokens=256",
            "actor.micro_batch_size=1",
            IGNORE_EOS,
        ),
        "the native engine's fixed cost per layer step dominates: two TP=1 replicas decode one sequence each for 256 "
        "steps (planned: ~75% of the rollout; native_layer_step_ops doubled or halved moves the rollout ~75% or "
        "~37%, where no other configuration sees it)",
    ),
    RunSpec(
        "micro_batches_of_one",
        "tiny_cpu",
        ("trainer.prompts_per_step=4", "actor.micro_batch_size=1", "rollout.max_new_tokens=16", IGNORE_EOS),
        "megatron's fixed cost per micro-batch dominates: 32 micro-batches of one ~20-token row per pass (planned: "
        "the actor's ops ~70% of train and old_logprob; actor_backward_op_factor and collective_step_ops doubled "
        "move the step past 15%, where no other configuration sees them)",
    ),
)


def run_dir_for(spec: RunSpec, set_name: str, root: Path | None = None) -> Path:
    return (root or REPO / "runs") / set_name / spec.name


def select_specs(specs, names: list[str] | None) -> list[RunSpec]:
    """The ``specs`` that ``--only`` names (all of them when it names none), checked before any run starts: a name
    none of them has is a ValueError that lists the names there are."""
    if not names:
        return list(specs)
    known = [spec.name for spec in specs]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--only {' '.join(unknown)}: no such configuration; the configurations: {', '.join(known)}")
    return [spec for spec in specs if spec.name in names]


def print_results(results: list[dict], table: str | None) -> list[str]:
    """A validation's results as one JSON line each on stdout, then ``table`` (if any) on stderr; the names of the
    configurations that failed."""
    for result in results:
        print(json.dumps(result), flush=True)
    if table is not None:
        print(table, file=sys.stderr)
    return [result["config"] for result in results if not result["passed"]]


def add_repeats_argument(parser: argparse.ArgumentParser, default: int) -> None:
    """``--repeats`` of make calibrate-time and validate-time: runs of each configuration, at least one."""

    def count(text: str) -> int:
        value = int(text)  # not a number: argparse's own one-line error
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value}: each configuration needs at least one run")
        return value

    count.__name__ = "repeats"  # argparse names the type in its error
    parser.add_argument(
        "--repeats", type=count, default=default, help="runs of each configuration, alternating (medians over all)"
    )


def ensure_runs(
    specs, set_name: str, repeats: int = 1, rerun: bool = False, root: Path | None = None
) -> dict[str, list[Path]]:
    """Each spec's ``repeats`` runs, by name: the first in :func:`run_dir_for`'s directory, the k-th beside it in
    ``<name>.<k>``; made in alternating order (every spec, then every spec in reverse, ...), so that a drift of the
    machine's speed falls on every configuration alike and a slow spell on one run of each, which a median over
    the runs' steps then leaves out."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    dirs: dict[str, list[Path]] = {spec.name: [] for spec in specs}
    for k in range(repeats):
        for spec in specs if k % 2 == 0 else list(reversed(specs)):
            first = run_dir_for(spec, set_name, root)
            run_dir = first if k == 0 else first.with_name(f"{spec.name}.{k + 1}")
            dirs[spec.name].append(ensure_run(spec, run_dir, rerun=rerun))
    return dirs


def ensure_run(spec: RunSpec, run_dir: Path, rerun: bool = False, timeout_s: float = 1800) -> Path:
    """Run ``spec`` into ``run_dir`` unless a finished run of the same spec is there already."""
    spec_file = run_dir / "spec.json"
    done = (run_dir / "summary.json").exists() and spec_file.exists()
    if done and not rerun and json.loads(spec_file.read_text()) == spec.key():
        print(f"{spec.name}: reading {run_dir}", file=sys.stderr, flush=True)
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    _probe_speed(run_dir, spec)
    cmd = [sys.executable, "-m", "run.main", "--exp", spec.exp, "--run-dir", str(run_dir), *spec.all_overrides]
    print(f"{spec.name}: running {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    # the repo first, then what the caller's path adds (make gpu-check's kit of wheels installed beside the image)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    with open(run_dir / "run.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        tail = (run_dir / "run.log").read_text()[-2000:]
        raise RuntimeError(f"{spec.name}: the run failed (exit {proc.returncode}); {run_dir}/run.log ends:\n{tail}")
    spec_file.write_text(json.dumps(spec.key()) + "\n")
    print(f"{spec.name}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return run_dir


def _probe_speed(run_dir: Path, spec: RunSpec) -> None:
    """CPU: the machine's speeds just before the run (its speed.json), what make validate-time times it with; the
    native engine's GEMMs at its rank's own weights (tools/speed_probe.py)."""
    import torch  # a heavy import this module's planner-only users never need

    if not torch.cuda.is_available():
        from tools.speed_probe import measure_cpu_speed_for  # imports torch at its top

        speed = measure_cpu_speed_for(inputs_for(spec))
        (run_dir / "speed.json").write_text(json.dumps(vars(speed)) + "\n")


# ---------------------------------------------------------------- measured
@dataclass(frozen=True)
class Measured:
    peak_bytes: int  # steady-state median of the phase's peak, worst rank
    rise_bytes: int  # steady-state median of (peak - level at the phase's first sample), worst rank
    start_bytes: int  # steady-state median of the level at the phase's first sample, worst rank


def measured_phases(run_dir: Path) -> dict[str, Measured]:
    # first use: keeps torch (~1 s) out of `import tools.plan_runs` (its argument parsing and input checks)
    from telemetry.memory_timeline import PEAK_METRIC, phase_samples, read_timeline_csv, steady_steps

    rows = read_timeline_csv(run_dir / "memory_timeline.csv")
    steps = set(steady_steps(rows))
    groups = phase_samples(rows)
    per: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for (rank, step, phase), samples in groups.items():
        if step not in steps:
            continue
        peak = max(int(r[PEAK_METRIC]) for r in samples)
        start = int(samples[0]["device_used"])
        per.setdefault((phase, rank), []).append((peak, peak - start, start))
    out: dict[str, Measured] = {}
    for phase in {p for p, _ in per}:
        ranks = [values for (p, _), values in per.items() if p == phase]
        med = [tuple(int(statistics.median(v[i] for v in values)) for i in range(3)) for values in ranks]
        out[phase] = Measured(
            peak_bytes=max(m[0] for m in med), rise_bytes=max(m[1] for m in med), start_bytes=max(m[2] for m in med)
        )
    return out


# ---------------------------------------------------------------- predicted
@dataclass(frozen=True)
class Predicted:
    peak_bytes: int  # the phase's bytes + the runtime terms (what the measurement includes)
    rise_bytes: int  # peak - what is resident when the phase starts
    components: dict[str, int] = field(default_factory=dict)


@functools.cache
def spec_config(spec: RunSpec):
    # first use: keeps torch (~1 s) out of `import tools.plan_runs` (its argument parsing and input checks)
    from run.compose import compose

    return compose(spec.exp, list(spec.all_overrides))


def run_prompt_tokens(cfg) -> int:
    """The task's longest prompt in tokens, as run/setup.py::plan_and_build_engine plans with."""
    # first use: keeps transformers out of `import tools.plan_runs` (its argument parsing and input checks)
    from transformers import AutoTokenizer

    from modelspec.tiny import resolve_model_path
    from run.compose import resolve_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(resolve_path(cfg.model.path)))
    return longest_prompt_tokens(cfg.data.build(seed=cfg.trainer.seed), tokenizer)


@functools.cache
def spec_prompt_tokens(spec: RunSpec) -> int:
    return run_prompt_tokens(spec_config(spec))


def launch_runtime_of(run_dir: Path | None) -> int | None:
    """The runtime level the run in ``run_dir`` measured at launch (its summary.json's ``memory_plan``), or None."""
    summary = run_dir / "summary.json" if run_dir is not None else None
    if summary is None or not summary.exists():
        return None
    return (json.loads(summary.read_text()).get("memory_plan") or {}).get("launch_runtime_bytes")


def inputs_for(spec: RunSpec, calibration=None, run_dir: Path | None = None, launch_runtime_bytes: int | None = None):
    """The planner inputs the run planned with, optionally under another calibration; with the runtime level the
    run in ``run_dir`` measured at launch (``launch_runtime_bytes`` given: that instead)."""
    # first use: keeps torch (~1 s) out of `import tools.plan_runs` (its argument parsing and input checks)
    from run.memory_plan import plan_inputs

    launch = launch_runtime_bytes if launch_runtime_bytes is not None else launch_runtime_of(run_dir)
    return plan_inputs(
        spec_config(spec), spec_prompt_tokens(spec), calibration=calibration, launch_runtime_bytes=launch
    )


def plan_for(spec: RunSpec, calibration=None, run_dir: Path | None = None, launch_runtime_bytes: int | None = None):
    """The plan the run made for itself (same inputs, the launch level of the run in ``run_dir``), optionally under
    another calibration or launch level."""
    # first use: keeps torch (~1 s) out of `import tools.plan_runs` (its argument parsing and input checks)
    from planner import make_plan

    return make_plan(inputs_for(spec, calibration, run_dir, launch_runtime_bytes))


def predicted_phases(plan, mutate: Callable[[dict[str, int]], dict[str, int]] | None = None) -> dict[str, Predicted]:
    """Each phase's predicted peak and rise; ``mutate`` rewrites the components (tools/mutate_plan.py)."""
    out = {}
    for p in plan.phases:
        comps = dict(p.components)
        start = dict(p.start_components)
        if mutate is not None:
            comps, start = mutate(comps), mutate(start)
        runtime = plan.runtime_overhead_bytes
        peak = sum(comps.values()) + runtime
        out[p.name] = Predicted(peak_bytes=peak, rise_bytes=peak - sum(start.values()) - runtime, components=comps)
    return out


def recorded_lengths_of(run_dir: Path | None) -> dict:
    """step -> :class:`planner.StepLengths` the run in ``run_dir`` recorded (metrics.jsonl; {}: none)."""
    # first use: keeps torch (~1 s) out of `import tools.plan_runs` (its argument parsing and input checks)
    from telemetry.metrics import recorded_lengths

    path = run_dir / "metrics.jsonl" if run_dir is not None else None
    if path is None or not path.exists():
        return {}
    return recorded_lengths([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def model_phases(plan, run_dir: Path | None, mutate=None) -> dict[str, Predicted]:
    """What the model predicts the run held: per phase, the median over the steady steps of :func:`predicted_phases`
    of ``plan`` at each step's recorded lengths (telemetry.memory_timeline.plans_at_recorded_lengths); ``plan``
    itself (the launch's bound) for a run that recorded none."""
    # first use: keeps torch (~1 s) out of `import tools.plan_runs` (its argument parsing and input checks)
    from telemetry.memory_timeline import plans_at_recorded_lengths, read_timeline_csv

    lengths = recorded_lengths_of(run_dir)
    plans = (
        plans_at_recorded_lengths(plan, lengths, read_timeline_csv(run_dir / "memory_timeline.csv")) if lengths else []
    )
    if not plans:
        return predicted_phases(plan, mutate)
    per_step = [predicted_phases(p, mutate) for p in plans]
    return {
        name: Predicted(
            peak_bytes=int(statistics.median(s[name].peak_bytes for s in per_step)),
            rise_bytes=int(statistics.median(s[name].rise_bytes for s in per_step)),
            components=per_step[len(per_step) // 2][name].components,
        )
        for name in per_step[0]
    }


# ---------------------------------------------------------------- the checks
def within(predicted: int, measured: int, relative: float) -> bool:
    return abs(predicted - measured) <= max(relative * abs(measured), FLOOR_BYTES)


def bounds(planned: int, measured: int, relative: float) -> bool:
    """The launch plan bounds the measurement: measured <= planned + the same allowance as :func:`within`."""
    return measured - planned <= max(relative * abs(measured), FLOOR_BYTES)


def check(
    config: str,
    predicted: dict[str, Predicted],
    measured: dict[str, Measured],
    bound: dict[str, Predicted] | None = None,
) -> dict:
    """One validation line: every phase the run measured, the model's predicted vs measured peak and rise
    (``predicted``: the plan at the run's recorded lengths, :func:`model_phases`), and with ``bound`` (the launch
    plan's phases) whether the launch plan's peak bounds the measured one."""
    phases, failures = {}, []
    for name, m in measured.items():
        if name not in predicted or m.peak_bytes <= 0:
            continue
        p = predicted[name]
        error = p.peak_bytes / m.peak_bytes - 1.0
        peak_ok = within(p.peak_bytes, m.peak_bytes, PEAK_TOLERANCE)
        rise_ok = within(p.rise_bytes, m.rise_bytes, RISE_TOLERANCE)
        phases[name] = {
            "predicted_bytes": p.peak_bytes,
            "measured_bytes": m.peak_bytes,
            "relative_error": round(error, 4),
            "predicted_rise_bytes": p.rise_bytes,
            "measured_rise_bytes": m.rise_bytes,
            "peak_ok": peak_ok,
            "rise_ok": rise_ok,
        }
        if not peak_ok:
            failures.append(f"{name} peak")
        if not rise_ok:
            failures.append(f"{name} rise")
        if bound is not None and name in bound:
            bound_ok = bounds(bound[name].peak_bytes, m.peak_bytes, PEAK_TOLERANCE)
            phases[name].update(launch_planned_bytes=bound[name].peak_bytes, bound_ok=bound_ok)
            if not bound_ok:
                failures.append(f"{name} launch bound")
    if not phases:  # a run that measured nothing (cut short, or still running) confirms nothing
        failures.append("no phase measured")
    worst = max(phases, key=lambda n: abs(phases[n]["relative_error"])) if phases else None
    return {
        "config": config,
        "max_abs_relative_error": abs(phases[worst]["relative_error"]) if worst else None,
        "worst_phase": worst,
        "passed": not failures,
        "failures": failures,
        "phases": phases,
    }


__all__ = [
    "FIT_SET",
    "TIME_FIT_SET",
    "VALIDATION_SET",
    "RunSpec",
    "asdict",
    "check",
    "ensure_run",
    "measured_phases",
    "print_results",
    "select_specs",
]
