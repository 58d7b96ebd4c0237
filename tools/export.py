"""``make export``: a run's checkpoint as a Hugging Face directory (transformers / vLLM load it as is).

    python -m tools.export RUN [--step N] [--out DIR] [--dtype bfloat16|float32] [--force] [--max-shard-mb M]

Reads ``RUN/checkpoints/step_<n>/actor`` (the actor's megatron-core distributed checkpoint, any layout it
was saved at) tensor by tensor and writes ``OUT`` (default ``RUN/hf/step_<n>``): ``config.json`` (the run's
model checkpoint's, its dtype set), ``model.safetensors`` or shards of at most ``--max-shard-mb`` with
``model.safetensors.index.json``, the tokenizer files, ``generation_config.json`` when the source has one, and
``run_config.yaml`` (the run's config). One process, no live run; see :mod:`megatron_backend.hf_export`.
Progress: one line per file on stderr; then one JSON line on stdout (out, files, bytes, seconds, peak RSS).
Bad input (no checkpoint, a step it lacks, a non-empty OUT, a checkpoint of another model, too little disk)
fails in one line, exit code 2, before anything is written.
"""

from __future__ import annotations

import argparse
import errno
import json
import multiprocessing
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from colocation.host_memory import configure_host_allocator

RUN_CONFIG = "config.yaml"
EXPORT_DTYPES = ("bfloat16", "float32")


class ExportError(ValueError):
    """Bad input: one line naming the thing and the fix."""


@dataclass(frozen=True)
class ExportJob:
    checkpoint: Path  # runs/<exp>/<time>/checkpoints/step_<n>
    step: int
    source_dir: Path  # the run's model.path (config.json, tokenizer)
    out_dir: Path
    dtype: str
    run_config: Path


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux


def resolve(run: str, step: int | None, out: str | None, dtype: str | None, force: bool) -> ExportJob:
    """Check the input (files and headers only) and pick the checkpoint, OUT and dtype; ExportError if bad."""

    # first use: keeps torch (~1 s) out of `import tools.export` (its argument parsing and input checks)
    from checkpointing.checkpoint import (
        CHECKPOINT_DIR,
        HF_DIR,
        RLState,
        complete_checkpoints,
        model_sizes,
        step_dir_name,
    )

    run_dir = Path(run)
    if not (run_dir / RUN_CONFIG).is_file():
        raise ExportError(f"RUN={run} is not a run directory (no {RUN_CONFIG}); give runs/<exp>/<time>")
    found = complete_checkpoints(run_dir / CHECKPOINT_DIR)
    steps = [RLState.read(p).completed_steps for p in found]
    if not found:
        raise ExportError(
            f"RUN={run} has no complete checkpoint under {CHECKPOINT_DIR}/; run it with trainer.save_every=<n> "
            "(0 writes none) or pick another run"
        )
    if step is None:
        checkpoint, step = found[-1], steps[-1]
    elif step in steps:
        checkpoint = found[steps.index(step)]
    else:
        raise ExportError(f"STEP={step}: RUN={run} has checkpoints at steps {steps}; pick one of them")
    config = yaml.safe_load((run_dir / RUN_CONFIG).read_text())
    source_dir = Path(config["model"]["path"])
    if not (source_dir / "config.json").is_file():
        raise ExportError(
            f"the run's model.path {source_dir} has no config.json (its config and tokenizer are exported with the "
            "weights); restore that checkpoint directory"
        )
    # first use: keeps torch (~1 s) out of `import tools.export` (its argument parsing and input checks)
    from modelspec import ModelShape

    shape = ModelShape.from_pretrained(source_dir)
    saved = RLState.read(checkpoint).model
    if saved != model_sizes(shape):
        raise ExportError(
            f"{checkpoint} holds a model of {saved} but the run's model.path {source_dir} is {model_sizes(shape)}; "
            "export from the run that wrote this checkpoint, or point its config.yaml model.path at that model"
        )
    dtype = dtype or config["model"].get("dtype", "float32")
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"DTYPE={dtype} is not one of {list(EXPORT_DTYPES)}")
    out_dir = Path(out) if out else run_dir / HF_DIR / step_dir_name(step)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise ExportError(f"OUT={out_dir} exists and is not empty; pick another OUT or pass FORCE=1 to replace it")
    return ExportJob(checkpoint, step, source_dir, out_dir, dtype, run_dir / RUN_CONFIG)


def _print_file(name: str, num_bytes: int) -> None:
    print(
        f"[export] {name}: {num_bytes / 2**20:.1f} MiB (peak RSS {_peak_rss_bytes() / 2**20:.0f} MiB)", file=sys.stderr
    )


