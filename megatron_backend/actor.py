"""The actor the RL loop holds: a megatron-core GPTModel (TP x PP x VPP) built from a HF dir, as four parts.

- :class:`~megatron_backend.actor_model.ActorModel`: the chunks, built and loaded; the forward passes, routing;
- :class:`~megatron_backend.actor_train.ActorTrainer`: the optimizer; forward + backward, the guarded step;
- :class:`~megatron_backend.actor_offload.ActorStates`: params, grads and optimizer states to host and back;
- checkpoint and export: :mod:`megatron_backend.dist_checkpoint`, :mod:`megatron_backend.hf_export`.

:class:`Actor` composes them: each call checks that the states it needs are on the device, runs inside its
memory-ledger op, and on CPU gives the pages its pass freed back to the OS.

Batches are :class:`modelspec.TokenBatch` of CPU or device tensors, identical on every TP/PP rank of one
DP group (each DP rank passes its own share):

- ``input_ids`` [B, S] int64, right-padded prompt + response;
- ``seq_lens`` [B] (optional): real tokens per row; without it rows count as unpadded;
- ``loss_mask`` [B, S-1]: 1 where the target token ``input_ids[:, t+1]`` is a response token;
- for training, whatever the loss function reads (``old_logprobs`` [B, S-1], ``advantages`` [B] or
  [B, S-1], ``ref_logprobs`` [B, S-1]).

The loss function comes from ``rl`` (``rl.losses.PolicyLoss``); this package never imports ``rl``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from colocation import host_memory
from configs.actor import ActorConfig
from megatron_backend import dist_checkpoint
from megatron_backend.actor_model import ActorModel
from megatron_backend.actor_offload import ActorStates
from megatron_backend.actor_train import ActorTrainer
from megatron_backend.checkpoint import chunk_params, gather_hf_state_dict
from megatron_backend.hf_export import save_live
from megatron_backend.memory import MemoryLedger
from megatron_backend.parallel import ParallelDims
from modelspec import LossFn, ModelShape, TokenBatch


class Actor:
    """Build from a HF dir; compute log-probs; train; offload/onload; report memory; checkpoint and export."""

    def __init__(
        self,
        hf_dir: str | Path,
        config: ActorConfig,
        dims: ParallelDims,
        dtype: str = "float32",
        train: bool = True,
        shape: ModelShape | None = None,
    ):
        """``shape``: the run's model shape (None: read from ``hf_dir``); ``train``: with an optimizer."""
        self.config, self.dims, self.dtype, self.hf_dir = config, dims, dtype, Path(hf_dir)
        shape = shape if shape is not None else ModelShape.from_pretrained(hf_dir)
        self.ledger = MemoryLedger()
        with self.ledger.op("build"):
            self.model = ActorModel(hf_dir, config, dims, dtype, shape, train)
            self.states = ActorStates(self.model, self.ledger, config.offload)
        self.trainer = None
        if train:
            with self.ledger.op("build_optimizer"):
                self.trainer = ActorTrainer(self.model, config, dtype)
                self.states.track_optimizer(self.trainer.optimizer)
        # what callers and the checkpoint read: the weight sync's layout, the grad buffers' DDP wrappers
        model = self.model
        self.shape, self.layout, self.chunks, self.models = shape, model.layout, model.chunks, model.models
        self.num_bytes_loaded = model.num_bytes_loaded
        self.optimizer = self.trainer.optimizer if self.trainer is not None else None

    def _training(self, op: str) -> ActorTrainer:
        if self.trainer is None:
            raise RuntimeError(f"{op}: this Actor was built with train=False")
        return self.trainer

    @property
    def optimizer_name(self) -> str:
        """The megatron-core optimizer class that steps (summary.json ``actor_optimizer``)."""
        return self.trainer.optimizer_name if self.trainer is not None else "none"

    # ---------------------------------------------------------------- passes
    def compute_logprobs(
        self,
        batch: TokenBatch,
        with_entropy: bool = False,
        phase: str = "logprob",
        response_only: bool = False,
        replay_routing: bool = False,
    ):
        """Forward-only log-probs [B, S-1] (fp32, on every rank); with entropy: (logprobs, entropy).

        Values at every real target (``seq_lens``), or with ``response_only`` only at the response
        targets (``loss_mask``: all a loss reads, and less vocab-wide work); other positions are 0.
        Micro-batches follow ``actor.max_tokens_per_forward_micro_batch``. ``phase`` names the ledger
        entry (the loop passes ``old_logprob`` / ``ref_logprob``). MoE: ``replay_routing`` routes the tokens
        the engine routed (``batch.routed_experts``) to its experts; without it, a batch with ``routed_experts``
        has the actor's own routing compared with them (:meth:`take_routing_mismatch`).
        """
        self.states.require_onloaded("compute_logprobs", ("params",))
        with self.ledger.op(phase):
            out = self.model.compute_logprobs(batch, with_entropy, response_only, replay_routing)
        self.release_freed_host_memory()
        return out

    def take_routing_mismatch(self) -> float | None:
        """See :meth:`ActorModel.take_routing_mismatch` (collective; None for a dense model)."""
        return self.model.take_routing_mismatch()

    def compute_grads(self, batch: TokenBatch, loss_fn: LossFn, replay_routing: bool = False) -> dict[str, float]:
        """Forward + backward of ``batch`` over its micro-batches into the grad buffers (DP-reduced); metrics.

        The loss of each micro-batch is normalized by the whole batch's totals (``BatchTotals``), so the
        accumulated gradient does not depend on how the batch is split. When ``loss_fn.uses_entropy``
        the micro-batch handed to it holds ``entropy`` [b, S-1] with gradient. ``replay_routing``: as in
        :meth:`compute_logprobs`.
        """
        return self._training("compute_grads").compute_grads(batch, loss_fn, replay_routing)

    def train_step(self, batch: TokenBatch, loss_fn: LossFn, replay_routing: bool = False) -> dict[str, float]:
        """One optimizer step over ``batch`` split in micro-batches (grad accumulation); returns metrics.
        ``replay_routing``: as in :meth:`compute_logprobs`."""
        trainer = self._training("train_step")
        self.states.require_onloaded("train_step")
        with self.ledger.op("train"):
            metrics = trainer.train_step(batch, loss_fn, replay_routing)
            self.states.count("optimizer")  # Adam's moments appear at the first step
        self.release_freed_host_memory()
        return metrics

    def release_freed_host_memory(self) -> None:
        """On CPU, give the pages of the freed activations and logits back to the OS at the end of a pass, so
        the next phase starts from what the actor really holds (CUDA's caching allocator keeps them, as
        device_reserved says)."""
        if self.dims.device.type == "cpu":
            host_memory.release_freed_host_memory()

    # ---------------------------------------------------------------- memory
    def offload(self, what: str | Iterable[str] | None = None) -> dict[str, int]:
        """Move params / grad buffers / optimizer states to host (None: the ``actor.offload`` switches); returns
        bytes released per tag."""
        return self.states.offload(what)

    def onload(self, what: str | Iterable[str] | None = None) -> dict[str, int]:
        """Bring back what :meth:`offload` moved (bit-exact); returns bytes restored per tag."""
        return self.states.onload(what)

    def memory(self) -> dict[str, int]:
        """{tag: bytes resident} (+ ``host/<tag>`` offloaded copies); peaks per op in ``ledger.peaks``."""
        return self.ledger.snapshot()

    # ---------------------------------------------------------------- checkpoint and export
    def save_checkpoint(self, directory: str | Path) -> None:
        """Params + optimizer state as a megatron-core distributed checkpoint (collective; each rank
        writes its own shards). Needs everything resident: see :mod:`megatron_backend.dist_checkpoint`."""
        self.states.require_onloaded("save_checkpoint")
        with self.ledger.op("save_checkpoint"):
            dist_checkpoint.save(self, directory)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore params + optimizer state saved at any TP x PP (x VPP) layout (collective)."""
        self.states.require_onloaded("load_checkpoint")
        with self.ledger.op("load_checkpoint"):
            dist_checkpoint.load(self, directory)

    def local_params(self) -> dict[tuple[int, str], torch.Tensor]:
        """(vp_stage, megatron name) -> this rank's parameter tensor (no copies), for the weight-sync executor."""
        self.states.require_onloaded("local_params", ("params",))
        return {key: p.detach() for key, p in chunk_params(self.chunks).items()}

    def export_hf(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """Full HF state dict on global rank ``dst`` (None elsewhere): the whole model on one rank, for tests
        and parity checks that compare weights in memory. Exporting is :meth:`save_hf` / ``make export``."""
        return gather_hf_state_dict(
            self.chunks, self.shape, self.layout, self.dims.dp_rank, dst, self.dims.expert_dp_rank
        )

    def save_hf(
        self, out_dir: str | Path, dtype: torch.dtype | None = None, extra_files: dict[str, Path] | None = None
    ) -> Path:
        """Write a HF directory of the current weights (collective; no rank gathers the model): see
        :func:`megatron_backend.hf_export.save_live`."""
        self.states.require_onloaded("save_hf", ("params",))
        with self.ledger.op("export_hf"):
            return save_live(self, out_dir, dtype, extra_files=extra_files)
