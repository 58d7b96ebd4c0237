"""The run's config: one dataclass per component, composed by Hydra, validated before any process starts.

Each package owns its component's dataclass (``ActorConfig`` in ``megatron_backend``,
``RolloutConfig`` in ``rollout``); this module owns the rest and :class:`RunConfig`, whose
``__post_init__`` checks what spans components (parallel sizes against the model and the world).

:func:`compose` is the single entry: experiment name + dotted overrides -> a validated
:class:`RunConfig`, or a :class:`ConfigError` whose message is one line naming the key and the fix.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from megatron_backend.config import ActorConfig, OffloadConfig
from rl.losses import PolicyLossConfig
from modelspec.tiny import TINY_FAMILIES, TINY_PREFIX, tiny_hf_config
from rollout.config import RolloutConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "experiments" / "conf"
WANDB_MODES = ("offline", "online", "disabled")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config problem, in one line that names the key and the fix."""


@dataclass
class ModelDims:
    """The few model sizes that parallel layouts must divide."""

    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int


@dataclass
class ModelConfig:
    """The policy checkpoint (``model.*``). ``tiny:<family>`` names a built-in tiny checkpoint."""

    path: str = "tiny:qwen2"
    dtype: str = "float32"
    # Sizes for validation when ``path`` is not on this machine yet (e.g. a cluster experiment
    # composed on a laptop). When config.json exists, it wins and these must agree with it.
    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.path.startswith(TINY_PREFIX) and self.path[len(TINY_PREFIX) :] not in TINY_FAMILIES:
            raise ValueError(f"model.path={self.path!r}: tiny families are {sorted(TINY_FAMILIES)}")

    def dims(self) -> ModelDims | None:
        """Sizes from config.json (or the tiny family), else from the declared fields, else None."""
        if self.path.startswith(TINY_PREFIX):
            hf = tiny_hf_config(self.path[len(TINY_PREFIX) :]).to_dict()
        elif (Path(self.path) / "config.json").is_file():
            hf = json.loads((Path(self.path) / "config.json").read_text())
        else:
            hf = None
        declared = ModelDims(self.num_layers, self.num_attention_heads, self.num_key_value_heads)
        if hf is None:
            if None in (declared.num_layers, declared.num_attention_heads):
                return None
            if declared.num_key_value_heads is None:
                declared.num_key_value_heads = declared.num_attention_heads
            return declared
        found = ModelDims(
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        )
        for key, value in vars(declared).items():
            if value is not None and value != getattr(found, key):
                raise ValueError(
                    f"model.{key}={value} disagrees with {self.path}/config.json ({getattr(found, key)}); "
                    f"drop the override"
                )
        return found


@dataclass
class WeightSyncConfig:
    """Actor -> engine weight resharding (``weight_sync.*``)."""

    bucket_mb: int = 512
    verify: bool = False

    def __post_init__(self) -> None:
        if self.bucket_mb < 1:
            raise ValueError(f"weight_sync.bucket_mb={self.bucket_mb} must be >= 1")


@dataclass
class TrainerConfig:
    """The RL loop (``trainer.*``)."""

    steps: int = 20
    prompts_per_step: int = 8
    seed: int = 0
    # supervised steps on the task's format examples before RL (teaches the answer format, not the answers)
    sft_warmup_steps: int = 0
    memory_sample_interval_s: float = 0.05  # background memory sampler period inside phases
    ppo_epochs: int = 1  # optimizer steps per RL step on the same rollouts (PPO epochs; ratio clipping acts from 2)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"trainer.steps={self.steps} must be >= 1")
        if self.prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step={self.prompts_per_step} must be >= 1")
        if self.ppo_epochs < 1:
            raise ValueError(f"trainer.ppo_epochs={self.ppo_epochs} must be >= 1")
        if self.sft_warmup_steps < 0:
            raise ValueError(f"trainer.sft_warmup_steps={self.sft_warmup_steps} must be >= 0")
        if self.memory_sample_interval_s <= 0:
            raise ValueError(f"trainer.memory_sample_interval_s={self.memory_sample_interval_s} must be > 0")


TASKS = ("digit_sum", "gsm8k")


@dataclass
class DataConfig:
    """Prompts and rewards (``data.*``): the shipped synthetic task, or GSM8K-style math from a local file."""

    task: str = "digit_sum"
    path: str | None = None  # gsm8k: a local .jsonl or .parquet with question/answer fields
    max_operand: int = 9  # digit_sum: operands in [0, max_operand]

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"data.task={self.task!r} is not one of {TASKS}")
        if self.task == "gsm8k" and not self.path:
            raise ValueError("data.task=gsm8k needs data.path=<local .jsonl or .parquet file>")
        if not 1 <= self.max_operand <= 9:
            raise ValueError(f"data.max_operand={self.max_operand} must be in [1, 9]")


@dataclass
class WandbConfig:
    """Weights & Biases tracking (``wandb.*``); offline unless asked otherwise."""

    mode: str = "offline"
    project: str = "rlmem"
    entity: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={self.mode!r} is not one of {WANDB_MODES}")