def _write_share(actor_dir: str, source_dir: str, plan, out_dir: str, rank: int, num_procs: int) -> int:
    """One process of ``--procs``: its files (index % num_procs == rank); returns its peak RSS."""
    # first use: keeps torch (~1 s) out of `import tools.export` (its argument parsing and input checks)
    from megatron_backend.hf_export import write_files
    from modelspec import ModelShape

    configure_host_allocator()
    write_files(actor_dir, ModelShape.from_pretrained(source_dir), plan, out_dir, rank, num_procs, _print_file)
    return _peak_rss_bytes()


def export(job: ExportJob, max_shard_bytes: int, num_procs: int = 1) -> dict:
    """Write ``job.out_dir`` (``num_procs`` processes writing the files); returns the summary (files, bytes,
    seconds, RSS: with several processes ``peak_rss_bytes`` is the largest of theirs and this one's)."""
    # first use: keeps torch (~1 s) out of `import tools.export` (its argument parsing and input checks)
    import torch

    from checkpointing.checkpoint import ACTOR_DIR, RUN_CONFIG_COPY
    from megatron_backend.hf_export import plan_export, source_tensor_names, write_hf_dir
    from modelspec import ModelShape

    start = time.perf_counter()
    shape = ModelShape.from_pretrained(job.source_dir)
    dtype = getattr(torch, job.dtype)
    plan = plan_export(shape, dtype, max_shard_bytes, source_tensor_names(job.source_dir))
    parent = job.out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if free < plan.total_bytes:
        raise ExportError(
            f"OUT={job.out_dir}: {free / 2**20:.0f} MiB free on its disk, the export needs "
            f"{plan.total_bytes / 2**20:.0f} MiB; free space or pick OUT on another disk"
        )
    rss_before = _rss_bytes()
    sizes: dict[str, int] = {}

    def on_file(name: str, num_bytes: int) -> None:
        sizes[name] = num_bytes
        print(
            f"[export] {name}: {num_bytes / 2**20:.1f} MiB ({len(sizes)}/{len(plan.files)} files, "
            f"peak RSS {_peak_rss_bytes() / 2**20:.0f} MiB)",
            file=sys.stderr,
            flush=True,
        )

    actor_dir = job.checkpoint / ACTOR_DIR
    worker_peaks: list[int] = []

    def write_in_pool(tmp: Path) -> None:

        args = [(str(actor_dir), str(job.source_dir), plan, str(tmp), r, num_procs) for r in range(num_procs)]
        with multiprocessing.get_context("spawn").Pool(num_procs) as pool:
            worker_peaks.extend(pool.starmap(_write_share, args))

    try:
        write_hf_dir(
            actor_dir,
            shape,
            job.source_dir,
            job.out_dir,
            plan,
            on_file=on_file,
            extra_files={RUN_CONFIG_COPY: job.run_config},
            write=write_in_pool if num_procs > 1 else None,
        )
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ExportError(
                f"OUT={job.out_dir}: the disk filled up during the export (nothing was left there); free "
                f"{plan.total_bytes / 2**20:.0f} MiB or pick OUT on another disk"
            ) from None
        raise
    files = {p.name: p.stat().st_size for p in sorted(job.out_dir.iterdir())}
    return dict(
        out=str(job.out_dir),
        step=job.step,
        dtype=job.dtype,
        files=files,
        bytes=sum(files.values()),
        weight_bytes=plan.total_bytes,
        seconds=round(time.perf_counter() - start, 2),
        rss_before_bytes=rss_before,
        peak_rss_bytes=max([_peak_rss_bytes(), *worker_peaks]),
        num_procs=num_procs,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the run directory, runs/<exp>/<time>")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--out", default=None, help="the HF directory to write (default: RUN/hf/step_<n>)")
    parser.add_argument("--dtype", default=None, choices=EXPORT_DTYPES, help="default: the run's model.dtype")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--max-shard-mb", type=float, default=2048.0, help="largest safetensors file (MiB)")
    parser.add_argument("--procs", type=int, default=1, help="processes writing the files, each its share")
    args = parser.parse_args(argv)

    configure_host_allocator()  # freed chunk buffers go back to the OS: the RSS stays at one tensor's reads
    try:
        if args.max_shard_mb <= 0:
            raise ExportError(f"SHARD_MB={args.max_shard_mb} must be > 0")
        if args.procs < 1:
            raise ExportError(f"NPROC={args.procs} must be >= 1")
        job = resolve(args.run, args.step, args.out, args.dtype, args.force)
        summary = export(job, int(args.max_shard_mb * 2**20), args.procs)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
