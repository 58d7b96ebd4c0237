"""The actor's train step: megatron-core's optimizer, gradients over micro-batches, and the non-finite guard.

Optimizer: megatron-core's own on every device (``get_megatron_optimizer``, fp32 main params and grads): the
``DistributedOptimizer`` when DP > 1 (or with ``actor.optimizer_offload_fraction``), else
``Float16OptimizerWithFloat16Params`` (bf16/fp16 params) or ``FP32Optimizer``; its CUDA assumptions are handled on
CPU by :mod:`megatron_backend.cpu_compat`. The step runs megatron's ``ChainedOptimizer.step`` in its parts
(``prepare_grads``, the norm, clip, ``step_with_ready_grads``) so that the non-finite check reads the gradient
the step applies, and every rank stops together before it is applied.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer

from configs.actor import ActorConfig
from megatron_backend.actor_model import ActorModel
from megatron_backend.model import ROUTER_LOSSES, clear_router_losses, router_losses
from modelspec import BatchTotals, LossFn, TokenBatch


class ActorTrainer:
    """megatron's optimizer over ``model``'s DDP-wrapped chunks; forward + backward and the guarded step."""

    def __init__(self, model: ActorModel, config: ActorConfig, dtype: str):
        offload_fraction = config.optimizer_offload_fraction
        if offload_fraction > 0 and dtype == "float32":
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
        self.model, self.config = model, config
        # megatron wires its CPU offload (HybridDeviceOptimizer) into the distributed optimizer only
        use_dist_opt = model.dims.dp > 1 or offload_fraction > 0
        model.wrap_ddp(
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_dist_opt
            )
        )
        chunk_config = model.chunks[0].config
        chunk_config.finalize_model_grads_func = finalize_model_grads  # DP all-reduce + tied-embedding grads
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            weight_decay=config.weight_decay,
            clip_grad=config.grad_clip,
            use_distributed_optimizer=use_dist_opt,
            bf16=dtype == "bfloat16",
            fp16=dtype == "float16",
            params_dtype=chunk_config.params_dtype,
            optimizer_cpu_offload=offload_fraction > 0,
            optimizer_offload_fraction=offload_fraction,
            # the HybridDeviceOptimizer runs on this flag's code path (megatron's training refuses CPU offload
            # without it, megatron/training/arguments.py): it keeps the fp32 masters, and its checkpoint load
            # (_update_fp32_params_by_new_state) knows only those
            use_precision_aware_optimizer=offload_fraction > 0,
        )
        self.optimizer = get_megatron_optimizer(opt_config, model.models)
        use_loss_scaling(model.chunks, self.optimizer)

    @property
    def optimizer_name(self) -> str:
        """The megatron-core optimizer class that steps (summary.json ``actor_optimizer``)."""
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return "megatron-core " + "+".join(sorted({type(opt).__name__ for opt in inner}))

    def compute_grads(self, batch: TokenBatch, loss_fn: LossFn, replay_routing: bool) -> dict[str, float]:
        """Forward + backward of ``batch`` into the grad buffers (DP-reduced); metrics. See
        :meth:`megatron_backend.actor.Actor.compute_grads`."""
        model, dims = self.model, self.model.dims
        routing = model.routing_mode(batch, replay_routing, forward_only=False)
        micro_batches = model.micro_batches(batch, self.config.max_tokens_per_micro_batch, response_only=True)
        num_micro = len(micro_batches)
        totals = BatchTotals(num_tokens=float(batch.loss_mask.sum()), num_seqs=batch.num_seqs)
        uses_entropy = bool(getattr(loss_fn, "uses_entropy", False))
        chunked = self.config.logprob_chunk_tokens is not None
        keep_softmax = not chunked or (uses_entropy and not self.config.entropy_recompute)
        for ddp_model in model.models:
            ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        clear_router_losses()
        if model.routed_copies is not None:
            model.routed_copies.reset()  # this pass's alone

        def factory(mb):
            def loss_func(logits):
                logprobs, entropy = model.logprobs_entropy(logits, mb, keep_softmax)
                data = dataclasses.replace(mb.data, entropy=mb.to_dense(entropy)) if uses_entropy else mb.data
                loss, metrics = loss_fn(mb.to_dense(logprobs), data, totals)
                metrics = {k: torch.as_tensor(v).detach().clone().float() for k, v in metrics.items()}
                mask = data.loss_mask
                metrics["entropy"] = (mb.to_dense(entropy.detach()) * mask).sum() / max(totals.num_tokens, 1.0)
                # the schedule divides by the number of micro-batches; the loss is already batch-scaled
                return loss * num_micro, metrics

            return loss_func

        outputs = model.run_schedule(micro_batches, factory, forward_only=False, routing=routing)
        metrics = {}
        if dims.is_last_stage:
            for out in outputs:
                for k, v in out.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v)
        if dims.pp > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=model.last_stage_rank, group=dims.pp_group)
            metrics = box[0]
        metrics["num_micro_batches"] = float(num_micro)
        metrics["num_tokens"] = totals.num_tokens
        logged = [name for name, coef in ROUTER_LOSSES.items() if getattr(self.config, coef) > 0]
        metrics.update(router_losses(dims, logged, len(model.shape.moe_layers), num_micro))
        if model.routed_copies is not None:  # collective: every rank of the world trains
            metrics["moe/routed_copies_max_ratio"] = model.routed_copies.take(dims.device)
        return metrics

    def train_step(self, batch: TokenBatch, loss_fn: LossFn, replay_routing: bool) -> dict[str, float]:
        """:meth:`compute_grads`, then the guarded optimizer step; metrics with ``grad_norm`` (NaN: skipped)."""
        metrics = self.compute_grads(batch, loss_fn, replay_routing)
        grad_norm = self._checked_step({k: v for k, v in metrics.items() if "loss" in k})
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        return metrics

    def _stop_if_not_finite(self, values: dict[str, float]) -> None:
        """Every rank raises together (one all-reduce) when any rank's loss or the grad norm is NaN/inf."""
        local = [name for name, value in values.items() if not math.isfinite(float(value))]
        flag = torch.tensor([float(bool(local))], device=self.model.dims.device)
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
                # looked up on the module at the call: megatron_backend.cpu_compat wraps it there on CPU
                clip_grads.clip_grad_by_total_norm_fp32(
                    params, max_norm=opt.config.clip_grad, total_norm=grad_norm, use_decoupled_grad=decoupled
                )
        self.optimizer.step_with_ready_grads()
        return grad_norm


def use_loss_scaling(chunks, optimizer) -> None:
    """Let megatron's schedule scale the loss by the optimizer's loss scale before backward (as megatron's
    own training.py does). ``schedules.backward_step`` scales only through ``config.grad_scale_func``, and
    the fp16 optimizer starts its scaler at 2**32 and divides the grads by it in ``step()``: without this,
    fp16 grads come out 2**-32 too small. (bf16/fp32: the scale is 1.)"""
    for chunk in chunks:
        chunk.config.grad_scale_func = optimizer.scale_loss
