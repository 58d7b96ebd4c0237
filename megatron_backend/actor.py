"""The actor facade the RL loop calls: a megatron-core GPTModel (TP x PP x VPP) built from a HF dir.

Batches are :class:`modelspec.TokenBatch` of CPU or device tensors, identical on every TP/PP rank of one
DP group (each DP rank passes its own share):

- ``input_ids`` [B, S] int64, right-padded prompt + response;
- ``seq_lens`` [B] (optional): real tokens per row; without it rows count as unpadded;
- ``loss_mask`` [B, S-1]: 1 where the target token ``input_ids[:, t+1]`` is a response token;
- for training, whatever the loss function reads (``old_logprobs`` [B, S-1], ``advantages`` [B] or
  [B, S-1], ``ref_logprobs`` [B, S-1]).

Log-probs are [B, S-1] fp32: ``logprobs[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1])``.
The model runs on micro-batches from :mod:`megatron_backend.packing` (padded [b, S] or packed THD
[1, T], ``actor.remove_padding``; fixed size or a token budget); log-probs and entropy come from the
chunked :func:`~megatron_backend.logprobs.fused_logprobs_entropy` at the response targets only.
The loss function comes from ``rl`` (``rl.losses.PolicyLoss``); this package never imports ``rl``.

Optimizer: megatron-core's own on every device (``get_megatron_optimizer``, fp32 main params and grads):
the ``DistributedOptimizer`` when DP > 1, else ``Float16OptimizerWithFloat16Params`` (bf16/fp16 params)
or ``FP32Optimizer``; its CUDA assumptions are handled on CPU by :mod:`megatron_backend.cpu_compat`.
``train_step`` runs megatron's step in its parts (``prepare_grads``, the norm, clip, ``step_with_ready_grads``)
so that the non-finite check reads the gradient the step applies.

MoE routing (:mod:`megatron_backend.routing_replay`): when the batch carries the engine's ``routed_experts``,
a pass with ``replay_routing`` routes those tokens to the engine's experts; a forward-only pass without it
records the actor's own routing and counts where it differs (``take_routing_mismatch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from colocation.host_memory import release_freed_host_memory
from colocation.phases import HOLDERS
from configs.actor import ActorConfig
from megatron_backend.checkpoint import chunk_params, gather_hf_state_dict, load_hf_into_chunks
from megatron_backend.layout import RankLayout, padded_vocab_size
from megatron_backend.logprobs import fused_logprobs_entropy
from megatron_backend.memory import MemoryLedger, StorageOffloader, storage_bytes
from megatron_backend.model import (
    ROUTER_LOSSES,
    RoutedCopies,
    build_gpt_chunks,
    clear_router_losses,
    moe_kwargs,
    recompute_kwargs,
    router_losses,
    te_available,
)
from megatron_backend.packing import MicroBatch, build_micro_batch, partition, sequence_lengths
from megatron_backend.parallel import ParallelDims
from modelspec import BatchTotals, LossFn, ModelShape, TokenBatch
from modelspec.mesh import check_actor_split, check_expert_split

# what offload / onload take -> its memory tag: the step's own translation (colocation.phases.HOLDERS)
_TAG = {name: state for state, (holder, name) in HOLDERS.items() if holder == "actor"}
OFFLOADABLE = tuple(_TAG)  # ("params", "grads", "optimizer")


class Actor:
    """Build from a HF dir; compute log-probs; train; offload/onload; report memory; export shards."""

    def __init__(
        self,
        hf_dir: str | Path,
        config: ActorConfig,
        dims: ParallelDims,
        dtype: str = "float32",
        train: bool = True,
        shape: ModelShape | None = None,
    ):
        """``shape``: the run's model shape (None: read from ``hf_dir``)."""
        sizes = (config.tp, config.pp, config.vpp, config.ep, config.expert_tp)
        if sizes != (dims.tp, dims.pp, dims.vpp, dims.ep, dims.etp):
            raise ValueError(
                f"actor.tp/pp/vpp/ep/etp = {'/'.join(map(str, sizes))} but the process groups are "
                f"{dims.tp}/{dims.pp}/{dims.vpp}/{dims.ep}/{dims.etp}; initialize_model_parallel with the actor "
                "config's sizes"
            )
        self.config, self.dims, self.dtype = config, dims, dtype
        self.hf_dir = Path(hf_dir)
        self.shape = shape if shape is not None else ModelShape.from_pretrained(hf_dir)
        check_actor_split(self.shape, dims.tp, dims.pp, dims.vpp)
        check_expert_split(self.shape, dims.ep, dims.etp)
        self.sequence_parallel = config.sequence_parallel_for(self.shape.is_moe)
        if train and dims.tp > 1 and self.shape.is_moe and not self.sequence_parallel:
            raise ValueError(
                f"actor.sequence_parallel=false with actor.tp={dims.tp} and an MoE model ({self.shape.source}): "
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
        self.vocab_start = dims.tp_rank * padded_vocab_size(self.shape.vocab_size, dims.tp) // dims.tp
        self.ledger = MemoryLedger()
        # grads: released and handed back zeroed, never copied (compute_grads zeroes them before use)
        self._offloaders = {
            what: StorageOffloader(_TAG[what], self.ledger, keep_contents=what != "grads") for what in OFFLOADABLE
        }
        with self.ledger.op("build"):
            recompute = recompute_kwargs(
                config.recompute, config.recompute_method, config.recompute_num_layers, config.recompute_modules
            )
            # micro-batch shapes vary with packing or token budgets: pipeline stages exchange shapes
            variable = config.remove_padding or config.max_tokens_per_micro_batch is not None
            variable = variable or config.forward_max_tokens is not None
            # raw GPTModel per VPP stage
            moe = moe_kwargs(
                self.shape,
                dims,
                config.moe_aux_loss_coef,
                config.moe_z_loss_coef,
                config.moe_token_dispatcher,
                config.moe_expert_capacity_factor,
            )
            self.chunks = build_gpt_chunks(
                self.shape,
                dims,
                dtype,
                recompute=recompute,
                variable_seq_lengths=variable,
                moe=moe,
                sequence_parallel=self.sequence_parallel,
            )
            self.num_bytes_loaded = load_hf_into_chunks(self.chunks, hf_dir, self.shape, self.layout)
            self.routing = None
            if self.shape.is_moe:
                from megatron_backend.routing_replay import ActorRouting  # megatron's, imported when used

                self.routing = ActorRouting(self.chunks, self.shape, dims, self.sequence_parallel)
            self.routed_copies = None
            if self.shape.is_moe:
                gathered = dims.etp if self.sequence_parallel else 1
                self.routed_copies = RoutedCopies(self.chunks, self.shape.moe_top_k, gathered)
            self.ledger.set("actor_params", resident_bytes=storage_bytes(self._param_tensors()))
        self.models = self.chunks  # DDP-wrapped when training
        self.optimizer = None
        if train:
            with self.ledger.op("build_optimizer"):
                self._setup_training()

    # ---------------------------------------------------------------- training setup
    def _setup_training(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        offload_fraction = self.config.optimizer_offload_fraction
        if offload_fraction > 0 and self.dtype == "float32":
            # the distributed optimizer hands the HybridDeviceOptimizer float32 params as views of DDP's buffer
            # (distrib_optimizer.py, _build_model_and_main_param_groups), which torch.optim refuses at build
            raise ValueError(
                f"actor.optimizer_offload_fraction={offload_fraction} with model.dtype=float32: megatron-core's "
                'HybridDeviceOptimizer cannot step float32 params ("can\'t optimize a non-leaf Tensor"); set '
                "model.dtype=bfloat16, or actor.optimizer_offload_fraction=0"
            )
        if offload_fraction > 0 and importlib.util.find_spec("transformer_engine") is None:
            # megatron-core 0.16.1's OptimizerConfig reads TE's version on the precision-aware path (below)
            raise ValueError(
                f"actor.optimizer_offload_fraction={offload_fraction} needs Transformer Engine: megatron-core's CPU "
                "offload runs on its precision-aware optimizer, which reads TE's version; install "
                "transformer-engine, or set actor.optimizer_offload_fraction=0"
            )
        # megatron wires its CPU offload (HybridDeviceOptimizer) into the distributed optimizer only
        use_dist_opt = self.dims.dp > 1 or offload_fraction > 0
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_dist_opt
        )
        self.models = [
            DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk) for chunk in self.chunks
        ]
        config = self.chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads  # DP all-reduce + tied-embedding grads
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=self.config.lr,
            weight_decay=self.config.weight_decay,
            clip_grad=self.config.grad_clip,
            use_distributed_optimizer=use_dist_opt,
            bf16=self.dtype == "bfloat16",
            fp16=self.dtype == "float16",
            params_dtype=config.params_dtype,
            optimizer_cpu_offload=offload_fraction > 0,
            optimizer_offload_fraction=offload_fraction,
            # the HybridDeviceOptimizer runs on this flag's code path (megatron's training refuses CPU offload
            # without it, megatron/training/arguments.py): it keeps the fp32 masters, and its checkpoint load
            # (_update_fp32_params_by_new_state) knows only those
            use_precision_aware_optimizer=offload_fraction > 0,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.models)
        use_loss_scaling(self.chunks, self.optimizer)
        self.ledger.set("actor_grads", resident_bytes=storage_bytes(self._grad_tensors()))
        # bf16/fp16: megatron builds the fp32 masters here (the moments come at the first step); uncounted, an
        # offload before the first step would take the tag below zero and inflate the launch's runtime level
        self.ledger.set("optimizer", resident_bytes=storage_bytes(self._optimizer_tensors()))

    # ---------------------------------------------------------------- forward passes
    def _micro_batches(self, batch: TokenBatch, max_tokens: int | None, response_only: bool) -> list[MicroBatch]:
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

    def _routing_mode(self, batch: TokenBatch, replay: bool, forward_only: bool) -> tuple[bool, bool]:
        """(replay the engine's routing, record the actor's own) for a pass over ``batch``."""
        if replay and (self.routing is None or batch.routed_experts is None):
            what = "the model has no MoE layers" if self.routing is None else "the batch has no routed_experts"
            raise ValueError(f"replay_routing=True but {what} (algorithm.routing_replay needs the engine's routing)")
        record = self.routing is not None and batch.routed_experts is not None and forward_only and not replay
        return replay, record

    def _run_schedule(
        self,
        micro_batches: list[MicroBatch],
        loss_func_factory,
        forward_only: bool,
        routing: tuple[bool, bool] = (False, False),
    ) -> list[dict]:
        """``routing``: (replay, record) from :meth:`_routing_mode`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

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

    def take_routing_mismatch(self) -> float | None:
        """The fraction of (response token, MoE layer) pairs whose top-k expert set differs between the engine
        and the actor's own routing, over the passes that recorded it since the last call, every PP stage and DP
        rank (collective; None for a dense model)."""
        if self.routing is None:
            return None
        return self.routing.take_mismatch_fraction()

    def _logprobs_entropy(self, logits: torch.Tensor, mb: MicroBatch, keep_softmax: bool = False):
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

    def _last_stage_src(self) -> int:
        return dist.get_global_rank(self.dims.pp_group, self.dims.pp - 1)

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
        self._require_onloaded("compute_logprobs", ("params",))
        if response_only and batch.loss_mask is None:
            raise ValueError("compute_logprobs(response_only=True) needs batch.loss_mask")
        with self.ledger.op(phase), torch.no_grad():
            micro_batches = self._micro_batches(batch, self.config.forward_max_tokens, response_only)

            def factory(mb):
                def loss_func(logits):
                    logprobs, entropy = self._logprobs_entropy(logits, mb)
                    out = {"logprobs": mb.to_dense(logprobs)}
                    if with_entropy:
                        out["entropy"] = mb.to_dense(entropy)
                    return torch.zeros((), device=logits.device), out

                return loss_func

            routing = self._routing_mode(batch, replay_routing, forward_only=True)
            outputs = self._run_schedule(micro_batches, factory, forward_only=True, routing=routing)
            num_seqs, seq_len = batch.input_ids.shape
            keys = ("logprobs", "entropy") if with_entropy else ("logprobs",)
            results = []
            for key in keys:
                value = torch.zeros(num_seqs, seq_len - 1, dtype=torch.float32, device=self.dims.device)
                if self.dims.is_last_stage:
                    for mb, out in zip(micro_batches, outputs):
                        value[mb.index.to(value.device)] = out[key].float()
                if self.dims.pp > 1:
                    dist.broadcast(value, src=self._last_stage_src(), group=self.dims.pp_group)
                results.append(value)
        self._release_freed_host_memory()
        return tuple(results) if with_entropy else results[0]

    # ---------------------------------------------------------------- training
    def compute_grads(self, batch: TokenBatch, loss_fn: LossFn, replay_routing: bool = False) -> dict[str, float]:
        """Forward + backward of ``batch`` over its micro-batches into the grad buffers (DP-reduced); metrics.

        The loss of each micro-batch is normalized by the whole batch's totals (``BatchTotals``), so the
        accumulated gradient does not depend on how the batch is split. When ``loss_fn.uses_entropy``
        the micro-batch handed to it holds ``entropy`` [b, S-1] with gradient. ``replay_routing``: as in
        :meth:`compute_logprobs`.
        """
        routing = self._routing_mode(batch, replay_routing, forward_only=False)
        micro_batches = self._micro_batches(batch, self.config.max_tokens_per_micro_batch, response_only=True)
        num_micro = len(micro_batches)
        totals = BatchTotals(num_tokens=float(batch.loss_mask.sum()), num_seqs=batch.num_seqs)
        uses_entropy = bool(getattr(loss_fn, "uses_entropy", False))
        chunked = self.config.logprob_chunk_tokens is not None
        keep_softmax = not chunked or (uses_entropy and not self.config.entropy_recompute)
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        clear_router_losses()
        if self.routed_copies is not None:
            self.routed_copies.reset()  # this pass's alone

        def factory(mb):
            def loss_func(logits):
                logprobs, entropy = self._logprobs_entropy(logits, mb, keep_softmax)
                data = dataclasses.replace(mb.data, entropy=mb.to_dense(entropy)) if uses_entropy else mb.data
                loss, metrics = loss_fn(mb.to_dense(logprobs), data, totals)
                metrics = {k: torch.as_tensor(v).detach().clone().float() for k, v in metrics.items()}
                mask = data.loss_mask
                metrics["entropy"] = (mb.to_dense(entropy.detach()) * mask).sum() / max(totals.num_tokens, 1.0)
                # the schedule divides by the number of micro-batches; the loss is already batch-scaled
                return loss * num_micro, metrics

            return loss_func

        outputs = self._run_schedule(micro_batches, factory, forward_only=False, routing=routing)
        metrics = {}
        if self.dims.is_last_stage:
            for out in outputs:
                for k, v in out.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v)
        if self.dims.pp > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=self._last_stage_src(), group=self.dims.pp_group)
            metrics = box[0]
        metrics["num_micro_batches"] = float(num_micro)
        metrics["num_tokens"] = totals.num_tokens
        logged = [name for name, coef in ROUTER_LOSSES.items() if getattr(self.config, coef) > 0]
        metrics.update(router_losses(self.dims, logged, len(self.shape.moe_layers), num_micro))
        if self.routed_copies is not None:  # collective: every rank of the world trains
            metrics["moe/routed_copies_max_ratio"] = self.routed_copies.take(self.dims.device)
        return metrics

    def train_step(self, batch: TokenBatch, loss_fn: LossFn, replay_routing: bool = False) -> dict[str, float]:
        """One optimizer step over ``batch`` split in micro-batches (grad accumulation); returns metrics.
        ``replay_routing``: as in :meth:`compute_logprobs`."""
        if self.optimizer is None:
            raise RuntimeError("this Actor was built with train=False")
        self._require_onloaded("train_step")
        with self.ledger.op("train"):
            metrics = self.compute_grads(batch, loss_fn, replay_routing)
            grad_norm = self._checked_step({k: v for k, v in metrics.items() if "loss" in k})
            metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
            self.ledger.set("optimizer", resident_bytes=storage_bytes(self._optimizer_tensors()))
        self._release_freed_host_memory()
        return metrics

    def _release_freed_host_memory(self) -> None:
        """On CPU, give the pages of the freed activations and logits back to the OS at the end of a pass, so
        the next phase starts from what the actor really holds (CUDA's caching allocator keeps them, as
        device_reserved says)."""
        if self.dims.device.type == "cpu":
            release_freed_host_memory()

    def _stop_if_not_finite(self, values: dict[str, float]) -> None:
        """Every rank raises together (one all-reduce) when any rank's loss or the grad norm is NaN/inf."""
        local = [name for name, value in values.items() if not math.isfinite(float(value))]
        flag = torch.tensor([float(bool(local))], device=self.dims.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            where = ", ".join(f"{n}={float(values[n])}" for n in local) or "another rank's loss"
            raise FloatingPointError(f"{where} is not finite; the optimizer step was not applied")

    @torch.no_grad()
    def _checked_step(self, losses: dict[str, float]) -> float | None:
        """megatron's ``ChainedOptimizer.step`` with the non-finite check between its parts: ``prepare_grads``
        copies the reduced grads to the fp32 main params (before it their ``.grad`` is None and the norm
        reads 0), the norm is taken over exactly those, and only a finite norm and loss reach the clip and
        ``step_with_ready_grads``. Returns the grad norm (None: fp16's loss scaler found an overflow and
        skipped the step, as megatron does)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if self.optimizer.prepare_grads():  # fp16 only: the scaler backed off, nothing is applied
            self._stop_if_not_finite(losses)
            return None
        grad_norm = self.optimizer.get_grad_norm()
        self._stop_if_not_finite({**losses, "grad_norm": grad_norm})
        for opt in self.optimizer.chained_optimizers:
            params = opt.get_parameters()
            if opt.config.clip_grad > 0.0 and params and not getattr(opt, "is_stub_optimizer", False):
                # the precision-aware path (CPU offload) hands its grads over as ``decoupled_grad``
                decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                clip_grad_by_total_norm_fp32(
                    params, max_norm=opt.config.clip_grad, total_norm=grad_norm, use_decoupled_grad=decoupled
                )
        self.optimizer.step_with_ready_grads()
        return grad_norm

    @property
    def optimizer_name(self) -> str:
        """The megatron-core optimizer class that steps (summary.json ``actor_optimizer``)."""
        if self.optimizer is None:
            return "none"
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return "megatron-core " + "+".join(sorted({type(opt).__name__ for opt in inner}))

    # ---------------------------------------------------------------- offload / onload
    def _param_tensors(self) -> list[torch.Tensor]:
        return [p.data for chunk in self.chunks for p in chunk.parameters()]

    def _grad_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [
            buf.grad_data
            for model in self.models
            for buf in list(model.buffers) + list(model.expert_parallel_buffers)
            if buf.grad_data is not None
        ]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """Adam moments (and megatron's fp32 master copies of bf16/fp16 params)."""
        if self.optimizer is None:
            return []
        tensors, stack = [], [self.optimizer]
        device = next(self.chunks[0].parameters()).device.type
        while stack:  # megatron: ChainedOptimizer -> MegatronOptimizer -> torch optimizer
            opt = stack.pop()
            if hasattr(opt, "chained_optimizers"):
                stack.extend(opt.chained_optimizers)
                continue
            torch_opt = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
            for state in torch_opt.state.values():
                # the device's only: a HybridDeviceOptimizer's host part (actor.optimizer_offload_fraction) stays
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.device.type == device]
            for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
                for group in getattr(opt, attr, None) or []:
                    tensors += [p.data for p in group if p is not None]  # None: the optimizer keeps the masters
        # never the params' storage: a HybridDeviceOptimizer's state holds its param as ``master_param``
        # (hybrid_optimizer.py, _sync_sub_optimizers_state_to_hdo), a view of DDP's param buffer for float32
        params = {p.untyped_storage().data_ptr() for p in self._param_tensors()}
        return [t for t in tensors if t.untyped_storage().data_ptr() not in params]

    def _tensors_for(self, what: str) -> list[torch.Tensor]:
        return {"params": self._param_tensors, "grads": self._grad_tensors, "optimizer": self._optimizer_tensors}[
            what
        ]()

    def _selected(self, what: str | Iterable[str] | None) -> list[str]:
        if what is None:  # the switches of actor.offload
            return [w for w in OFFLOADABLE if getattr(self.config.offload, w)]
        names = [what] if isinstance(what, str) else list(what)
        bad = [w for w in names if w not in OFFLOADABLE]
        if bad:
            raise ValueError(f"cannot offload {bad}; choose from {OFFLOADABLE}")
        return names

    def offload(self, what: str | Iterable[str] | None = None) -> dict[str, int]:
        """Move params / grad buffers / optimizer states to host; returns bytes released per tag."""
        released = {}
        for name in self._selected(what):
            with self.ledger.op(f"offload_{name}"):
                released[_TAG[name]] = self._offloaders[name].offload(self._tensors_for(name))
        return released

    def onload(self, what: str | Iterable[str] | None = None) -> dict[str, int]:
        """Bring back what :meth:`offload` moved (bit-exact); returns bytes restored per tag."""
        restored = {}
        for name in self._selected(what):
            with self.ledger.op(f"onload_{name}"):
                restored[_TAG[name]] = self._offloaders[name].onload()
        return restored

    def _require_onloaded(self, op: str, needed: tuple[str, ...] = OFFLOADABLE) -> None:
        away = [w for w in needed if self._offloaders[w].offloaded]
        if away:
            raise RuntimeError(f"{op} needs {away} on the device; call actor.onload({away}) first")

    def memory(self) -> dict[str, int]:
        """{tag: bytes resident} (+ ``host/<tag>`` offloaded copies); peaks per op in ``ledger.peaks``."""
        return self.ledger.snapshot()

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str | Path) -> None:
        """Params + optimizer state as a megatron-core distributed checkpoint (collective; each rank
        writes its own shards). Needs everything resident: see :mod:`megatron_backend.dist_checkpoint`."""
        from megatron_backend import dist_checkpoint

        self._require_onloaded("save_checkpoint")
        with self.ledger.op("save_checkpoint"):
            dist_checkpoint.save(self, directory)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore params + optimizer state saved at any TP x PP (x VPP) layout (collective)."""
        from megatron_backend import dist_checkpoint

        self._require_onloaded("load_checkpoint")
        with self.ledger.op("load_checkpoint"):
            dist_checkpoint.load(self, directory)

    # ---------------------------------------------------------------- export
    def local_params(self) -> dict[tuple[int, str], torch.Tensor]:
        """(vp_stage, megatron name) -> this rank's parameter tensor (no copies), for the weight-sync executor."""
        if self._offloaders["params"].offloaded:
            raise RuntimeError("local_params needs the params on the device; call actor.onload('params') first")
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
        from megatron_backend.hf_export import save_live

        if self._offloaders["params"].offloaded:
            raise RuntimeError("save_hf needs the params on the device; call actor.onload('params') first")
        with self.ledger.op("export_hf"):
            return save_live(self, out_dir, dtype, extra_files=extra_files)


def use_loss_scaling(chunks, optimizer) -> None:
    """Let megatron's schedule scale the loss by the optimizer's loss scale before backward (as megatron's
    own training.py does). ``schedules.backward_step`` scales only through ``config.grad_scale_func``, and
    the fp16 optimizer starts its scaler at 2**32 and divides the grads by it in ``step()``: without this,
    fp16 grads come out 2**-32 too small. (bf16/fp32: the scale is 1.)"""
    for chunk in chunks:
        chunk.config.grad_scale_func = optimizer.scale_loss
