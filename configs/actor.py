"""Config of the Megatron-core actor (``actor.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from modelspec.mesh import uses_sequence_parallel


@dataclass
class OffloadConfig:
    """What the actor moves to host memory between its phases (``actor.offload.*``)."""

    params: bool = True
    grads: bool = True
    optimizer: bool = True
    # the reference actor's params (algorithm.kl_coef > 0): on host except around its ref_logprob pass
    ref_params: bool = True


RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")  # megatron's choices for a dense model
# megatron-core's MoE token dispatchers that run without DeepEP/HybridEP (``moe_token_dispatcher_type``)
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")


@dataclass
class ActorConfig:
    """The trained policy: parallel layout, optimizer and the train-phase memory/throughput levers (``actor.*``).

    Levers (docs/DESIGN.md, "Train-phase levers"): ``remove_padding`` packs each micro-batch's sequences
    into one THD row; ``max_tokens_per_micro_batch`` / ``max_tokens_per_forward_micro_batch`` form
    micro-batches by a token budget instead of ``micro_batch_size`` sequences; ``recompute*`` are
    megatron-core's activation recomputation; ``logprob_chunk_tokens`` bounds the fp32 vocab-wide
    temporaries of the log-prob/entropy pass (recomputed per chunk in backward); ``entropy_recompute``
    does the same for an entropy term in the loss (``algorithm.entropy_coef > 0``).
    """

    tp: int = 1
    pp: int = 1
    # expert parallel (MoE models): the experts of each MoE layer split over ep ranks (megatron's
    # expert_model_parallel_size); must divide the number of experts
    ep: int = 1
    # expert tensor parallel: each expert's intermediate dim split over etp ranks; null = actor.tp
    # (megatron's default). World = pp x multiple of lcm(tp, etp x ep)
    etp: int | None = None
    vpp: int | None = None  # virtual pipeline stages per PP rank; null = no interleaving
    dp: int | None = None  # null = derived from the world size; if set, must match it
    micro_batch_size: int = 4
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1234
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # sequence packing: the model runs on real tokens (megatron THD), not micro_batch_size x longest
    remove_padding: bool = True
    # token budget per train micro-batch (null: micro_batch_size sequences each); with remove_padding
    # the budget counts real tokens, without it rows x padded length
    max_tokens_per_micro_batch: int | None = None
    # token budget of the forward-only passes (old_logprob, ref_logprob); null: 2 x max_tokens_per_micro_batch
    # (nothing is kept for backward, so they fit about twice the tokens), or micro_batch_size sequences
    max_tokens_per_forward_micro_batch: int | None = None
    # give every DP rank the same number of tokens (equal sequence counts), before micro-batching
    balance_dp_tokens: bool = True
    # activation recomputation (megatron-core): none | selective (recompute_modules, default core_attn)
    # | full (recompute_method uniform: every recompute_num_layers layers keep only their input; block:
    # the first recompute_num_layers layers of each stage)
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    # rows of fp32 [rows, vocab/TP] the log-prob/entropy pass works on at once, recomputed per chunk in
    # backward; null: all response tokens of a micro-batch at once, softmax kept for backward (unfused)
    logprob_chunk_tokens: int | None = 1024
    # with an entropy term in the loss: recompute its softmax per chunk in backward instead of keeping it
    entropy_recompute: bool = True
    # megatron-core's optimizer CPU offload (OptimizerConfig.optimizer_cpu_offload / optimizer_offload_fraction):
    # this fraction of the distributed optimizer's parameters keep their Adam states on the host and step there
    # (HybridDeviceOptimizer); 0: none. CUDA only (megatron's optimizer), the distributed optimizer at any DP
    optimizer_offload_fraction: float = 0.0
    # MoE router losses added to the policy loss (megatron's moe_aux_loss_coeff / moe_z_loss_coeff),
    # both logged per step (moe/load_balancing_loss, moe/z_loss); 0 = not computed
    moe_aux_loss_coef: float = 0.0
    moe_z_loss_coef: float = 0.0
    # megatron's expert capacity factor (moe_expert_capacity_factor, drop policy "probs"): each expert keeps at most
    # ceil(N k cf / E) of a rank's N tokens' routed copies, the lowest-probability ones beyond it are dropped (the
    # token skips that expert). It bounds the experts' activations at cf x balanced routing's (the plan's bound);
    # the engine drops nothing, so dropped tokens' actor log-probs differ from the engine's. null: no dropping
    moe_expert_capacity_factor: float | None = None
    # megatron's token dispatcher: alltoall (tokens to their experts' EP ranks) | allgather
    moe_token_dispatcher: str = "alltoall"
    # megatron's sequence parallelism at actor.tp > 1: the norms, residual stream and dropout of each layer
    # hold S / tp of the tokens (all-gather before the column-parallel linears, reduce-scatter after the
    # row-parallel ones, instead of the all-reduce). null: on where megatron requires it (an MoE model at
    # tp > 1, see sequence_parallel_for), off for a dense one; true: on at any tp > 1 (dense too)
    sequence_parallel: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"actor.{name}={value!r} must be a positive integer")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"actor.etp={self.etp!r} must be a positive integer, or null to follow actor.tp")
        for name in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"actor.{name}={getattr(self, name)} must be >= 0 (0: the loss is not used)")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            raise ValueError(
                f"actor.moe_expert_capacity_factor={self.moe_expert_capacity_factor} must be > 0 (1.0: each expert "
                "keeps balanced routing's share), or null to drop no token"
            )
        if self.moe_token_dispatcher not in MOE_TOKEN_DISPATCHERS:
            raise ValueError(
                f"actor.moe_token_dispatcher={self.moe_token_dispatcher!r} is not one of {MOE_TOKEN_DISPATCHERS}"
            )
        if self.sequence_parallel not in (None, True, False):
            raise ValueError(f"actor.sequence_parallel={self.sequence_parallel!r} must be true, false or null")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "actor.sequence_parallel=true needs actor.tp > 1 (it shards the sequence over the TP group); "
                "set it to null or raise actor.tp"
            )
        if self.vpp is not None:
            if self.vpp < 1:
                raise ValueError(f"actor.vpp={self.vpp} must be >= 1, or null for no interleaving")
            if self.vpp > 1 and self.pp < 2:
                raise ValueError(f"actor.vpp={self.vpp} needs actor.pp >= 2; set actor.vpp=null")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"actor.optimizer_offload_fraction={self.optimizer_offload_fraction} must be in [0, 1] (0: no offload)"
            )
        if self.dp is not None and self.dp < 1:
            raise ValueError(f"actor.dp={self.dp} must be >= 1, or null to derive it from the world size")
        if self.lr <= 0:
            raise ValueError(f"actor.lr={self.lr} must be > 0")
        if self.grad_clip < 0:
            raise ValueError(f"actor.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        for name in ("max_tokens_per_micro_batch", "max_tokens_per_forward_micro_batch", "logprob_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"actor.{name}={value!r} must be a positive integer, or null to turn it off")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"actor.recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"actor.recompute_method={self.recompute_method!r} is not one of {RECOMPUTE_METHODS}")
        if self.recompute_num_layers is not None:
            if not isinstance(self.recompute_num_layers, int) or self.recompute_num_layers < 1:
                raise ValueError(
                    f"actor.recompute_num_layers={self.recompute_num_layers!r} must be a positive integer or null"
                )
            if self.recompute != "full":
                raise ValueError(
                    f"actor.recompute_num_layers={self.recompute_num_layers} only applies to actor.recompute=full "
                    f"(got {self.recompute!r}); set it to null"
                )
        if self.recompute_modules is not None:
            if self.recompute != "selective":
                raise ValueError(
                    f"actor.recompute_modules={self.recompute_modules} only applies to actor.recompute=selective "
                    f"(got {self.recompute!r}); set it to null"
                )
            bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
            if bad or not self.recompute_modules:
                raise ValueError(
                    f"actor.recompute_modules={self.recompute_modules}: pick a non-empty list from {RECOMPUTE_MODULES}"
                )

    @property
    def expert_tp(self) -> int:
        """Expert tensor parallel size: ``actor.etp``, or ``actor.tp`` when null (megatron's default)."""
        return self.etp if self.etp is not None else self.tp

    def sequence_parallel_for(self, is_moe: bool) -> bool:
        """Whether the actor runs megatron's sequence parallelism for this model (``modelspec.mesh``; megatron's
        ``MoELayer.forward`` refuses training at TP > 1 without it)."""
        return uses_sequence_parallel(self.sequence_parallel, self.tp, is_moe)

    @property
    def forward_max_tokens(self) -> int | None:
        """The forward-only passes' token budget (None: micro_batch_size sequences per micro-batch)."""
        if self.max_tokens_per_forward_micro_batch is not None:
            return self.max_tokens_per_forward_micro_batch
        if self.max_tokens_per_micro_batch is not None:
            return 2 * self.max_tokens_per_micro_batch
        return None
