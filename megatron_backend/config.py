"""Config of the Megatron-core actor (``actor.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OffloadConfig:
    """What the actor moves to host memory between its phases (``actor.offload.*``)."""

    params: bool = True
    grads: bool = True
    optimizer: bool = True
    # the reference actor's params (algorithm.kl_coef > 0): on host except around its ref_logprob pass
    ref_params: bool = True


@dataclass
class ActorConfig:
    """The trained policy: parallel layout and optimizer (``actor.*``)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages per PP rank; null = no interleaving
    dp: int | None = None  # null = derived from the world size; if set, must match it
    micro_batch_size: int = 4
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1234
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "micro_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"actor.{name}={value!r} must be a positive integer")
        if self.vpp is not None:
            if self.vpp < 1:
                raise ValueError(f"actor.vpp={self.vpp} must be >= 1, or null for no interleaving")
            if self.vpp > 1 and self.pp < 2:
                raise ValueError(f"actor.vpp={self.vpp} needs actor.pp >= 2; set actor.vpp=null")
        if self.dp is not None and self.dp < 1:
            raise ValueError(f"actor.dp={self.dp} must be >= 1, or null to derive it from the world size")
        if self.lr <= 0:
            raise ValueError(f"actor.lr={self.lr} must be > 0")
        if self.grad_clip < 0:
            raise ValueError(f"actor.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
