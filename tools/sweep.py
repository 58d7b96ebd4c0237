"""``make sweep`` / ``make sweep-local``: a W&B grid sweep of one experiment, on W&B + Slurm or here, offline.

    python -m tools.sweep create --sweep NAME --exp EXP [--sweep-id ENTITY/PROJECT/ID] [--allow-infeasible]
                                 [--max-parallel N] [key=value ...]
    python -m tools.sweep local  --sweep NAME --exp EXP [key=value ...]

The sweep is ``experiments/sweeps/<NAME>.yaml`` in W&B's sweep format (``method: grid``, ``parameters`` of
``values`` / ``value``, a ``command`` with ``${args_no_hyphens}``). ``key=value`` overrides (make's ARGS) go to
every point, before the point's own. Before anything launches, every point is composed and validated
(:func:`rl.compose.compose`) and planned on the experiment's device (:func:`planner.make_plan`); points that
fail either are listed with the reason instead of run.

``create`` uploads the sweep with ``wandb sweep`` (online; ``--sweep-id`` skips that and renders for an
existing sweep) and renders ``sweep.sbatch``, a Slurm job array with one ``wandb agent --count 1`` per point,
from ``experiments/slurm/sweep.sbatch`` with :mod:`tools.sbatch`'s pieces. ``local`` runs the same grid here,
one point after the other, each as the very command W&B's agent would run (the agent's own macro expansion,
``wandb.sdk.launch.sweeps.utils``) into ``<sweep dir>/<point>/``, then writes ``summary.csv``, ``summary.md``
and ``peak_memory.png`` there: per point the measured peak of every phase, the planner's prediction, the
step time and the reward.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rl.compose import REPO_ROOT, ConfigError, compose
from rl.config import RunConfig
from rl.launch import updated_environ
from rl.memory import PEAK_METRIC
from tools.sbatch import SHELL_SAFE_PATH, fill, gpus_per_node, new_run_dir, resource_lines

SWEEPS_DIR = REPO_ROOT / "experiments" / "sweeps"
ARRAY_TEMPLATE = REPO_ROOT / "experiments" / "slurm" / "sweep.sbatch"
ARGS_MACRO = "${args_no_hyphens}"
# what the sweep's command reads from the environment (${envvar:...}); the array script exports both
EXP_ENV, RUN_DIR_ENV = "RLMEM_EXP", "RLMEM_RUN_DIR"
# measured peak of a phase, max over ranks (rl.memory: CUDA allocator peak + memory outside it; CPU: RSS high-water mark)
MEASURED_METRIC = PEAK_METRIC
_SWEEP_ID = re.compile(r"^[\w.-]+/[\w.-]+/\w+$")
WANDB_SWEEP_TIMEOUT_S = 120
_SHORT = {"gpu_memory_utilization": "util", "wake_strategy": "wake", "kv_cache_bytes": "kv_bytes"}


class SweepError(ValueError):
    """A bad sweep file or sweep request, in one line."""


# ---------------------------------------------------------------- the sweep file and its grid
def load_sweep(name: str) -> dict:
    """``experiments/sweeps/<name>.yaml`` (or a path), checked for what both ``create`` and ``local`` need."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else SWEEPS_DIR / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))
        raise SweepError(f"SWEEP={name!r} is not a sweep; choose one of {names} (experiments/sweeps/)")
    sweep = yaml.safe_load(path.read_text())
    if not isinstance(sweep, dict) or sweep.get("method") != "grid":
        raise SweepError(f"{path}: method must be grid (a W&B sweep file with method: grid)")
    command = sweep.get("command")
    if not isinstance(command, list) or command.count(ARGS_MACRO) != 1:
        raise SweepError(f"{path}: command must be a list holding {ARGS_MACRO} once (the point's Hydra overrides)")
    grid_points(sweep)  # parameters checked here, once
    return sweep


