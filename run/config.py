"""The run's config and the checks that span components, before any process starts.

Each component owns its keyword-only config dataclass beside its code: ``ActorConfig``
(configs/actor.py), ``RolloutConfig`` (configs/rollout.py), ``WeightSyncConfig``
(weight_sync/sync.py), ``DataConfig`` (rl/data.py), ``WandbConfig`` (telemetry/tracking.py),
``ClusterConfig`` (run/launch.py), ``PolicyLossConfig`` (rl/losses.py), ``EvalConfig`` (rl/evaluation.py). This module holds the model and
trainer configs and :class:`RunConfig`, whose ``__post_init__`` checks parallel sizes against the model
(its :class:`~modelspec.ModelShape`) and the world through :meth:`modelspec.ColocatedMesh.check`. Hydra composition lives in :mod:`run.compose`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colocation.phases import StepFlags
from configs import ActorConfig, step_flags
from configs.rollout import RolloutConfig, routed_experts_unsupported
from modelspec import DTYPE_NAMES, ColocatedMesh, ModelShape
from modelspec.mesh import check_world
from modelspec.tiny import TINY_FAMILIES, TINY_PREFIX
from rl.data import DataConfig
from rl.evaluation import EvalConfig
from rl.losses import PolicyLossConfig
from run.launch import ClusterConfig
from telemetry.tracking import WandbConfig
from weight_sync import WeightSyncConfig


@dataclass(kw_only=True)
class ModelConfig:
    """The policy checkpoint (``model.*``). ``tiny:<family>`` names a built-in tiny checkpoint."""

    path: str = "tiny:qwen2"
    dtype: str = "float32"
    # Where the model's shape comes from when ``path`` is not on this machine (a cluster experiment
    # composed on a laptop): anything ModelShape.from_pretrained accepts. config.json at ``path`` wins.
    architecture: str | None = None
    # Optional expected sizes: cross-checked against the shape, so a wrong checkpoint fails at once.
    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"model.dtype={self.dtype!r} is not one of {DTYPE_NAMES}")
        if self.path.startswith(TINY_PREFIX) and self.path[len(TINY_PREFIX) :] not in TINY_FAMILIES:
            raise ValueError(f"model.path={self.path!r}: tiny families are {sorted(TINY_FAMILIES)}")

    def shape(self) -> ModelShape:
        """The model's shape from ``path`` (or ``architecture``), checked against the declared sizes. Read once
        per run: kept with this config (and pickled with it to the ranks) until ``path`` or ``architecture``
        changes, so the config's checks, preflight, the planner, the actor and the engine share one read."""
        key = (self.path, self.architecture)
        cached = getattr(self, "_shape_read", None)
        if cached is None or cached[0] != key:
            self._shape_read = (key, self._read_shape())
        return self._shape_read[1]

    def _read_shape(self) -> ModelShape:
        try:
            shape = ModelShape.from_pretrained(self.path)
        except ValueError as exc:  # an unsupported architecture, a config.json that does not parse
            raise ValueError(f"model.path={self.path!r}: {exc}") from None
        except FileNotFoundError:
            if self.architecture is None:
                raise ValueError(
                    f"model.path={self.path!r} has no config.json here; point it at a HF checkpoint directory "
                    "or set model.architecture for planning and validation"
                ) from None
            try:
                shape = ModelShape.from_pretrained(self.architecture)
            except FileNotFoundError:
                raise ValueError(
                    f"model.architecture={self.architecture!r} is neither a HF checkpoint directory nor a shipped "
                    f"architecture; use arch:<name> with a name from modelspec/architectures/"
                ) from None
        declared = dict(
            num_layers=(self.num_layers, shape.num_layers),
            num_attention_heads=(self.num_attention_heads, shape.num_heads),
            num_key_value_heads=(self.num_key_value_heads, shape.num_kv_heads),
        )
        for key, (value, found) in declared.items():
            if value is not None and value != found:
                raise ValueError(
                    f"model.{key}={value} disagrees with {shape.source}/config.json ({found}); drop the override"
                )
        return shape


