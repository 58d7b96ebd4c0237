"""``make sbatch``: render (and with ``--submit`` submit) the Slurm batch script of one experiment.

    python -m tools.sbatch --exp NAME [--nodes N] [--submit] [key=value ...]

Composes and validates the experiment exactly as ``make run`` does (``run.compose.compose``), prepares
``runs/<exp>/<timestamp>/`` (config.yaml, tiny checkpoints if any) and writes ``job.sbatch`` there from
``experiments/slurm/job.sbatch``. Nodes and ranks per node come from ``cluster.num_nodes`` (or ``--nodes``)
and ``cluster.procs_per_node``; time, partition and account from ``cluster.slurm_*``, else from
``SBATCH_TIMELIMIT`` / ``SBATCH_PARTITION`` / ``SBATCH_ACCOUNT`` (which sbatch also honours at submit time).

A rendered template rather than submitit: the script must be readable and ``bash -n``-checkable before
it is submitted, rerun as is by ``--requeue``, and start torchrun (c10d rendezvous) once per node; see
the README's Slurm section.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from planner import device_preset
from run.compose import REPO_ROOT, ConfigError, compose, resolve_path
from run.config import RunConfig
from run.main import prepare

TEMPLATE = REPO_ROOT / "experiments" / "slurm" / "job.sbatch"
SCRIPT_NAME = "job.sbatch"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# seconds the batch shell keeps for itself after USR1 (requeue, logging) before the time limit
REQUEUE_MARGIN_S = 20
# #SBATCH lines are not shell-parsed, so paths and values in them must need no quoting
SHELL_SAFE_PATH = re.compile(r"^[\w@+=:,./-]+$")


class SbatchError(ValueError):
    """Bad input to ``make sbatch`` that is not a config problem (e.g. no sbatch here)."""


def slurm_time_seconds(text: str, key: str) -> int:
    """A Slurm time limit (``minutes``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM[:SS]``) in seconds."""
    match = _SLURM_TIME.match(text.strip())
    if not match:
        raise ConfigError(f"{key}={text!r} is not a Slurm time limit; use e.g. 90 (minutes), 04:00:00 or 1-12:00:00")
    days, first, second, third = (int(g) if g else None for g in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)
    if third is not None:  # HH:MM:SS
        return first * 3600 + second * 60 + third
    if second is not None:  # MM:SS
        return first * 60 + second
    return first * 60  # minutes


def _setting(value: str | None, key: str, env: str, environ: dict[str, str]) -> tuple[str | None, str]:
    """A Slurm setting from the config, else the environment; returns (value, where it came from)."""
    value, source = (value, f"cluster.{key}") if value is not None else (environ.get(env) or None, env)
    if value is None:
        return None, ""
    if not SHELL_SAFE_PATH.match(value):  # it goes on an #SBATCH line as is
        raise ConfigError(f"{source}={value!r} has characters an #SBATCH line cannot carry")
    return value, source


def gpus_per_node(cfg: RunConfig) -> int:
    """GPUs to request per node: cluster.slurm_gpus_per_node, else one per rank when the ranks run on a CUDA
    device (cluster.device), whatever the engine (vLLM's CPU build runs a CPU job), else 0."""

    if cfg.cluster.slurm_gpus_per_node is not None:
        return cfg.cluster.slurm_gpus_per_node
    return cfg.cluster.procs_per_node if device_preset(cfg.cluster.device).kind == "cuda" else 0


def resource_lines(cfg: RunConfig, environ: dict[str, str]) -> list[str]:
    """The ``#SBATCH`` lines that depend on the experiment: devices, time, partition, account."""
    gpus = gpus_per_node(cfg)
    if gpus:  # a whole GPU node per agent: all its CPUs and memory go to the node's ranks
        lines = [f"#SBATCH --gpus-per-node={gpus}", "#SBATCH --exclusive", "#SBATCH --mem=0"]
    else:  # a CPU job: one core per rank
        lines = [f"#SBATCH --cpus-per-task={cfg.cluster.procs_per_node}"]
    time_limit, source = _setting(cfg.cluster.slurm_time, "slurm_time", "SBATCH_TIMELIMIT", environ)
    if time_limit is None:
        lines.append("# --time: the partition's default (set cluster.slurm_time or SBATCH_TIMELIMIT)")
    else:
        limit_s = slurm_time_seconds(time_limit, source)
        if limit_s <= cfg.cluster.slurm_signal_seconds:
            raise ConfigError(
                f"{source}={time_limit} ({limit_s} s) leaves no time before cluster.slurm_signal_seconds="
                f"{cfg.cluster.slurm_signal_seconds}; raise the time limit or lower the signal lead"
            )
        lines.append(f"#SBATCH --time={time_limit}")
    for key, env, flag in (
        ("slurm_partition", "SBATCH_PARTITION", "partition"),
        ("slurm_account", "SBATCH_ACCOUNT", "account"),
    ):
        value, _ = _setting(getattr(cfg.cluster, key), key, env, environ)
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines


def fill(template: str, values: dict[str, str]) -> str:
    """Replace every ``{{name}}``; a placeholder without a value (or a value without one) is a bug here."""
    names = set(_PLACEHOLDER.findall(template))
    if names != set(values):
        raise KeyError(f"template placeholders {sorted(names)} != values {sorted(values)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def render(cfg: RunConfig, overrides: list[str], run_dir: Path, python: str, environ: dict[str, str]) -> str:
    """The batch script for ``cfg`` (composed from ``cfg.exp`` + ``overrides``) writing into ``run_dir``."""
    quote = shlex.quote
    script = run_dir / SCRIPT_NAME
    if not SHELL_SAFE_PATH.match(str(run_dir)):
        raise ConfigError(f"run directory {run_dir} has characters #SBATCH lines cannot carry; pick another output_dir")
    signal_s = cfg.cluster.slurm_signal_seconds
    values = {
        "exp": quote(cfg.exp),
        "script": str(script),
        "job_name": f"rlmem-{cfg.exp}",
        "num_nodes": str(cfg.cluster.num_nodes),
        "procs_per_node": str(cfg.cluster.procs_per_node),
        "resources": "\n".join(resource_lines(cfg, environ)),
        "run_dir": str(run_dir),
        "repo": quote(str(REPO_ROOT)),
        "python": quote(python),
        "signal_seconds": str(signal_s),
        "grace_seconds": str(signal_s - REQUEUE_MARGIN_S),
        # W&B ids allow letters, digits, - and _; the run dir name is unique per render
        "wandb_run_id": re.sub(r"[^A-Za-z0-9_-]", "_", f"{cfg.exp}-{run_dir.name}"),
        "overrides": " ".join(quote(o) for o in overrides),
    }
    return fill(TEMPLATE.read_text(), values)


def new_run_dir(cfg: RunConfig) -> Path:
    """``<output_dir>/<exp>/<timestamp>`` as ``make run`` names it; a suffix if that one exists already."""
    base = Path(resolve_path(cfg.output_dir)) / cfg.exp / time.strftime("%Y%m%d-%H%M%S")
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    return run_dir


def with_nodes(overrides: list[str], nodes: str | None) -> list[str]:
    """``--nodes N`` as the override ``cluster.num_nodes=N``; a disagreeing override in ARGS is an error."""
    if nodes is None:
        return overrides
    if not nodes.isdigit() or int(nodes) < 1:
        raise ConfigError(f"NODES={nodes!r} must be a positive integer")
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "cluster.num_nodes"]
    if any(value != nodes for value in given):
        raise ConfigError(f"NODES={nodes} disagrees with cluster.num_nodes={given[-1]} in ARGS; give one of them")
    return overrides if given else [*overrides, f"cluster.num_nodes={nodes}"]


def submit(script: Path) -> str:
    """``sbatch --parsable`` -> the job id."""
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed: {' '.join(proc.stderr.split()) or proc.returncode}")
    return proc.stdout.strip().split(";")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exp", default="tiny_cpu", help="experiment under experiments/conf/exp/")
    parser.add_argument("--nodes", default=None, help="number of nodes (sets cluster.num_nodes)")
    parser.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, passed to every rank as well")
    args = parser.parse_args(argv)

    try:
        if args.submit and shutil.which("sbatch") is None:
            raise SbatchError(
                "SUBMIT=1 needs `sbatch` on PATH and there is none; render without SUBMIT=1, "
                "or start a local Slurm with .ci/slurm-up"
            )
        overrides = with_nodes(list(args.overrides), args.nodes)
        cfg = compose(args.exp, overrides)
        run_dir = new_run_dir(cfg)
        text = render(cfg, overrides, run_dir, sys.executable, dict(os.environ))
    except (ConfigError, SbatchError) as exc:
        print(f"{'config error' if isinstance(exc, ConfigError) else 'error'}: {exc}", file=sys.stderr)
        return 2
    prepare(cfg, str(run_dir))  # config.yaml and tiny checkpoints exist before any rank starts
    script = run_dir / SCRIPT_NAME
    script.write_text(text)
    script.chmod(0o755)
    gpus = gpus_per_node(cfg)
    device = f"{gpus} GPUs per node" if gpus else f"CPU, {cfg.cluster.procs_per_node} cores per node"
    print(f"rendered {script}: {cfg.cluster.num_nodes} node(s) x {cfg.cluster.procs_per_node} ranks ({device})")
    if not args.submit:
        print(f"submit with: sbatch {script}")
        return 0
    try:
        job_id = submit(script)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"job id: {job_id}")
    print(f"run dir: {run_dir}")
    print(f"log: {run_dir}/slurm-{job_id}.out (squeue -j {job_id}; scontrol show job {job_id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
