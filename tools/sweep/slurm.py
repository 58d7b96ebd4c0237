"""``create``: upload the sweep to W&B and render the Slurm job array of agents (one ``wandb agent --count 1``
per task) from ``experiments/slurm/sweep.sbatch`` with :mod:`tools.sbatch`'s pieces."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from modelspec.tiny import resolve_model_path
from run.compose import REPO_ROOT, compose, resolve_path
from run.config import RunConfig
from tools.sbatch import SHELL_SAFE_PATH, fill, gpus_per_node, resource_lines
from tools.sweep.agent import EXP_ENV, RUN_DIR_ENV, wandb_sweep
from tools.sweep.grid import SweepError, new_sweep_dir, with_fixed_overrides
from tools.sweep.points import print_validation, validate

ARRAY_TEMPLATE = REPO_ROOT / "experiments" / "slurm" / "sweep.sbatch"
_SWEEP_ID = re.compile(r"^[\w.-]+/[\w.-]+/\w+$")


def render_array(
    cfg: RunConfig,
    sweep: str,
    sweep_id: str,
    num_tasks: int,
    sweep_dir: Path,
    python: str,
    environ: dict[str, str],
    max_parallel: int | None = None,
) -> str:
    """The job array script: ``num_tasks`` tasks, each one ``wandb agent --count 1 <sweep_id>`` on one node."""
    if not _SWEEP_ID.match(sweep_id):
        raise SweepError(f"sweep id {sweep_id!r} is not <entity>/<project>/<id>")
    if not SHELL_SAFE_PATH.match(str(sweep_dir)):
        raise SweepError(f"sweep directory {sweep_dir} has characters #SBATCH lines cannot carry")
    if num_tasks < 1:
        raise SweepError("no point to run: the array would be empty")
    if max_parallel is not None and max_parallel < 1:
        raise SweepError(f"--max-parallel={max_parallel} must be >= 1")
    array = f"1-{num_tasks}" + (f"%{max_parallel}" if max_parallel else "")
    values = {
        "sweep": sweep,
        "sweep_id": sweep_id,
        "exp": shlex.quote(cfg.exp),
        "script": str(sweep_dir / "sweep.sbatch"),
        "job_name": f"rlmem-sweep-{sweep}",
        "num_tasks": str(num_tasks),
        "array": array,
        "procs_per_node": str(cfg.cluster.procs_per_node),
        "resources": "\n".join(resource_lines(cfg, environ)),
        "sweep_dir": str(sweep_dir),
        "repo": shlex.quote(str(REPO_ROOT)),
        "python": shlex.quote(python),
    }
    return fill(ARRAY_TEMPLATE.read_text(), values)


def create(args: argparse.Namespace, sweep: dict, grid: list[dict[str, Any]]) -> int:
    base = compose(args.exp, args.overrides)
    if base.cluster.num_nodes > 1:
        raise SweepError(
            f"{args.exp} has cluster.num_nodes={base.cluster.num_nodes}: a sweep runs one agent per array task on "
            "one node; sweep a one-node experiment"
        )
    points = validate(args.exp, args.overrides, grid)
    print_validation(points, args.exp, base.cluster.device)
    infeasible = [p for p in points if p.status == "infeasible"]
    if infeasible and not args.allow_infeasible:
        raise SweepError(
            f"{len(infeasible)} of {len(points)} points do not fit (listed above) and W&B's grid cannot skip points: "
            "narrow the values, run the rest with make sweep-local, or pass ALLOW_INFEASIBLE=1"
        )
    sweep_dir = new_sweep_dir(base, args.sweep)
    sweep_dir.mkdir(parents=True)
    uploaded = dict(sweep, name=f"{args.sweep}-{args.exp}", description=f"rlmem sweep {args.sweep} over {args.exp}")
    uploaded["command"] = with_fixed_overrides(sweep["command"], ["wandb.mode=online", *args.overrides])
    config_path = sweep_dir / "sweep.yaml"
    config_path.write_text(yaml.safe_dump(uploaded, sort_keys=False))
    try:
        sweep_id = args.sweep_id or wandb_sweep(config_path, base.wandb.project, base.wandb.entity)
    except SweepError:
        shutil.rmtree(sweep_dir)  # nothing was created: leave nothing behind
        raise
    for model_path in sorted({p.cfg.model.path for p in points if p.cfg is not None}):
        resolve_model_path(resolve_path(model_path))  # tiny checkpoints exist before the array's tasks start
    text = render_array(
        base, args.sweep, sweep_id, len(points), sweep_dir, sys.executable, dict(os.environ), args.max_parallel
    )
    script = sweep_dir / "sweep.sbatch"
    script.write_text(text)
    script.chmod(0o755)
    gpus = gpus_per_node(base)
    print(f"sweep {sweep_id}: {len(points)} points ({sweep_dir / 'sweep.yaml'})")
    print(
        f"rendered {script}: array of {len(points)} tasks, 1 node x {base.cluster.procs_per_node} ranks each"
        f" ({f'{gpus} GPUs' if gpus else 'CPU'})"
    )
    print(f"one agent by hand: {EXP_ENV}={args.exp} {RUN_DIR_ENV}={sweep_dir}/manual wandb agent --count 1 {sweep_id}")
    print(f"all points on Slurm: sbatch {script}")
    return 0
