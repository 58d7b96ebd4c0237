"""``make bench-sync [ENGINE=vllm] [LAYOUT=...]``: the planned reshard against what verl and slime do, per layout.

On each layout, ranks hold a megatron actor (train TP x PP [x EP]) loaded from ``--hf`` (default: the layout's
model, below) and an engine (native or vLLM's CPU build, rollout TP) built with empty weights; both methods end
in that same engine:

- ``planned``: this project's sync (``weight_sync``): each engine rank receives only the slices it lacks,
  written in place between ``begin_weight_update`` / ``finish_weight_update``;
- ``baseline``: the peers' export (``weight_sync.baseline``, cited there): PP broadcast of shards when
  PP > 1, every routed expert all-gathered over expert TP x EP (every rank gets every expert), TP all-gather
  of the rest, full HF tensors streamed into the engine's own ``load_weights``.

Dense layouts, on memory_cpu's model with 4 KV heads (``tiny:qwen2_memory_kv4``, ~126 MB in fp32, so TP=4
fits): ``tp4->tp2`` (4 ranks), ``tp2pp2->tp2`` (4 ranks), ``tp2->tp1`` (2 ranks: both move the same bytes, so
it shows each path's overhead). MoE layouts, on a Qwen3-MoE of 123 MB in fp32 (``tiny:qwen3_moe_memory``, 16
experts per layer): ``ep2->tp2`` (actor EP2 -> engine TP2, 2 ranks) and ``tp2ep2->tp2`` (actor TP2 x EP2, expert
TP following TP -> engine TP2, 4 ranks; two engine replicas: skipped with one line for vLLM on CPU, whose CPU
build cannot run data-parallel MoE layers, ``EngineProfile.check_moe_replicas``). One warm-up sync of each method, then ``--repeats`` of each, alternating which goes
first. After every sync the engine generates greedily from fixed prompts; every sync of either method must give
the first one's tokens and log-probs exactly, or the tool fails.

One JSON line per layout: ``planned_bytes`` (from the plan: bytes that cross ranks, per sync, all ranks),
``baseline_bytes`` (counted by the baseline's collectives, all ranks; checked against
``PeerExport.bytes_received``, the same count from the layouts), ``min_bytes`` (the least any correct sync
moves, from the layouts), ``planned_s`` / ``baseline_s`` (median over repeats of the slowest rank),
``*_gbps`` (bytes / seconds), ``memcpy_gbps`` (one process's ``copy_`` of a buffer of ``planned_bytes``, median
of 5, same run), ``*_memcpy_fraction`` (``*_gbps / memcpy_gbps``), ``*_peak_extra_bytes`` (measured: the
largest rise, over ranks, of the kernel's RSS high-water mark over the RSS at the sync's start, reset through
``/proc/self/clear_refs``; median over repeats) and ``speedup`` (baseline_s / planned_s). MoE layouts add
``expert_bytes`` (all routed experts' HF tensors) and ``baseline_expert_bytes_per_rank`` (the full expert
tensors the baseline builds on each rank per sync: every expert, on every rank).

``--layout paper [--exp <experiment>]`` (``make bench-sync LAYOUT=paper EXP=qwen3_30b_a3b_8xh100``) prints a
paper ESTIMATE instead, nothing run: the experiment's planned sync (its actor and engine layouts, dtype, bucket
size) over its device's datasheet bandwidths, next to the peers' published refit times
(:func:`weight_sync.estimate.refit_estimate`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass

from colocation.engines import ENGINES, engine_profile

PROMPTS = ("1+2=", "3+4=", "2+2=")
DENSE_MODEL, MOE_MODEL = "tiny:qwen2_memory_kv4", "tiny:qwen3_moe_memory"
PAPER = "paper"
PAPER_EXP = "qwen3_30b_a3b_8xh100"


@dataclass(frozen=True)
class BenchLayout:
    train_tp: int
    train_pp: int
    train_ep: int
    rollout_tp: int
    world_size: int
    model: str


LAYOUTS = {
    "tp4->tp2": BenchLayout(4, 1, 1, 2, 4, DENSE_MODEL),
    "tp2pp2->tp2": BenchLayout(2, 2, 1, 2, 4, DENSE_MODEL),
    "tp2->tp1": BenchLayout(2, 1, 1, 1, 2, DENSE_MODEL),
    "ep2->tp2": BenchLayout(1, 1, 2, 2, 2, MOE_MODEL),
    "tp2ep2->tp2": BenchLayout(2, 1, 2, 2, 4, MOE_MODEL),
}


def parse_layout(text: str) -> str:
    """``tp4->tp2``, ``tp4-tp2`` or ``tp4_tp2`` (a bare ``>`` is a redirection in a shell) -> the canonical name."""
    if text.strip().lower() == PAPER:
        return PAPER
    canonical = re.sub(r"[-_>]+", "->", text.strip().lower())
    if canonical not in LAYOUTS:
        raise ValueError(
            f"LAYOUT={text!r} is not one of {', '.join(LAYOUTS)} or {PAPER} (write tp4-tp2 without quotes)"
        )
    return canonical


def memcpy_gbps(num_bytes: int, repeats: int = 5) -> float:
    """One process copying ``num_bytes`` from one buffer to another: median GB/s."""
    # first use: keeps torch (~1 s) out of `import tools.bench_sync` (its argument parsing and input checks)
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
    # the rank's imports: the launcher (its argument checks, --layout paper) never loads megatron or an engine
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from configs.actor import ActorConfig
    from configs.rollout import RolloutConfig
    from rollout import SamplingParams
    from run.config import ModelConfig
    from run.setup import build_rank
    from telemetry.memory_timeline import ProcessMemory
    from weight_sync import WeightSyncConfig
    from weight_sync.baseline import gather_full_hf_tensors, make_peer_export
    from weight_sync.execute import SyncStats
    from weight_sync.layouts import actor_sources, engine_destinations
    from weight_sync.transfers import min_sync_bytes

    spec = LAYOUTS[layout]
    train_tp, train_pp, train_ep, rollout_tp = spec.train_tp, spec.train_pp, spec.train_ep, spec.rollout_tp
    model_path = args.model_paths[layout]
    rollout_cfg = RolloutConfig(
        engine=args.engine,
        tp=rollout_tp,
        temperature=0.0,
        max_model_len=128,
        kv_cache_bytes=args.kv_cache_mb << 20 if args.engine == "vllm" else None,
    )
    parts = build_rank(
        ModelConfig(path=model_path),
        ActorConfig(tp=train_tp, pp=train_pp, ep=train_ep),
        rollout_cfg,
        WeightSyncConfig(bucket_mb=args.bucket_mb),
        train=False,
    )
    dims, mesh, actor, planned = parts.dims, parts.mesh, parts.actor, parts.weight_sync
    rank, world = dims.rank, dims.world_size
    engine = parts.start_engine()
    te_norms = actor.layout.te_norms
    element_bytes = next(iter(actor.local_params().values())).element_size()
    export = make_peer_export(rank, actor.shape, mesh, te_norms=te_norms)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    process = ProcessMemory()
    expert_names = {p.hf_name for pieces in export.sources.values() for p in pieces if p.is_expert}
    full_expert_bytes = [0]  # the full expert tensors the baseline built on this rank, last sync

    def counted(tensors):
        full_expert_bytes[0] = 0
        for name, tensor in tensors:
            if name in expert_names:
                full_expert_bytes[0] += tensor.numel() * tensor.element_size()
            yield name, tensor

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
            engine.load_weights(counted(gather_full_hf_tensors(export, actor.local_params(), dims.device, stats)))
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
    baseline_counts = [None] * world
    dist.all_gather_object(baseline_counts, (export.bytes_received(planned.plan.element_bytes), full_expert_bytes[0]))
    dist.barrier()
    copy_gbps = memcpy_gbps(planned_bytes) if rank == 0 else 0.0
    dist.barrier()
    if rank == 0:
        if results["planned"][0][0] != planned_bytes:
            raise RuntimeError(
                f"{layout}: ranks received {results['planned'][0][0]} bytes, the plan says {planned_bytes}"
            )
        if results["baseline"][0][0] != sum(c[0] for c in baseline_counts):
            raise RuntimeError(
                f"{layout}: the baseline received {results['baseline'][0][0]} bytes, its layouts say "
                f"{sum(c[0] for c in baseline_counts)}"
            )
        out = {"layout": layout, "engine": args.engine, "model": args.hf or spec.model}
        out.update(num_params=actor.shape.param_count(), weight_bytes=actor.shape.param_count() * element_bytes)
        out.update(train_tp=train_tp, train_pp=train_pp, train_ep=train_ep, rollout_tp=rollout_tp, world_size=world)
        out["planned_bytes"] = planned_bytes
        out["baseline_bytes"] = results["baseline"][0][0]
        if expert_names:
            out["expert_bytes"] = element_bytes * sum(math.prod(export.hf_shapes[n]) for n in expert_names)
            out["baseline_expert_bytes_per_rank"] = min(c[1] for c in baseline_counts)
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


def paper_estimate(exp: str, overrides: list[str]) -> dict:
    """The experiment's planned sync on its GPUs, estimated from bytes and bandwidths (nothing allocated)."""
    # first use: keeps torch (~1 s) out of `import tools.bench_sync` (its argument parsing and input checks)
    from run.compose import compose
    from weight_sync.estimate import refit_estimate

    cfg = compose(exp, overrides)
    mesh = cfg.mesh()  # the run's own mesh (engine expert split included)
    out = refit_estimate(cfg.model.shape(), mesh, cfg.model.dtype, cfg.weight_sync.bucket_mb << 20, cfg.cluster.device)
    return {"layout": PAPER, "exp": exp, **out}


