"""``make bench-train``: each train-phase lever with and without, measured, beside the planner's prediction.

One JSON line per lever. A lever compares two actor configs ("without" -> "with") on the same batch:
right-padded sequences of one prompt length and responses of very different lengths (so padding
matters), a Qwen2-shaped model built in-process (hidden 512, vocab 8192 by default), one rank.

Each (config, repeat) runs in a fresh process, alternating without/with, so peaks never mix. A process
builds the actor, runs the ``old_logprob`` pass (forward-only micro-batches), allocates the optimizer
states with a zero-gradient step (no weight moves), then one ``train`` step. Measured per phase:

- peak: on CPU the process's peak RSS (the kernel's high-water mark ``VmHWM``, reset at the phase's
  start by ``/proc/self/clear_refs``; a 2 ms RSS sampler where that is unavailable), with glibc told to
  return every freed block of a page or more at once (``MALLOC_MMAP_THRESHOLD_``, the runs' own threshold,
  ``colocation.host_memory.MMAP_THRESHOLD_BYTES``) so that RSS follows live memory; on CUDA ``max_memory_allocated``;
- tokens/s: real (unpadded) tokens of the batch / wall seconds of the phase.

Figures are medians over the repeats. ``predicted`` is the planner's (``planner.make_plan``) bytes of the
phase for the same config (actor params, grads, optimizer, activations, logits); the line gives the
predicted delta beside the measured one. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import psutil

from colocation.host_memory import MMAP_THRESHOLD_BYTES, release_freed_host_memory

MIB = 2**20

# name -> ActorConfig overrides (and "entropy_coef" for the loss); every config trains the same batch
CONFIGS = {
    "padded": dict(remove_padding=False),
    "packed": dict(remove_padding=True),
    "packed_budget": dict(remove_padding=True, max_tokens_per_micro_batch="BUDGET"),
    "packed_budget_fwd1x": dict(
        remove_padding=True, max_tokens_per_micro_batch="BUDGET", max_tokens_per_forward_micro_batch="BUDGET"
    ),
    "packed_full_recompute": dict(remove_padding=True, recompute="full"),
    "padded_selective_recompute": dict(remove_padding=False, recompute="selective"),
    "packed_unchunked_logprob": dict(remove_padding=True, logprob_chunk_tokens=None),
    "packed_entropy_kept": dict(remove_padding=True, entropy_recompute=False, entropy_coef=0.01),
    "packed_entropy_recompute": dict(remove_padding=True, entropy_recompute=True, entropy_coef=0.01),
}
# lever -> (key, without config, with config, phase); the first two against the padded baseline
LEVERS = {
    "remove_padding": ("actor.remove_padding", "padded", "packed", "train"),
    "token_budget_micro_batches": ("actor.max_tokens_per_micro_batch", "padded", "packed_budget", "train"),
    "recompute_full": ("actor.recompute=full", "packed", "packed_full_recompute", "train"),
    "recompute_selective_padded": ("actor.recompute=selective", "padded", "padded_selective_recompute", "train"),
    "fused_chunked_logprob": ("actor.logprob_chunk_tokens", "packed_unchunked_logprob", "packed", "train"),
    "entropy_recompute": ("actor.entropy_recompute", "packed_entropy_kept", "packed_entropy_recompute", "train"),
    "forward_token_budget": (
        "actor.max_tokens_per_forward_micro_batch",
        "packed_budget_fwd1x",
        "packed_budget",
        "old_logprob",
    ),
}


# ---------------------------------------------------------------- the model and the batch
def response_lengths(num_seqs: int, shortest: int, longest: int) -> list[int]:
    """A long tail, deterministic: most responses short, a few near ``longest`` (quadratic spacing), in a
    fixed shuffled order (samples arrive in no length order)."""

    lengths = [shortest + round((longest - shortest) * (i / max(1, num_seqs - 1)) ** 2) for i in range(num_seqs)]
    random.Random(0).shuffle(lengths)
    return lengths


def write_model(out_dir: Path, args) -> Path:
    """A Qwen2-shaped HF checkpoint with random weights (fixed seed), written once per shape."""
    # first use: keeps torch (~1 s) out of `import tools.bench_train` (its argument parsing and input checks)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from modelspec.tiny import publish_dir

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )

    def save(tmp: Path) -> None:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)

    # under the directory's lock, complete or absent (two bench-train runs may share the temp dir)
    return publish_dir(out_dir, save, keep=lambda d: (d / "config.json").exists())


def make_batch(args, vocab_size: int):
    # first use: keeps torch (~1 s) out of `import tools.bench_train` (its argument parsing and input checks)
    import torch

    from modelspec import TokenBatch

    gen = torch.Generator().manual_seed(0)
    responses = response_lengths(args.seqs, args.response_min, args.response_max)
    lengths = [args.prompt + r for r in responses]
    width = max(lengths)
    input_ids = torch.randint(3, vocab_size, (args.seqs, width), generator=gen)
    loss_mask = torch.zeros(args.seqs, width - 1)
    for i, n in enumerate(lengths):
        input_ids[i, n:] = 0
        loss_mask[i, args.prompt - 1 : n - 1] = 1.0
    advantages = torch.randn(args.seqs, generator=gen)
    return TokenBatch(input_ids=input_ids, seq_lens=torch.tensor(lengths), loss_mask=loss_mask, advantages=advantages)


def config_overrides(name: str, args) -> tuple[dict, float]:
    """ActorConfig kwargs of config ``name`` and its entropy_coef."""
    overrides = dict(CONFIGS[name])
    entropy_coef = overrides.pop("entropy_coef", 0.0)
    budget = args.budget or args.micro_batch_size * (args.prompt + args.response_max) // 2
    overrides = {k: (budget if v == "BUDGET" else v) for k, v in overrides.items()}
    return dict(micro_batch_size=args.micro_batch_size, **overrides), entropy_coef


# ---------------------------------------------------------------- one measurement (a worker process)
class PeakRss:
    """Peak RSS of this process over a block: the kernel's VmHWM reset at the start, else a sampler."""

    def __init__(self):
        self.exact = True
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.exact = False

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    def __enter__(self):

        self.before = psutil.Process().memory_info().rss
        self.sampled, self._stop = self.before, threading.Event()
        if self.exact:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):

        proc = psutil.Process()
        while not self._stop.wait(0.002):
            self.sampled = max(self.sampled, proc.memory_info().rss)

    def __exit__(self, *exc):
        if self.exact:
            self.peak = self._status("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            self.peak = self.sampled


def _measure(phase_fn, device) -> dict:
    # first use: keeps torch (~1 s) out of `import tools.bench_train` (its argument parsing and input checks)
    import torch

    release_freed_host_memory()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        phase_fn()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return dict(seconds=seconds, before_bytes=before, peak_bytes=torch.cuda.max_memory_allocated())
    with PeakRss() as rss:
        start = time.perf_counter()
        phase_fn()
        seconds = time.perf_counter() - start
    return dict(seconds=seconds, before_bytes=rss.before, peak_bytes=rss.peak, exact_peak=rss.exact)


def worker(args) -> dict:

    # first use: keeps torch (~1 s) out of `import tools.bench_train` (its argument parsing and input checks)
    import torch

    warnings.filterwarnings("ignore")
    # runs in a spawned rank: keeps torch (~1 s) out of the tool's argument parsing and input checks
    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from rl.losses import PolicyLoss, PolicyLossConfig
    from run.launch import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(args.threads)
    overrides, entropy_coef = config_overrides(args.worker, args)
    dims = initialize_model_parallel(tp=1, pp=1)
    actor = Actor(args.model_dir, ActorConfig(**overrides), dims)
    batch = make_batch(args, actor.shape.vocab_size).to(dims.device)
    loss_fn = PolicyLoss(PolicyLossConfig(entropy_coef=entropy_coef))
    out = {}

    def old_logprob():
        batch.old_logprobs = actor.compute_logprobs(batch, phase="old_logprob", response_only=True)

    out["old_logprob"] = _measure(old_logprob, dims.device)
    # Adam's states, allocated by a step on zero gradients (no weight moves), so train measures a steady step
    for model in actor.models:
        model.zero_grad_buffer()
    actor.optimizer.step()
    metrics = {}

    def train():
        metrics.update(actor.train_step(batch, loss_fn))

    out["train"] = _measure(train, dims.device)
    out["num_micro_batches"] = metrics["num_micro_batches"]
    out["loss"] = metrics["loss"]
    return out


# ---------------------------------------------------------------- the planner's side
def predicted(args, name: str, shape, phase: str, device_kind: str) -> dict:
    """The planner's bytes of ``phase`` for config ``name``: total and activations + logits."""
    # first use: keeps torch (~1 s) out of `import tools.bench_train` (its argument parsing and input checks)
    from configs import ActorConfig, OffloadConfig, RolloutConfig
    from configs.rollout import MIN_KV_CACHE_BYTES
    from planner import PlanInputs, device_preset, make_plan

    overrides, entropy_coef = config_overrides(name, args)
    responses = response_lengths(args.seqs, args.response_min, args.response_max)
    inputs = PlanInputs(
        shape=shape,
        device=device_preset("cpu" if device_kind == "cpu" else "H100-80GB"),
        dtype="float32",
        actor=ActorConfig(
            offload=OffloadConfig(params=False, grads=False, optimizer=False),
            micro_batch_size=overrides["micro_batch_size"],
            remove_padding=overrides.get("remove_padding", True),
            max_tokens_per_micro_batch=overrides.get("max_tokens_per_micro_batch"),
            max_tokens_per_forward_micro_batch=overrides.get("max_tokens_per_forward_micro_batch"),
            recompute=overrides.get("recompute", "none"),
            logprob_chunk_tokens=overrides.get("logprob_chunk_tokens", 1024),
            entropy_recompute=overrides.get("entropy_recompute", True),
        ),
        # the train phase alone is read: the engine's KV cache is the least a run may set
        rollout=RolloutConfig(engine="native", max_new_tokens=max(responses), kv_cache_bytes=MIN_KV_CACHE_BYTES),
        entropy_grad=entropy_coef > 0,
        attention="unfused" if device_kind == "cpu" else "flash",
        sequences_per_step=args.seqs,
        prompt_tokens=args.prompt,
        response_tokens=max(responses),
        mean_prompt_tokens=args.prompt,
        mean_response_tokens=max(1, round(sum(responses) / len(responses))),
    )
    components = make_plan(inputs).phase(phase).components
    return dict(bytes=sum(components.values()), transient_bytes=components["activations"] + components["logits"])


# ---------------------------------------------------------------- the driver
def _run_worker(name: str, args, model_dir: Path) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES), OMP_NUM_THREADS=str(args.threads))
    command = [sys.executable, "-m", "tools.bench_train", "--worker", name, "--model-dir", str(model_dir)]
    command += _shape_args(args)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"bench worker {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


