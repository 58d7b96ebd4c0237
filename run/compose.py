"""Hydra composition: experiment name + dotted overrides -> a validated :class:`~run.config.RunConfig`.

``experiments/conf/config.yaml`` composes ``exp/<name>.yaml`` over the structured configs (each
component's dataclass is its schema in Hydra's ConfigStore). Every failure becomes one
:class:`ConfigError` line that names the key and the fix, before any process starts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.actor import ActorConfig, OffloadConfig
from configs.rollout import RolloutConfig
from modelspec.tiny import TINY_PREFIX
from rl.data import DataConfig
from rl.evaluation import EvalConfig, EvalDataConfig
from rl.losses import PolicyLossConfig
from run.config import ModelConfig, RunConfig, TrainerConfig
from run.launch import ClusterConfig
from telemetry.tracking import WandbConfig
from weight_sync import WeightSyncConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "experiments" / "conf"


class ConfigError(ValueError):
    """A config problem, in one line that names the key and the fix."""


def register_configs() -> None:
    """Put every component's schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="run_config", node=RunConfig)
    for group, node in (
        ("model", ModelConfig),
        ("actor", ActorConfig),
        ("actor/offload", OffloadConfig),
        ("rollout", RolloutConfig),
        ("weight_sync", WeightSyncConfig),
        ("trainer", TrainerConfig),
        ("data", DataConfig),
        ("eval", EvalConfig),
        ("eval/data", EvalDataConfig),
        ("algorithm", PolicyLossConfig),
        ("wandb", WandbConfig),
        ("cluster", ClusterConfig),
    ):
        cs.store(group=group, name=f"{group.replace('/', '_')}_schema", node=node)


def list_experiments() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "exp").glob("*.yaml"))


def _one_line(exc: BaseException) -> str:
    # OmegaConf appends a "full_key: ... object_type=..." trailer; the first sentence is the point.
    text = " ".join(str(exc).split()).split(" full_key:")[0]
    if exc.__cause__ is not None:
        text = f"{text}: {_one_line(exc.__cause__)}"
    return text


def compose_dict(exp: str = "tiny_cpu", overrides: Sequence[str] = ()) -> Any:
    """Compose experiments/conf with ``exp=<exp>`` and overrides; returns the (unvalidated) DictConfig."""
    # hydra's `compose` at the top would shadow this module's own
    from hydra import compose, initialize_config_dir

    if exp not in list_experiments():
        raise ConfigError(f"EXP={exp!r} is not an experiment; choose one of {list_experiments()}")
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=[f"exp={exp}", *overrides])
    except (HydraException, OmegaConfBaseException) as exc:
        message = _one_line(exc)
        match = re.search(r"Could not override '([^']+)'|Key '([^']+)' is not in struct", message)
        if match:
            message = _unknown_key_message(match.group(1) or match.group(2))
        raise ConfigError(message) from None


def _unknown_key_message(key: str) -> str:
    """'actor.foo' -> one line naming the bad key and the valid keys beside it."""
    node: Any = RunConfig
    parts = key.lstrip("+~").split(".")
    for part in parts[:-1]:
        sub = {f.name: f for f in fields(node)}.get(part) if is_dataclass(node) else None
        if sub is None or not is_dataclass(sub.default_factory()):
            break
        node = type(sub.default_factory())
    valid = ", ".join(f.name for f in fields(node)) if is_dataclass(node) else ""
    return f"unknown config key '{key}'; valid keys here: {valid}"


def compose(exp: str = "tiny_cpu", overrides: Sequence[str] = ()) -> RunConfig:
    """Experiment name + dotted overrides -> a validated :class:`RunConfig` (raises :class:`ConfigError`)."""

    cfg = compose_dict(exp, overrides)
    try:
        run_config = OmegaConf.to_object(cfg)
    except (ValueError, OmegaConfBaseException) as exc:
        raise ConfigError(_one_line(exc)) from None
    assert isinstance(run_config, RunConfig)
    return run_config


def compose_from_file(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunConfig:
    """A run's saved config (``<run dir>/config.yaml``, every key as the run resolved it) + dotted overrides ->
    a validated :class:`RunConfig` (raises :class:`ConfigError` naming the file)."""

    register_configs()
    try:
        saved = OmegaConf.load(str(path))
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), saved, OmegaConf.from_dotlist(list(overrides)))
        run_config = OmegaConf.to_object(merged)
    except (ValueError, OmegaConfBaseException) as exc:
        message = _one_line(exc)
        match = re.search(r"Key '([^']+)' not in '", message) or re.search(r"Key '([^']+)' is not in struct", message)
        if match:
            message = _unknown_key_message(match.group(1))
        raise ConfigError(f"{path}: {message}") from None
    assert isinstance(run_config, RunConfig)
    return run_config


def resolve_path(path: str) -> str:
    """Relative paths in configs are relative to the repo root, not the caller's cwd."""
    return path if os.path.isabs(path) or path.startswith(TINY_PREFIX) else str(REPO_ROOT / path)
