"""``make bench-sync ENGINE=vllm``: the planned reshard into vLLM against what verl and slime do, in one run.

Both end in the same vLLM engine (its CPU build here; external launcher, rollout TP), built with empty
weights, on ranks that hold a megatron actor (train TP x PP) loaded from a checkpoint:

- ``planned``: this project's sync. Each engine rank receives only its own slices in vLLM's layout,
  written into vLLM's parameters inside ``begin_weight_update`` / ``finish_weight_update`` (on CPU, vLLM's
  layerwise reload restores the unprocessed layers and repacks them after).
- ``baseline``: every rank gathers every full HF tensor from the actor (all-gather over actor TP, broadcast
  from its pipeline stage: ``rl.weight_sync.baseline.gather_full_hf_tensors``) and streams them into the
  model's own ``load_weights``, which keeps its slices (the same repack afterwards).

Repeats alternate the two. After every sync the engine generates greedily from fixed prompts; every run
of either method must give the first planned run's tokens and log-probs exactly, or the tool fails.
Prints one JSON line: per method ``bytes_moved`` (bytes received over all ranks, per sync),
``seconds`` (median over repeats of the slowest rank), ``peak_extra_bytes`` (median over repeats of the
largest rise of a rank's RSS high-water mark over its RSS at the sync's start), and ``speedup``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PROMPTS = ("1+2=", "The quick brown fox", "def add(a, b):")


def _rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from megatron_backend.actor import Actor
    from megatron_backend.config import ActorConfig
    from megatron_backend.layout import hf_tensor_shapes
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ColocatedMesh
    from modelspec.tiny import resolve_model_path
    from rl.memory import ProcessMemory
    from rl.weight_sync import WeightSyncConfig
    from rl.weight_sync.baseline import gather_full_hf_tensors, make_actor_tp_groups
    from rl.weight_sync.execute import SyncStats
    from rl.weight_sync.layouts import actor_sources
    from rollout import RolloutConfig, SamplingParams, make_engine

    model_path = resolve_model_path(args.hf)
    dims = initialize_model_parallel(args.train_tp, args.train_pp)
    rank, world = dims.rank, dims.world_size
    actor = Actor(model_path, ActorConfig(tp=args.train_tp, pp=args.train_pp), dims, train=False)
    mesh = ColocatedMesh(world_size=world, actor_tp=args.train_tp, actor_pp=args.train_pp, rollout_tp=args.rollout_tp)
    rollout_cfg = RolloutConfig(
        engine="vllm", tp=args.rollout_tp, temperature=0.0, max_model_len=128, kv_cache_bytes=args.kv_cache_mb << 20
    )
    engine = make_engine(
        rollout_cfg, model_path, mesh=mesh, rank=rank, device=dims.device, dtype=actor.dtype, load=False
    )
    planned = WeightSyncConfig(bucket_mb=args.bucket_mb, verify=False).build(
        actor.shape, mesh, rank, dtype=actor.dtype, te_norms=actor.layout.te_norms
    )
    sources = actor_sources(actor.shape, mesh, te_norms=actor.layout.te_norms)
    tp_members, tp_group = make_actor_tp_groups(rank, mesh)
    hf_shapes = hf_tensor_shapes(actor.shape)
    torch_dtype = next(iter(actor.local_params().values())).dtype
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    process = ProcessMemory()

    def run(method: str) -> tuple[int, float, int]:
        dist.barrier()
        process.reset_peak()
        before, _ = process.read()
        start = time.perf_counter()
        if method == "planned":
            stats = planned(actor.local_params(), engine.begin_weight_update()).stats
            engine.finish_weight_update()
        else:
            stats = SyncStats()
            full = gather_full_hf_tensors(
                rank, sources, hf_shapes, tp_members, tp_group, actor.local_params(), torch_dtype, dims.device, stats
            )
            engine.load_weights(full)
        seconds = time.perf_counter() - start
        _, peak = process.read()
        return stats.bytes_received, seconds, peak - before

    reference = None
    results: dict[str, list[tuple[int, float, int]]] = {"planned": [], "baseline": []}
    for repeat in range(args.repeats):
        order = ("planned", "baseline") if repeat % 2 == 0 else ("baseline", "planned")
        for method in order:
            measured = run(method)
            outputs = [(c[0].token_ids, c[0].logprobs) for c in engine.generate(prompt_ids, greedy)]
            reference = reference or outputs
            if outputs != reference:
                raise RuntimeError(f"repeat {repeat}: the engine's greedy outputs after the {method} sync differ")
            gathered = [None] * world
            dist.all_gather_object(gathered, measured)
            results[method].append(
                (sum(g[0] for g in gathered), max(g[1] for g in gathered), max(g[2] for g in gathered))
            )
            if rank == 0:
                print(f"[bench-sync vllm] repeat {repeat + 1}/{args.repeats}: {method}", file=sys.stderr, flush=True)
    if rank == 0:
        out = {"engine": "vllm", "model": args.hf, "num_params": actor.shape.param_count()}
        out["layout"] = dict(
            train_tp=args.train_tp, train_pp=args.train_pp, rollout_tp=args.rollout_tp, world_size=world
        )
        for method, runs in results.items():
            out[method] = dict(
                bytes_moved=runs[0][0],
                seconds=statistics.median(r[1] for r in runs),
                seconds_all=[round(r[1], 4) for r in runs],
                peak_extra_bytes=statistics.median(r[2] for r in runs),
            )
        out["speedup"] = out["baseline"]["seconds"] / out["planned"]["seconds"]
        out["same_outputs"] = True  # checked after every sync above
        print(json.dumps(out), flush=True)
    engine.shutdown()
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    import math

    from rl.launch import spawn_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default="tiny:qwen2_memory", help="HF checkpoint directory or tiny:<family>")
    parser.add_argument("--train-tp", type=int, default=2)
    parser.add_argument("--train-pp", type=int, default=1)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--kv-cache-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench-sync: ENGINE=vllm needs the vllm package (`make install` brings its CPU build)", file=sys.stderr)
        return 2
    world = math.lcm(args.train_tp * args.train_pp, args.rollout_tp)
    return spawn_local(_rank_main, world, (args,))


if __name__ == "__main__":
    sys.exit(main())
