"""Micro-batches for the actor: which sequences go together, and the tensors the model and loss get.

A batch (``modelspec.TokenBatch``) is right-padded: ``input_ids`` [B, S], ``loss_mask`` [B, S-1], optional
``seq_lens`` [B] (real prompt + response tokens of each row; without it every row counts as S tokens).

Grouping (:func:`partition`): ``max_tokens=None`` keeps the fixed ``micro_batch_size`` split in batch
order. With a token budget, packed micro-batches are balanced bins of real tokens (longest first into
the lightest bin, more bins until each fits the budget or holds one sequence); padded micro-batches
hold ``max_tokens // S`` rows. ``min_count`` raises the number of micro-batches (the same count on
every DP rank; >= PP for the interleaved schedule).

Layouts (:func:`build_micro_batch`):

- padded: tokens [b, S], positions 0..S-1, no ``PackedSeqParams``; logits [b, S, V_local];
- packed (THD): the b sequences concatenated, tokens [1, T] with T = sum of their lengths, positions
  restarting at 0 per sequence, ``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv [b+1] int32,
  max_seqlen_q/kv)``; logits [1, T, V_local].

With ``pad_to`` > 1 (megatron's sequence parallelism splits the model's token dim over TP ranks) the
model's token count becomes a multiple of it: padded rows get pad columns on the right (S rounded up),
a packed micro-batch one more THD sequence of pad tokens (T rounded up; its own attention span, positions
from 0). Causal attention keeps either from reaching a real token; no row reads them.

``padding_mask`` [b, S'] or [1, T] bool is True on every token that is not a sequence's (a padded row's
right padding, the TP pad columns or the pad sequence): megatron's MoE routers leave those out of their
load-balancing and z losses (``GPTModel.forward(padding_mask=)``, True = padding as
``moe_utils.compute_routing_scores_for_aux_loss`` reads it). They are still routed and computed, and no row
reads them.

Either way ``rows`` [M] are the rows of the flattened logits whose next-token log-prob is wanted
(every real target, or with ``response_only`` those under ``loss_mask``), ``targets``
[M] the next tokens, and ``dense_index`` [M] where each value goes in the micro-batch's
[b, S-1] log-prob tensor (what the loss reads; zeros elsewhere). The loss's totals are the whole
batch's, so how a batch is split never changes the loss (``rl.losses``' ``BatchTotals``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from modelspec.contract import TokenBatch


@dataclass
class MicroBatch:
    """One micro-batch in the model's layout, plus what maps its outputs back to the batch."""

    index: torch.Tensor  # [b] int64: the batch rows it holds
    input_ids: torch.Tensor  # [b, S] padded or [1, T] packed
    position_ids: torch.Tensor  # same shape as input_ids
    packed_seq_params: object | None  # megatron PackedSeqParams (THD) or None (padded)
    rows: torch.Tensor  # [M] int64 rows of the flattened logits [b*S or T, V_local]
    targets: torch.Tensor  # [M] int64 token ids
    dense_index: torch.Tensor  # [M] int64 positions in the flattened [b, S-1] output
    data: TokenBatch  # the batch's rows ([b, ...]): what the loss function reads
    num_model_tokens: int  # tokens the model runs on (b*S padded, T packed)
    # MoE, when the batch has the engine's routing: [N, num_moe_layers, top_k] int16 in the router's token order
    # (N = num_model_tokens: s*b + j padded, the packed order packed; -1 where the engine did not route), and
    # [N] bool: the tokens whose output is a response log-prob (input positions under loss_mask); both in host
    # memory: the routers take their layer's [N, k] to the device (megatron_backend/routing_replay.py)
    routed_experts: torch.Tensor | None = None
    routing_counted: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None  # same shape as input_ids: True on tokens of no sequence

    @property
    def num_seqs(self) -> int:
        return int(self.index.numel())

    @property
    def dense_shape(self) -> tuple[int, int]:
        return self.num_seqs, self.data.input_ids.shape[1] - 1

    def to_dense(self, values: torch.Tensor) -> torch.Tensor:
        """[M] per-row values -> [b, S-1] (zeros where nothing was computed), differentiable."""
        b, width = self.dense_shape
        out = values.new_zeros(b * width)
        return out.index_copy(0, self.dense_index, values).view(b, width)


