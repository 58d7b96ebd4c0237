"""The colocated mesh: every global rank is one actor rank and one rollout-engine rank on one device.

Built once in setup from the config and passed explicitly (in the spirit of torchtitan's
``ParallelDims``); nobody else does ``rank // rollout_tp`` arithmetic.

- Actor: megatron-core's default order tp-cp-ep-dp-pp with CP = EP = 1, i.e. TP fastest, then DP,
  then PP: ``tp_rank = r % TP``, ``dp_rank = (r // TP) % DP``, ``pp_rank = r // (TP * DP)``.
- Rollout: consecutive ranks form one engine replica (vLLM's external-launcher layout): TP fastest, then
  engine EP (``rollout.ep``, native engine: a replica of TP x EP ranks whose EP ranks hold different
  experts): replica ``r // (rollout_tp * rollout_ep)``, rollout TP rank ``r % rollout_tp``, rollout EP rank
  ``(r // rollout_tp) % rollout_ep``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelspec.shape import ModelShape


def _of(shape: ModelShape) -> str:
    return f" of {shape.source}" if shape.source else ""


def check_actor_split(shape: ModelShape, tp: int, pp: int, vpp: int | None) -> None:
    """The one check that actor TP x PP (x VPP) can split this model; ValueError naming the key and the fix.
    Config (``RunConfig``), the planner (``PlanInputs``) and megatron's layout all call it."""
    if shape.num_heads % tp or shape.num_kv_heads % tp:
        raise ValueError(
            f"actor.tp={tp} must divide the attention heads ({shape.num_heads}) and KV heads ({shape.num_kv_heads})"
            f"{_of(shape)}; pick a common divisor"
        )
    if shape.intermediate_size % tp:
        raise ValueError(
            f"actor.tp={tp} must divide the intermediate size ({shape.intermediate_size}){_of(shape)}; pick a divisor"
        )
    if shape.moe_intermediate_size % tp:  # expert TP follows TP
        raise ValueError(
            f"actor.tp={tp} must divide the experts' intermediate size ({shape.moe_intermediate_size}){_of(shape)}; "
            "pick a divisor"
        )
    if shape.num_layers % (pp * (vpp or 1)):
        raise ValueError(
            f"actor.pp x actor.vpp = {pp}x{vpp or 1} must divide the {shape.num_layers} layers{_of(shape)}"
        )


def check_rollout_split(shape: ModelShape, tp: int) -> None:
    """The one check that rollout TP can split this model (KV heads may be replicated: TP a multiple of them).
    Config, the planner and the engines' layout (``rollout.layout.tp_shape``) all call it."""
    if shape.num_heads % tp or (shape.num_kv_heads % tp and tp % shape.num_kv_heads):
        raise ValueError(
            f"rollout.tp={tp} must divide the attention heads ({shape.num_heads}), and divide or be a multiple "
            f"of the KV heads ({shape.num_kv_heads}){_of(shape)}"
        )
    if shape.intermediate_size % tp:
        raise ValueError(
            f"rollout.tp={tp} must divide the intermediate size ({shape.intermediate_size}){_of(shape)}; pick a divisor"
        )
    if shape.moe_intermediate_size % tp:  # vLLM's TP splits every expert by its intermediate dim
        raise ValueError(
            f"rollout.tp={tp} must divide the experts' intermediate size ({shape.moe_intermediate_size}){_of(shape)}; "
            "pick a divisor"
        )


def check_rollout_experts(shape: ModelShape, ep: int) -> None:
    """The one check that engine expert parallel (``rollout.ep``) can split this model's experts."""
    if ep == 1:
        return
    if not shape.is_moe:
        raise ValueError(f"rollout.ep={ep} needs a mixture-of-experts model{_of(shape)} (it has no experts); set 1")
    if shape.num_experts % ep:
        raise ValueError(f"rollout.ep={ep} must divide the {shape.num_experts} experts{_of(shape)}; pick a divisor")


def check_world(world_size: int, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """megatron's two grids over one world: tp x dp x pp (attention, dense MLP) and etp x ep x expert-dp x pp
    (experts); both must tile it. ValueError naming the fields."""
    etp = tp if etp is None else etp
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by actor.tp x actor.pp = {tp} x {pp}")
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by actor.etp x actor.ep x actor.pp = {etp} x {ep} x {pp} "
            f"(actor.etp null follows actor.tp); use a world that is a multiple of it, or smaller actor.ep / actor.etp"
        )


def min_world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """The fewest ranks that hold both grids: pp x lcm(tp, etp x ep) (TP2 x EP2 with etp = tp: 4)."""
    etp = tp if etp is None else etp
    return pp * math.lcm(tp, etp * ep)


def check_expert_split(shape: ModelShape, ep: int, etp: int) -> None:
    """The one check that actor EP x expert TP can split this MoE model's experts (nothing to check for a
    dense model); ValueError naming the key and the fix."""
    if not shape.is_moe:
        if ep > 1:
            raise ValueError(f"actor.ep={ep} needs a mixture-of-experts model{_of(shape)} (it has no experts); set 1")
        return
    if shape.num_experts % ep:
        raise ValueError(f"actor.ep={ep} must divide the {shape.num_experts} experts{_of(shape)}; pick a divisor")
    if shape.moe_intermediate_size % etp:
        raise ValueError(
            f"actor.etp={etp} (null: actor.tp) must divide the experts' intermediate size "
            f"({shape.moe_intermediate_size}){_of(shape)}; pick a divisor"
        )


