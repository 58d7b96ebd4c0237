"""A Hugging Face checkpoint written from the actor's distributed checkpoint (torch_dist), streaming.

The actor saves its params as megatron-core ``ShardedTensor`` s (:mod:`megatron_backend.dist_checkpoint`):
each key holds one megatron parameter as a *global* tensor whatever the saving layout was (the TP split
and, for the decoder layers, a leading layer axis are global offsets in the checkpoint's metadata). So the
global tensors are the TP=1 x PP=1 layout's parameters, and :func:`megatron_backend.layout.rank_pieces` of
that layout says which block of which HF tensor each of their row / column blocks is (the families' HF
names, fused tensors and q/k/v grouping all come from there; MoE experts are read from megatron's one key
per layer with a leading expert axis, :data:`_EXPERT_PARAM`). Vocab padding: the checkpoint's embedding /
output layer has the saving TP's padded rows; only the first ``vocab_size`` are read.

Streaming: the HF tensors are assigned to safetensors files up front (each at most ``max_shard_bytes``,
in the order of :func:`modelspec.family.hf_tensor_shapes`). A file's header is known from the plan, so the
file is written tensor by tensor: each HF tensor is assembled by reading exactly its blocks from the
checkpoint (``torch.distributed.checkpoint``'s ``FileSystemReader`` with a planner that asks for those
regions only; it reads one stored chunk at a time), written, and dropped. Host memory: the largest HF
tensor plus one stored chunk of the checkpoint (one saving rank's shard of one layer's parameter), never the
model. ``safetensors.torch.save_file`` would hold a whole file plus a bytes copy of it, hence the writer
here (the safetensors format: 8-byte header length, JSON header, raw little-endian data).

No process group is needed (``no_dist``): one process exports everything, or N processes (the run's ranks in
the loop) each write the files ``index % N == rank``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint import FileSystemReader, load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_backend.checkpoint import safetensors_index
from megatron_backend.dist_checkpoint import save_params
from megatron_backend.layout import RankLayout, SlicePiece, rank_pieces
from modelspec import ModelShape
from modelspec.family import hf_tensor_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 2 << 30
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_LAYER_KEY_PREFIX = "decoder.layers."
# an expert's parameter in the model (SequentialMLP | TEGroupedMLP): (layer prefix, expert, linear_fc1|2, expert)
_EXPERT_PARAM = re.compile(
    r"(decoder\.layers\.\d+\.)mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight"
    r"|(linear_fc[12])\.weight(\d+))"
)


@dataclass(frozen=True)
class ExportPlan:
    """Which HF tensors go to which file, and their shapes (what the source checkpoint holds)."""

    files: list[tuple[str, list[str]]]  # (file name, HF tensor names in it, in write order)
    shapes: dict[str, tuple[int, ...]]
    tied_copies: dict[str, str]  # HF name -> the HF name it copies (a tied lm_head the source stores)
    dtype: torch.dtype

    @property
    def total_bytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(s) for s in self.shapes.values()) * size


def plan_export(
    shape: ModelShape, dtype: torch.dtype, max_shard_bytes: int, source_names: set[str] | None = None
) -> ExportPlan:
    """The files of the export. ``source_names``: the tensors of the source HF checkpoint (None: the family's
    own list); with tied embeddings a source that also stores ``lm_head.weight`` gets it again (a copy)."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"export dtype {dtype} is not one of {sorted(str(d) for d in _SAFETENSORS_DTYPES)}")
    shapes = hf_tensor_shapes(shape)
    tied_copies = {}
    family = shape.family
    if source_names is not None:
        if shape.tie_word_embeddings and family.lm_head in source_names:
            shapes[family.lm_head] = shapes[family.embed]
            tied_copies[family.lm_head] = family.embed
        missing, extra = sorted(set(shapes) - source_names), sorted(source_names - set(shapes))
        if missing or extra:
            raise ValueError(
                f"the source checkpoint's tensors differ from what the {shape.model_type} model holds "
                f"(missing there: {missing[:3]}, extra there: {extra[:3]}); export from a run of that checkpoint"
            )
    element = torch.empty((), dtype=dtype).element_size()
    groups: list[list[str]] = [[]]
    size = 0
    for name, dims in shapes.items():
        num_bytes = math.prod(dims) * element
        if groups[-1] and size + num_bytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += num_bytes
    if len(groups) == 1:
        files = [(SINGLE_FILE, groups[0])]
    else:
        files = [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]
    return ExportPlan(files=files, shapes=shapes, tied_copies=tied_copies, dtype=dtype)


def checkpoint_uses_te_norms(metadata) -> bool:
    return any(key.endswith("layer_norm_weight") for key in metadata.state_dict_metadata)


