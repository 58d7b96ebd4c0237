"""Routing replay (R3) on megatron-core's ``RouterReplay``: the actor's MoE layers route the tokens the engine
routed to the experts the engine chose, and the actor's own routing is compared with the engine's.

megatron-core 0.16 (``transformer/moe/router_replay.py``): with ``moe_enable_routing_replay`` every
``TopKRouter`` holds a ``RouterReplay`` whose action decides its top-k: ``RECORD`` (compute it, keep the
indices), ``REPLAY_FORWARD`` (take ``target_topk_idx`` [N, k], gather the scores there) or None (compute it).
Its instances also sit in a process-global list that its static setters walk; the actor and the reference
actor live in one process, so :class:`ActorRouting` never uses those: it sets and clears only its own model's
instances, around each micro-batch's forward, and leaves them cleared (action None) after every pass.

The engine routed every token it ran (``Completion.routed_experts``): the prompt and all sampled tokens but
the last. A token it did not route (the last one, padding: nothing read depends on them) has target -1 and
routes as the actor would (:class:`PartialRouterReplay`), never to made-up experts.

Token order: megatron's router sees a micro-batch as [S, b, h] (padded; token s*b + j) or [T, 1, h] (packed
THD), so :class:`megatron_backend.packing.MicroBatch` carries the engine's routing in that order. Under expert
parallelism each rank routes its own micro-batch's tokens before the dispatcher's all-to-all moves them, so
every rank replays its own share. TP ranks without sequence parallelism route the same tokens; with it
(``actor.sequence_parallel``) TP rank r routes the r-th of TP equal chunks of the sequence dim ([S / tp, b] or
[T / tp]: a contiguous range of the flattened order), so it takes that range of the routing.

Activation recompute: a recomputed router reruns in backward with the action of the pass then current; with
PP = 1 megatron runs each micro-batch's backward right after its forward, so the targets set for it are still
in place. With PP > 1 (1F1B) they are not: ``RunConfig`` refuses replay with a recompute that reruns routers there.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_backend.parallel import ParallelDims
from modelspec import ModelShape

NOT_ROUTED = -1  # the engine's routing of a token it did not run through the model


class PartialRouterReplay(RouterReplay):
    """megatron's ``RouterReplay`` where a token whose target row is :data:`NOT_ROUTED` routes by its own
    top-k; in ``REPLAY_FORWARD`` it also records the actor's own top-k (what it would have routed)."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.record_indices(own)
        target = self.target_topk_idx.to(scores.device)  # [N, k]
        recorded = (target >= 0).all(dim=-1, keepdim=True)  # [N, 1]
        top_indices = torch.where(recorded, target, own)
        return scores.gather(1, top_indices), top_indices


def enable_partial_replay(chunks) -> list[list[tuple[int, PartialRouterReplay]]]:
    """Give every router of ``chunks`` (built with ``moe_enable_routing_replay``) a :class:`PartialRouterReplay`
    and take this model's instances out of megatron's process-global list (only :class:`ActorRouting` drives
    them). Returns per chunk [(router's global 0-based layer, its replay)] in layer order."""
    per_chunk = []
    for chunk in chunks:
        routers = []
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and module.router_replay is not None:
                replay = PartialRouterReplay()
                for instance in (module.router_replay, replay):
                    RouterReplay.global_router_replay_instances.remove(instance)
                module.router_replay = replay
                routers.append((module.layer_number - 1, replay))
        per_chunk.append(sorted(routers, key=lambda entry: entry[0]))
    return per_chunk


class ActorRouting:
    """One actor's routers: replay the engine's routing into a micro-batch's forward, or record the actor's
    own and count the tokens whose top-k set differs from the engine's."""

    def __init__(self, chunks, shape: ModelShape, dims: ParallelDims, sequence_parallel: bool) -> None:
        self.dims, self.sequence_parallel = dims, sequence_parallel
        # per chunk [(MoE-layer ordinal, replay)]: the ordinal indexes dim 1 of MicroBatch.routed_experts
        self.routers = [
            [(shape.moe_layers.index(layer), replay) for layer, replay in chunk]
            for chunk in enable_partial_replay(chunks)
        ]
        self.mismatch = torch.zeros(2, dtype=torch.float64)  # [tokens x layers whose set differs, compared]

    @contextmanager
    def forward(self, chunk_index: int, mb, replay: bool, record: bool):
        """Around one micro-batch's forward through chunk ``chunk_index``: targets set (replay) or the action
        RECORD (record); afterwards (record) the mismatch counted and every instance of the chunk cleared."""
        routers = self.routers[chunk_index]
        routed, counted = self._tp_share(mb.routed_experts), self._tp_share(mb.routing_counted)  # host memory
        device = self.dims.device
        for moe_layer, router in routers:
            if replay:  # [N, k] int64 on the device, kept until the pass ends
                router.set_target_indices(routed[:, moe_layer].to(device, torch.long))
                router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            elif record:
                router.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
            if record and not replay:
                for moe_layer, router in routers:
                    engine = routed[:, moe_layer].to(device, torch.long)
                    self.mismatch += count_mismatch(router.get_recorded_indices(), engine, counted)
        finally:
            for _, router in routers:
                if not replay:  # replay's targets stay until the pass ends: a recomputed router reads them
                    router.clear_indices()
                    router.clear_router_replay_action()

    def _tp_share(self, per_token: torch.Tensor) -> torch.Tensor:
        """[N, ...] in the router's order -> the tokens this TP rank routes (all of them without SP)."""
        if not self.sequence_parallel:
            return per_token
        share = per_token.shape[0] // self.dims.tp  # packing pads N to a multiple of TP under SP
        return per_token[self.dims.tp_rank * share : (self.dims.tp_rank + 1) * share]

    def clear(self) -> None:
        """Every instance of this actor back to plain routing (after a pass)."""
        for routers in self.routers:
            for _, router in routers:
                router.clear_indices()
                router.clear_router_replay_action()

    def take_mismatch_fraction(self) -> float:
        """The recorded passes' mismatch fraction over the PP stages, DP ranks and, under SP (each its own
        tokens), TP ranks (collective); resets it."""
        dims = self.dims
        counts = self.mismatch.to(dims.device)
        if self.sequence_parallel:
            dist.all_reduce(counts, group=dims.tp_group)
        if dims.pp > 1:
            dist.all_reduce(counts, group=dims.pp_group)
        if dims.dp > 1:
            dist.all_reduce(counts, group=dims.dp_group)
        self.mismatch = torch.zeros(2, dtype=torch.float64)
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0


def count_mismatch(own: torch.Tensor, engine: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """[mismatched, compared] over the ``counted`` tokens [N] bool: own [N, k] vs the engine's [N, k] top-k,
    compared as sets (the order within the top-k does not change the layer's output)."""
    counted = counted.to(own.device) & (engine.to(own.device) >= 0).all(dim=-1)
    differs = (own.sort(dim=-1).values != engine.to(own.device).sort(dim=-1).values).any(dim=-1)
    return torch.tensor([float((differs & counted).sum()), float(counted.sum())], dtype=torch.float64)
