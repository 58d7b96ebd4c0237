"""``weight_sync.check_every``: the engine's weights against the actor's own, by a path that shares nothing
with the transfer plan.

``weight_sync.verify`` compares what was sent with what arrived along the plan's transfers, so a wrong plan
(or a write into the engine after the sync) passes it. Here the reference is the actor's full HF tensor,
gathered from its TP/PP/EP shards by the export's gather (:func:`megatron_backend.checkpoint.gather_hf_tensors`),
and each engine slice is cut from it by the family's HF mapping the engine's loader uses
(:func:`rollout.layout.vllm_param_layouts`); they must agree bit for bit. A mismatch is evidence of a wrong
layout, never of rounding (the log-prob gap cannot tell the two apart in bf16), so it stops the run.

Sample: check i covers every HF tensor of layer i mod L (a layout is per kind and the same in every layer,
so one layer shows every kind's), plus the vocab tensors and the final norm on every L-th check, the
first included. Cost per check: one layer's weights (1/L of the decoder) all-gathered to every rank on the host
and compared there; the vocab tensors every L-th check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_backend.checkpoint import gather_hf_tensors
from modelspec import ColocatedMesh, ModelShape
from modelspec.family import HF_LAYER, hf_tensor_shapes
from rollout.layout import engine_expert_split, local_view, vllm_param_layouts
from weight_sync.layouts import actor_rank_layout
from weight_sync.verify import _BITS

_LAYER = HF_LAYER


def host_group() -> dist.ProcessGroup | None:
    """The world over gloo, for the check's object gathers (collective: every rank calls it, in the same order).
    all_gather_object over NCCL serialises into device byte tensors, padded to the largest rank's and gathered
    [world x largest] on every GPU (torch 2.13 distributed_c10d.py, _object_to_tensor / all_gather_object): tens of
    GiB at 8 GPUs for one layer of an 8B model. Over gloo they stay on the host. None where the world is gloo."""
    if not dist.is_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


class WeightLayoutError(RuntimeError):
    """An engine slice differs from the same slice of the actor's own full tensor: the layout is wrong."""


def sample_names(shape: ModelShape, check_index: int) -> set[str]:
    """The HF tensors check ``check_index`` compares (see the module doc)."""
    layer = check_index % shape.num_layers
    out = set()
    for name in hf_tensor_shapes(shape):
        match = _LAYER.search(name)
        if (int(match.group(1)) == layer) if match else layer == 0:
            out.add(name)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bits, not values: -0.0 == 0.0 and NaN != NaN would hide or invent a difference
    bits = _BITS[a.dtype]
    return a.shape == b.shape and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


@dataclass(frozen=True)
class ReferenceCheck:
    """The check for one model on one mesh (every rank holds the same)."""

    shape: ModelShape
    mesh: ColocatedMesh
    te_norms: bool = False
    # the world over gloo (:func:`host_group`): the gathered objects stay in host memory; None: the default group
    group: dist.ProcessGroup | None = None

    @torch.no_grad()
    def __call__(
        self, rank: int, src_tensors: dict, dst_tensors: dict, names: set[str], group: dist.ProcessGroup | None = None
    ) -> int:
        """Compare this rank's engine slices of ``names`` with the actor's; collective over ``group`` (default:
        the check's own, the world); raises :class:`WeightLayoutError` on every rank with the first mismatch's
        line. Returns how many slices this rank compared."""
        group = group if group is not None else self.group

        c = self.mesh.actor_coords(rank)
        layout = actor_rank_layout(self.mesh, rank, self.te_norms)
        full = gather_hf_tensors(src_tensors, self.shape, layout, c.dp_rank, None, c.expert_dp_rank, names, group)
        split = engine_expert_split(self.mesh, rank)
        engine = vllm_param_layouts(self.shape, self.mesh.rollout_tp, self.mesh.rollout_tp_rank(rank), split)
        bad, checked = None, 0
        for param in engine:
            for spec in param.slices:
                if spec.hf_name not in full or bad:
                    continue
                got = local_view(dst_tensors[param.name], spec).cpu()
                want = full[spec.hf_name].narrow(spec.dim, spec.hf_start, spec.length).to(got.dtype)
                checked += 1
                if not _same_bits(got, want):
                    expert = "" if spec.expert is None else f"[expert {spec.expert}]"
                    bad = (
                        f"weight sync check failed: engine rank {rank} {param.name}{expert}[dim {spec.dim}, "
                        f"{spec.local_start}:{spec.local_start + spec.length}] is not the actor's {spec.hf_name}"
                        f"[dim {spec.dim}, {spec.hf_start}:{spec.hf_stop}] (the layout is wrong, not rounded)"
                    )
        lines = [bad]
        if dist.is_initialized():
            lines = [None] * dist.get_world_size(group)
            dist.all_gather_object(lines, bad, group=group)
        first = next((line for line in lines if line), None)
        if first:
            raise WeightLayoutError(first)
        return checked
