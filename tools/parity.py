"""Logit parity: the same HF checkpoint and input through megatron (TP x PP) and through transformers.

``python -m tools.parity --hf DIR --tp T --pp P [--vpp V] [--ep E [--etp X]]`` checks its input first (one
line on stderr, exit 2, before any process group exists), then launches the fewest ranks that hold the
layout with torchrun (``P x lcm(T, X x E)``, X = T unless set: megatron's dense and expert grids over one
world) and prints ONE JSON line: ``{"tp", "pp", "vpp", "ep", "etp", "world_size", "model_type",
"max_abs_logprob_diff", "num_tokens"}``.
The diff is over fp32 log-probs of every next token of a fixed random batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def check_input(hf_dir: str, tp: int, pp: int, vpp: int | None, ep: int = 1, etp: int | None = None) -> str | None:
    """One line describing what is wrong, or None."""
    # first use: keeps torch (~1 s) out of `import tools.parity` (its argument parsing and input checks)
    from modelspec import ModelShape
    from modelspec.mesh import check_actor_split, check_expert_split

    path = Path(hf_dir)
    if not path.is_dir():
        return f"HF={hf_dir}: no such directory"
    if not (path / "config.json").is_file():
        return f"HF={hf_dir}: no config.json; point HF at a Hugging Face checkpoint directory"
    if not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file():
        return f"HF={hf_dir}: no model.safetensors or model.safetensors.index.json (only safetensors are supported)"
    if tp < 1 or pp < 1 or ep < 1 or (vpp is not None and vpp < 1) or (etp is not None and etp < 1):
        return f"TP={tp} PP={pp} VPP={vpp} EP={ep} ETP={etp}: sizes must be positive integers"
    try:
        # first use: keeps torch (~1 s) out of `import tools.parity` (its argument parsing and input checks)
        from megatron_backend.model import rope_scaling_kwargs

        shape = ModelShape.from_pretrained(path)
        rope_scaling_kwargs(shape)
        check_actor_split(shape, tp, pp, vpp)
        check_expert_split(shape, ep, tp if etp is None else etp)
    except ValueError as exc:
        return f"HF={hf_dir}: {exc}"
    return None


def _worker(args) -> None:
    result = parity(args)
    if result is not None:
        print(json.dumps(result), flush=True)
    # runs in a spawned rank: keeps torch (~1 s) out of the tool's argument parsing and input checks
    from megatron_backend.parallel import destroy

    destroy()


def parity(args) -> dict | None:
    """The check on this rank (every rank of the layout calls it): rank 0 returns the JSON line's fields."""
    # runs in a spawned rank: keeps torch (~1 s) out of the tool's argument parsing and input checks
    import torch
    from transformers import AutoModelForCausalLM

    from configs.actor import ActorConfig
    from megatron_backend.actor import Actor
    from megatron_backend.parallel import initialize_model_parallel
    from modelspec import TokenBatch

    dims = initialize_model_parallel(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)
    # the interleaved schedule needs >= PP micro-batches: one sequence per micro-batch there
    micro_batch_size = 1 if args.vpp else args.batch
    actor = Actor(
        args.hf,
        ActorConfig(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp, micro_batch_size=micro_batch_size),
        dims,
        train=False,
    )
    generator = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(0, actor.shape.vocab_size, (args.batch, args.seq_len), generator=generator)
    logprobs = actor.compute_logprobs(TokenBatch(input_ids=input_ids)).cpu()  # [B, S-1] on every rank
    if dims.rank == 0:
        hf_model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
        hf_model.eval()
        with torch.no_grad():
            logits = hf_model(input_ids=input_ids).logits.float()  # [B, S, V]
        reference = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return dict(
            tp=args.tp,
            pp=args.pp,
            vpp=args.vpp,
            ep=args.ep,
            etp=dims.etp,
            world_size=dims.world_size,
            model_type=actor.shape.model_type,
            max_abs_logprob_diff=float((logprobs - reference).abs().max()),
            num_tokens=int(reference.numel()),
        )
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hf", required=True, help="Hugging Face checkpoint directory (a family of modelspec/families/)"
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel (MoE models)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: --tp)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # first use: keeps torch (~1 s) out of `import tools.parity` (its argument parsing and input checks)
    from modelspec.mesh import min_world_size

    args.batch = max(args.batch, args.pp) if args.vpp else args.batch
    if args.worker:
        _worker(args)
        return 0
    problem = check_input(args.hf, args.tp, args.pp, args.vpp, args.ep, args.etp)
    if problem is None and args.vpp is not None and args.vpp > 1 and args.pp < 2:
        problem = f"VPP={args.vpp} needs PP >= 2"
    if problem:
        print(f"parity: {problem}", file=sys.stderr)
        return 2
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={min_world_size(args.tp, args.pp, args.ep, args.etp)}",
        "-m",
        "tools.parity",
        "--worker",
        *(argv if argv is not None else sys.argv[1:]),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
