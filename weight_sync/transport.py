"""The weight sync's transport seam: submit sends and receives, then run them as one batch.

The shape is megatron-core's resharding copy services (``megatron/core/resharding/copy_services/
base.py``: ``submit_send`` / ``submit_recv`` / ``run``), so the executor never knows how bytes move.
:class:`TorchP2PTransport` is torch.distributed point-to-point (gloo on CPU, NCCL on GPU); a later
transport (CUDA IPC handles between colocated processes, vLLM's weight-transfer engine) implements
the same three methods and plugs in without touching the planner or the executor.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Transport(Protocol):
    def submit_send(self, src_tensor: torch.Tensor, dest_rank: int) -> None:
        """Register ``src_tensor`` (contiguous) to go to global rank ``dest_rank``."""
        ...

    def submit_recv(self, dest_tensor: torch.Tensor, src_rank: int) -> None:
        """Register ``dest_tensor`` (contiguous) to be filled from global rank ``src_rank``."""
        ...

    def run(self) -> int:
        """Execute everything submitted since the last run; returns the number of messages."""
        ...


class TorchP2PTransport:
    """torch.distributed ``batch_isend_irecv`` over ``group`` (None: the default group).

    Messages between one pair of ranks are matched in submission order, so both sides must submit
    their messages to one peer in the same order (the executor follows the plan's order)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self._ops: list[dist.P2POp] = []

    def submit_send(self, src_tensor: torch.Tensor, dest_rank: int) -> None:
        self._ops.append(dist.P2POp(dist.isend, src_tensor, dest_rank, self.group))

    def submit_recv(self, dest_tensor: torch.Tensor, src_rank: int) -> None:
        self._ops.append(dist.P2POp(dist.irecv, dest_tensor, src_rank, self.group))

    def run(self) -> int:
        ops, self._ops = self._ops, []
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return len(ops)
