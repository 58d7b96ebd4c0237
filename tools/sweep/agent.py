"""W&B glue: the command line W&B's agent runs for a point (its own macro expansion), and ``wandb sweep``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from run.launch import updated_environ
from tools.sweep.grid import ARGS_MACRO, SweepError

# what the sweep's command reads from the environment (${envvar:...}); the array script exports both
EXP_ENV, RUN_DIR_ENV = "RLMEM_EXP", "RLMEM_RUN_DIR"
WANDB_SWEEP_TIMEOUT_S = 120


def point_overrides(point: dict[str, Any]) -> list[str]:
    """The point as W&B's agent passes it: ``${args_no_hyphens}`` (``key=value``, Python's str of the value)."""
    # optional: W&B is imported where it is used, not every install has it
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    return create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})["args_no_hyphens"]


def agent_command(sweep: dict, point: dict[str, Any], env: dict[str, str], python: str) -> list[str]:
    """The command line W&B's agent runs for ``point`` (wandb_agent.Agent._command_run, step for step).

    ``${envvar:NAME}`` macros come from ``env`` (the agent: its environment), ``${interpreter}`` is ``python``
    (the agent: ``python`` from PATH), ``${env}`` is /usr/bin/env, ``${args_no_hyphens}`` and the other
    argument macros come from wandb's own ``create_sweep_command_args``.
    """
    # optional: W&B is imported where it is used, not every install has it
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
