"""HF safetensors <-> megatron TP x PP (x VPP) shards, driven by :mod:`megatron_backend.layout`.

Loading streams: each rank opens only the safetensors files that hold its tensors and reads only its
slices through ``safe_open(...).get_slice`` (never the whole model). :func:`gather_hf_state_dict` gathers
the primary pieces of every rank to one rank as full HF tensors, for in-memory comparisons (tests, parity);
a HF directory is written streaming from the distributed checkpoint instead (:mod:`megatron_backend.hf_export`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from megatron_backend.layout import (
    ModelShape,
    RankLayout,
    SlicePiece,
    local_param_shapes,
    num_covered,
    rank_pieces,
)
from modelspec.family import hf_tensor_shapes


def safetensors_index(hf_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (sharded or single-file checkpoints)."""

    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


# rows read at once by the finite check: bounds its memory to ~this many bytes per tensor
FINITE_CHECK_CHUNK_BYTES = 64 << 20


def verify_hf_checkpoint(hf_dir: str | Path, shape: ModelShape) -> None:
    """Every safetensors file of ``hf_dir`` present and whole, holding every tensor the model needs in its
    shape (headers only), and every value of those tensors finite (read file by file, a bounded block of
    rows at a time: a disk read of the model, seconds for the experiments here). Raises ValueError naming
    the file and the tensor."""

    hf_dir = Path(hf_dir)
    index_file = hf_dir / "model.safetensors.index.json"
    try:
        index = safetensors_index(hf_dir)
    except FileNotFoundError as exc:
        raise ValueError(f"{exc}; point model.path at a complete HF checkpoint directory") from None
    except SafetensorError as exc:
        raise ValueError(f"{hf_dir / 'model.safetensors'} is truncated or corrupt ({exc}); download it again") from None
    expected = hf_tensor_shapes(shape)
    missing = sorted(set(expected) - set(index))
    if missing:
        raise ValueError(
            f"{index_file if index_file.is_file() else hf_dir / 'model.safetensors'} lacks tensors "
            f"{missing[:3]}{' ...' if len(missing) > 3 else ''} of this {shape.model_type} model; the checkpoint is "
            "incomplete or of another architecture"
        )
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in expected:
        by_file[index[name]].append(name)
    for file, names in sorted(by_file.items()):
        if not file.is_file():
            raise ValueError(f"{file} is missing (listed in {index_file.name}); download the checkpoint's shards again")
        try:
            with safe_open(str(file), framework="pt") as handle:
                present = set(handle.keys())
                for name in names:
                    if name not in present:
                        raise ValueError(f"{file} lacks {name} (listed there by {index_file.name}); download it again")
                    got = tuple(handle.get_slice(name).get_shape())
                    if got != expected[name]:
                        raise ValueError(
                            f"{file}: {name} has shape {list(got)}, config.json implies {list(expected[name])}; "
                            "the weights and config.json are of different models"
                        )
        except SafetensorError as exc:
            raise ValueError(f"{file} is truncated or corrupt ({exc}); download it again") from None
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(names):
                _check_finite(handle, file, name)


