"""The sweep file (``experiments/sweeps/<name>.yaml``, W&B's format), its grid in W&B's order, and where a
sweep writes."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import yaml

from run.compose import REPO_ROOT
from run.config import RunConfig
from tools.sbatch import new_run_dir

SWEEPS_DIR = REPO_ROOT / "experiments" / "sweeps"
ARGS_MACRO = "${args_no_hyphens}"
_SHORT = {"gpu_memory_utilization": "util", "wake_strategy": "wake", "kv_cache_bytes": "kv_bytes"}


class SweepError(ValueError):
    """A bad sweep file or sweep request, in one line."""


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


def check_fixed(fixed: list[str], grid: list[dict[str, Any]]) -> None:
    """A key both in ARGS and in the grid would be silently overridden by the grid: say so instead."""
    swept = set(grid[0])
    clash = [o for o in fixed if o.split("=", 1)[0].lstrip("+~") in swept]
    if clash:
        raise SweepError(f"ARGS sets {', '.join(clash)}, which the sweep varies; drop it from ARGS")


def short_key(key: str) -> str:
    """``actor.offload.params`` -> ``offload.params``, ``rollout.gpu_memory_utilization`` -> ``util``."""
    tail = key.split(".", 1)[-1]
    return _SHORT.get(tail, tail)


def new_sweep_dir(cfg: RunConfig, sweep: str) -> Path:
    """``<output_dir>/<exp>/sweep-<name>-<timestamp>`` beside the experiment's runs."""
    run_dir = new_run_dir(cfg)  # <output_dir>/<exp>/<timestamp>, unique
    return run_dir.parent / f"sweep-{sweep}-{run_dir.name}"
