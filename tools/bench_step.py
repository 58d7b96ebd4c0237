"""``make bench-step``: the step of two or more commits (or configs) measured in alternating runs on this machine.

The machine's speed drifts by up to 1.4x within minutes, so one run of each side compares nothing: the
sides run in turn, the order reversed every repeat (A B C C B A A B C ...), and each figure is the median over a
side's runs; ``over_first`` divides each side's medians by the first side's. Per run: the run's own
``summary.json`` (median step seconds and each phase's median, steps 1.. after the warm-up), the wall time of
the side's ``make run`` from start to exit, and what the kernel charged to it and its ranks (``getrusage`` of
the reaped children: user and system seconds, minor page faults). A commit runs its own ``make run`` recipe
from a detached ``git worktree`` of it with this checkout's venv; a config is this checkout with its overrides. One JSON object on stdout;
progress on stderr.

    python -m tools.bench_step --commits 20932f8 120ac35 HEAD [--repeats 3] [--exp tiny_cpu] [overrides ...]
    python -m tools.bench_step --configs "actor.recompute=none" "actor.recompute=full" [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, kw_only=True)
class Side:
    """One side of the comparison: the code it runs (``repo``) and its overrides."""

    label: str
    repo: Path
    overrides: tuple[str, ...] = ()
    commit: str = ""


@dataclass(kw_only=True)
class RunFigures:
    wall_seconds: float
    user_seconds: float
    system_seconds: float
    minor_page_faults: int
    step_median_seconds: float
    phase_median_seconds: dict[str, float] = field(default_factory=dict)


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def machine_speed_seconds() -> float:
    """The project's machine-speed figure: ``sum(range(10**6))`` in this interpreter, best of 5."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        sum(range(10**6))
        best = min(best, time.perf_counter() - start)
    return best


def run_once(side: Side, exp: str, out_dir: Path, common: list[str]) -> RunFigures:
    """One ``make run`` of ``side`` (its own Makefile's recipe: the entry point moved between commits), with
    this checkout's venv: its figures, from the run's summary and the kernel's rusage."""
    env = {**os.environ, "PYTHONPATH": str(side.repo)}  # the side's packages before the venv's editable install
    overrides = [*common, *side.overrides, f"output_dir={out_dir}"]
    venv = Path(sys.executable).parent.parent
    cmd = ["make", "-s", "-C", str(side.repo), "run", f"EXP={exp}", f"VENV={venv}", f"ARGS={shlex.join(overrides)}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summaries = sorted(out_dir.glob(f"{exp}/*/summary.json"))
    if proc.returncode != 0 or len(summaries) != 1:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise SystemExit(f"error: {side.label}'s run failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    times = json.loads(summaries[0].read_text())["time"]
    return RunFigures(
        wall_seconds=wall,
        user_seconds=after.ru_utime - before.ru_utime,
        system_seconds=after.ru_stime - before.ru_stime,
        minor_page_faults=after.ru_minflt - before.ru_minflt,
        step_median_seconds=times["step_median_seconds"],
        phase_median_seconds=times["phase_median_seconds"],
    )


def medians(runs: list[RunFigures]) -> dict:
    phases = sorted({p for r in runs for p in r.phase_median_seconds})
    return {
        "runs": len(runs),
        "step_median_seconds": statistics.median(r.step_median_seconds for r in runs),
        "wall_seconds": statistics.median(r.wall_seconds for r in runs),
        "user_seconds": statistics.median(r.user_seconds for r in runs),
        "system_seconds": statistics.median(r.system_seconds for r in runs),
        "minor_page_faults": int(statistics.median(r.minor_page_faults for r in runs)),
        "phase_median_seconds": {
            p: statistics.median(r.phase_median_seconds[p] for r in runs if p in r.phase_median_seconds) for p in phases
        },
        "each_run": [
            {
                "step_median_seconds": r.step_median_seconds,
                "wall_seconds": r.wall_seconds,
                "system_seconds": r.system_seconds,
            }
            for r in runs
        ],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="make bench-step", description=__doc__.split("\n\n")[0])
    sides = parser.add_mutually_exclusive_group(required=True)
    sides.add_argument("--commits", nargs="+", metavar="REV", help="two or more git revisions of this repository")
    sides.add_argument(
        "--configs", nargs="+", metavar="OVERRIDES", help="two or more quoted override lists, this checkout"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side (alternating; default 3)")
    parser.add_argument("--exp", default="tiny_cpu", help="experiment (default tiny_cpu, what make run runs)")
    parser.add_argument("overrides", nargs="*", help="overrides for both sides, e.g. trainer.steps=8")
    return parser


def make_sides(args: argparse.Namespace, scratch: Path) -> list[Side]:
    """The sides, in the order given; a commit is checked out as a detached worktree under ``scratch`` (removed after)."""
    if args.configs:
        return [Side(label=c or "(none)", repo=REPO, overrides=tuple(shlex.split(c))) for c in args.configs]
    sides = []
    for n, rev in enumerate(args.commits):
        try:
            commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
        except subprocess.CalledProcessError:
            raise SystemExit(f"error: --commits: {rev!r} is not a commit of {REPO}") from None
        tree = scratch / f"side{n}"
        git("worktree", "add", "--detach", str(tree), commit)
        sides.append(Side(label=rev, repo=tree, commit=commit[:12]))
    return sides


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.commits or args.configs) < 2:
        raise SystemExit("error: --commits/--configs: give two or more sides to compare")
    if len(set(args.commits or args.configs)) < len(args.commits or args.configs):
        raise SystemExit("error: --commits/--configs: a side is given twice (each side's label must be unique)")
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be >= 1 (runs of each side)")
    if not (REPO / "experiments" / "conf" / "exp" / f"{args.exp}.yaml").is_file():
        raise SystemExit(f"error: --exp {args.exp!r}: no experiments/conf/exp/{args.exp}.yaml")
    results: dict[str, list[RunFigures]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        scratch = Path(tmp)
        sides = make_sides(args, scratch)
        try:
            for repeat in range(args.repeats):
                for side in sides if repeat % 2 == 0 else sides[::-1]:  # A B C C B A ...: no side always first
                    print(
                        f"bench-step: run {repeat + 1}/{args.repeats} of {side.label} ...", file=sys.stderr, flush=True
                    )
                    out_dir = scratch / f"run_{sides.index(side)}_{repeat}"
                    figures = run_once(side, args.exp, out_dir, list(args.overrides))
                    results.setdefault(side.label, []).append(figures)
                    print(
                        f"bench-step:   step {figures.step_median_seconds:.2f} s, wall {figures.wall_seconds:.0f} s,"
                        f" system {figures.system_seconds:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            for side in sides:
                if side.repo != REPO:
                    subprocess.run(["git", "worktree", "remove", "--force", str(side.repo)], cwd=REPO, check=False)
    figures = {s.label: medians(results[s.label]) for s in sides}
    first = figures[sides[0].label]
    ratio_of = ("step_median_seconds", "wall_seconds", "system_seconds", "minor_page_faults")
    out = {
        "bench": "step",
        "exp": args.exp,
        "overrides": list(args.overrides),
        "machine_speed_seconds": machine_speed_seconds(),
        "head": git("rev-parse", "--short=12", "HEAD"),
        "sides": {s.label: {"commit": s.commit, "overrides": list(s.overrides), **figures[s.label]} for s in sides},
        "over_first": {s.label: {k: figures[s.label][k] / max(first[k], 1e-9) for k in ratio_of} for s in sides[1:]},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