@dataclass(kw_only=True)
class TrainerConfig:
    """The RL loop (``trainer.*``)."""

    steps: int = 20
    prompts_per_step: int = 8
    seed: int = 0
    # supervised steps on the task's format examples before RL (teaches the answer format, not the answers)
    sft_warmup_steps: int = 0
    memory_sample_interval_s: float = 0.05  # background memory sampler period inside phases
    # every phase's tensors counted per aten op (telemetry/live_tensors.py): the timeline's tensor_peak column,
    # what of a CPU phase's rise is tensors and what glibc's heap; several times slower, for diagnosis
    count_tensors: bool = False
    ppo_epochs: int = 1  # optimizer steps per RL step on the same rollouts (PPO epochs; ratio clipping acts from 2)
    # a checkpoint (checkpointing/checkpoint.py) after every save_every-th step and after the last one; 0: never
    save_every: int = 10
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted once a newer one is complete
    # a HF directory <run dir>/hf/step_<n> (megatron_backend/hf_export.py, as `make export` writes) after every
    # export_every-th step; 0: none, except after the last step when export_at_end
    export_every: int = 0
    export_at_end: bool = False
    # a warning (once per new high, not a stop: bf16 rounding grows the gap too) when the engine's and the
    # actor's log-probs of the step's sampled tokens (all ranks) differ by more than max_logprob_gap_p99 at
    # the 99th percentile or by more than max_logprob_gap on any token; null: the model dtype's default
    # (telemetry.metrics.LOGPROB_GAP_RULE). Wrong weights stop the run at weight_sync.check_every's check.
    max_logprob_gap: float | None = None
    max_logprob_gap_p99: float | None = None

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
        if self.save_every < 0:
            raise ValueError(f"trainer.save_every={self.save_every} must be >= 0 (0: no checkpoints)")
        if self.keep_last < 1:
            raise ValueError(f"trainer.keep_last={self.keep_last} must be >= 1")
        if self.export_every < 0:
            raise ValueError(f"trainer.export_every={self.export_every} must be >= 0 (0: only trainer.export_at_end)")
        for name in ("max_logprob_gap", "max_logprob_gap_p99"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"trainer.{name}={getattr(self, name)} must be > 0, or null for the dtype's default")

    def exports_after(self, step: int) -> bool:
        """Whether the weights are exported as a HF directory after ``step`` (0-based)."""
        every = self.export_every > 0 and (step + 1) % self.export_every == 0
        return every or (self.export_at_end and step + 1 == self.steps)

    def saves_after(self, step: int) -> bool:
        """Whether a checkpoint is written after ``step`` (0-based): every save_every-th and the last."""
        return self.save_every > 0 and ((step + 1) % self.save_every == 0 or step + 1 == self.steps)


