"""``make bench-sync [ENGINE=vllm] [LAYOUT=...]``: the planned reshard against what verl and slime do, per layout.

On each layout, ranks hold a megatron actor (train TP x PP) loaded from ``--hf`` (default the memory_cpu
model with 4 KV heads, ~122 MB in fp32, so TP=4 fits) and an engine (native or vLLM's CPU build, rollout TP)
built with empty weights; both methods end in that same engine:

- ``planned``: this project's sync (``weight_sync``): each engine rank receives only the slices it lacks,
  written in place between ``begin_weight_update`` / ``finish_weight_update``;
- ``baseline``: the peers' export (``weight_sync.baseline``, cited there): PP broadcast of shards when
  PP > 1, TP all-gather, full HF tensors streamed into the engine's own ``load_weights``.

Layouts (the bytes differ unless rollout TP=1 and PP=1): ``tp4->tp2`` (4 ranks), ``tp2pp2->tp2`` (4 ranks),
``tp2->tp1`` (2 ranks: both move the same bytes, so it shows each path's overhead). One warm-up sync of each
method, then ``--repeats`` of each, alternating which goes first. After every sync the engine generates
greedily from fixed prompts; every sync of either method must give the first one's tokens and log-probs
exactly, or the tool fails.

One JSON line per layout: ``planned_bytes`` (from the plan: bytes that cross ranks, per sync, all ranks),
``baseline_bytes`` (counted by the baseline's collectives, all ranks), ``min_bytes`` (the least any correct
sync moves, from the layouts), ``planned_s`` / ``baseline_s`` (median over repeats of the slowest rank),
``*_gbps`` (bytes / seconds), ``memcpy_gbps`` (one process's ``copy_`` of a buffer of ``planned_bytes``, median
of 5, same run), ``*_memcpy_fraction`` (``*_gbps / memcpy_gbps``), ``*_peak_extra_bytes`` (measured: the
largest rise, over ranks, of the kernel's RSS high-water mark over the RSS at the sync's start, reset through
``/proc/self/clear_refs``; median over repeats) and ``speedup`` (baseline_s / planned_s).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

from colocation.engines import ENGINES

PROMPTS = ("1+2=", "3+4=", "2+2=")
# name -> (train TP, train PP, rollout TP, world size)
LAYOUTS = {"tp4->tp2": (4, 1, 2, 4), "tp2pp2->tp2": (2, 2, 2, 4), "tp2->tp1": (2, 1, 1, 2)}


def parse_layout(text: str) -> str:
    """``tp4->tp2``, ``tp4-tp2`` or ``tp4_tp2`` (a bare ``>`` is a redirection in a shell) -> the canonical name."""
    canonical = re.sub(r"[-_>]+", "->", text.strip().lower())
    if canonical not in LAYOUTS:
        raise ValueError(f"LAYOUT={text!r} is not one of {', '.join(LAYOUTS)} (write tp4-tp2 without quotes)")
    return canonical


def memcpy_gbps(num_bytes: int, repeats: int = 5) -> float:
    """One process copying ``num_bytes`` from one buffer to another: median GB/s."""
    import torch

    src = torch.ones(max(num_bytes, 1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(src.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def _rank_main(args: argparse.Namespace, layout: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from megatron_backend.actor import Actor
    from megatron_backend.config import ActorConfig
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import ColocatedMesh
    from rollout import RolloutConfig, SamplingParams, make_engine
    from run.setup import rollout_groups
    from telemetry.memory_timeline import ProcessMemory
    from weight_sync import WeightSyncConfig
    from weight_sync.baseline import gather_full_hf_tensors, make_peer_export
    from weight_sync.execute import SyncStats
    from weight_sync.layouts import actor_sources, engine_destinations
    from weight_sync.transfers import min_sync_bytes

    train_tp, train_pp, rollout_tp, _ = LAYOUTS[layout]
    model_path = args.model_path
    dims = initialize_model_parallel(train_tp, train_pp)
    rank, world = dims.rank, dims.world_size
    actor = Actor(model_path, ActorConfig(tp=train_tp, pp=train_pp), dims, train=False)
    mesh = ColocatedMesh(world_size=world, actor_tp=train_tp, actor_pp=train_pp, rollout_tp=rollout_tp)
    groups = rollout_groups(mesh)
    rollout_cfg = RolloutConfig(
        engine=args.engine,
        tp=rollout_tp,
        temperature=0.0,
        max_model_len=128,
        kv_cache_bytes=args.kv_cache_mb << 20 if args.engine == "vllm" else None,
    )
    engine = make_engine(
        rollout_cfg,
        model_path,
        mesh=mesh,
        rank=rank,
        group=groups[mesh.replica(rank)] if rollout_tp > 1 else None,
        device=dims.device,
        dtype=actor.dtype,
        load=False,
    )
    te_norms = actor.layout.te_norms
    planned = WeightSyncConfig(bucket_mb=args.bucket_mb).build(actor.shape, mesh, rank, actor.dtype, te_norms)
    export = make_peer_export(rank, actor.shape, mesh, te_norms=te_norms)
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
            engine.load_weights(gather_full_hf_tensors(export, actor.local_params(), dims.device, stats))
        seconds = time.perf_counter() - start
        _, peak = process.read()
        return stats.bytes_received, seconds, peak - before

    reference = None
    results: dict[str, list[tuple[int, float, int]]] = {"planned": [], "baseline": []}
    for repeat in range(-1, args.repeats):  # -1: warm-up, not recorded
        order = ("planned", "baseline") if repeat % 2 == 0 else ("baseline", "planned")
        for method in order:
            measured = run(method)
            outputs = [(c[0].token_ids, c[0].logprobs) for c in engine.generate(prompt_ids, greedy)]
            reference = reference or outputs
            if outputs != reference:
                raise RuntimeError(f"{layout}: the engine's greedy outputs after the {method} sync #{repeat} differ")
            gathered = [None] * world
            dist.all_gather_object(gathered, measured)
            if repeat >= 0:
                results[method].append(
                    (sum(g[0] for g in gathered), max(g[1] for g in gathered), max(g[2] for g in gathered))
                )
            if rank == 0:
                label = "warm-up" if repeat < 0 else f"repeat {repeat + 1}/{args.repeats}"
                print(f"[bench-sync {args.engine} {layout}] {label}: {method} {measured[1]:.3f} s", file=sys.stderr)
    planned_bytes = planned.plan.bytes_moved
    dist.barrier()
    copy_gbps = memcpy_gbps(planned_bytes) if rank == 0 else 0.0
    dist.barrier()
    if rank == 0:
        if results["planned"][0][0] != planned_bytes:
            raise RuntimeError(
                f"{layout}: ranks received {results['planned'][0][0]} bytes, the plan says {planned_bytes}"
            )
        out = {"layout": layout, "engine": args.engine, "model": args.hf, "num_params": actor.shape.param_count()}
        out.update(train_tp=train_tp, train_pp=train_pp, rollout_tp=rollout_tp, world_size=world)
        out["planned_bytes"] = planned_bytes
        out["baseline_bytes"] = results["baseline"][0][0]
        out["min_bytes"] = min_sync_bytes(
            actor_sources(actor.shape, mesh, te_norms),
            engine_destinations(actor.shape, mesh),
            planned.plan.element_bytes,
        )
        for method, runs in results.items():
            seconds = statistics.median(r[1] for r in runs)
            out[f"{method}_s"] = seconds
            out[f"{method}_s_all"] = [round(r[1], 4) for r in runs]
            out[f"{method}_gbps"] = out[f"{method}_bytes"] / seconds / 1e9
            out[f"{method}_peak_extra_bytes"] = int(statistics.median(r[2] for r in runs))
        out["memcpy_gbps"] = copy_gbps
        out["planned_memcpy_fraction"] = out["planned_gbps"] / copy_gbps
        out["baseline_memcpy_fraction"] = out["baseline_gbps"] / copy_gbps
        out["speedup"] = out["baseline_s"] / out["planned_s"]
        out["same_outputs"] = True  # checked after every sync above
        print(json.dumps(out), flush=True)
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    from run.launch import spawn_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES, default="native")
    parser.add_argument("--layout", help=f"one of {', '.join(LAYOUTS)} (default: all three)")
    parser.add_argument("--hf", default="tiny:qwen2_memory_kv4", help="HF checkpoint directory or tiny:<family>")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--kv-cache-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        layouts = [parse_layout(args.layout)] if args.layout else list(LAYOUTS)
    except ValueError as exc:
        parser.error(str(exc))
    if args.repeats < 1 or args.bucket_mb < 1:
        parser.error("--repeats and --bucket-mb must be >= 1")
    if args.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            print(
                "bench-sync: ENGINE=vllm needs the vllm package (`make install` brings its CPU build)", file=sys.stderr
            )
            return 2
    from modelspec.tiny import resolve_model_path

    args.model_path = resolve_model_path(args.hf)  # built here, once: the ranks only read it
    for layout in layouts:
        code = spawn_local(_rank_main, LAYOUTS[layout][3], (args, layout))
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
