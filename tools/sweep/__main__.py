"""``python -m tools.sweep create|local``: the command line of :mod:`tools.sweep`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tools.sweep
from run.compose import ConfigError
from tools.sweep.grid import SweepError, check_fixed, grid_points, load_sweep
from tools.sweep.local import local
from tools.sweep.slurm import create


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.sweep", description=tools.sweep.__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    for action, text in (("create", "create the W&B sweep and render the Slurm array"), ("local", "run the grid here")):
        p = sub.add_parser(action, help=text)
        p.add_argument("--sweep", required=True, help="sweep under experiments/sweeps/ (or a .yaml path)")
        p.add_argument("--exp", default="tiny_cpu", help="experiment under experiments/conf/exp/")
        p.add_argument("overrides", nargs="*", help="Hydra overrides for every point (make's ARGS)")
        if action == "create":
            p.add_argument("--sweep-id", default=None, help="render for this existing sweep (entity/project/id)")
            p.add_argument("--allow-infeasible", action="store_true", help="create it even with infeasible points")
            p.add_argument("--max-parallel", type=int, default=None, help="at most this many array tasks at once")
    args = parser.parse_args(argv)
    try:
        sweep = load_sweep(args.sweep)
        args.sweep = Path(args.sweep).stem  # a path names the sweep by its file
        grid = grid_points(sweep)
        check_fixed(args.overrides, grid)
        return (create if args.action == "create" else local)(args, sweep, grid)
    except (ConfigError, SweepError) as exc:
        print(f"{'config error' if isinstance(exc, ConfigError) else 'error'}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
