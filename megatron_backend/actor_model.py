"""The actor's model: megatron-core GPTModel chunks (one per VPP stage) built from a HF dir, and its passes.

A pass runs megatron's pipeline schedule over micro-batches from :mod:`megatron_backend.packing` (padded [b, S]
or packed THD [1, T], ``actor.remove_padding``; ``actor.micro_batch_size`` sequences each or a token budget);
log-probs and entropy come from the chunked :func:`~megatron_backend.logprobs.fused_logprobs_entropy` at the
target rows only. Log-probs are [B, S-1] fp32: ``logprobs[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1])``.

MoE routing (:mod:`megatron_backend.routing_replay`): when the batch carries the engine's ``routed_experts``,
a pass with ``replay`` routes those tokens to the engine's experts; a forward-only pass without it records the
actor's own routing and counts where it differs (:meth:`ActorModel.take_routing_mismatch`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func

from configs.actor import ActorConfig
from megatron_backend.checkpoint import load_hf_into_chunks
from megatron_backend.layout import RankLayout, padded_vocab_size
from megatron_backend.logprobs import fused_logprobs_entropy
from megatron_backend.model import RoutedCopies, build_gpt_chunks, moe_kwargs, recompute_kwargs, te_available
from megatron_backend.packing import MicroBatch, build_micro_batch, partition, sequence_lengths
from megatron_backend.parallel import ParallelDims
from megatron_backend.routing_replay import ActorRouting
from modelspec import ModelShape, TokenBatch
from modelspec.mesh import check_actor_split, check_expert_split


class ActorModel:
    """This rank's chunks of the model, loaded from ``hf_dir``; forward passes over micro-batches."""

    def __init__(
        self, hf_dir: str | Path, config: ActorConfig, dims: ParallelDims, dtype: str, shape: ModelShape, train: bool
    ):
        sizes = (config.tp, config.pp, config.vpp, config.ep, config.expert_tp)
        if sizes != (dims.tp, dims.pp, dims.vpp, dims.ep, dims.etp):
            raise ValueError(
                f"actor.tp/pp/vpp/ep/etp = {'/'.join(map(str, sizes))} but the process groups are "
                f"{dims.tp}/{dims.pp}/{dims.vpp}/{dims.ep}/{dims.etp}; initialize_model_parallel with the actor "
                "config's sizes"
            )
        self.config, self.dims, self.shape = config, dims, shape
        check_actor_split(shape, dims.tp, dims.pp, dims.vpp)
        check_expert_split(shape, dims.ep, dims.etp)
        self.sequence_parallel = config.sequence_parallel_for(shape.is_moe)
        if train and dims.tp > 1 and shape.is_moe and not self.sequence_parallel:
            raise ValueError(
                f"actor.sequence_parallel=false with actor.tp={dims.tp} and an MoE model ({shape.source}): "
                "megatron-core trains MoE layers at TP > 1 only with sequence parallelism; set "
                "actor.sequence_parallel to null or true"
            )
        self.layout = RankLayout(
            dims.tp,
            dims.pp,
            dims.vpp,
            dims.tp_rank,
            dims.pp_rank,
            te_norms=te_available(),
            ep=dims.ep,
            etp=dims.etp,
            ep_rank=dims.ep_rank,
            etp_rank=dims.etp_rank,
            grouped_experts=te_available(),
        )
        self.vocab_start = dims.tp_rank * padded_vocab_size(shape.vocab_size, dims.tp) // dims.tp
        recompute = recompute_kwargs(
            config.recompute, config.recompute_method, config.recompute_num_layers, config.recompute_modules
        )
        # micro-batch shapes vary with packing or token budgets: pipeline stages exchange shapes
        variable = config.remove_padding or config.max_tokens_per_micro_batch is not None
        variable = variable or config.forward_max_tokens is not None
        moe = moe_kwargs(
            shape,
            dims,
            config.moe_aux_loss_coef,
            config.moe_z_loss_coef,
            config.moe_token_dispatcher,
            config.moe_expert_capacity_factor,
        )
        # raw GPTModel per VPP stage
        self.chunks = build_gpt_chunks(
            shape,
            dims,
            dtype,
            recompute=recompute,
            variable_seq_lengths=variable,
            moe=moe,
            sequence_parallel=self.sequence_parallel,
        )
        self.num_bytes_loaded = load_hf_into_chunks(self.chunks, hf_dir, shape, self.layout)
        self.routing = ActorRouting(self.chunks, shape, dims, self.sequence_parallel) if shape.is_moe else None
        self.routed_copies = None
        if shape.is_moe:
            gathered = dims.etp if self.sequence_parallel else 1
            self.routed_copies = RoutedCopies(self.chunks, shape.moe_top_k, gathered)
        self.models = self.chunks  # what the passes run: DDP-wrapped by wrap_ddp when training

    def wrap_ddp(self, ddp_config: DistributedDataParallelConfig) -> None:
        """Run the passes on megatron's DistributedDataParallel wrappers of the chunks (their grad buffers)."""
        self.models = [
            DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk) for chunk in self.chunks
        ]

    @property
    def last_stage_rank(self) -> int:
        """The global rank of this rank's last pipeline stage, which holds a pass's outputs."""
        return dist.get_global_rank(self.dims.pp_group, self.dims.pp - 1)

    def micro_batches(self, batch: TokenBatch, max_tokens: int | None, response_only: bool) -> list[MicroBatch]:
        """This rank's micro-batches (megatron_backend.packing): ``micro_batch_size`` sequences each, or
        by the token budget ``max_tokens``; as many on every DP rank (the most any rank needs)."""
        lengths = sequence_lengths(batch)
        packed, width = self.config.remove_padding, batch.input_ids.shape[1]
        min_count = self.dims.pp if self.dims.vpp else 1

        def split(at_least: int) -> list[list[int]]:
            return partition(lengths.tolist(), self.config.micro_batch_size, max_tokens, packed, width, at_least)

        groups = split(min_count)
        if max_tokens is not None and self.dims.dp > 1:
            count = torch.tensor([len(groups)], dtype=torch.long, device=self.dims.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dims.dp_group)
            if int(count) > len(groups):
                groups = split(int(count))
        if self.dims.vpp and len(groups) < self.dims.pp:
            raise ValueError(
                f"the interleaved (VPP) schedule needs >= PP={self.dims.pp} micro-batches, got {len(groups)}; "
                f"lower actor.micro_batch_size / the token budget or send more sequences"
            )
        device = self.dims.device
        # sequence parallelism splits the model's token dim over TP: pad it to a multiple of TP
        pad_to = self.dims.tp if self.sequence_parallel else 1
        return [build_micro_batch(batch, g, lengths, packed, device, response_only, pad_to) for g in groups]

    def _router_padding(self, chunk, mb) -> dict:
        """``padding_mask`` for an MoE model's forward, so its routers leave the pads out of their losses. megatron
        splits it over TP under sequence parallelism on the first stage only (``GPTModel._preprocess``); a later
        stage gets this TP rank's contiguous share of the token dim ([b, S / tp] or [1, T / tp]) here."""
        if not self.shape.is_moe:
            return {}
        mask = mb.padding_mask
        if self.sequence_parallel and not chunk.pre_process:
            share = mask.shape[1] // self.dims.tp
            mask = mask[:, self.dims.tp_rank * share : (self.dims.tp_rank + 1) * share]
        return {"padding_mask": mask}

    def routing_mode(self, batch: TokenBatch, replay: bool, forward_only: bool) -> tuple[bool, bool]:
        """(replay the engine's routing, record the actor's own) for a pass over ``batch``."""
        if replay and (self.routing is None or batch.routed_experts is None):
            what = "the model has no MoE layers" if self.routing is None else "the batch has no routed_experts"
            raise ValueError(f"replay_routing=True but {what} (algorithm.routing_replay needs the engine's routing)")
        record = self.routing is not None and batch.routed_experts is not None and forward_only and not replay
        return replay, record

    def run_schedule(
        self,
        micro_batches: list[MicroBatch],
        loss_func_factory,
        forward_only: bool,
        routing: tuple[bool, bool] = (False, False),
    ) -> list[dict]:
        """megatron's forward(-backward) schedule over ``micro_batches``; ``loss_func_factory(mb)`` gives the loss
        function of one micro-batch's logits. ``routing``: (replay, record) from :meth:`routing_mode`. Returns the
        loss functions' outputs (last stage; empty elsewhere)."""
        chunk_index = {id(model): i for i, model in enumerate(self.models)}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            routed = self.routing is not None and any(routing)
            with self.routing.forward(chunk_index[id(model)], mb, *routing) if routed else contextlib.nullcontext():
                # last stage: logits [b, S, V_local] (padded) or [1, T, V_local] (packed)
                output = model(
                    mb.input_ids,
                    mb.position_ids,
                    attention_mask=None,
                    packed_seq_params=mb.packed_seq_params,
                    **self._router_padding(self.chunks[chunk_index[id(model)]], mb),
                )
            return output, loss_func_factory(mb)

        many = len(self.models) > 1
        # forward-only passes in eval mode: megatron's MoE router then neither computes nor tracks its aux
        # losses (no backward to carry them)
        for chunk in self.chunks:
            chunk.train(not forward_only)
        # fixed-shape pipelines size their p2p buffers from these; variable ones send shapes first
        seq_len = max(mb.input_ids.shape[1] for mb in micro_batches)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(micro_batches) for _ in self.models] if many else iter(micro_batches),
                model=self.models if many else self.models[0],
                num_microbatches=len(micro_batches),
                seq_length=seq_len,
                micro_batch_size=max(mb.input_ids.shape[0] for mb in micro_batches),
                forward_only=forward_only,
            )
        finally:
            if self.routing is not None:  # megatron's replay state is process-global: none outlives the pass
                self.routing.clear()

    def logprobs_entropy(self, logits: torch.Tensor, mb: MicroBatch, keep_softmax: bool = False):
        """(log-probs [M], entropy [M]) of the micro-batch's target rows (megatron_backend.logprobs)."""
        return fused_logprobs_entropy(
            logits,
            mb.rows,
            mb.targets,
            self.vocab_start,
            self.shape.vocab_size,
            self.dims.tp_group,
            self.config.logprob_chunk_tokens,
            keep_softmax,
        )

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch, with_entropy: bool, response_only: bool, replay_routing: bool):
        """Forward-only log-probs [B, S-1] (fp32, on every rank); with entropy: (logprobs, entropy). See
        :meth:`megatron_backend.actor.Actor.compute_logprobs`."""
        if response_only and batch.loss_mask is None:
            raise ValueError("compute_logprobs(response_only=True) needs batch.loss_mask")
        micro_batches = self.micro_batches(batch, self.config.forward_max_tokens, response_only)

        def factory(mb):
            def loss_func(logits):
                logprobs, entropy = self.logprobs_entropy(logits, mb)
                out = {"logprobs": mb.to_dense(logprobs)}
                if with_entropy:
                    out["entropy"] = mb.to_dense(entropy)
                return torch.zeros((), device=logits.device), out

            return loss_func

        routing = self.routing_mode(batch, replay_routing, forward_only=True)
        outputs = self.run_schedule(micro_batches, factory, forward_only=True, routing=routing)
        num_seqs, seq_len = batch.input_ids.shape
        keys = ("logprobs", "entropy") if with_entropy else ("logprobs",)
        results = []
        for key in keys:
            value = torch.zeros(num_seqs, seq_len - 1, dtype=torch.float32, device=self.dims.device)
            if self.dims.is_last_stage:
                for mb, out in zip(micro_batches, outputs):
                    value[mb.index.to(value.device)] = out[key].float()
            if self.dims.pp > 1:
                dist.broadcast(value, src=self.last_stage_rank, group=self.dims.pp_group)
            results.append(value)
        return tuple(results) if with_entropy else results[0]

    def take_routing_mismatch(self) -> float | None:
        """The fraction of (response token, MoE layer) pairs whose top-k expert set differs between the engine
        and the actor's own routing, over the passes that recorded it since the last call, every PP stage and DP
        rank (collective; None for a dense model)."""
        if self.routing is None:
            return None
        return self.routing.take_mismatch_fraction()
