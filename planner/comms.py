"""Every communicator one rank's step uses on CUDA, and the device bytes each holds.

Named from the libraries' sources for the run's layout (actor TP t, PP p, DP d; engine TP r; world W = t p d):

- ``world``: torch's default process group (megatron_backend/parallel.py ``init_process_group``), NCCL. The step
  uses it: the launcher's free-memory MIN (run/setup.py), barriers, the weight sync's point-to-point
  (weight_sync/transport.py: ``batch_isend_irecv`` over the default group, coalesced, so the sends and receives
  run on this communicator with per-peer point-to-point buffers), the train step's non-finite check
  (megatron_backend/actor_train.py ``_stop_if_not_finite``). Not megatron's grad norm: see
  ``INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE`` below.
- megatron-core (megatron/core/parallel_state.py ``initialize_model_parallel``): ``TP`` (the layers'
  all-reduces), ``PP`` (megatron/core/pipeline_parallel/p2p_communication.py ``batch_isend_irecv``: coalesced on
  the PP group's communicator), ``DP`` (DDP's gradient all-reduce / reduce-scatter and the distributed
  optimizer's all-gather, the DP-with-CP group), ``MODEL_PARALLEL`` (t p ranks; megatron/core/optimizer/optimizer.py
  ``get_grad_stats_parallel_group``: the grad norm and zero count of the non-distributed optimizer), ``EMBEDDING``
  (first and last stage, tied embeddings with PP > 1: the word embeddings' gradient all-reduce in
  megatron/core/distributed/finalize_model_grads.py), ``INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE`` (the distributed
  optimizer's grad norm, below).
- megatron-core's groups beside those, each ``create_group`` of its own (so an NCCL communicator of its own, though
  its ranks may be another's), counted where the step runs a collective on them (``tests/test_planner_node.py``
  records every collective's group on real ranks against this list):
  ``DATA_PARALLEL_GROUP`` (without CP; DDP uses the with-CP one above): megatron_backend's own collectives over
  ``dims.dp_group``: the token budget's micro-batch count (actor_model.py ``micro_batches``), the MoE router
  losses' mean (model.py ``router_losses``) and the routing-mismatch fraction (routing_replay.py).
  MoE (transformer/moe/): ``TENSOR_AND_CONTEXT_PARALLEL`` (the load-balancing loss's token counts, router.py
  ``get_tokens_per_expert_and_token_count`` over ``tp_cp``), ``EXPERT_MODEL_PARALLEL`` (the alltoall dispatcher's
  all-to-alls, token_dispatcher.py), ``EXPERT_TENSOR_AND_MODEL_PARALLEL`` (its gather of the tokens per expert,
  on EP > 1 or expert TP > 1), ``EXPERT_TENSOR_PARALLEL`` (its gather and reduce-scatter of the routed tokens),
  ``EXPERT_DATA_PARALLEL`` (DDP's expert-grad reduce and the distributed optimizer's expert gather:
  ``intra_expt_dp_group``, world / (expert TP x EP x PP) ranks), ``EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL`` (the
  non-distributed expert optimizer's grad norm, optimizer/__init__.py ``model_parallel_group=expt_tp_pp_group``);
  the last two on EP > 1 only: below it the experts' parameters are dense ones (moe/experts.py and
  tensor_parallel/layers.py set ``allreduce`` unless EP > 1), in DP's buffers and the dense optimizer.
- megatron-core's ``INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP``: ``initialize_model_parallel`` builds it on every
  layout (parallel_state.py, "build the intra distributed optimizer instance group": ``create_group``, i.e.
  ``torch.distributed.new_group``, of the tp-ep-pp groups of one optimizer instance; this project leaves
  ``num_distributed_optimizer_instances`` at 1, so it holds every rank of the world). It is a process group of its
  own, not the default group nor the DP group, though its ranks are the world's: torch gives each group its own
  NCCL communicator, created at the group's first collective (lazily: megatron_backend/parallel.py passes
  ``init_process_group`` no ``device_id``, so no group is connected or split eagerly). Its first collective is the
  distributed optimizer's: optimizer/__init__.py ``_get_megatron_optimizer_based_on_param_groups`` sets the
  DistributedOptimizer's ``grad_stats_parallel_group`` to it (the non-distributed ones get MODEL_PARALLEL), and
  the step's ``get_grad_norm`` (optimizer.py, ChainedOptimizer too) all-reduces the norm over it
  (optimizer/clip_grads.py ``get_grad_norm_fp32``; fp16's found-inf MAX in ``_unscale_main_grads_and_check_for_nan``
  too). So it is counted where megatron_backend/actor_train.py builds the distributed optimizer (DP > 1, or
  ``actor.optimizer_offload_fraction`` > 0: the HybridDeviceOptimizer's norm is taken on the device's main grads
  all the same) and the world has more than one rank; never with the non-distributed optimizer.
- vLLM 0.32 (vllm/distributed/parallel_state.py ``initialize_model_parallel``): ``tp`` and ``dp``
  ``GroupCoordinator`` s, each with a ``CudaCommunicator`` (device_communicators/cuda_communicator.py) whose
  ``PyNcclCommunicator`` (device_communicators/pynccl.py) is an NCCL communicator of its own, created eagerly,
  beside torch's ``device_group`` (lazily; the TP group's ``gather`` of the logits uses it). The TP group alone
  also holds vLLM's custom all-reduce buffers (device_communicators/custom_all_reduce.py: a meta buffer of
  ``meta_size + max_size``, an IPC buffer of max(max_size, 2 MiB all-gather, 16 MiB reduce-scatter) and 8 MiB of
  ``rank_data``; max_size 8 MiB) and, on compute capability 9.0 / 10.0, torch symmetric memory
  (device_communicators/symm_mem.py: ``SYMM_MEM_ALL_REDUCE_MAX_SIZES`` in all_reduce_utils.py).

An NCCL communicator's device buffers (NCCL_BUFFSIZE, NVIDIA's NCCL user guide: 4 MiB for the Simple protocol;
NCCL's src/include/device.h: DEFAULT_LL_BUFFSIZE 8 lines x 512 threads x 8 steps x 16 B = 512 KiB and
DEFAULT_LL128_BUFFSIZE 120 x 640 threads x 8 steps x 8 B = 4800 KiB) are allocated per channel and per peer
connection: ring collectives connect each rank to its ring neighbour on every channel (one receive buffer set
per channel); point-to-point buffers are Simple only, per peer. The channel count is topology-dependent
(NCCL picks it from the NVLink / NVSwitch graph; NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS bound it), so it
is the calibration's ``nccl_channels`` estimate with its uncertainty, and a tree or NVLS connection per channel
(what NCCL may add beside the ring) is counted in the uncertainty, not the value. Created lazily: a communicator
is counted only where the step runs a collective on it (vLLM's PyNccl ones are eager).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.devices import MIB

NCCL_SIMPLE_BUFFER_BYTES = 4 * MIB  # NCCL_BUFFSIZE default
NCCL_LL_BUFFER_BYTES = 512 * 1024  # DEFAULT_LL_BUFFSIZE
NCCL_LL128_BUFFER_BYTES = 4800 * 1024  # DEFAULT_LL128_BUFFSIZE
NCCL_PROTOCOL_BUFFER_BYTES = NCCL_SIMPLE_BUFFER_BYTES + NCCL_LL_BUFFER_BYTES + NCCL_LL128_BUFFER_BYTES
NCCL_P2P_CHANNELS_PER_PEER = 2  # NCCL_NCHANNELS_PER_PEER's default (point-to-point channels per peer)
# vLLM's custom all-reduce (custom_all_reduce.py): max_size 8 MiB; the IPC buffer max(8, 2, 16) MiB; rank_data 8 MiB
VLLM_CUSTOM_ALL_REDUCE_BYTES = 8 * MIB + 16 * MIB + 8 * MIB
# torch symmetric memory of vLLM's TP all-reduce on capability 9.0 (H100 / H200), by TP size (all_reduce_utils.py)
VLLM_SYMM_MEM_BYTES_SM90 = {2: 64 * MIB, 4: 32 * MIB, 6: 64 * MIB, 8: 64 * MIB}
SM90_DEVICES = ("H100-80GB", "H200-141GB")
NCCL_BUFFER_FREE = ("vLLM custom all-reduce", "vLLM symmetric memory")  # buffers, not NCCL communicators


@dataclass(frozen=True)
class Communicator:
    """One communicator (or communication buffer) this rank holds on its device."""

    name: str
    ranks: int
    source: str  # the library file that creates it
    use: str  # what the step runs on it
    bytes: int
    uncertainty_bytes: int


def nccl_collective_bytes(channels: float) -> int:
    """One NCCL communicator's ring buffers: every channel's receive buffers of the three protocols."""
    return round(channels * NCCL_PROTOCOL_BUFFER_BYTES)


def nccl_p2p_bytes(peers: int) -> int:
    """Point-to-point buffers for ``peers`` peers: Simple only, send and receive, per p2p channel per peer."""
    return peers * NCCL_P2P_CHANNELS_PER_PEER * 2 * NCCL_SIMPLE_BUFFER_BYTES


def communicators(inp, channels: float, channels_uncertainty: float) -> tuple[Communicator, ...]:
    """The communicators one rank of ``inp``'s layout uses in the step (CUDA only; gloo on CPU holds no device
    bytes), each with its buffers; ``channels`` (+- ``channels_uncertainty``) NCCL channels per communicator."""
    if not inp.on_cuda:
        return ()
    t, p, d, r = inp.actor.tp, inp.actor.pp, inp.actor_dp, inp.rollout.tp
    world = t * p * d
    # the value: a ring set per channel; the uncertainty: the channel count's, plus a tree / NVLS set per channel
    ring = nccl_collective_bytes(channels)
    spread = round(channels_uncertainty * NCCL_PROTOCOL_BUFFER_BYTES) + ring
    state = "megatron/core/parallel_state.py"
    vllm = "vllm/distributed/parallel_state.py + device_communicators/pynccl.py"
    out: list[Communicator] = []

    def nccl(name: str, ranks: int, source: str, use: str, extra: int = 0) -> None:
        if ranks > 1:
            out.append(Communicator(name, ranks, source, use, ring + extra, spread))

    peers = inp.sync_peers if inp.sync_peers is not None else (0 if t == r and p == 1 else world - 1)
    nccl(
        "world",
        world,
        "torch.distributed.init_process_group (megatron_backend/parallel.py)",
        f"free-memory MIN, barriers, weight-sync point-to-point with {peers} peers (weight_sync/transport.py)",
        extra=nccl_p2p_bytes(peers),
    )
    nccl("megatron TP", t, state, "the layers' all-reduces")
    nccl("megatron PP", p, state, "stage-to-stage send/recv (p2p_communication.py, coalesced)")
    nccl("megatron DP", d, state, "gradient reduce, distributed optimizer all-gather")
    if inp.distributed_optimizer:
        # its own process group over the world's ranks (num_distributed_optimizer_instances 1), not "world"'s
        nccl(
            "megatron INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE",
            world,
            f"{state} + megatron/core/optimizer/__init__.py",
            "the distributed optimizer's grad norm (clip_grads.py get_grad_norm_fp32)",
        )
    else:
        nccl("megatron MODEL_PARALLEL", t * p, state, "grad norm and zero count (optimizer.py)")
    token_budget = inp.actor.max_tokens_per_micro_batch is not None or inp.actor.forward_max_tokens is not None
    router_losses = inp.shape.is_moe and (inp.actor.moe_aux_loss_coef > 0 or inp.actor.moe_z_loss_coef > 0)
    if token_budget or router_losses or inp.routed_experts:
        nccl("megatron DP (without CP)", d, state, "megatron_backend's token budget, router-loss and routing means")
    if inp.shape.is_moe:
        moe = "megatron/core/transformer/moe/"
        ep, etp = inp.actor.ep, inp.actor.expert_tp
        if inp.actor.moe_aux_loss_coef > 0:
            nccl("megatron TP x CP", t, moe + "router.py", "the load-balancing loss's tokens per expert")
        nccl("megatron EP", ep, moe + "token_dispatcher.py", "the dispatcher's all-to-alls")
        nccl("megatron expert TP", etp, moe + "token_dispatcher.py", "the routed tokens' gather and reduce-scatter")
        nccl("megatron expert TP x EP", etp * ep, moe + "token_dispatcher.py", "the gather of tokens per expert")
        if ep > 1:  # else the experts' params are dense ones (experts.py: ``allreduce`` unless EP > 1), in DP's buffers
            nccl("megatron expert DP", world // (etp * ep * p), state, "expert grads' reduce, their optimizer's gather")
            if not inp.distributed_optimizer:
                nccl("megatron expert TP x EP x PP", etp * ep * p, state, "the expert optimizer's grad norm")
    if p > 1 and inp.shape.tie_word_embeddings:
        nccl("megatron EMBEDDING", 2, state, "tied word embeddings' gradient all-reduce (finalize_model_grads.py)")
    if inp.rollout.engine == "vllm":
        nccl("vLLM tp (PyNccl)", r, vllm, "the engine's TP all-reduces (eager)")
        nccl("vLLM tp (torch device_group)", r, "vllm/distributed/parallel_state.py", "the logits' gather")
        nccl("vLLM dp (PyNccl)", world // r, vllm, "the DP replicas' has-unfinished all-reduce (eager)")
        if r > 1:
            out.append(
                Communicator(
                    "vLLM custom all-reduce",
                    r,
                    "vllm/distributed/device_communicators/custom_all_reduce.py",
                    "IPC buffers of the TP all-reduce",
                    VLLM_CUSTOM_ALL_REDUCE_BYTES,
                    0,
                )
            )
        symm = VLLM_SYMM_MEM_BYTES_SM90.get(r, 0) if inp.device.name in SM90_DEVICES else 0
        if symm:
            out.append(
                Communicator(
                    "vLLM symmetric memory",
                    r,
                    "vllm/distributed/device_communicators/symm_mem.py",
                    "torch symmetric memory of the TP all-reduce (VLLM_ALLREDUCE_USE_SYMM_MEM=1)",
                    symm,
                    0,
                )
            )
    elif r * inp.rollout.ep > 1:  # the native engine: its replica's process group (run/setup.py build_rank)
        nccl("native engine TP x EP", r * inp.rollout.ep, "run/setup.py build_rank", "the engine's all-reduces")
    return tuple(out)