def grid_points(sweep: dict) -> list[dict[str, Any]]:
    """The grid's points in W&B's order: parameters sorted by name, the last one varying fastest.

    W&B's grid search (the ``sweeps`` package: ``grid_search_next_runs``) takes the product of each
    parameter's ``values`` (a ``value`` is one value) over the parameters sorted by name. The installed
    wandb does not expose it itself: its local controller imports that optional package
    (``wandb[sweeps]``, which pulls scipy and scikit-learn), so this expands the same product.
    """
    params = sweep.get("parameters")
    if not isinstance(params, dict) or not params:
        raise SweepError("parameters: a grid needs at least one parameter with values: [...]")
    axes = []
    for key in sorted(params):
        spec = params[key]
        if isinstance(spec, dict) and isinstance(spec.get("values"), list) and spec["values"]:
            axes.append([(key, v) for v in spec["values"]])
        elif isinstance(spec, dict) and "value" in spec:
            axes.append([(key, spec["value"])])
        else:
            raise SweepError(f"parameters.{key}: a grid parameter needs values: [...] or value: (got {spec!r})")
    return [dict(combo) for combo in itertools.product(*axes)]


def with_fixed_overrides(command: list, overrides: list[str]) -> list:
    """The sweep's command with ``overrides`` (every point's) just before the point's own (which win in Hydra)."""
    i = command.index(ARGS_MACRO)
    return [*command[:i], *overrides, *command[i:]]


def point_overrides(point: dict[str, Any]) -> list[str]:
    """The point as W&B's agent passes it: ``${args_no_hyphens}`` (``key=value``, Python's str of the value)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    return create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})["args_no_hyphens"]


def agent_command(sweep: dict, point: dict[str, Any], env: dict[str, str], python: str) -> list[str]:
    """The command line W&B's agent runs for ``point`` (wandb_agent.Agent._command_run, step for step).

    ``${envvar:NAME}`` macros come from ``env`` (the agent: its environment), ``${interpreter}`` is ``python``
    (the agent: ``python`` from PATH), ``${env}`` is /usr/bin/env, ``${args_no_hyphens}`` and the other
    argument macros come from wandb's own ``create_sweep_command_args``.
    """
    from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

    with updated_environ(**env):  # the agent reads ${envvar:NAME} from its own environment
        command = create_sweep_command([str(c) for c in sweep["command"]])
    sweep_vars: dict[str, Any] = create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})
    sweep_vars.update(interpreter=[python], program=[sweep.get("program", "")], env=["/usr/bin/env"])
    out: list[str] = []
    for chunk in command:
        if chunk.startswith("${") and chunk.endswith("}"):
            name = chunk[2:-1]
            if name not in sweep_vars or name == "args_dict":
                raise SweepError(f"command macro {chunk} is not one the agent fills in here; use {ARGS_MACRO}")
            out += [str(v) for v in sweep_vars[name]]
        else:
            out.append(chunk)
    return out


# ---------------------------------------------------------------- validation before launch
@dataclass
class Point:
    index: int
    params: dict[str, Any]
    overrides: list[str]
    cfg: RunConfig | None = None
    plan: Any = None  # planner.Plan
    reason: str | None = None  # why it is not run (infeasible) or why it failed
    status: str = "pending"  # pending | infeasible | ok | failed | not run
    result: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``03_offload.params=True_util=0.5``: the index and each parameter by its short name."""
        parts = [f"{short_key(k)}={v}" for k, v in self.params.items()]
        return re.sub(r"[^\w.=,+-]", "_", f"{self.index:02d}_" + "_".join(parts))


def short_key(key: str) -> str:
    """``actor.offload.params`` -> ``offload.params``, ``rollout.gpu_memory_utilization`` -> ``util``."""
    tail = key.split(".", 1)[-1]
    return _SHORT.get(tail, tail)


def validate(exp: str, fixed: list[str], grid: list[dict[str, Any]]) -> list[Point]:
    """Compose and plan every point on the experiment's device; infeasible ones get their reason."""
    from tqdm import tqdm

    from planner import make_plan
    from planner.report import verdict
    from rl.planning import plan_inputs

    points = []
    for index, params in enumerate(
        tqdm(grid, desc=f"checking points on {exp}", unit="point", leave=False, disable=None)
    ):
        point = Point(index, params, point_overrides(params))
        try:
            point.cfg = compose(exp, [*fixed, *point.overrides])
            point.plan = make_plan(plan_inputs(point.cfg))
        except (ConfigError, ValueError) as exc:
            point.status, point.reason = "infeasible", f"config: {exc}"
        else:
            if not point.plan.fits:
                point.status, point.reason = "infeasible", f"plan on {point.cfg.cluster.device}: {verdict(point.plan)}"
        points.append(point)
    return points


