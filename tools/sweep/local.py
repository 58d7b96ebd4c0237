"""``local``: the grid run here, offline, point after point (infeasible points skipped), then the summary."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import yaml
from tqdm import tqdm

from run.compose import compose
from run.launch import missing_devices
from tools.sweep.agent import EXP_ENV, RUN_DIR_ENV, agent_command
from tools.sweep.grid import new_sweep_dir, with_fixed_overrides
from tools.sweep.points import print_validation, validate
from tools.sweep.summary import format_table, plot_figures, table_rows, write_csv, write_markdown
from tools.sweep.trial import run_point


def local(args: argparse.Namespace, sweep: dict, grid: list[dict[str, Any]]) -> int:

    base = compose(args.exp, args.overrides)
    points = validate(args.exp, args.overrides, grid)
    print_validation(points, args.exp, base.cluster.device)
    sweep_dir = new_sweep_dir(base, args.sweep)
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.yaml").write_text(
        yaml.safe_dump(dict(sweep, exp=args.exp, args=args.overrides), sort_keys=False)
    )
    problem = missing_devices(base.cluster, external=False)
    runnable = [p for p in points if p.status != "infeasible"]
    if problem is not None:
        for p in runnable:
            p.status, p.reason = "not run", f"needs {base.cluster.world_size} x {base.cluster.device}: {problem}"
        runnable = []
    command = with_fixed_overrides(sweep["command"], args.overrides)
    print(f"sweep directory: {sweep_dir}", flush=True)
    interrupted = False
    previous_handler = signal.signal(
        signal.SIGTERM, _interrupt
    )  # scancel / kill: stop the running point, keep the table
    progress = tqdm(runnable, desc=f"{args.sweep} on {args.exp}", unit="point", dynamic_ncols=True, disable=None)
    try:
        for point in progress:
            run_dir = sweep_dir / point.name
            env = {EXP_ENV: args.exp, RUN_DIR_ENV: str(run_dir)}
            run_point(
                point, agent_command(dict(sweep, command=command), point.params, env, sys.executable), run_dir, progress
            )
            tail = f"in {point.result['wall_seconds']:.0f} s" if point.status == "ok" else point.reason
            progress.write(f"[{runnable.index(point) + 1}/{len(runnable)}] {point.name}: {point.status} {tail}")
    except KeyboardInterrupt:
        interrupted = True
        for p in runnable:
            if p.status == "pending":
                p.status, p.reason = "not run", "interrupted"
    finally:
        progress.close()
        signal.signal(signal.SIGTERM, previous_handler)
    rows = table_rows(points)
    print(format_table(rows, list(grid[0])))
    write_csv(rows, sweep_dir / "summary.csv")
    write_markdown(rows, list(grid[0]), sweep_dir / "summary.md", title=f"{args.sweep} on {args.exp}")
    plot_figures(
        rows, list(grid[0]), sweep_dir / "peak_memory.png", title=f"{args.sweep} on {args.exp} ({base.cluster.device})"
    )
    print(f"wrote {sweep_dir / 'summary.csv'}, {sweep_dir / 'summary.md'}, {sweep_dir / 'peak_memory.png'}")
    if interrupted:
        return 130
    if problem is not None:
        print(
            f"error: {args.exp} needs {base.cluster.world_size} x {base.cluster.device} and {problem}: nothing ran "
            f"(the table has the planner's predictions); on the cluster: make sweep SWEEP={args.sweep} EXP={args.exp}",
            file=sys.stderr,
        )
        return 2
    return 1 if any(p.status == "failed" for p in points) else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
