"""``make bench-sync``: the planned reshard against the gather+broadcast baseline, in one run, on 4 CPU ranks.

Prints one JSON line: ``planned`` and ``baseline`` (``bytes_moved``, ``seconds``, ``gbps``,
``peak_extra_bytes`` = max over ranks), ``min_bytes`` (the least any correct sync must move),
``bucket_bytes``, ``memcpy_gbps`` (a plain tensor copy on this machine, same run) and ``speedup``
(baseline seconds / planned seconds). Both syncs must leave identical engine weights, or it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# A Qwen2-style model large enough that one sync moves >= 256 MiB at train (2, 2) -> rollout TP 4.
BENCH_MODEL = dict(
    model_type="qwen2",
    num_hidden_layers=8,
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
)


def memcpy_gbps(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return num_bytes * repeats / (time.perf_counter() - start) / 1e9


def _rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from megatron_backend.layout import RankLayout, hf_tensor_shapes, local_param_shapes, rank_pieces
    from modelspec import ColocatedMesh, ModelShape
    from rl.weight_sync import TorchP2PTransport, execute_sync, plan_sync
    from rl.weight_sync.baseline import baseline_sync, make_actor_tp_groups
    from rl.weight_sync.layouts import actor_sources, engine_destinations
    from rl.weight_sync.plan import min_sync_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, pp, rtp = args.train_tp, args.train_pp, args.rollout_tp
    mesh = ColocatedMesh(world_size=world, actor_tp=tp, actor_pp=pp, rollout_tp=rtp)
    tp_rank, pp_rank = mesh.actor_coords(rank).tp_rank, mesh.actor_coords(rank).pp_rank
    shape = ModelShape.from_hf_config(BENCH_MODEL)
    # Random shards, seeded so that DP replicas match and TP-replicated tensors (norms) agree across
    # TP ranks, as they do in a trained actor.
    layout = RankLayout(tp, pp, None, tp_rank, pp_rank)
    replicated = {(p.vp_stage, p.megatron_name) for p in rank_pieces(shape, layout) if p.transform == "replicate"}
    src = {}
    for i, (key, local_shape) in enumerate(sorted(local_param_shapes(shape, layout).items())):
        seed = 1_000_000 * pp_rank + 1000 * i + (0 if key in replicated else 1 + tp_rank)
        src[key] = torch.randn(local_shape, generator=torch.Generator().manual_seed(seed))
    sources = actor_sources(shape, mesh)
    destinations = engine_destinations(shape, mesh)
    bucket_bytes = args.bucket_mb << 20
    plan = plan_sync(sources, destinations, bucket_bytes, element_bytes=4)
    results = {}
    for name in ("planned", "baseline"):
        dst = {p.name: torch.zeros(p.local_shape) for p in destinations[rank]}
        dist.barrier()
        if name == "planned":
            stats = execute_sync(plan, rank, src, dst, transport=TorchP2PTransport())
        else:
            tp_members, tp_group = make_actor_tp_groups(rank, mesh)
            stats = baseline_sync(
                rank,
                sources,
                destinations,
                hf_tensor_shapes(shape),
                tp_members,
                tp_group,
                src,
                dst,
                torch.float32,
                torch.device("cpu"),
            )
        dist.barrier()
        gathered = [None] * world
        dist.all_gather_object(gathered, (stats.bytes_received, stats.seconds, stats.peak_extra_bytes))
        results[name] = dict(
            bytes_moved=sum(g[0] for g in gathered),
            seconds=max(g[1] for g in gathered),
            peak_extra_bytes=max(g[2] for g in gathered),
        )
        results[name]["gbps"] = results[name]["bytes_moved"] / results[name]["seconds"] / 1e9
        results[name + "_weights"] = dst
    same = all(
        torch.equal(results["planned_weights"][k], results["baseline_weights"][k]) for k in results["planned_weights"]
    )
    agree = [None] * world
    dist.all_gather_object(agree, same)
    if rank == 0:
        if not all(agree):
            print("bench-sync: planned and baseline syncs disagree", file=sys.stderr)
            sys.exit(1)
        out = dict(
            model=dict(BENCH_MODEL, num_params=sum(torch.Size(s).numel() for s in hf_tensor_shapes(shape).values())),
            layout=dict(train_tp=tp, train_pp=pp, rollout_tp=rtp, world_size=world),
            planned=results["planned"],
            baseline=results["baseline"],
            min_bytes=min_sync_bytes(sources, destinations, 4),
            bucket_bytes=bucket_bytes,
            memcpy_gbps=memcpy_gbps(),
            speedup=results["baseline"]["seconds"] / results["planned"]["seconds"],
        )
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> int:
    from rl.launch import spawn_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-tp", type=int, default=2)
    parser.add_argument("--train-pp", type=int, default=2)
    parser.add_argument("--rollout-tp", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--bucket-mb", type=int, default=64)
    args = parser.parse_args()
    if args.world_size % (args.train_tp * args.train_pp) or args.world_size % args.rollout_tp:
        parser.error("--world-size must be a multiple of train TP x PP and of rollout TP")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return spawn_local(_rank_main, args.world_size, (args,))


if __name__ == "__main__":
    sys.exit(main())