def print_validation(points: list[Point], exp: str, device: str) -> None:
    feasible = [p for p in points if p.status != "infeasible"]
    print(
        f"{len(points)} points, {len(feasible)} fit {exp} on {device} (planner), {len(points) - len(feasible)} do not"
    )
    for p in points:
        if p.status == "infeasible":
            print(f"  skip {p.name}: {p.reason}")


def check_fixed(fixed: list[str], grid: list[dict[str, Any]]) -> None:
    """A key both in ARGS and in the grid would be silently overridden by the grid: say so instead."""
    swept = set(grid[0])
    clash = [o for o in fixed if o.split("=", 1)[0].lstrip("+~") in swept]
    if clash:
        raise SweepError(f"ARGS sets {', '.join(clash)}, which the sweep varies; drop it from ARGS")


# ---------------------------------------------------------------- create: W&B + the Slurm array
def new_sweep_dir(cfg: RunConfig, sweep: str) -> Path:
    """``<output_dir>/<exp>/sweep-<name>-<timestamp>`` beside the experiment's runs."""
    run_dir = new_run_dir(cfg)  # <output_dir>/<exp>/<timestamp>, unique
    return run_dir.parent / f"sweep-{sweep}-{run_dir.name}"


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


def wandb_sweep(config_path: Path, project: str, entity: str | None) -> str:
    """``wandb sweep`` -> ``entity/project/id``; raises SweepError with wandb's own reason in one line."""
    cmd = [sys.executable, "-m", "wandb", "sweep", "--project", project, *(["--entity", entity] if entity else [])]
    try:
        proc = subprocess.run(
            [*cmd, str(config_path)],
            capture_output=True,
            text=True,
            timeout=WANDB_SWEEP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise SweepError(f"wandb sweep got no answer from W&B in {WANDB_SWEEP_TIMEOUT_S} s (no network?)") from None
    text = proc.stdout + proc.stderr
    match = re.search(r"wandb agent (\S+/\S+/\w+)", text)
    if proc.returncode != 0 or not match:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "debug-cli" not in ln]
        why = next((ln for ln in reversed(lines) if "rror" in ln), lines[-1] if lines else f"exit {proc.returncode}")
        raise SweepError(f"wandb sweep failed ({why}); it needs network and a W&B API key (`wandb login`)")
    return match.group(1)


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


