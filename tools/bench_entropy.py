"""Peak memory of chunked vs unchunked vocab entropy (``make bench-entropy``): one JSON line.

Each mode runs in a fresh process so peaks do not mix: on CPU the peak is ``ru_maxrss`` (peak RSS)
minus the RSS once the logits exist; on CUDA it is ``max_memory_allocated`` minus the allocated
bytes once the logits exist. Both modes compute the same entropy (``max_abs_entropy_diff``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import psutil


def _measure(num_tokens: int, vocab_size: int, chunk_tokens: int | None) -> dict:
    # runs in a spawned rank: keeps torch (~1 s) out of the tool's argument parsing and input checks
    import torch

    from megatron_backend.logprobs import vocab_parallel_entropy

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    logits = torch.randn(num_tokens, vocab_size, device=device).mul_(3.0)  # [N, V] fp32, no temporary
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline = psutil.Process().memory_info().rss
    entropy = vocab_parallel_entropy(logits, 0, vocab_size, None, chunk_tokens)
    if cuda:
        torch.cuda.synchronize()
        peak_extra = torch.cuda.max_memory_allocated() - baseline
    else:
        peak_extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    return dict(peak_extra_bytes=int(peak_extra), entropy=entropy.cpu().tolist(), device=device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--mode", choices=["chunked", "unchunked"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        chunk = args.chunk_tokens if args.mode == "chunked" else None
        print(json.dumps(_measure(args.tokens, args.vocab, chunk)))
        return 0
    results = {}
    for mode in ("chunked", "unchunked"):
        command = [sys.executable, "-m", "tools.bench_entropy", "--mode", mode]
        command += ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--chunk-tokens", str(args.chunk_tokens)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    chunked, unchunked = results["chunked"], results["unchunked"]
    diff = max(abs(a - b) for a, b in zip(chunked["entropy"], unchunked["entropy"]))
    logits_bytes = args.tokens * args.vocab * 4
    print(
        json.dumps(
            dict(
                device=chunked["device"],
                num_tokens=args.tokens,
                vocab_size=args.vocab,
                chunk_tokens=args.chunk_tokens,
                logits_bytes=logits_bytes,
                peak_extra_bytes_chunked=chunked["peak_extra_bytes"],
                peak_extra_bytes_unchunked=unchunked["peak_extra_bytes"],
                peak_saved_bytes=unchunked["peak_extra_bytes"] - chunked["peak_extra_bytes"],
                max_abs_entropy_diff=diff,
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