@dataclass
class ClusterConfig:
    """Where the ranks run (``cluster.*``): world size = num_nodes x procs_per_node."""

    num_nodes: int = 1
    procs_per_node: int = 2  # GPUs per node on a cluster, CPU processes on a laptop/CI
    # --- Slurm (`make sbatch`, tools/sbatch.py). Unset: SBATCH_TIMELIMIT / SBATCH_PARTITION / SBATCH_ACCOUNT
    # from the environment, else the cluster's defaults.
    slurm_time: str | None = None  # --time, e.g. "04:00:00" (checked by tools/sbatch.py, with the environment's)
    slurm_partition: str | None = None
    slurm_account: str | None = None
    slurm_gpus_per_node: int | None = None  # None: procs_per_node if rollout.engine=vllm, else 0 (a CPU job)
    slurm_signal_seconds: int = 300  # USR1 this long before the time limit: ranks checkpoint, the job requeues

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"cluster.num_nodes={self.num_nodes} must be >= 1")
        if self.procs_per_node < 1:
            raise ValueError(f"cluster.procs_per_node={self.procs_per_node} must be >= 1")
        if self.slurm_gpus_per_node not in (None, 0, self.procs_per_node):
            raise ValueError(
                f"cluster.slurm_gpus_per_node={self.slurm_gpus_per_node}: one rank per GPU, so use 0 (CPU job) or "
                f"cluster.procs_per_node={self.procs_per_node}"
            )
        if self.slurm_signal_seconds < 30:
            raise ValueError(
                f"cluster.slurm_signal_seconds={self.slurm_signal_seconds} must be >= 30 (time to checkpoint)"
            )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.procs_per_node


@dataclass
class RunConfig:
    """Everything one run needs. Cross-component checks live in ``__post_init__``."""

    exp: str = "tiny_cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    resume: str = "auto"  # auto | never | <checkpoint path>
    output_dir: str = "runs"

    def __post_init__(self) -> None:
        self._check_world()
        dims = self.model.dims()
        if dims is None:
            raise ValueError(
                f"model.path={self.model.path!r} has no config.json here; point it at a HF checkpoint "
                "directory or declare model.num_layers and model.num_attention_heads for validation"
            )
        self._check_model_split(dims)
        dp = self.dp
        if self.trainer.prompts_per_step % dp:
            raise ValueError(
                f"trainer.prompts_per_step={self.trainer.prompts_per_step} must split evenly over the {dp} actor "
                "DP ranks (whole GRPO groups per rank); use a multiple of the DP size"
            )
        per_rank = self.trainer.prompts_per_step * self.rollout.n_samples_per_prompt // dp
        if per_rank % self.actor.micro_batch_size:
            raise ValueError(
                f"each DP rank trains on {per_rank} sequences per step (trainer.prompts_per_step x "
                f"rollout.n_samples_per_prompt / DP), not a multiple of actor.micro_batch_size="
                f"{self.actor.micro_batch_size}; pick a divisor of {per_rank}"
            )
        if self.trainer.sft_warmup_steps and self.data.task != "digit_sum":
            raise ValueError(
                f"trainer.sft_warmup_steps={self.trainer.sft_warmup_steps}: only data.task=digit_sum has format "
                "examples; set trainer.sft_warmup_steps=0"
            )
        if self.resume not in ("auto", "never"):
            raise ValueError(
                f"resume={self.resume!r}: checkpoint/resume is not implemented yet; use resume=auto or resume=never"
            )

    def _check_world(self) -> None:
        world, tp, pp = self.cluster.world_size, self.actor.tp, self.actor.pp
        if world % (tp * pp) != 0:
            raise ValueError(
                f"world size {world} (cluster.num_nodes x cluster.procs_per_node) is not a multiple of "
                f"actor.tp x actor.pp = {tp * pp}; change cluster.procs_per_node or the actor layout"
            )
        if self.actor.dp is not None and tp * pp * self.actor.dp != world:
            raise ValueError(
                f"actor.tp x actor.pp x actor.dp = {tp}x{pp}x{self.actor.dp} != world size {world}; "
                f"set actor.dp={world // (tp * pp)} or actor.dp=null"
            )
        if world % self.rollout.tp != 0:
            raise ValueError(
                f"rollout.tp={self.rollout.tp} does not divide the world size {world}; pick a divisor of {world}"
            )

    def _check_model_split(self, dims: ModelDims) -> None:
        heads, kv_heads, layers = dims.num_attention_heads, dims.num_key_value_heads, dims.num_layers
        tp, pp, vpp = self.actor.tp, self.actor.pp, self.actor.vpp or 1
        if heads % tp or kv_heads % tp:
            raise ValueError(
                f"actor.tp={tp} must divide the attention heads ({heads}) and KV heads ({kv_heads}) "
                f"of {self.model.path}; pick a common divisor"
            )
        if layers % (pp * vpp):
            raise ValueError(f"actor.pp x actor.vpp = {pp}x{vpp} must divide the {layers} layers of {self.model.path}")
        rtp = self.rollout.tp
        if heads % rtp or (kv_heads % rtp and rtp % kv_heads):
            raise ValueError(
                f"rollout.tp={rtp} must divide the attention heads ({heads}), and divide or be a multiple "
                f"of the KV heads ({kv_heads}) of {self.model.path}"
            )

    @property
    def dp(self) -> int:
        return self.cluster.world_size // (self.actor.tp * self.actor.pp)


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
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

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
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = compose_dict(exp, overrides)
    try:
        run_config = OmegaConf.to_object(cfg)
    except (ValueError, OmegaConfBaseException) as exc:
        raise ConfigError(_one_line(exc)) from None
    assert isinstance(run_config, RunConfig)
    return run_config


def resolve_path(path: str) -> str:
    """Relative paths in configs are relative to the repo root, not the caller's cwd."""
    return path if os.path.isabs(path) or path.startswith(TINY_PREFIX) else str(REPO_ROOT / path)