# ---------------------------------------------------------------- local: run the points here
def run_point(point: Point, command: list[str], run_dir: Path, progress) -> None:
    """One point as a subprocess (its own session, so an interrupt stops its ranks too); output to a log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "sweep_point.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(shlex.quote(c) for c in command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while proc.poll() is None:
                progress.set_postfix_str(f"{point.name} {time.monotonic() - start:.0f}s", refresh=True)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)  # the point's own session: rl.main and its ranks
            proc.wait()
            raise
    point.result = collect_result(run_dir)
    point.result["wall_seconds"] = time.monotonic() - start
    if proc.returncode == 0 and (run_dir / "summary.json").is_file():
        point.status = "ok"
    else:
        point.status, point.reason = "failed", f"exit {proc.returncode}: {last_error_line(log_path)} (log {log_path})"


def last_error_line(log_path: Path) -> str:
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()[1:] if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower() or ln.startswith("rank "):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def collect_result(run_dir: Path) -> dict:
    """What a finished run directory measured: per-phase peaks (max over ranks), step time, reward."""
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    timeline = run_dir / "memory_timeline.csv"
    if timeline.is_file():
        peaks: dict[str, int] = {}
        with open(timeline, newline="") as f:
            for row in csv.DictReader(f):
                value = int(float(row[MEASURED_METRIC]))
                peaks[row["phase"]] = max(peaks.get(row["phase"], 0), value)
        out["measured"] = peaks
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        step_seconds = [sum(v for k, v in m.items() if k.startswith("time/")) for m in steps]
        if step_seconds:
            out["step_seconds"] = statistics.median(step_seconds)
    summary = run_dir / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        out["reward"] = data.get("reward_last5")
        out["steps"] = data.get("steps")
        # the plan the run made before its engine started (the task's real prompt lengths, the KV cache
        # the engine got): a sharper prediction than the launch-time check's worst case
        phases = (data.get("memory_plan") or {}).get("phases") or {}
        if phases:
            out["predicted"] = {phase: v["predicted_bytes"] for phase, v in phases.items()}
    return out


def local(args: argparse.Namespace, sweep: dict, grid: list[dict[str, Any]]) -> int:
    from tqdm import tqdm

    from rl.launch import missing_devices

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
    previous_handler = signal.signal(signal.SIGTERM, _interrupt)  # scancel / kill: stop the running point, keep the table
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
    print(format_compact(rows, list(grid[0])))
    write_csv(rows, sweep_dir / "summary.csv")
    write_markdown(rows, list(grid[0]), sweep_dir / "summary.md", title=f"{args.sweep} on {args.exp}")
    plot_peaks(
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


# ---------------------------------------------------------------- the summary table and plot
def table_rows(points: list[Point]) -> list[dict[str, Any]]:
    """One flat row per point (the CSV's columns); byte figures are ints, missing ones None."""
    from planner import PHASES

    rows = []
    for p in points:
        measured = p.result.get("measured", {})
        row: dict[str, Any] = {"index": p.index, "point": p.name, **p.params, "status": p.status}
        predicted = {ph.name: ph.predicted_bytes for ph in p.plan.phases} if p.plan is not None else {}
        predicted = p.result.get("predicted") or predicted  # the run's own plan, when it ran
        row["predicted_peak_bytes"] = max(predicted.values()) if predicted else None
        row["predicted_peak_phase"] = max(predicted, key=predicted.get) if predicted else None
        row["measured_peak_bytes"] = max(measured.values()) if measured else None
        row["measured_peak_phase"] = max(measured, key=measured.get) if measured else None
        row["step_seconds"] = p.result.get("step_seconds")
        row["reward"] = p.result.get("reward")
        for phase in PHASES:
            row[f"measured_{phase}_bytes"] = measured.get(phase)
        for phase in PHASES:
            row[f"predicted_{phase}_bytes"] = predicted.get(phase)
        row["reason"] = p.reason or ""
        row["run_dir"] = p.result.get("run_dir", "")
        rows.append(row)
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)


def _unit(rows: list[dict[str, Any]]) -> tuple[str, int]:
    """GiB when any figure reaches 10 GiB, else MiB (CPU runs of tiny models)."""
    figures = [v for r in rows for k, v in r.items() if k.endswith("_bytes") and isinstance(v, int)]
    return ("GiB", 2**30) if figures and max(figures) >= 10 * 2**30 else ("MiB", 2**20)


def _fmt(value: Any, scale: int | None = None) -> str:
    if value is None or value == "":
        return "-"
    if scale is not None:
        return f"{value / scale:.2f}" if scale == 2**30 else f"{value / scale:.0f}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _table(header: list[str], body: list[list[str]]) -> str:
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in body)]
    )