def global_pieces(shape: ModelShape, te_norms: bool) -> dict[str, list[SlicePiece]]:
    """HF name -> the blocks of the checkpoint's global tensors (the TP=1 x PP=1 layout) it is made of."""
    out: dict[str, list[SlicePiece]] = {}
    for piece in rank_pieces(shape, RankLayout(1, 1, None, 0, 0, te_norms)):
        if piece.primary:
            out.setdefault(piece.hf_name, []).append(piece)
    return out


_LOCAL_SPEC_NORM = (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")


def _holds(keys, name: str) -> bool:
    """Whether the checkpoint has ``name``, as its own key or in its layer-stacked key (see :func:`_region`)."""
    if name in keys:
        return True
    if not name.startswith(_LAYER_KEY_PREFIX):
        return False
    return _LAYER_KEY_PREFIX + name[len(_LAYER_KEY_PREFIX) :].split(".", 1)[-1] in keys


def _region(piece: SlicePiece, hf: torch.Tensor, keys) -> tuple[str, list[int], torch.Tensor]:
    """(checkpoint key, offsets of the piece's block in that global tensor, the view of ``hf`` it fills)."""
    dest = hf.narrow(piece.dim, piece.hf_start, piece.length)
    offsets = [0] * dest.dim()
    offsets[piece.dim] = piece.local_start
    name = piece.megatron_name
    expert = _EXPERT_PARAM.fullmatch(name)
    if expert and name not in keys:
        # megatron saves a layer's experts as one key with the (global) expert index as a leading axis
        # (SequentialMLP's local_experts.<e> and TEGroupedMLP's weight<e> alike); at the export's EP=1 layout
        # the local index is the global one: [1, *block] at offset [expert, *offsets]
        prefix, index, module, grouped_module, grouped_index = expert.groups()
        name = f"{prefix}mlp.experts.experts.{module or grouped_module}.weight"
        offsets, dest = [int(index if index is not None else grouped_index), *offsets], dest.unsqueeze(0)
    if _LOCAL_SPEC_NORM[0] in name and not _holds(keys, name):
        # megatron's local spec saves every layer's pre-MLP norm under TE's fused name, an MoE layer's too
        # (gpt_layer_specs.py's sharded_state_dict_keys_map, megatron-core 0.16.1); TE's spec keeps an MoE
        # layer's own pre_mlp_layernorm (the layout's name)
        name = name.replace(*_LOCAL_SPEC_NORM)
    if name.startswith(_LAYER_KEY_PREFIX) and name not in keys:
        # one key per parameter with the (global) layer index as a leading axis: megatron's layout for a
        # homogeneous decoder; [1, *block] at offset [layer, *offsets]
        layer, rest = name[len(_LAYER_KEY_PREFIX) :].split(".", 1)
        name = _LAYER_KEY_PREFIX + rest
        offsets, dest = [int(layer), *offsets], dest.unsqueeze(0)
    if name not in keys:
        raise ValueError(f"the checkpoint holds no tensor {name!r} (for {piece.hf_name}); it is not of this model")
    return name, offsets, dest


def _load_regions(reader, metadata, regions: list[tuple[str, list[int], torch.Tensor]]) -> None:
    """Fill each destination view with the block of the checkpoint key at ``offsets`` (of the view's shape);
    DCP reads each overlapping stored chunk and copies (casting) its overlap into the view."""

    by_key: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for key, offsets, dest in regions:
        by_key.setdefault(key, []).append((offsets, dest))

    class RegionPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, wanted in by_key.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=d.shape) for o, d in wanted]
                # each item's dest_index.index is the position of its chunk in ``chunks``
                items += create_read_items_for_chunk_list(key, metadata.state_dict_metadata[key], chunks)
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            dest = by_key[read_item.dest_index.fqn][read_item.dest_index.index][1]
            return narrow_tensor_by_index(dest, read_item.dest_offsets, read_item.lengths)

        def commit_tensor(self, read_item, tensor) -> None:
            pass  # the copy landed in the view already

    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        load({}, storage_reader=reader, planner=RegionPlanner(), no_dist=True)


