"""``python -m tools.logprob_gap``: the distribution of |engine - actor| log-prob over sampled tokens, as the
loop's check sees it, with the engine's weights synced from the actor, and again with one shard misplaced.

One process: a megatron actor (TP=1) loaded from ``--hf`` in ``--dtype``, an engine (native or vLLM) filled by
the planned weight sync, ``--num-prompts`` x ``--n`` samples at temperature 1 (digit-sum prompts), the actor's
log-probs of them (``Actor.compute_logprobs``, as the ``old_logprob`` phase), and the statistics the loop logs
(``telemetry.metrics.gap_distribution``). Then ``--corrupt``: the two column halves of one layer's ``down_proj`` are
swapped in the engine (what a TP=2 shard placed in the other rank's slot gives: a layout error in one layer
of eight), the same prompts are sampled again and measured again. One JSON line: ``synced`` and ``corrupt``.
"""

from __future__ import annotations

import argparse
import json
import sys

from colocation.engines import ENGINES


def _rank_main(args: argparse.Namespace) -> None:
    # the rank's imports: the launcher never loads megatron or an engine
    import torch
    from transformers import AutoTokenizer

    from configs.actor import ActorConfig
    from configs.rollout import RolloutConfig
    from rl.batching import Sample, pack_sequences
    from rollout import SamplingParams
    from run.config import ModelConfig
    from run.setup import build_rank
    from telemetry.metrics import gap_distribution
    from weight_sync import WeightSyncConfig

    model_path = args.model_path
    rollout_cfg = RolloutConfig(
        engine=args.engine,
        tp=1,
        temperature=1.0,
        max_model_len=128,
        kv_cache_bytes=64 << 20 if args.engine == "vllm" else None,
    )
    parts = build_rank(
        ModelConfig(path=model_path, dtype=args.dtype), ActorConfig(), rollout_cfg, WeightSyncConfig(), train=False
    )
    actor, sync, engine = parts.actor, parts.weight_sync, parts.start_engine()
    # the loop's bf16 actor keeps some params (the norms) in fp32: the sync sends the engine's dtype
    torch_dtype = getattr(torch, args.dtype)
    sync({k: v.to(torch_dtype).contiguous() for k, v in actor.local_params().items()}, engine.begin_weight_update())
    engine.finish_weight_update()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer(f"{i % 5}+{(i // 5) % 5}=").input_ids for i in range(args.num_prompts)]

    def measure(seed: int) -> dict:
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_new_tokens, seed=seed)
        samples = [
            Sample(c.prompt_index, prompts[c.prompt_index], c.token_ids, c.logprobs, c.finish_reason or "", 0.0)
            for per_prompt in engine.generate(prompts, params)
            for c in per_prompt
            if c.token_ids
        ]
        batch = pack_sequences(samples, pad_id=tokenizer.pad_token_id or 0)
        old = actor.compute_logprobs(batch, response_only=True)
        mask = batch.loss_mask > 0
        gaps = (old - batch.engine_logprobs).abs()[mask]
        return gap_distribution(gaps.float(), token_threshold=args.token_threshold)

    out = {"engine": args.engine, "dtype": args.dtype, "model": args.hf, "synced": measure(seed=1)}
    if args.corrupt:
        layer = actor.shape.num_layers // 2
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        params = engine.begin_weight_update()
        with torch.no_grad():
            weight = params[name]  # [H, F]: a TP=2 shard is F/2 columns
            left, right = weight[:, : weight.shape[1] // 2].clone(), weight[:, weight.shape[1] // 2 :].clone()
            weight[:, : right.shape[1]].copy_(right)
            weight[:, right.shape[1] :].copy_(left)
        engine.finish_weight_update()
        out["corrupt"] = dict(measure(seed=1), what=f"{name}: its two column halves swapped")
    print(json.dumps(out), flush=True)
    if hasattr(engine, "shutdown"):
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    # first use: keeps torch (~1 s) out of `import tools.logprob_gap` (its argument parsing and input checks)
    from run.launch import spawn_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES, default="native")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--hf", default="tiny:qwen2_memory")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--token-threshold", type=float, default=0.1)
    parser.add_argument("--corrupt", action="store_true")
    args = parser.parse_args(argv)
    # first use: keeps torch (~1 s) out of `import tools.logprob_gap` (its argument parsing and input checks)
    from modelspec.tiny import resolve_model_path

    args.model_path = resolve_model_path(args.hf)  # built here, before the rank starts: it only reads it
    return spawn_local(_rank_main, 1, (args,))


if __name__ == "__main__":
    sys.exit(main())
