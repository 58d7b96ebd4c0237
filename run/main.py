"""``make run``: compose + validate the config, prepare the run directory, start the ranks.

    python -m run.main [--exp tiny_cpu] [--run-dir DIR] [key=value ...]

Under torchrun / srun (``WORLD_SIZE`` and ``RANK`` set) this process is one rank and ``--run-dir``
must name the directory every rank shares; otherwise it spawns the local ranks itself. Bad input (config,
files, the checkpoint to resume) fails in one line with exit code 2 before any rank starts.
``resume=auto`` without ``--run-dir`` continues the newest unfinished run of the experiment whose config
is the same (``trainer.steps`` may differ); ``resume=<checkpoint>`` continues in that checkpoint's run.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist
import yaml

from checkpointing.checkpoint import checkpoint_from_path
from megatron_backend.parallel import init_distributed
from modelspec.tiny import resolve_model_path
from planner import make_plan
from planner.report import format_table
from run.compose import ConfigError, compose, resolve_path
from run.config import RunConfig
from run.launch import (
    bind_gloo_to_master_interface,
    forked_children_die_with_this_process,
    interface_to,
    launched_externally,
    lost_peer_line,
    missing_devices,
    rank_environ,
    run_launched,
    spawn_local,
)
from run.memory_plan import LaunchPlan, data_prompt_length, plan_inputs, plan_launch
from run.preflight import find_unfinished_run, hold_run_dir, nothing_left, preflight, resume_point


def prepare(cfg: RunConfig, run_dir: str | Path | None) -> Path:
    """Materialize tiny checkpoints, pick and create the run directory, save the composed config."""

    cfg.model.path = resolve_model_path(resolve_path(cfg.model.path))
    if run_dir is None:
        run_dir = Path(resolve_path(cfg.output_dir)) / cfg.exp / time.strftime("%Y%m%d-%H%M%S")
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
    return path


def needs_devices(cfg: RunConfig, overrides: list[str], problem: str) -> int:
    """No devices for this experiment here: print its memory plan, then one line saying what it needs; exit 2."""

    try:
        print(
            format_table(
                make_plan(plan_inputs(cfg, data_prompt_length(cfg).tokens)), title=" ".join([cfg.exp, *overrides])
            )
            + "\n",
            flush=True,
        )
    except ValueError as exc:  # no shape to plan with: the line below still says what is needed
        print(f"(no memory plan: {exc})", flush=True)
    cluster = cfg.cluster
    args = f' ARGS="{" ".join(overrides)}"' if overrides else ""
    print(
        f"error: {cfg.exp} needs {cluster.world_size} x {cluster.device} ({cluster.num_nodes} node(s) x "
        f"{cluster.procs_per_node}) and {problem}; the plan is above. Run it on a cluster: "
        f"`make sbatch EXP={cfg.exp}{args} SUBMIT=1`",
        file=sys.stderr,
    )
    return 2


def pick_run_dir(cfg: RunConfig, given: str | None) -> Path | None:
    """Where the run writes: --run-dir; else the run directory of resume=<checkpoint>; else, for resume=auto,
    the newest unfinished run of this experiment with the same config; else None (a new directory)."""
    if given is not None:
        return Path(given)
    if cfg.resume not in ("auto", "never"):
        try:
            return checkpoint_from_path(cfg.resume).parent.parent  # <run dir>/checkpoints/step_*
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.resume == "auto":
        return find_unfinished_run(cfg, Path(resolve_path(cfg.output_dir)))
    return None


def check_launch(cfg: RunConfig, run_dir: str | None) -> LaunchPlan:
    """What the launcher itself cannot do with this config (raises ConfigError); else the launch's memory plan,
    made here once and handed to every rank (``rollout.gpu_memory_utilization=auto`` resolved)."""
    try:
        launch = plan_launch(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if launched_externally() and run_dir is None:
        raise ConfigError("--run-dir is required under torchrun/srun so all ranks share one")
    if not launched_externally() and cfg.cluster.num_nodes > 1:
        raise ConfigError(
            f"cluster.num_nodes={cfg.cluster.num_nodes} needs a multi-node launcher; "
            "use `make sbatch` (Slurm) or torchrun on each node"
        )
    return launch


def run_launched_rank(cfg: RunConfig, run_dir: str, launch: LaunchPlan) -> int:
    """One rank under torchrun / srun: gloo on the interface that reaches the master (several nodes), every
    rank's host and address known to all, so that a rank whose peer dies names it before it fails."""

    # the launcher checks the input before any rank starts; the rank's loop brings megatron-core (~4 s), transformers
    from run.loop import run_rank

    forked_children_die_with_this_process()  # torchrun / srun stop the ranks; their forked writers too
    chosen = bind_gloo_to_master_interface()
    if chosen is not None and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
        print(f"{socket.gethostname()}: {chosen}", flush=True)
    init_distributed(cfg.cluster.timeout_s)
    rank_hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(rank_hosts, (socket.gethostname(), interface_to(os.environ["MASTER_ADDR"])[1]))
    try:
        return run_rank(cfg, run_dir, launch)
    except Exception as exc:
        line = lost_peer_line(str(exc), rank_hosts, dist.get_rank())
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exp", default="tiny_cpu", help="experiment under experiments/conf/exp/")
    parser.add_argument("--run-dir", default=None, help="shared run directory (required under torchrun/srun)")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. actor.tp=2 rollout.wake_strategy=all_at_once"
    )
    args = parser.parse_args(argv)
    # everything that can be wrong with the input fails here, in one line, before any rank starts
    try:
        cfg = compose(args.exp, args.overrides)
        problem = missing_devices(cfg.cluster, launched_externally())
        if problem is not None:
            return needs_devices(cfg, args.overrides, problem)
        launch = check_launch(cfg, args.run_dir)  # the launch's one memory plan
        cfg.model.path = resolve_model_path(resolve_path(cfg.model.path))
        run_dir = pick_run_dir(cfg, args.run_dir)
        # one live run per directory (under torchrun/srun rank 0 holds it for the job)
        lock = hold_run_dir(run_dir) if run_dir is not None and int(os.environ.get("RANK", "0")) == 0 else None
        preflight(cfg, run_dir, launch)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    state = resume_point(cfg, run_dir)
    done = nothing_left(state.completed_steps, cfg.trainer.steps, run_dir) if state is not None else None
    if done is not None:
        print(done)
        return 0
    run_dir = prepare(cfg, run_dir)
    lock = lock or (hold_run_dir(run_dir) if int(os.environ.get("RANK", "0")) == 0 else None)  # a new directory
    if launched_externally():
        return run_launched(run_launched_rank, cfg.cluster, cfg, str(run_dir), launch)
    resuming = f"; resuming after step {state.completed_steps}" if state is not None else ""
    print(f"run directory: {run_dir}{resuming}", flush=True)
    return spawn_local(local_rank, cfg.cluster.world_size, (cfg, str(run_dir), launch), rank_environ(cfg.cluster))


def local_rank(cfg: RunConfig, run_dir: str, launch: LaunchPlan) -> int:
    """A spawned rank's entry. The loop is imported here, in the ranks, so the launcher never loads megatron-core
    (~4.5 s of CPU): the ranks load it at once instead of waiting for the launcher to load it first."""
    from run.loop import run_rank

    return run_rank(cfg, run_dir, launch)


if __name__ == "__main__":
    sys.exit(main())