def _safetensors_header(plan: ExportPlan, names: list[str]) -> bytes:
    """The safetensors header of one file: JSON of every tensor's dtype, shape and byte range, padded to 8."""
    element = torch.empty((), dtype=plan.dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    start = 0
    for name in names:
        num_bytes = math.prod(plan.shapes[name]) * element
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[plan.dtype],
            "shape": list(plan.shapes[name]),
            "data_offsets": [start, start + num_bytes],
        }
        start += num_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw little-endian bytes, no copy (bf16 through a uint8 view: numpy has no bf16)."""
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def write_files(
    actor_dir: str | Path,
    shape: ModelShape,
    plan: ExportPlan,
    out_dir: str | Path,
    rank: int = 0,
    world_size: int = 1,
    on_file: Callable[[str, int], None] | None = None,
) -> list[str]:
    """Write this process's files of ``plan`` (index % world_size == rank) into ``out_dir``; returns their
    names. ``on_file(name, bytes)`` after each file (progress)."""

    reader = FileSystemReader(str(actor_dir))
    metadata = reader.read_metadata()
    keys = metadata.state_dict_metadata
    pieces = global_pieces(shape, checkpoint_uses_te_norms(metadata))
    written = []
    for index, (file_name, names) in enumerate(plan.files):
        if index % world_size != rank:
            continue
        path = Path(out_dir) / file_name
        num_bytes = 0
        with open(path, "wb") as f:
            f.write(_safetensors_header(plan, names))
            for name in names:
                hf = torch.empty(plan.shapes[name], dtype=plan.dtype)
                source = plan.tied_copies.get(name, name)
                _load_regions(reader, metadata, [_region(p, hf, keys) for p in pieces[source]])
                f.write(_tensor_bytes(hf))
                num_bytes += hf.numel() * hf.element_size()
                del hf
        written.append(file_name)
        if on_file is not None:
            on_file(file_name, num_bytes)
    return written


def write_index(plan: ExportPlan, out_dir: str | Path) -> None:
    """``model.safetensors.index.json`` for a sharded export (nothing for a single file)."""
    if len(plan.files) == 1:
        return
    weight_map = {name: file_name for file_name, names in plan.files for name in names}
    index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
    (Path(out_dir) / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


# what a HF directory holds besides the weights and config.json, copied from the source checkpoint
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
GENERATION_CONFIG = "generation_config.json"


def source_tensor_names(source_dir: str | Path) -> set[str]:
    """The tensor names of the source HF checkpoint (safetensors headers only)."""

    return set(safetensors_index(source_dir))


def _write_config(source_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """The source's config.json with the export's dtype (``dtype``, and ``torch_dtype`` if it had that key)."""
    config = json.loads((source_dir / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_hf_dir(
    actor_dir: str | Path,
    shape: ModelShape,
    source_dir: str | Path,
    out_dir: str | Path,
    plan: ExportPlan,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = lambda: None,
    on_file: Callable[[str, int], None] | None = None,
    extra_files: dict[str, Path] | None = None,
    write: Callable[[Path], None] | None = None,
) -> Path:
    """Write the HF directory ``out_dir`` from the actor checkpoint ``actor_dir`` (every process calls it).

    Everything is written into ``.tmp-<name>`` beside ``out_dir`` and renamed into place by rank 0 at the
    end (an existing ``out_dir`` is replaced then); a failure (a full disk) leaves nothing under the
    name: the temporary directory is removed and the error raised. ``extra_files``: {name in OUT: file
    to copy there} (the run's config). ``write(tmp)``: writes every safetensors file of ``plan`` into ``tmp``
    instead of this process's share (``make export NPROC=<n>``: a pool of processes).
    """

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        if write is not None:
            write(tmp)
        else:
            write_files(actor_dir, shape, plan, tmp, rank, world_size, on_file)
        barrier()
        if rank == 0:
            write_index(plan, tmp)
            _write_config(source_dir, tmp, plan.dtype)
            for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
                if (source_dir / name).is_file():
                    shutil.copy(source_dir / name, tmp / name)
            for name, path in (extra_files or {}).items():
                shutil.copy(path, tmp / name)
            if out_dir.exists():
                trash = out_dir.with_name(f".trash-{out_dir.name}")
                shutil.rmtree(trash, ignore_errors=True)
                out_dir.rename(trash)
                tmp.rename(out_dir)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    return out_dir


def save_live(
    actor,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: dict[str, Path] | None = None,
) -> Path:
    """A HF directory of a live actor's weights, by the same path as a run's export (collective: every rank
    of the actor calls it): each rank saves its param shards as a params-only distributed checkpoint beside
    ``out_dir`` (DP replicas write once), then each writes its share of the HF files from it; no rank
    gathers the model. The params must be resident."""

    out_dir = Path(out_dir)
    params_dir = out_dir.with_name(f".params-{out_dir.name}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(params_dir, ignore_errors=True)
        params_dir.mkdir(parents=True)
    dist.barrier()
    try:
        save_params(actor.chunks, params_dir)
        dtype = dtype or getattr(torch, actor.dtype)
        plan = plan_export(actor.shape, dtype, max_shard_bytes, source_tensor_names(actor.hf_dir))
        write_hf_dir(
            params_dir, actor.shape, actor.hf_dir, out_dir, plan, rank, world_size, dist.barrier, None, extra_files
        )
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(params_dir, ignore_errors=True)
    return out_dir