def uses_sequence_parallel(setting: bool | None, tp: int, is_moe: bool) -> bool:
    """``actor.sequence_parallel`` resolved for a model (the actor and the planner both ask here): never at
    TP 1; null: on for an MoE model (megatron-core trains MoE layers at TP > 1 only with it), off for a dense one."""
    if tp == 1:
        return False
    return is_moe if setting is None else bool(setting)


@dataclass(frozen=True)
class ActorCoords:
    tp_rank: int
    pp_rank: int
    dp_rank: int
    # megatron's expert grid (MoE): expert TP, EP and expert-DP ranks (0, 0, dp_rank-like for a dense model)
    ep_rank: int = 0
    etp_rank: int = 0
    expert_dp_rank: int = 0


@dataclass(frozen=True)
class ColocatedMesh:
    """World size, actor TP x PP (x VPP) x DP and rollout TP x replicas, with every rank's coordinates."""

    world_size: int
    actor_tp: int = 1
    actor_pp: int = 1
    actor_vpp: int | None = None
    rollout_tp: int = 1
    actor_ep: int = 1  # MoE: expert parallel; experts grid etp x ep x expert-dp x pp over the same ranks
    actor_etp: int | None = None  # expert tensor parallel; None = actor_tp
    rollout_ep: int = 1  # engine expert parallel (native engine): a replica is rollout_tp x rollout_ep ranks
    # vLLM: FusedMoE splits the experts over every engine rank of every replica (FusedMoEParallelConfig.make
    # flattens TP across DP), not within one replica (rollout.layout.engine_expert_split)
    rollout_experts_span_replicas: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "actor_tp", "actor_pp", "rollout_tp", "rollout_ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"mesh {name}={getattr(self, name)} must be >= 1")
        world, tp, pp = self.world_size, self.actor_tp, self.actor_pp
        if world % (tp * pp):
            raise ValueError(
                f"actor.tp={tp} x actor.pp={pp} does not divide the world size {world} (cluster.num_nodes x "
                f"cluster.procs_per_node); pick actor.tp and actor.pp whose product divides {world}, or change "
                "cluster.procs_per_node"
            )
        check_world(world, tp, pp, self.actor_ep, self.actor_expert_tp)
        if world % self.rollout_tp:
            raise ValueError(
                f"rollout.tp={self.rollout_tp} does not divide the world size {world}; pick a divisor of {world}"
            )
        if world % (self.rollout_tp * self.rollout_ep):
            raise ValueError(
                f"rollout.tp x rollout.ep = {self.rollout_tp} x {self.rollout_ep} does not divide the world size "
                f"{world}; pick rollout.ep so that the product divides {world}"
            )

    def check(self, shape: ModelShape) -> None:
        """Whether both sides' layouts can split ``shape`` (:func:`check_actor_split`, :func:`check_rollout_split`)."""
        check_actor_split(shape, self.actor_tp, self.actor_pp, self.actor_vpp)
        check_expert_split(shape, self.actor_ep, self.actor_expert_tp)
        check_rollout_split(shape, self.rollout_tp)
        check_rollout_experts(shape, self.rollout_ep)

    # ------------------------------------------------------------------ actor
    @property
    def actor_dp(self) -> int:
        return self.world_size // (self.actor_tp * self.actor_pp)

    @property
    def actor_expert_tp(self) -> int:
        return self.actor_etp if self.actor_etp is not None else self.actor_tp

    def actor_coords(self, rank: int) -> ActorCoords:
        """megatron's rank orders: tp-dp-pp for the dense grid, tp-ep-dp-pp (etp fastest) for the expert grid."""
        tp, dp, etp, ep = self.actor_tp, self.actor_dp, self.actor_expert_tp, self.actor_ep
        in_stage = rank % (tp * dp)  # the same ranks form a PP stage in both grids
        return ActorCoords(
            tp_rank=rank % tp,
            pp_rank=rank // (tp * dp),
            dp_rank=(rank // tp) % dp,
            ep_rank=(in_stage // etp) % ep,
            etp_rank=in_stage % etp,
            expert_dp_rank=in_stage // (etp * ep),
        )

    def actor_ranks(self, tp_rank: int | None = None, pp_rank: int | None = None, dp_rank: int | None = None):
        """Global ranks whose actor coordinates match the given ones (None: any)."""
        want = dict(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)
        return [
            r
            for r in range(self.world_size)
            if all(v is None or getattr(self.actor_coords(r), k) == v for k, v in want.items())
        ]

    # ------------------------------------------------------------------ rollout
    @property
    def replica_size(self) -> int:
        """Engine ranks of one replica: rollout TP x rollout EP."""
        return self.rollout_tp * self.rollout_ep

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.replica_size

    def replica(self, rank: int) -> int:
        return rank // self.replica_size

    def rollout_tp_rank(self, rank: int) -> int:
        return rank % self.rollout_tp

    def rollout_ep_rank(self, rank: int) -> int:
        return (rank // self.rollout_tp) % self.rollout_ep

    def replica_ranks(self, replica: int) -> list[int]:
        return list(range(replica * self.replica_size, (replica + 1) * self.replica_size))

    def prompts_of_replica(self, replica: int, num_prompts: int) -> list[int]:
        """Replica i generates prompts i, i + R, i + 2R, ... (round robin over replicas)."""
        return list(range(replica, num_prompts, self.num_replicas))
