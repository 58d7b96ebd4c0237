"""``make bench-rollout``: native engine vs transformers' ``generate``, same tiny model, prompts and lengths.

Prints one JSON line: generated tokens/s of each, their ratio, and whether the greedy outputs agree.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2", help="HF checkpoint directory or tiny:<family>")
    parser.add_argument("--batch", type=int, default=32, help="prompts generated together")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each (alternating); the best counts")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from modelspec.tiny import resolve_model_path
    from rollout.config import RolloutConfig
    from rollout.engine import SamplingParams
    from rollout.native import NativeEngine

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 99, (args.batch, args.prompt_len), generator=gen)
    prompts[:, 0] = 1  # bos

    # native: greedy, eos ignored so every sequence runs max_new_tokens
    engine = NativeEngine(RolloutConfig(cpu_capacity_gb=0.5), path, device="cpu")
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

    # warm up both, then alternate timed runs so load from other processes hits both alike; keep the best
    native_out, hf_out = run_native(), run_hf()
    native_s, hf_s = float("inf"), float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        native_out = run_native()
        native_s = min(native_s, time.perf_counter() - start)
        start = time.perf_counter()
        hf_out = run_hf()
        hf_s = min(hf_s, time.perf_counter() - start)
    native_tps = sum(len(o) for o in native_out) / native_s
    hf_tps = sum(len(o) for o in hf_out) / hf_s
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": args.batch,
                "prompt_len": args.prompt_len,
                "max_new_tokens": args.max_new_tokens,
                "threads": args.threads,
                "native_tokens_per_s": round(native_tps, 1),
                "hf_generate_tokens_per_s": round(hf_tps, 1),
                "ratio": round(native_tps / hf_tps, 2),
                "greedy_outputs_equal": native_out == hf_out,
            }
        )
    )


if __name__ == "__main__":
    main()
