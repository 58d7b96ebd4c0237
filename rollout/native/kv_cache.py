"""The native engine's paged KV cache and its block allocator.

One preallocated tensor [num_layers, 2 (k, v), kv_heads_per_rank, num_blocks * block_size, head_dim] in
the memory-saver region ``kv_cache``, handed out in blocks of ``rollout.block_size`` tokens. Its size is
``gpu_memory_utilization x capacity - weights - activation reserve`` (capacity: the CUDA device's total
memory, or ``rollout.cpu_capacity_gb`` on CPU), capped at what ``max_num_seqs`` full-length sequences
could ever use.

Addressing: token position p of a sequence whose blocks are ``table`` lives in slot
``table[p // block_size] * block_size + p % block_size``. One block of one (k|v, kv head) plane is
``block_size * head_dim`` contiguous values, so decode gathers whole blocks as rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from configs.rollout import RolloutConfig
from modelspec import ModelShape
from rollout.layout import TPShape
from rollout.memory_saver import MemorySaver


def kv_cache_budget_bytes(cfg: RolloutConfig, device: torch.device, weight_bytes: int) -> int:
    """:meth:`RolloutConfig.kv_cache_budget_bytes` of this device's capacity (CUDA: its total memory)."""
    capacity = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else int(cfg.cpu_capacity_gb * 2**30)
    return cfg.kv_cache_budget_bytes(device.type, capacity, weight_bytes)


class BlockAllocator:
    """Free block ids; the most recently freed block is handed out first."""

    def __init__(self, num_blocks: int) -> None:
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, num: int) -> list[int]:
        return [self.free_blocks.pop() for _ in range(num)]

    def free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(reversed(blocks))


class DecodeRows(NamedTuple):
    """Where one decode step reads and writes, as rows of one layer's cache (same for every layer)."""

    new_rows: torch.Tensor  # [2*B*kv]: rows of the [2*kv*slots, d] view receiving the new k and v, (k|v, B, head)
    ctx_block_rows: torch.Tensor  # [2*B*kv*nb]: rows of the [2*kv*blocks, bs*d] view, (k|v, B, head, block)
    span: int  # nb * block_size: context positions gathered per sequence (ctx + the new token, rounded up)


class KVCache:
    """The cache tensor, its per-layer row views and its blocks (see the module doc)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        shape: ModelShape,
        tps: TPShape,
        max_model_len: int,
        saver: MemorySaver,
        device: torch.device,
        dtype: torch.dtype,
        weight_bytes: int,
    ) -> None:
        self.saver = saver
        self.block_size = bs = cfg.block_size_on(device.type)
        self.head_dim = d = shape.head_dim
        num_kv_heads = tps.num_kv_heads
        elem = torch.empty((), dtype=dtype).element_size()
        # one block = block_size tokens of k and v for every layer
        self.block_bytes = shape.num_layers * 2 * bs * num_kv_heads * d * elem
        blocks_per_seq = math.ceil(max_model_len / bs)
        self.budget_bytes = budget = kv_cache_budget_bytes(cfg, device, weight_bytes)
        num_blocks = min(budget // self.block_bytes, cfg.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"KV cache budget {budget / 2**20:.1f} MiB holds {max(num_blocks, 0)} blocks, fewer than one "
                f"max_model_len={max_model_len} sequence needs ({blocks_per_seq}); raise "
                "rollout.gpu_memory_utilization (or rollout.cpu_capacity_gb on CPU) or lower rollout.max_model_len"
            )
        self.num_blocks = int(num_blocks)
        with saver.region("kv_cache"):
            # [layer, k|v, kv head (local), slot = block * block_size + offset, head_dim]
            self.tensor = saver.track(
                torch.zeros((shape.num_layers, 2, num_kv_heads, self.num_blocks * bs, d), dtype=dtype, device=device)
            )
        self.allocator = BlockAllocator(self.num_blocks)
        # per layer, its cache viewed as rows of one token [2*kv*slots, d] and of one block [2*kv*blocks, bs*d]
        self.token_rows = [c.view(-1, d) for c in self.tensor]
        self.block_rows = [c.view(-1, bs * d) for c in self.tensor]
        # first row of each (k|v, kv head) plane in one layer's cache, counted in slots and in blocks: [2, kv]
        planes = torch.arange(2 * num_kv_heads, device=device).view(2, -1)
        self._plane_slot_offsets = planes * (self.num_blocks * bs)
        self._plane_block_offsets = planes * self.num_blocks
        self._block_offsets = torch.arange(bs, device=device)  # [bs]: slot offsets inside one block

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        self.saver.pause("kv_cache")

    def wake_up(self) -> None:
        if self.saver.resume("kv_cache"):
            self.tensor.zero_()  # torch-memory-saver hands back uninitialised pages

    @property
    def asleep(self) -> bool:
        return self.saver.is_paused("kv_cache")

    # ------------------------------------------------------------------ blocks
    @property
    def free_blocks(self) -> list[int]:
        return self.allocator.free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # ------------------------------------------------------------------ addressing
    def slot_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """block_table [B, width] -> the cache slot of every position [B, width * block_size]."""
        return (block_table[:, :, None] * self.block_size + self._block_offsets).flatten(1)

    def write_prefill(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, kv, d] of N tokens -> their slots [N] in ``layer``'s cache."""
        self.tensor[layer, 0].index_copy_(1, slots, k.transpose(0, 1))
        self.tensor[layer, 1].index_copy_(1, slots, v.transpose(0, 1))

    def decode_rows(self, ctx_lens: torch.Tensor, block_table: torch.Tensor, slot_table: torch.Tensor) -> DecodeRows:
        """For B running sequences with ctx_lens [B] tokens cached: where the new token's k/v go and which
        block rows hold their context (see :class:`DecodeRows`)."""
        bs = self.block_size
        new_slots = slot_table.gather(1, ctx_lens[:, None])  # [B, 1]
        new_rows = (new_slots + self._plane_slot_offsets[:, None, :]).flatten()
        num_ctx_blocks = (int(ctx_lens.max()) + bs) // bs  # blocks covering ctx + the new token
        ctx_block_rows = (
            block_table[None, :, None, :num_ctx_blocks] + self._plane_block_offsets[:, None, :, None]
        ).flatten()
        return DecodeRows(new_rows, ctx_block_rows, num_ctx_blocks * bs)