def _check_finite(handle, file: Path, name: str) -> None:
    """A NaN or inf in a checkpoint surfaces much later as a sampling error naming nothing: name it here."""
    piece = handle.get_slice(name)
    dims = piece.get_shape()
    row_bytes = max(1, int(torch.Size(dims[1:]).numel()) * 4)
    rows_per_chunk = max(1, FINITE_CHECK_CHUNK_BYTES // row_bytes)
    num_rows = dims[0] if dims else 1
    for start in range(0, num_rows, rows_per_chunk):
        block = piece[start : start + rows_per_chunk] if dims else handle.get_tensor(name)
        bad = ~torch.isfinite(block)
        if bad.any():
            first = bad.nonzero()[0].tolist()
            first[0] += start if dims else 0
            raise ValueError(
                f"{file}: {name} holds {int(bad.sum())} non-finite value(s) (NaN/inf), the first at {first}; the "
                "checkpoint is corrupt or diverged: restore it from its source or an earlier save"
            )


def _read_block(handle, piece: SlicePiece) -> torch.Tensor:
    """The HF block of one piece, read as a slice (only these bytes are materialized)."""
    sl = handle.get_slice(piece.hf_name)
    stop = piece.hf_start + piece.length
    if piece.dim == 0:
        return sl[piece.hf_start : stop]
    return sl[:, piece.hf_start : stop]


def chunk_params(chunks) -> dict[tuple[int, str], torch.nn.Parameter]:
    return {(vp, name): p for vp, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}


def check_params_match_layout(chunks, shape: ModelShape, layout: RankLayout) -> None:
    """The built model and the layout module must agree on every name and local shape."""
    params = chunk_params(chunks)
    expected = local_param_shapes(shape, layout)
    got = {key: tuple(p.shape) for key, p in params.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise RuntimeError(f"model/layout mismatch: missing {missing}, unexpected {extra}, wrong shape {wrong}")


@torch.no_grad()
def load_hf_into_chunks(chunks, hf_dir: str | Path, shape: ModelShape, layout: RankLayout) -> int:
    """Fill this rank's chunks from the HF checkpoint; returns the number of bytes read from disk."""

    check_params_match_layout(chunks, shape, layout)
    params = chunk_params(chunks)
    pieces = rank_pieces(shape, layout)
    index = safetensors_index(hf_dir)
    missing = sorted({p.hf_name for p in pieces} - set(index))
    if missing:
        raise KeyError(f"{hf_dir} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    covered = num_covered(pieces, local_param_shapes(shape, layout))
    for key, param in params.items():
        if covered.get(key, 0) != param.numel():  # vocab padding rows: zero (their logits are masked)
            param.zero_()
    by_file: dict[Path, list[SlicePiece]] = defaultdict(list)
    for piece in pieces:
        by_file[index[piece.hf_name]].append(piece)
    num_bytes_read = 0
    for file, file_pieces in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for piece in file_pieces:
                block = _read_block(handle, piece)
                num_bytes_read += block.numel() * block.element_size()
                target = params[(piece.vp_stage, piece.megatron_name)]
                target.data.narrow(piece.dim, piece.local_start, piece.length).copy_(block)
    return num_bytes_read


def local_shards(params: dict, shape: ModelShape, layout: RankLayout, primary_only: bool = True):
    """This rank's (piece, local block view) pairs of ``params`` ((vp_stage, megatron name) -> tensor, as
    :func:`chunk_params` gives): what a weight-sync planner moves, no copies."""
    out = []
    for piece in rank_pieces(shape, layout):
        if primary_only and not piece.primary:
            continue
        param = params[(piece.vp_stage, piece.megatron_name)]
        out.append((piece, param.detach().narrow(piece.dim, piece.local_start, piece.length)))
    return out


def gather_hf_state_dict(
    chunks, shape: ModelShape, layout: RankLayout, dp_rank: int = 0, dst: int = 0, expert_dp_rank: int = 0
) -> dict[str, torch.Tensor] | None:
    """Full HF tensors on global rank ``dst`` (None elsewhere). Only DP rank 0 contributes, and for the
    experts (which EP spreads over the DP ranks) expert-DP rank 0."""
    return gather_hf_tensors(chunk_params(chunks), shape, layout, dp_rank, dst, expert_dp_rank)


def gather_hf_tensors(
    params: dict,
    shape: ModelShape,
    layout: RankLayout,
    dp_rank: int = 0,
    dst: int | None = 0,
    expert_dp_rank: int = 0,
    names: set[str] | None = None,
    group=None,
) -> dict[str, torch.Tensor] | None:
    """:func:`gather_hf_state_dict` of ``params`` (:func:`chunk_params`' keys); ``names``: only those HF
    tensors; ``dst`` None: on every rank of ``group``."""
    blocks = [
        (piece, block.cpu().clone())
        for piece, block in local_shards(params, shape, layout)
        if (expert_dp_rank if piece.is_expert else dp_rank) == 0 and (names is None or piece.hf_name in names)
    ]
    if not dist.is_initialized():  # one process holds the whole model
        gathered = [blocks]
    elif dst is None:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, blocks, group=group)
    else:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(blocks, gathered, dst=dst)
        if dist.get_rank() != dst:
            return None
    full_shapes = {n: s for n, s in hf_tensor_shapes(shape).items() if names is None or n in names}
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = defaultdict(int)
    seen: set[tuple] = set()  # replicated pieces (norms) arrive from every TP rank: count once
    for rank_blocks in gathered:
        for piece, block in rank_blocks:
            key = (piece.hf_name, piece.dim, piece.hf_start, piece.length)
            if key in seen:
                continue
            seen.add(key)
            if piece.hf_name not in out:
                out[piece.hf_name] = torch.empty(full_shapes[piece.hf_name], dtype=block.dtype)
            out[piece.hf_name].narrow(piece.dim, piece.hf_start, piece.length).copy_(block)
            filled[piece.hf_name] += block.numel()
    incomplete = [n for n, s in full_shapes.items() if filled.get(n, 0) != torch.Size(s).numel()]
    if incomplete:
        raise RuntimeError(f"export did not cover every element of {incomplete[:5]}")
    return out