def write_markdown(rows: list[dict[str, Any]], params: list[str], path: Path, title: str) -> None:
    """Every phase's measured peak, the predicted peak, step time and reward; reasons listed below."""
    from planner import PHASES

    unit, scale = _unit(rows)
    short = [short_key(k) for k in params]
    header = ["#", *short, "status", f"predicted peak {unit}", f"measured peak {unit}", *PHASES, "step s", "reward"]
    body = [
        [
            str(r["index"]),
            *(_fmt(r[k]) for k in params),
            r["status"],
            f"{_fmt(r['predicted_peak_bytes'], scale)} ({r['predicted_peak_phase'] or '-'})",
            f"{_fmt(r['measured_peak_bytes'], scale)} ({r['measured_peak_phase'] or '-'})",
            *(_fmt(r[f"measured_{ph}_bytes"], scale) for ph in PHASES),
            _fmt(r["step_seconds"]),
            _fmt(r["reward"]),
        ]
        for r in rows
    ]
    notes = [f"- {r['point']}: {r['status']}: {r['reason']}" for r in rows if r["reason"]]
    text = [
        f"# Sweep {title}",
        "",
        f"Measured: the max over ranks of `{MEASURED_METRIC}` in each phase (CUDA: the allocator's peak plus what the device holds "
        f"outside it; CPU: the process's RSS high-water mark over its start), in {unit}. Predicted: the plan the run made before its engine started (summary.json memory_plan; for points not run, the launch-time check on the experiment's device). Step time: the median "
        "over steps of the phases' seconds. Reward: mean of the last 5 steps.",
        "",
        _table(header, body),
        *(["", "Not run or failed:", "", *notes] if notes else []),
        "",
    ]
    path.write_text("\n".join(text))


def format_compact(rows: list[dict[str, Any]], params: list[str]) -> str:
    """The printed table: the measured peaks of rollout, train and the wake window instead of every phase."""
    from modelspec.phases import wake_window_phases

    unit, scale = _unit(rows)
    window = wake_window_phases()
    header = [
        "#",
        *(short_key(k) for k in params),
        "status",
        f"predicted {unit}",
        f"measured {unit}",
        "rollout",
        "train",
        "wake window",
        "step s",
        "reward",
    ]
    body = []
    for r in rows:
        wake = [r[f"measured_{ph}_bytes"] for ph in window if r[f"measured_{ph}_bytes"] is not None]
        body.append(
            [
                str(r["index"]),
                *(_fmt(r[k]) for k in params),
                r["status"],
                f"{_fmt(r['predicted_peak_bytes'], scale)} {r['predicted_peak_phase'] or ''}".strip(),
                f"{_fmt(r['measured_peak_bytes'], scale)} {r['measured_peak_phase'] or ''}".strip(),
                _fmt(r["measured_rollout_bytes"], scale),
                _fmt(r["measured_train_bytes"], scale),
                _fmt(max(wake) if wake else None, scale),
                _fmt(r["step_seconds"]),
                _fmt(r["reward"]),
            ]
        )
    return _table(header, body)


def plot_peaks(rows: list[dict[str, Any]], params: list[str], path: Path, title: str) -> None:
    """Peak memory per point (x: the swept utilization / offload / wake values): predicted and measured bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = _unit(rows)
    # tick labels: the index, then each swept value by its last key part (params=True, util=0.5, wake=staged)
    labels = [f"{r['index']}\n" + "\n".join(f"{short_key(k).rsplit('.', 1)[-1]}={r[k]}" for k in params) for r in rows]
    x = range(len(rows))
    width = 0.4
    fig, ax = plt.subplots(figsize=(min(48.0, max(7.0, 1.3 * len(rows) + 2)), 6.0))
    predicted = [(r["predicted_peak_bytes"] or 0) / scale for r in rows]
    measured = [(r["measured_peak_bytes"] or 0) / scale for r in rows]
    colors = ["tab:gray" if r["status"] == "infeasible" else "tab:blue" for r in rows]
    ax.bar(
        [i - width / 2 for i in x],
        predicted,
        width,
        color=colors,
        alpha=0.6,
        hatch="//",
        label="predicted peak (planner)",
    )
    ax.bar(
        [i + width / 2 for i in x],
        measured,
        width,
        color="tab:orange",
        label=f"measured peak ({MEASURED_METRIC}: NVML used on CUDA, RSS on CPU)",
    )
    for i, r in enumerate(rows):
        if r["status"] != "ok":
            ax.text(i, max(predicted[i], measured[i]), r["status"], ha="center", va="bottom", fontsize=8, rotation=90)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel(f"peak per rank ({unit})")
    ax.set_ylim(0, 1.25 * max([*predicted, *measured, 1e-9]))  # room above the bars for the legend and labels
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