def main(argv: list[str] | None = None) -> int:
    # first use: keeps torch (~1 s) out of `import tools.bench_sync` (its argument parsing and input checks)
    from run.launch import spawn_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES, default="native")
    parser.add_argument("--layout", help=f"one of {', '.join(LAYOUTS)} (default: all), or {PAPER}")
    parser.add_argument("--hf", default=None, help="HF checkpoint directory or tiny:<family> (default: the layout's)")
    parser.add_argument("--exp", default=PAPER_EXP, help=f"--layout {PAPER}: the experiment to estimate")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--kv-cache-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help=f"--layout {PAPER}: hydra overrides of the experiment")
    args = parser.parse_args(argv)
    try:
        layouts = [parse_layout(args.layout)] if args.layout else list(LAYOUTS)
    except ValueError as exc:
        parser.error(str(exc))
    if layouts == [PAPER]:
        # first use: keeps torch (~1 s) out of `import tools.bench_sync` (its argument parsing and input checks)
        from run.compose import ConfigError

        try:
            print(json.dumps(paper_estimate(args.exp, args.overrides)), flush=True)
        except (ConfigError, ValueError) as exc:
            print(f"bench-sync: EXP={args.exp}: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.overrides:
        parser.error(f"hydra overrides are for --layout {PAPER} only")
    if args.repeats < 1 or args.bucket_mb < 1:
        parser.error("--repeats and --bucket-mb must be >= 1")
    if args.engine == "vllm":
        try:
            # optional: vLLM is imported where it is used, not every install has it
            import vllm  # noqa: F401
        except ImportError:
            print(
                "bench-sync: ENGINE=vllm needs the vllm package (`make install` brings its CPU build)", file=sys.stderr
            )
            return 2
    # first use: keeps torch (~1 s) out of `import tools.bench_sync` (its argument parsing and input checks)
    import torch

    from modelspec import ModelShape
    from modelspec.tiny import resolve_model_path

    device_kind = "cuda" if torch.cuda.is_available() else "cpu"

    # built here, once: the ranks only read them
    args.model_paths = {layout: resolve_model_path(args.hf or LAYOUTS[layout].model) for layout in layouts}
    for layout in layouts:
        spec = LAYOUTS[layout]
        is_moe = ModelShape.from_pretrained(args.model_paths[layout]).is_moe
        try:
            engine_profile(args.engine).check_moe_replicas(device_kind, spec.world_size // spec.rollout_tp, is_moe)
        except ValueError as exc:
            print(f"bench-sync: LAYOUT={layout}: {exc}; skipped", file=sys.stderr)
            if len(layouts) == 1:
                return 2
            continue
        code = spawn_local(_rank_main, spec.world_size, (args, layout))
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
