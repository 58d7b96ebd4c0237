"""``make bench-rollout``: native engine vs vLLM vs transformers' ``generate``, same model, prompts and lengths.

Prints one JSON line: generated tokens/s of each, their ratio, and whether the greedy outputs agree. vLLM
(its CPU build on CPU; one rank, external launcher) is measured when it is importable, else its fields are
null.
``--max-num-seqs`` / ``--max-num-batched-tokens`` set the native engine's batching knobs
(``rollout.max_num_seqs`` / ``rollout.max_num_batched_tokens``). ``--sweep-knobs`` instead prints one
JSON line with the native engine under several knob settings on prompts of mixed lengths: tokens/s
(best of the alternating repeats), most sequences decoded together, largest prefill batch (padded
tokens) and the peak RSS growth of ``generate`` (CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from configs.rollout import RolloutConfig
from modelspec import ColocatedMesh
from modelspec.tiny import resolve_model_path
from rollout.engine import SamplingParams
from rollout.native import NativeEngine
from rollout.vllm_engine import VllmEngine
from run.launch import free_port
from tools.bench_train import PeakRss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2", help="HF checkpoint directory or tiny:<family>")
    parser.add_argument("--batch", type=int, default=32, help="prompts generated together")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each (alternating); the best counts")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="rollout.max_num_seqs of the native engine")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="rollout.max_num_batched_tokens of the native engine"
    )
    parser.add_argument("--sweep-knobs", action="store_true", help="native engine under several knob settings")
    args = parser.parse_args()
    if args.sweep_knobs:
        sweep_knobs(args)
        return

    # first use: keeps transformers out of `import tools.bench_rollout` (its argument parsing and input checks)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 99, (args.batch, args.prompt_len), generator=gen)
    prompts[:, 0] = 1  # bos

    # native: greedy, eos ignored so every sequence runs max_new_tokens
    knobs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = NativeEngine(RolloutConfig(cpu_capacity_gb=0.5, **knobs), path, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True)
    prompt_lists = prompts.tolist()

    def run_native():
        out = engine.generate(prompt_lists, params)
        return [r[0].token_ids for r in out]

    # transformers: the same, eos disabled so every row runs max_new_tokens
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def run_hf():
        with torch.inference_mode():
            out = model.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=args.max_new_tokens
            )
        return out[:, args.prompt_len :].tolist()

    runners = {"native": run_native, "hf": run_hf}
    vllm_engine = _vllm_engine(path, args, knobs)
    if vllm_engine is not None:

        def run_vllm():
            out = vllm_engine.generate(prompt_lists, params)
            return [r[0].token_ids for r in out]

        runners["vllm"] = run_vllm
    # warm up each, then alternate timed runs so load from other processes hits all alike; keep the best
    outputs = {name: run() for name, run in runners.items()}
    best = dict.fromkeys(runners, float("inf"))
    for _ in range(args.repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            outputs[name] = run()
            best[name] = min(best[name], time.perf_counter() - start)
    tps = {name: sum(len(o) for o in outputs[name]) / best[name] for name in runners}
    native_out, hf_out = outputs["native"], outputs["hf"]
    native_tps, hf_tps = tps["native"], tps["hf"]
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": args.batch,
                "prompt_len": args.prompt_len,
                "max_new_tokens": args.max_new_tokens,
                "threads": args.threads,
                **knobs,
                "native_tokens_per_s": round(native_tps, 1),
                "hf_generate_tokens_per_s": round(hf_tps, 1),
                "ratio": round(native_tps / hf_tps, 2),
                "greedy_outputs_equal": native_out == hf_out,
                "vllm_tokens_per_s": round(tps["vllm"], 1) if "vllm" in tps else None,
                "vllm_over_native": round(tps["vllm"] / native_tps, 2) if "vllm" in tps else None,
                "vllm_greedy_outputs_equal": outputs["vllm"] == hf_out if "vllm" in outputs else None,
            }
        )
    )


def _vllm_engine(path: str, args, knobs: dict):
    """vLLM on one rank (a world of 1), or None when vLLM is not installed."""
    try:
        # optional: vLLM is imported where it is used, not every install has it
        import vllm  # noqa: F401
    except ImportError:
        return None

    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo")
    cfg = RolloutConfig(
        engine="vllm", kv_cache_bytes=64 << 20, max_model_len=args.prompt_len + args.max_new_tokens, **knobs
    )
    engine = VllmEngine(cfg, path, ColocatedMesh(world_size=1), 0, dtype="float32")
    torch.set_num_threads(args.threads)  # vLLM's CPU worker may have changed it for its own serving
    return engine


def sweep_knobs(args) -> None:
    """The native engine under (max_num_seqs, max_num_batched_tokens) settings, same prompts: one JSON line."""

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    gen = torch.Generator().manual_seed(0)
    # mixed prompt lengths: 1x to 4x --prompt-len
    lengths = torch.randint(args.prompt_len, 4 * args.prompt_len + 1, (args.batch,), generator=gen).tolist()
    prompts = [[1] + torch.randint(4, 99, (n - 1,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True)
    longest = max(lengths)
    settings = [
        ("defaults", dict()),
        ("max_num_seqs=batch/4", dict(max_num_seqs=max(1, args.batch // 4))),
        ("max_num_batched_tokens=4x longest prompt", dict(max_num_seqs=args.batch, max_num_batched_tokens=4 * longest)),
        (
            "max_num_batched_tokens=longest prompt",
            dict(max_num_seqs=args.batch, max_num_batched_tokens=max(longest, args.batch)),
        ),
    ]
    engines = {
        name: NativeEngine(RolloutConfig(cpu_capacity_gb=0.5, **kw), path, device="cpu") for name, kw in settings
    }
    best = dict.fromkeys(engines, float("inf"))
    peaks: dict[str, list[int]] = {name: [] for name in engines}
    outputs = {}
    for name, engine in engines.items():  # warm-up
        outputs[name] = [r[0].token_ids for r in engine.generate(prompts, params)]
    for _ in range(args.repeats):
        for name, engine in engines.items():
            with PeakRss() as rss:
                start = time.perf_counter()
                engine.generate(prompts, params)
                best[name] = min(best[name], time.perf_counter() - start)
            peaks[name].append(rss.peak - rss.before)
    generated = args.batch * args.max_new_tokens
    rows = []
    for name, _ in settings:
        scheduler = engines[name].scheduler
        rows.append(
            {
                "setting": name,
                "max_num_seqs": scheduler.max_num_seqs,
                "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                "tokens_per_s": round(generated / best[name], 1),
                "most_running": scheduler.max_running_seen,
                "largest_prefill_tokens": scheduler.max_prefill_tokens_seen,
                "generate_peak_rss_growth_mib": round(sorted(peaks[name])[len(peaks[name]) // 2] / 2**20, 1),
                "greedy_equal_to_defaults": outputs[name] == outputs["defaults"],
            }
        )
    line = dict(bench="rollout_knobs", model=args.model, batch=args.batch, prompt_lens=[min(lengths), longest])
    print(json.dumps({**line, "max_new_tokens": args.max_new_tokens, "settings": rows}))


if __name__ == "__main__":
    main()
