"""``make run``: compose + validate the config, prepare the run directory, start the ranks.

    python -m rl.main [--exp tiny_cpu] [--run-dir DIR] [key=value ...]

Under torchrun / srun (``WORLD_SIZE`` and ``RANK`` set) this process is one rank and ``--run-dir``
must name the directory every rank shares; otherwise it spawns the local ranks itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from modelspec.tiny import resolve_model_path
from rl.compose import ConfigError, compose, resolve_path
from rl.config import RunConfig
from rl.launch import launched_externally, missing_devices, spawn_local


def prepare(cfg: RunConfig, run_dir: str | None) -> Path:
    """Materialize tiny checkpoints, pick and create the run directory, save the composed config."""
    import yaml

    cfg.model.path = resolve_model_path(resolve_path(cfg.model.path))
    if run_dir is None:
        run_dir = Path(resolve_path(cfg.output_dir)) / cfg.exp / time.strftime("%Y%m%d-%H%M%S")
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
    return path


def needs_devices(cfg: RunConfig, overrides: list[str], problem: str) -> int:
    """No devices for this experiment here: print its memory plan, then one line saying what it needs; exit 2."""
    from planner import make_plan
    from planner.report import format_table
    from rl.planning import plan_inputs

    try:
        print(format_table(make_plan(plan_inputs(cfg)), title=" ".join([cfg.exp, *overrides])) + "\n", flush=True)
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


def recommended_utilization(cfg: RunConfig) -> str:
    """The planner's gpu_memory_utilization for ``cfg`` (a placeholder when it cannot plan)."""
    from planner import make_plan
    from rl.planning import plan_inputs

    try:
        return str(make_plan(plan_inputs(cfg)).recommended_gpu_memory_utilization)
    except ValueError:
        return "0.5"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exp", default="tiny_cpu", help="experiment under experiments/conf/exp/")
    parser.add_argument("--run-dir", default=None, help="shared run directory (required under torchrun/srun)")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. actor.tp=2 rollout.wake_strategy=all_at_once"
    )
    args = parser.parse_args(argv)
    try:
        cfg = compose(args.exp, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    problem = missing_devices(cfg.cluster, launched_externally())
    if problem is not None:
        return needs_devices(cfg, args.overrides, problem)
    if cfg.rollout.gpu_memory_utilization == "auto":
        print(
            "config error: rollout.gpu_memory_utilization=auto needs the memory planner's KV budget, which make run "
            f"does not hand the engine yet; set a float in (0, 1], e.g. rollout.gpu_memory_utilization="
            f"{recommended_utilization(cfg)} (what `make plan EXP={cfg.exp}` recommends)",
            file=sys.stderr,
        )
        return 2
    from rl.loop import run_rank

    if launched_externally():
        if args.run_dir is None:
            print("config error: --run-dir is required under torchrun/srun so all ranks share one", file=sys.stderr)
            return 2
        run_dir = prepare(cfg, args.run_dir)
        run_rank(cfg, str(run_dir))
        return 0
    if cfg.cluster.num_nodes > 1:
        print(
            f"config error: cluster.num_nodes={cfg.cluster.num_nodes} needs a multi-node launcher; "
            "use `make sbatch` (Slurm) or torchrun on each node",
            file=sys.stderr,
        )
        return 2
    run_dir = prepare(cfg, args.run_dir)
    print(f"run directory: {run_dir}", flush=True)
    return spawn_local(run_rank, cfg.cluster.world_size, (cfg, str(run_dir)))


if __name__ == "__main__":
    sys.exit(main())
