"""The actor's states it hands to the host and back: its params, grad buffers and optimizer states.

Each state is a list of tensors found on the model and the optimizer, counted in the memory ledger under its tag
(``colocation.phases.HOLDERS``) and moved by its own :class:`~megatron_backend.memory.StorageOffloader`
(bit-exact; the mechanism is :mod:`megatron_backend.memory`'s). Grads are released and handed back zeroed,
never copied: the next pass zeroes them before use.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from colocation.phases import HOLDERS
from configs.actor import OffloadConfig
from megatron_backend.actor_model import ActorModel
from megatron_backend.memory import MemoryLedger, StorageOffloader, storage_bytes

# what offload / onload take -> its memory tag: the step's own translation (colocation.phases.HOLDERS)
TAGS = {name: state for state, (holder, name) in HOLDERS.items() if holder == "actor"}
OFFLOADABLE = tuple(TAGS)  # ("params", "grads", "optimizer")


class ActorStates:
    """The tensors of each state of ``model`` (and of the optimizer once :meth:`track_optimizer` is called), their
    ledger counts, and their offload to host / onload back. ``switches``: what a plain :meth:`offload` moves."""

    def __init__(self, model: ActorModel, ledger: MemoryLedger, switches: OffloadConfig):
        self.model, self.ledger, self.switches = model, ledger, switches
        self.optimizer = None
        self._offloaders = {
            what: StorageOffloader(TAGS[what], ledger, keep_contents=what != "grads") for what in OFFLOADABLE
        }
        self.count("params")

    def track_optimizer(self, optimizer) -> None:
        """Take the grad buffers and the states of ``optimizer`` (megatron's, over the model's DDP wrappers) in."""
        self.optimizer = optimizer
        self.count("grads")
        # bf16/fp16: megatron builds the fp32 masters with the optimizer (the moments come at the first step);
        # uncounted, an offload before the first step would take the tag below zero and inflate the launch's
        # runtime level
        self.count("optimizer")

    def count(self, what: str) -> None:
        """Set the ledger's resident bytes of ``what`` to its tensors' storages."""
        self.ledger.set(TAGS[what], resident_bytes=storage_bytes(self.tensors(what)))

    def tensors(self, what: str) -> list[torch.Tensor]:
        """The tensors of one state (``OFFLOADABLE``) as they are now (their storages empty while offloaded)."""
        return {"params": self._params, "grads": self._grads, "optimizer": self._optimizer_states}[what]()

    def _params(self) -> list[torch.Tensor]:
        return [p.data for chunk in self.model.chunks for p in chunk.parameters()]

    def _grads(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [
            buf.grad_data
            for model in self.model.models
            for buf in list(model.buffers) + list(model.expert_parallel_buffers)
            if buf.grad_data is not None
        ]

    def _optimizer_states(self) -> list[torch.Tensor]:
        """Adam moments (and megatron's fp32 master copies of bf16/fp16 params)."""
        if self.optimizer is None:
            return []
        tensors, stack = [], [self.optimizer]
        device = next(self.model.chunks[0].parameters()).device.type
        while stack:  # megatron: ChainedOptimizer -> MegatronOptimizer -> torch optimizer
            opt = stack.pop()
            if hasattr(opt, "chained_optimizers"):
                stack.extend(opt.chained_optimizers)
                continue
            torch_opt = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
            for state in torch_opt.state.values():
                # the device's only: a HybridDeviceOptimizer's host part (actor.optimizer_offload_fraction) stays
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.device.type == device]
            for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
                for group in getattr(opt, attr, None) or []:
                    tensors += [p.data for p in group if p is not None]  # None: the optimizer keeps the masters
        # never the params' storage: a HybridDeviceOptimizer's state holds its param as ``master_param``
        # (hybrid_optimizer.py, _sync_sub_optimizers_state_to_hdo), a view of DDP's param buffer for float32
        params = {p.untyped_storage().data_ptr() for p in self._params()}
        return [t for t in tensors if t.untyped_storage().data_ptr() not in params]

    def _selected(self, what: str | Iterable[str] | None) -> list[str]:
        if what is None:  # the switches of actor.offload
            return [w for w in OFFLOADABLE if getattr(self.switches, w)]
        names = [what] if isinstance(what, str) else list(what)
        bad = [w for w in names if w not in OFFLOADABLE]
        if bad:
            raise ValueError(f"cannot offload {bad}; choose from {OFFLOADABLE}")
        return names

    def offload(self, what: str | Iterable[str] | None = None) -> dict[str, int]:
        """Move params / grad buffers / optimizer states to host; returns bytes released per tag."""
        released = {}
        for name in self._selected(what):
            with self.ledger.op(f"offload_{name}"):
                released[TAGS[name]] = self._offloaders[name].offload(self.tensors(name))
        return released

    def onload(self, what: str | Iterable[str] | None = None) -> dict[str, int]:
        """Bring back what :meth:`offload` moved (bit-exact); returns bytes restored per tag."""
        restored = {}
        for name in self._selected(what):
            with self.ledger.op(f"onload_{name}"):
                restored[TAGS[name]] = self._offloaders[name].onload()
        return restored

    def require_onloaded(self, op: str, needed: tuple[str, ...] = OFFLOADABLE) -> None:
        """Raise unless every state ``op`` needs is on the device."""
        away = [w for w in needed if self._offloaders[w].offloaded]
        if away:
            raise RuntimeError(f"{op} needs {away} on the device; call actor.onload({away}) first")
