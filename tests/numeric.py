"""Tolerances for one quantity computed two ways (another TP/PP/VPP layout, chunking, packing, a resume).

Where the layout is the same the tests ask for bit-exact equality. Where it changes, floating-point sums run
in another order (and the CPU's kernels pick their blocking by ISA and thread count), so the results differ
in their last bits: the bound is a number of units in the last place (ulps) of the compared quantity's
dtype at its scale (its largest magnitude), never a constant that holds on one machine only.
`make test-threads` runs every `numeric`-marked test again with other thread counts.
"""

from __future__ import annotations

import torch

# Reduction order alone: a few ulps per rounding, summed over a model's depth and a tensor-parallel split.
LAYOUT_ULPS = 64


def ulp_tolerance(scale: torch.Tensor | float, dtype: torch.dtype = torch.float32, ulps: int = LAYOUT_ULPS) -> float:
    """``ulps`` units in the last place of ``dtype`` at ``scale`` (a tensor: its largest magnitude)."""
    magnitude = scale.detach().abs().max().item() if isinstance(scale, torch.Tensor) else abs(scale)
    return ulps * torch.finfo(dtype).eps * magnitude


def max_abs_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.detach() - ref.detach()).abs().max().item()


def assert_close_across_layouts(got, ref, what: str, *, ulps: int = LAYOUT_ULPS, scale=None) -> None:
    """|got - ref| <= ``ulps`` ulps of ``ref``'s dtype at ``scale`` (default: ``ref``'s largest magnitude).

    ``got``/``ref`` are tensors, floats, or dicts of them (compared key by key, each at its own scale).
    """
    if isinstance(ref, dict):
        assert set(got) == set(ref), (what, set(got) ^ set(ref))
        for key in ref:
            assert_close_across_layouts(got[key], ref[key], f"{what} {key}", ulps=ulps, scale=scale)
        return
    dtype = ref.dtype if isinstance(ref, torch.Tensor) else torch.float32
    tolerance = ulp_tolerance(ref if scale is None else scale, dtype, ulps)
    diff = max_abs_diff(got, ref) if isinstance(ref, torch.Tensor) else abs(got - ref)
    assert diff <= tolerance, f"{what}: |diff| {diff:.3g} > {ulps} ulps of {dtype} at its scale = {tolerance:.3g}"