def sequence_lengths(batch: TokenBatch) -> torch.Tensor:
    """[B] int64 real tokens per row: ``seq_lens`` when the batch has it, else the padded width S."""
    num_seqs, width = batch.input_ids.shape
    if batch.seq_lens is None:
        return torch.full((num_seqs,), width, dtype=torch.long)
    lens = batch.seq_lens.to("cpu", torch.long)
    if lens.shape != (num_seqs,) or int(lens.min()) < 1 or int(lens.max()) > width:
        raise ValueError(f"batch.seq_lens must be [{num_seqs}] with values in 1..{width}, got {lens.tolist()}")
    return lens


def balanced_bins(lengths: list[int], num_bins: int, max_count: int | None = None) -> list[list[int]]:
    """Greedy longest-first: each sequence goes to the bin with the fewest tokens (that holds fewer than
    ``max_count`` sequences); each bin in ascending index order. Deterministic: every rank gets the same."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        open_bins = (b for b in range(num_bins) if max_count is None or len(bins[b]) < max_count)
        target = min(open_bins, key=lambda b: (loads[b], len(bins[b]), b))
        bins[target].append(i)
        loads[target] += lengths[i]
    return [sorted(b) for b in bins]


def partition(
    lengths: list[int],
    micro_batch_size: int,
    max_tokens: int | None = None,
    packed: bool = True,
    padded_len: int | None = None,
    min_count: int = 1,
) -> list[list[int]]:
    """Sequence indices of each micro-batch (see the module doc). Never an empty micro-batch."""
    num_seqs = len(lengths)
    if num_seqs == 0:
        raise ValueError("cannot split an empty batch into micro-batches")
    if max_tokens is None:
        if num_seqs % micro_batch_size:
            raise ValueError(
                f"batch of {num_seqs} sequences is not a multiple of actor.micro_batch_size={micro_batch_size}"
            )
        groups = [list(range(i, i + micro_batch_size)) for i in range(0, num_seqs, micro_batch_size)]
        if len(groups) >= min_count:
            return groups
        return _even_split(num_seqs, min(min_count, num_seqs))
    if not packed:
        rows = max(1, max_tokens // (padded_len or max(lengths)))
        return _even_split(num_seqs, min(num_seqs, max(min_count, math.ceil(num_seqs / rows))))
    count = min(num_seqs, max(min_count, math.ceil(sum(lengths) / max_tokens)))
    while True:
        bins = balanced_bins(lengths, count)
        too_big = any(len(b) > 1 and sum(lengths[i] for i in b) > max_tokens for b in bins)
        if not too_big or count == num_seqs:
            return bins
        count += 1


def _even_split(num_seqs: int, count: int) -> list[list[int]]:
    """``count`` consecutive groups whose sizes differ by at most one."""
    base, extra = divmod(num_seqs, count)
    groups, start = [], 0
    for g in range(count):
        size = base + (g < extra)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def _packed_seq_params(lengths: torch.Tensor, device: torch.device):
    # first use: at the top megatron-core (~4 s) would load with `import rl.batching, rl.evaluation ...`, which do not need it
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    cu_seqlens = cu_seqlens.to(device)
    longest = int(lengths.max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def build_micro_batch(
    batch: TokenBatch,
    index: list[int],
    lengths: torch.Tensor,
    packed: bool,
    device: torch.device,
    response_only: bool,
    pad_to: int = 1,
) -> MicroBatch:
    """The micro-batch of batch rows ``index`` in the padded or packed layout, the model's token count a
    multiple of ``pad_to`` (see the module doc)."""
    idx = torch.tensor(index, dtype=torch.long)
    data = batch.select(idx, device)
    data.routed_experts = None  # no loss reads it; the routers get it below, in their token order
    input_ids = batch.input_ids[idx.to(batch.input_ids.device)].cpu()  # [b, S]
    num_seqs, width = input_ids.shape
    lens = lengths[idx]  # [b]
    # target positions t of row j: t < len_j - 1 (and under loss_mask when response_only)
    valid = torch.arange(width - 1).unsqueeze(0) < (lens - 1).unsqueeze(1)  # [b, S-1]
    if response_only:
        valid &= batch.loss_mask[idx.to(batch.loss_mask.device)].cpu() > 0
    seq_of_row, pos_of_row = valid.nonzero(as_tuple=True)  # [M], [M] in row-major order
    targets = input_ids[seq_of_row, pos_of_row + 1]
    dense_index = seq_of_row * (width - 1) + pos_of_row
    if packed:
        offsets = torch.zeros(num_seqs, dtype=torch.long)
        offsets[1:] = torch.cumsum(lens, 0)[:-1]
        keep = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)  # [b, S]
        rows = offsets[seq_of_row] + pos_of_row
        num_pad = -int(lens.sum()) % pad_to
        spans = torch.cat([lens, torch.tensor([num_pad])]) if num_pad else lens  # [b] or [b+1]
        tokens = torch.cat([input_ids[keep], input_ids.new_zeros(num_pad)]).unsqueeze(0)  # [1, T]
        positions = torch.cat([torch.arange(int(n)) for n in spans]).unsqueeze(0)  # [1, T]
        params = _packed_seq_params(spans, device)
        num_model_tokens = int(spans.sum())
        padding = (torch.arange(num_model_tokens) >= int(lens.sum())).unsqueeze(0)  # [1, T]
    else:
        padded_width = width + (-width % pad_to)
        tokens = torch.nn.functional.pad(input_ids, (0, padded_width - width))  # [b, S'] pad id 0
        positions = torch.arange(padded_width).unsqueeze(0).expand(num_seqs, padded_width)
        rows = seq_of_row * padded_width + pos_of_row
        params = None
        num_model_tokens = num_seqs * padded_width
        padding = torch.arange(padded_width).unsqueeze(0) >= lens.unsqueeze(1)  # [b, S']
    routed, counted = None, None
    if batch.routed_experts is not None:
        routed = batch.routed_experts[idx.to(batch.routed_experts.device)].cpu()  # [b, S, layers, k] int16
        counted = torch.zeros(num_seqs, width, dtype=torch.bool)  # [b, S]: input t predicts a response token
        if batch.loss_mask is not None:
            counted[:, :-1] = batch.loss_mask[idx.to(batch.loss_mask.device)].cpu() > 0
        if packed:  # [T]: the sequences' tokens, then the TP padding (not routed by the engine)
            routed = torch.cat([routed[keep], routed.new_full((num_pad, *routed.shape[2:]), -1)])
            counted = torch.cat([counted[keep], counted.new_zeros(num_pad)])
        else:  # megatron's [S', b] token order, the TP padding columns not routed by the engine
            extra = padded_width - width
            routed = torch.nn.functional.pad(routed, (0, 0, 0, 0, 0, extra), value=-1)
            counted = torch.nn.functional.pad(counted, (0, extra))
            routed, counted = routed.transpose(0, 1).flatten(0, 1), counted.t().flatten()
    return MicroBatch(
        index=idx,
        input_ids=tokens.to(device),
        position_ids=positions.to(device),
        packed_seq_params=params,
        rows=rows.to(device),
        targets=targets.to(device),
        dense_index=dense_index.to(device),
        data=data,
        num_model_tokens=num_model_tokens,
        routed_experts=routed,
        routing_counted=counted,
        padding_mask=padding.to(device),
    )