SHAPE_KEYS = (
    "hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "seqs", "prompt", "response_min",
    "response_max", "micro_batch_size", "budget", "threads",
)  # fmt: skip


def _shape_args(args) -> list[str]:
    out = []
    for key in SHAPE_KEYS:
        value = getattr(args, key)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seqs", type=int, default=8, help="sequences in the batch (one rank)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens of every sequence")
    parser.add_argument("--response-min", type=int, default=16)
    parser.add_argument("--response-max", type=int, default=352)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch (fixed-size)")
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="actor.max_tokens_per_micro_batch (default: half the padded micro-batch)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="alternating without/with runs per lever; medians")
    parser.add_argument("--levers", nargs="*", default=list(LEVERS), choices=list(LEVERS))
    parser.add_argument("--model-dir", default=None, help="the checkpoint (default: built under the temp dir)")
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.response_min < 1 or args.response_max < args.response_min or args.prompt < 1:
        parser.error("need 1 <= --response-min <= --response-max and --prompt >= 1")
    if args.hidden < 512 or args.vocab < 8192:
        print("note: below hidden 512 / vocab 8192 the fixed costs hide the levers", file=sys.stderr)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    # first use: keeps torch (~1 s) out of `import tools.bench_train` (its argument parsing and input checks)
    from modelspec import ModelShape

    shape_tag = "-".join(
        str(getattr(args, k)) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")
    )
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / f"rlmem-bench-train-{shape_tag}")
    write_model(model_dir, args)
    shape = ModelShape.from_pretrained(model_dir)
    device_kind = "cuda" if _cuda() else "cpu"
    names = sorted({c for lever in args.levers for c in LEVERS[lever][1:3]}, key=list(CONFIGS).index)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names:  # alternating: every config once per repeat, in the same order
            print(f"[bench-train] repeat {repeat + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
            runs[name].append(_run_worker(name, args, model_dir))
    responses = response_lengths(args.seqs, args.response_min, args.response_max)
    real_tokens = sum(args.prompt + r for r in responses)
    for lever in args.levers:
        key, without, with_, phase = LEVERS[lever]
        line = dict(
            bench="train_levers",
            lever=lever,
            key=key,
            phase=phase,
            without=without,
            **{"with": with_},
            device=device_kind,
            model=dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=args.heads),
            batch=dict(
                seqs=args.seqs, real_tokens=real_tokens, padded_tokens=args.seqs * (args.prompt + max(responses))
            ),
            repeats=args.repeats,
        )
        for side, name in (("without", without), ("with", with_)):
            measured = [r[phase] for r in runs[name]]
            peak = statistics.median(m["peak_bytes"] for m in measured)
            extra = statistics.median(m["peak_bytes"] - m["before_bytes"] for m in measured)
            seconds = statistics.median(m["seconds"] for m in measured)
            plan = predicted(args, name, shape, phase, device_kind)
            line[f"{side}_peak_mib"] = round(peak / MIB, 1)
            line[f"{side}_phase_extra_mib"] = round(extra / MIB, 1)
            line[f"{side}_tokens_per_s"] = round(real_tokens / seconds, 1)
            line[f"{side}_micro_batches"] = runs[name][0]["num_micro_batches"]
            line[f"{side}_predicted_mib"] = round(plan["bytes"] / MIB, 1)
            line[f"{side}_predicted_transient_mib"] = round(plan["transient_bytes"] / MIB, 1)
        line["measured_peak_delta_mib"] = round(line["with_peak_mib"] - line["without_peak_mib"], 1)
        line["predicted_delta_mib"] = round(line["with_predicted_mib"] - line["without_predicted_mib"], 1)
        line["tokens_per_s_ratio"] = round(line["with_tokens_per_s"] / line["without_tokens_per_s"], 3)
        line["same_loss"] = abs(runs[with_][0]["loss"] - runs[without][0]["loss"]) < 1e-4 * max(
            1.0, abs(runs[without][0]["loss"])
        )
        print(json.dumps(line), flush=True)
    return 0


def _cuda() -> bool:
    # first use: keeps torch (~1 s) out of `import tools.bench_train` (its argument parsing and input checks)
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