@dataclass(kw_only=True)
class RunConfig:
    """Everything one run needs. Cross-component checks live in ``__post_init__``."""

    exp: str = "tiny_cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algorithm: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    resume: str = "auto"  # auto | never | <checkpoint path> (checkpointing/checkpoint.py)
    output_dir: str = "runs"

    def __post_init__(self) -> None:
        mesh = self.mesh()  # the world size against actor TP x PP and rollout TP
        self._check_actor_dp()
        shape = self.model.shape()
        mesh.check(shape)  # both layouts against the model: modelspec.mesh, the one layout check
        device_kind = "cpu" if self.cluster.device == "cpu" else "cuda"
        self.rollout.profile.check_moe_replicas(device_kind, mesh.num_replicas, shape.is_moe)
        self.rollout.profile.check_expert_parallel(device_kind, self.rollout.ep)
        dp = self.dp
        if self.trainer.prompts_per_step % dp:
            raise ValueError(
                f"trainer.prompts_per_step={self.trainer.prompts_per_step} must split evenly over the {dp} actor "
                "DP ranks (whole GRPO groups per rank); use a multiple of the DP size"
            )
        per_rank = self.trainer.prompts_per_step * self.rollout.n_samples_per_prompt // dp
        fixed_size = self.actor.max_tokens_per_micro_batch is None or self.actor.forward_max_tokens is None
        if fixed_size and per_rank % self.actor.micro_batch_size:
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
        if self.eval.data.path is not None and self.data.task == "digit_sum":
            raise ValueError(
                f"eval.data.path={self.eval.data.path!r}: data.task=digit_sum evaluates on its own problems; "
                "drop eval.data.path, or use data.task=gsm8k for a question/answer file"
            )
        if not self.resume:
            raise ValueError("resume='' is empty; use resume=auto, resume=never or resume=<checkpoint path>")
        self._check_capacity_factor()
        self._check_routing_replay()
        if self.actor.optimizer_offload_fraction > 0 and self.cluster.device == "cpu":
            raise ValueError(
                f"actor.optimizer_offload_fraction={self.actor.optimizer_offload_fraction} needs megatron's optimizer "
                "on CUDA (its HybridDeviceOptimizer); on cluster.device=cpu the optimizer is on the host already: set 0"
            )

    def _check_capacity_factor(self) -> None:
        factor = self.actor.moe_expert_capacity_factor
        if factor is None:
            return
        if not self.model.shape().is_moe:
            raise ValueError(
                f"actor.moe_expert_capacity_factor={factor} but {self.model.path} has no MoE layers; set it to null"
            )
        # the dropped copies widen the engine-vs-actor log-prob gap: only its warning (trainer.max_logprob_gap*)
        # reacts, and the weight sync's reference check compares weights, which the factor does not touch

    def _check_routing_replay(self) -> None:
        if not self.algorithm.routing_replay:
            return
        shape = self.model.shape()
        if not shape.is_moe:
            raise ValueError(
                f"algorithm.routing_replay=true but {self.model.path} has no MoE layers to route; set it to false"
            )
        why = routed_experts_unsupported(self.rollout.engine, self.device_kind)
        if why is not None:
            raise ValueError(f"algorithm.routing_replay=true but rollout.engine={self.rollout.engine} {why}")
        if self.actor.moe_expert_capacity_factor is not None:
            raise ValueError(
                f"algorithm.routing_replay=true with actor.moe_expert_capacity_factor="
                f"{self.actor.moe_expert_capacity_factor}: the actor would drop copies of the engine's routing it "
                "replays; set actor.moe_expert_capacity_factor=null"
            )
        reruns_router = self.actor.recompute == "full" or (
            self.actor.recompute == "selective" and "moe" in (self.actor.recompute_modules or ())
        )
        if self.actor.pp > 1 and reruns_router:
            raise ValueError(
                f"algorithm.routing_replay=true with actor.pp={self.actor.pp} and actor.recompute={self.actor.recompute} "
                "(recomputed routers rerun out of micro-batch order under 1F1B); use actor.recompute=none or actor.pp=1"
            )

    @property
    def returns_routed_experts(self) -> bool:
        """Whether the engine returns each completion's routing: an MoE model on an engine that can (the
        routing-mismatch metric every step; routing replay when ``algorithm.routing_replay``)."""
        return self.model.shape().is_moe and routed_experts_unsupported(self.rollout.engine, self.device_kind) is None

    @property
    def device_kind(self) -> str:
        """ "cpu" or "cuda" (``cluster.device`` names a CUDA device preset or cpu)."""
        return "cpu" if self.cluster.device == "cpu" else "cuda"

    def _check_actor_dp(self) -> None:
        world, tp, pp = self.cluster.world_size, self.actor.tp, self.actor.pp
        check_world(world, tp, pp, self.actor.ep, self.actor.expert_tp)
        if self.actor.dp is not None and tp * pp * self.actor.dp != world:
            raise ValueError(
                f"actor.tp x actor.pp x actor.dp = {tp}x{pp}x{self.actor.dp} != world size {world}; "
                f"set actor.dp={world // (tp * pp)} or actor.dp=null"
            )

    @property
    def dp(self) -> int:
        return self.cluster.world_size // (self.actor.tp * self.actor.pp)

    def step_flags(self) -> StepFlags:
        """What decides which state each phase of the step moves (colocation/phases.py, the step's table)."""
        return step_flags(self.actor, self.rollout, reference_model=self.algorithm.kl_coef > 0)

    def mesh(self) -> ColocatedMesh:
        """Every rank's actor and rollout coordinates."""
        return colocated_mesh(self.cluster.world_size, self.actor, self.rollout)


def colocated_mesh(world_size: int, actor: ActorConfig, rollout: RolloutConfig) -> ColocatedMesh:
    """Every rank's actor and rollout coordinates over ``world_size`` ranks (the one place this arithmetic lives:
    a run's config and a rank built without one, run/setup.py::build_rank)."""
    return ColocatedMesh(
        world_size=world_size,
        actor_tp=actor.tp,
        actor_pp=actor.pp,
        actor_vpp=actor.vpp,
        rollout_tp=rollout.tp,
        actor_ep=actor.ep,
        actor_etp=actor.etp,
        rollout_ep=rollout.ep,
        rollout_experts_span_replicas=rollout.profile.experts_span_replicas,
    )
