"""``make verify-sync``: a HF checkpoint -> the actor (TP x PP [x EP]) -> planned reshard -> the engine (native or vLLM).

    python -m tools.verify_sync --hf DIR --train-tp T --train-pp P [--train-ep E [--train-etp X]] --rollout-tp R
        [--rollout-ep Q] [--bucket-mb B]

Checks its input first (one line, exit 2, before any process starts), then runs lcm(actor world, R x Q) local
ranks, the actor world being the fewest ranks that hold both of megatron's grids (P x lcm(T, X*E), X = T
unless set; :func:`modelspec.mesh.min_world_size`): the actor loads the checkpoint into its shards, the engine starts with EMPTY weights and gets
them only through the weight sync (verified by checksums), then generates greedily from fixed prompts.
Rank 0 scores the generated tokens with transformers and prints one JSON line:
``max_abs_logprob_diff`` (engine vs transformers log-probs of the same tokens), ``num_tokens``,
``bytes_moved`` (the sync's cross-rank bytes), ``seconds`` (slowest rank), and the layout. With
``--engine vllm`` also ``max_abs_logprob_diff_fresh``: the same greedy generation by a fresh vLLM engine
built from the actor's exported checkpoint (inf when the tokens differ).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import warnings
from pathlib import Path

from colocation.engines import ENGINES, engine_profile
from tools.parity import check_input as check_actor_input

PROMPTS = ("1+2=", "The quick brown fox", "def add(a, b):", "RL on CPU, 7*6=")


def world_size(args: argparse.Namespace) -> int:
    """lcm(the fewest ranks holding both of megatron's grids, one engine replica)."""
    # first use: keeps torch (~1 s) out of `import tools.verify_sync` (its argument parsing and input checks)
    from modelspec.mesh import min_world_size

    actor_world = min_world_size(args.train_tp, args.train_pp, args.train_ep, args.train_etp)
    if engine_profile(args.engine).experts_span_replicas:  # vLLM: rollout.ep spans every engine rank
        return math.lcm(actor_world, args.rollout_tp, args.rollout_ep)
    return math.lcm(actor_world, args.rollout_tp * args.rollout_ep)


def check_input(args: argparse.Namespace) -> str | None:
    # runs in a spawned rank: keeps torch (~1 s) out of the tool's argument parsing and input checks
    import torch

    from configs.rollout import RolloutConfig
    from modelspec import ColocatedMesh, ModelShape
    from modelspec.mesh import check_rollout_experts
    from rollout.layout import tp_shape

    problem = check_actor_input(args.hf, args.train_tp, args.train_pp, None, args.train_ep, args.train_etp)
    if problem:
        return problem
    try:
        RolloutConfig(engine=args.engine, tp=args.rollout_tp, ep=args.rollout_ep)
        shape = ModelShape.from_pretrained(args.hf)
        tp_shape(shape, args.rollout_tp, 0)
        check_rollout_experts(shape, args.rollout_ep)
        profile = engine_profile(args.engine)
        mesh = ColocatedMesh(
            world_size=world_size(args),
            rollout_tp=args.rollout_tp,
            rollout_ep=args.rollout_ep,
            rollout_experts_span_replicas=profile.experts_span_replicas,
        )
        device_kind = "cuda" if torch.cuda.is_available() else "cpu"
        profile.check_expert_parallel(device_kind, args.rollout_ep)
        profile.check_moe_replicas(device_kind, mesh.num_replicas, shape.is_moe)
    except ValueError as exc:
        return f"HF={args.hf}: ROLLOUT_TP={args.rollout_tp} ROLLOUT_EP={args.rollout_ep}: {exc}"
    if args.bucket_mb < 1:
        return f"--bucket-mb={args.bucket_mb} must be >= 1"
    return None


def _rank_main(args: argparse.Namespace) -> None:
    result = sync_and_score(args)
    if result is not None:
        print(json.dumps(result), flush=True)


def sync_and_score(args: argparse.Namespace) -> dict | None:
    """The check on this rank (every rank of the world calls it): rank 0 returns the JSON line's fields."""
    # the rank's imports: the launcher's input check never loads megatron or an engine
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from configs.actor import ActorConfig
    from configs.rollout import RolloutConfig
    from rollout import SamplingParams, make_engine
    from run.config import ModelConfig
    from run.setup import build_rank
    from weight_sync import WeightSyncConfig

    tokenizer = AutoTokenizer.from_pretrained(args.hf)
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    rollout_cfg = RolloutConfig(
        engine=args.engine,
        tp=args.rollout_tp,
        ep=args.rollout_ep,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        max_model_len=max(len(p) for p in prompt_ids) + args.max_new_tokens,
        kv_cache_bytes=args.kv_cache_mb << 20 if args.engine == "vllm" else None,
    )
    parts = build_rank(
        ModelConfig(path=args.hf),
        ActorConfig(tp=args.train_tp, pp=args.train_pp, ep=args.train_ep, etp=args.train_etp),
        rollout_cfg,
        WeightSyncConfig(bucket_mb=args.bucket_mb, verify=True),
        train=False,
    )
    dims, mesh, actor, sync = parts.dims, parts.mesh, parts.actor, parts.weight_sync
    rank, world = dims.rank, dims.world_size
    engine = parts.start_engine()
    result = sync(actor.local_params(), engine.begin_weight_update())
    engine.finish_weight_update()
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=args.max_new_tokens)
    completions = engine.generate(prompt_ids, greedy)
    fresh_diff = None
    if args.engine == "vllm":
        # a fresh engine built from the actor's exported checkpoint must give the same tokens and log-probs
        chosen = [args.export_dir or (tempfile.mkdtemp(prefix="verify-sync-") if rank == 0 else None)]
        dist.broadcast_object_list(chosen, src=0)  # one directory for every rank
        export_dir = Path(chosen[0])
        actor.save_hf(export_dir)  # collective: every rank writes its share (config, tokenizer included)
        dist.barrier()
        engine.shutdown()
        fresh = make_engine(rollout_cfg, str(export_dir), mesh=mesh, rank=rank, device=dims.device, dtype=actor.dtype)
        fresh_completions = fresh.generate(prompt_ids, greedy)
        fresh_diff = max(
            (
                float((torch.tensor(a[0].logprobs) - torch.tensor(b[0].logprobs)).abs().max())
                if a[0].token_ids == b[0].token_ids
                else float("inf")
            )
            for a, b in zip(completions, fresh_completions)
        )
        fresh.shutdown()
    seconds = [None] * world
    dist.all_gather_object(seconds, result.stats.seconds)
    line = None
    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(args.hf, torch_dtype=torch.float32)
        max_diff, num_tokens = 0.0, 0
        with torch.no_grad():
            for prompt, per_prompt in zip(prompt_ids, completions):
                c = per_prompt[0]
                ids = torch.tensor([prompt + c.token_ids])
                logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
                targets = ids[0, len(prompt) :]
                reference = logprobs[len(prompt) - 1 : -1].gather(1, targets[:, None])[:, 0]
                max_diff = max(max_diff, float((reference - torch.tensor(c.logprobs)).abs().max()))
                num_tokens += len(c.token_ids)
        line = dict(
            hf=args.hf,
            train_tp=args.train_tp,
            train_pp=args.train_pp,
            train_ep=args.train_ep,
            train_etp=dims.etp,
            rollout_tp=args.rollout_tp,
            rollout_ep=args.rollout_ep,
            world_size=world,
            engine=args.engine,
            max_abs_logprob_diff=max_diff,
            max_abs_logprob_diff_fresh=fresh_diff,
            num_tokens=num_tokens,
            bytes_moved=sync.plan.bytes_moved,
            seconds=max(seconds),
            verified=result.verified,
            bucket_bytes=sync.plan.bucket_bytes,
        )
    dist.barrier()
    return line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hf", required=True, help="Hugging Face checkpoint directory (a family of modelspec.families)"
    )
    parser.add_argument("--train-tp", type=int, default=1)
    parser.add_argument("--train-pp", type=int, default=1)
    parser.add_argument("--train-ep", type=int, default=1, help="actor expert parallel (MoE models)")
    parser.add_argument("--train-etp", type=int, default=None, help="actor expert tensor parallel (default: TP)")
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument(
        "--rollout-ep", type=int, default=1, help="engine expert parallel (MoE; vllm: the world size, GPU only)"
    )
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--engine", choices=ENGINES, default="native")
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="vLLM's KV cache on CPU")
    parser.add_argument("--export-dir", default=None, help="vllm: where the actor's checkpoint is exported")
    return parser


def main(argv: list[str] | None = None) -> int:

    # first use: keeps torch (~1 s) out of `import tools.verify_sync` (its argument parsing and input checks)
    from run.launch import spawn_local

    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    problem = check_input(args)
    if problem:
        print(f"verify-sync: {problem}", file=sys.stderr)
        return 2
    return spawn_local(_rank_main, world_size(args), (args,))


if __name__ == "__main__":
    sys.exit(main())
