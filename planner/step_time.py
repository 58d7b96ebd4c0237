"""The step-time model: seconds per phase of one RL step, from counted work and a device's speeds.

For each phase (the step's table, colocation/phases.py, as the memory plan walks it) the work of the slowest rank is
counted from the model's shape, the layouts and the batch (:class:`PhaseWork`):

- ``flops``: dense math. A forward is 2 x the params a token meets (an MoE token meets its top-k experts; the
  embedding is a lookup) + causal attention's 2 x span x heads x d per layer; backward 2 x forward; full recompute
  one forward more; the train phase runs ``trainer.ppo_epochs`` train steps. The engine runs every prompt token
  once (prefill) and every response token once (decode); its lm_head only where it samples.
- ``memory_bytes``: bytes read or written in memory already mapped that no FLOP count sees: every decode step reads
  the engine's weights and the KV cache its sequences have written; the optimizer step reads and writes its states
  (on CPU torch's AdamW, op by op: :func:`torch_adamw_bytes_per_param`); DDP scales the grads before reducing them.
- ``fresh_bytes``: bytes written into fresh allocations (on CPU each buffer of a page or more is a fresh mapping,
  faulted in): an actor pass's activations and logits, the native engine's context gathers and its new tensors of
  16 KiB or more, a wake's weights and KV cache, the grads handed back zeroed.
- ``vocab_bytes``: bytes through the elementwise passes over [rows, V] fp32 logits (:func:`sampler_bytes_per_logit`,
  :func:`logprob_bytes_per_logit`, counted from the kernels), and ``draws``, the native sampler's random draws.
- ``host_bytes``, ``host_in_bytes``: what an offload copies out over the host link, and an onload in (its state's
  bytes, the memory plan's sizes);
  ``host_storages``: the storages an offload copies out, each to its own host buffer.
- ``link_bytes``: per link (``intra_node``, ``inter_node``), what one rank sends in collectives: TP's 4 all-reduces
  per layer in train (2 forward, 2 backward; 2 in a forward) of tokens x h, PP's activation sends, EP's all-to-all of
  the routed copies (dispatch and combine), DP's gradient all-reduce (no distributed optimizer); in rollout the
  engine's TP all-reduces and, where vLLM's MoE layers span its replicas, their all-gather and reduce-scatter.
  ``reduce_scatter_bytes``, ``all_gather_bytes``: the distributed optimizer's DP fp32 grads reduce-scattered and
  params gathered after the step, and the weight sync's reference check's gather (on CPU at gloo's measured rates,
  else over the link).
  ``exchange_bytes``: the weight sync's engine weights sent and received point to point (on CPU at gloo's measured
  exchange rate, else over the link).
- ``ops``: fixed costs by kind, in units of the device's ``op_seconds``: an actor layer's forward and backward (their
  torch ops counted on megatron's local layer: :data:`LOCAL_LAYER_OPS`, :data:`LOCAL_MODEL_OPS`), a micro-batch's
  pass (the schedule and the loss around the model), an engine layer's step, a parameter tensor an optimizer step or
  a sync handles, a phase.

seconds = flops / (peak x compute_efficiency) + draws x draw_seconds
          + (memory_bytes / bandwidth + fresh_bytes / fresh bandwidth) / memory_efficiency
          + vocab_bytes / (bandwidth x vocab_pass_efficiency)
          + sum ops x op_seconds x its factor + (host_bytes / host link + host_in_bytes / its way in) / host_efficiency
          + sum link_bytes / (link x link_efficiency) + collective_steps x op_seconds x collective_step_ops
          + exchange_bytes / the probe's gloo exchange rate (CPU; else with link_bytes)
          + reduce_scatter_bytes, all_gather_bytes / the probe's gloo rate of each (CPU; else with link_bytes)
          + gloo_steps x the probe's 2-rank gloo all-reduce / 2 x gloo_collective_factor
            (CPU: the native engine's collectives, not stretched by the cores' oversubscription)
          + actor_gloo_steps x the probe's 2-rank gloo all-reduce / 2 (CPU: the actor's TP all-reduces, stretched by
            the oversubscription as measured inside runs)

with the pipeline's bubble (pp - 1) / (micro-batches x vpp) stretching the actor's passes and, on CPU, a rank's share
of the cores its math and ops (the longer of the two: a rank waiting in the bubble leaves its core to the others); on CUDA the kernel launches overlap the device's work (:func:`combined_seconds`). The efficiencies and op factors are fitted (planner/calibration/<kind>_time.json,
``make calibrate-time``, each efficiency at most 1), on the memory plan's fit set, and checked by ``make validate-time`` on runs that did not
fit them. Each phase names what bounds it (the largest term). Pure standard library, like the memory plan.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field, fields

from colocation.host_memory import FAULTING_TENSOR_BYTES
from colocation.phases import ACTOR_STATE, step_phases
from modelspec.family import layer_parts
from planner.calibration import Calibration, load
from planner.inputs import PlanInputs, StepLengths
from planner.plan import (
    Plan,
    actor_stage_counts,
    optimizer_bytes_per_param,
    optimizer_shards,
    reference_sample,
    step_flags,
)
from planner.sizes import (
    FP32_BYTES,
    actor_stage_expert_param_count,
    actor_stage_param_count,
    actor_stage_param_tensors,
    engine_param_count,
    kv_bytes_per_token,
    layer_activation_bytes_per_token,
    local_layer_written_bytes_per_token,
    local_packed_attention_backward_padding_bytes_per_token,
    local_packed_attention_padding_bytes_per_token,
    megatron_padded_vocab,
    native_new_tensor_bytes_per_row,
    stage_layers,
    vllm_padded_vocab,
)
from planner.speed import SpeedSpec

# torch ops of one decoder layer of megatron's local spec (megatron_backend/model.py, packed sequences), counted with
# torch.utils._python_dispatch.TorchDispatchMode on a real layer (tests/test_step_time.py pins them): forward and
# backward, Qwen2-like and with Qwen3's q/k norms, a micro-batch of unequal sequences (one sequence alone: 2 more)
LOCAL_LAYER_OPS = {"forward": 131, "backward": 121}
# the same count's ops outside the layers (embedding, final norm, output layer): per micro-batch and pass
LOCAL_MODEL_OPS = {"forward": 25, "backward": 34}
# the same count's ops per micro-batch outside the model, on the last stage (tests/test_step_time.py pins them): a
# log-prob pass's (megatron_backend/logprobs.py over one chunk, the schedule's forward_step); in train beside those
# the train loss's own and the backward of both
LOSS_OPS = {"forward": 96, "backward": 178}
# over several chunks (actor.logprob_chunk_tokens under a micro-batch's response rows) the same count's (fixed, per
# chunk) instead; one chunk is off that line (4 fewer forward, 1 more backward: torch skips a slice that covers the
# whole tensor)
LOSS_CHUNKED_OPS = {"forward": (68, 32), "backward": (154, 23)}
QK_NORM_LAYER_OPS = {"forward": 13, "backward": 34}
# an MoE layer of the local spec (megatron's router, the alltoall dispatcher, its SequentialMLP over the rank's
# experts) beyond the dense layer's ops: (fixed, per local expert), the same dispatcher count; with Transformer
# Engine's grouped GEMM (CUDA) the experts run as one
MOE_LAYER_OPS = {"forward": (35, 12), "backward": (11, 20)}
TERMS = ("compute", "memory", "host", "link", "actor_ops", "engine_ops", "tensor_ops", "micro_batch_ops", "phase_ops")
# a fit's columns (raw_terms) -> the constant that scales each (planner/calibration TIME_CONSTANTS) and its term
COLUMN_CONSTANT = {
    "compute": "compute_efficiency",
    "memory": "memory_efficiency",
    "vocab": "vocab_pass_efficiency",
    "draws": None,  # a measured rate (SpeedSpec.draw_seconds): nothing to fit
    "gemm": None,  # a measured rate (SpeedSpec.gemm_seconds_per_weight_byte): nothing to fit
    "host": "host_efficiency",
    "link": "link_efficiency",
    "collective_ops": "collective_step_ops",
    "gloo": "gloo_collective_factor",  # SpeedSpec.gloo_all_reduce_seconds, as a rollout pays it
    "actor_gloo": None,  # the measured SpeedSpec.gloo_all_reduce_seconds, as the actor pays it: nothing to fit
    "exchange": None,  # a measured rate (SpeedSpec.gloo_exchange_bytes_per_s): nothing to fit
    "buckets": None,  # measured rates (SpeedSpec.gloo_reduce_scatter_bytes_per_s, ...): nothing to fit
    "storage_ops": "host_storage_ops",
    "actor_ops": "actor_op_factor",
    "actor_backward_ops": "actor_backward_op_factor",
    "native_ops": "native_layer_step_ops",
    "native_step_ops": "native_step_ops",
    "vllm_ops": "vllm_layer_step_ops",
    "vllm_step_ops": "vllm_step_ops",
    "tensor_ops": "param_tensor_ops",
    "plain_ops": None,  # counted ops at the measured op_seconds: nothing to fit
    "micro_batch_ops": "micro_batch_ops",
    "phase_ops": "phase_ops",
}
COLUMN_TERM = {
    "native_ops": "engine_ops",
    "native_step_ops": "engine_ops",
    "vllm_ops": "engine_ops",
    "vllm_step_ops": "engine_ops",
    "actor_backward_ops": "actor_ops",
    "vocab": "memory",
    "draws": "compute",
    "gemm": "compute",
    "collective_ops": "link",
    "gloo": "link",
    "actor_gloo": "link",
    "exchange": "link",
    "buckets": "link",
    "storage_ops": "host",
    "plain_ops": "tensor_ops",
}
EFFICIENCIES = (
    "compute_efficiency",
    "memory_efficiency",
    "vocab_pass_efficiency",
    "host_efficiency",
    "link_efficiency",
)


@dataclass
class PhaseWork:
    """One phase's work on its slowest rank (see the module doc)."""

    flops: float = 0.0
    memory_bytes: float = 0.0  # read or written in memory that is mapped already
    fresh_bytes: float = 0.0  # written into fresh allocations (SpeedSpec.fresh_bytes_per_s: CPU's page faults)
    vocab_bytes: float = 0.0  # through the elementwise passes over [rows, V] fp32 logits (their exp)
    draws: float = 0.0  # the sampler's random draws (SpeedSpec.draw_seconds each)
    host_bytes: float = 0.0  # out to the host: an offload (and on CUDA the reference check's copies)
    host_in_bytes: float = 0.0  # in from the host: an onload
    # torch F.linear GEMMs by row count: {rows: weight bytes multiplied at that count} (their FLOPs and weight
    # reads are in neither ``flops`` nor ``memory_bytes``): SpeedSpec.gemm_seconds_per_byte where measured
    gemms: dict[float, float] = field(default_factory=dict)
    link_bytes: dict[str, float] = field(default_factory=dict)
    # collectives' sequential steps (a ring all-reduce over n ranks takes 2 (n - 1), an all-gather or a broadcast
    # n - 1, a point-to-point send 1): their latency, which the bytes do not see
    collective_steps: float = 0.0
    # the native engine's collectives' steps on CPU: gloo's, timed at the probe's measured 2-rank all-reduce (2 steps;
    # SpeedSpec.gloo_all_reduce_seconds) times gloo_collective_factor, as a rollout pays it. vLLM's CPU build
    # all-reduces in shared memory (cpu_communicator.py _CPUSHMDistributed)
    gloo_steps: float = 0.0
    # the actor's TP all-reduces' steps on CPU (megatron's mappings.py and megatron_backend/logprobs.py, over gloo):
    # at the probe's all-reduce, nothing fitted, stretched by the cores' oversubscription. Timed inside runs
    # (docs/plan-validation.md), a call takes what the probe's does at 2 ranks on 2 cores (0.6-0.9 ms against its
    # 0.83: both ranks run the same work, so neither waits on the other) and 1.6-2.4 ms at 4 ranks (PP 2 x TP 2),
    # where a rank waits for its partner's share of the cores
    actor_gloo_steps: float = 0.0
    # the weight sync's point-to-point exchange per link, the busier direction's bytes (links are full duplex): on
    # CPU at the probe's measured gloo exchange (SpeedSpec.gloo_exchange_bytes_per_s: ~1.1 GB/s each way, a third of
    # a copy), else over the link as the collectives' bytes
    exchange_bytes: dict[str, float] = field(default_factory=dict)
    # the distributed optimizer's bucket collectives per link, the bytes one rank sends: DP's reduce-scatter of the
    # fp32 grads and the params' all-gather after the step. On CPU at gloo's measured rates for each
    # (SpeedSpec.gloo_reduce_scatter_bytes_per_s, gloo_all_gather_bytes_per_s: a twentieth of a copy), else over
    # the link as the collectives' bytes
    reduce_scatter_bytes: dict[str, float] = field(default_factory=dict)
    all_gather_bytes: dict[str, float] = field(default_factory=dict)
    host_storages: float = 0.0  # storages an offload copies out (CPU: one pwrite each into the offload's file)
    actor_ops: float = 0.0  # forward
    actor_backward_ops: float = 0.0  # autograd's: each op's node is also the engine's to schedule
    engine_layer_steps: float = 0.0
    engine_steps: float = 0.0  # decode steps and prefills: the engine's work per step outside its layers
    param_tensors: float = 0.0
    plain_ops: float = 0.0  # small torch ops counted one by one (the sync's checksums), at the device's op_seconds
    micro_batch_passes: float = 0.0  # a micro-batch's forward or backward: the schedule's and the loss's fixed cost
    bubble: float = 0.0  # the pipeline's idle fraction of the actor's passes


@dataclass(frozen=True)
class PhaseTime:
    name: str
    seconds: float
    terms: dict[str, float]  # seconds by term (TERMS)
    bound: str  # the largest term

    def __str__(self) -> str:
        return f"{self.name}: {self.seconds * 1e3:.1f} ms ({self.bound})"


@dataclass(frozen=True)
class StepTime:
    phases: tuple[PhaseTime, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def phase(self, name: str) -> PhaseTime:
        return next(p for p in self.phases if p.name == name)

    @property
    def bound(self) -> str:
        """What bounds the step: the largest term summed over phases, with the phase that spends most on it."""
        totals = {t: sum(p.terms[t] for p in self.phases) for t in TERMS}
        term = max(totals, key=totals.get)
        return f"{term} ({max(self.phases, key=lambda p: p.terms[term]).name})"


def time_constants(device_kind: str) -> Calibration:
    return load(f"{device_kind}_time")


# ---------------------------------------------------------------- counts
def _layer_ops(inp: PlanInputs, kind: str, layers) -> int:
    """Torch ops of ``layers`` in a forward or backward of one micro-batch (an MoE layer's grow with its experts)."""
    s = inp.shape
    dense = LOCAL_LAYER_OPS[kind] + (QK_NORM_LAYER_OPS[kind] if s.qk_norm else 0)
    fixed, per_expert = MOE_LAYER_OPS[kind]
    # the local spec's SequentialMLP loops over the experts; Transformer Engine's grouped GEMM (CUDA) does not
    local_spec = inp.attention == "unfused"
    moe = fixed + per_expert * (s.num_experts // inp.actor.ep if local_spec else 1) if s.is_moe else 0
    return sum(dense + (moe if s.is_moe_layer(layer) else 0) for layer in layers)


def _param_tensors(inp: PlanInputs, layers) -> int:
    return sum(len(layer_parts(inp.shape, layer)) for layer in layers) + 3  # embedding, final norm, output layer


def _shard_tensors(sizes: list[int], ranks: int) -> int:
    """Of tensors of ``sizes`` elements (in the model's order) in one DDP buffer, the most that overlap one rank's
    shard of the distributed optimizer (megatron/core/distributed/param_and_grad_buffer.py): the buffer lays them
    out in reverse order, each starting at a multiple of 64 elements, in buckets of at least max(40M, 1M x ranks)
    elements, each padded to a multiple of lcm(ranks, 128) and split evenly over the ranks; a rank steps the part
    of every tensor its shard overlaps (distrib_optimizer.py, param_range_map), a tensor of its own each."""
    if ranks == 1 or not sizes:
        return len(sizes)
    limit, align = max(40_000_000, 1_000_000 * ranks), math.lcm(ranks, 128)
    buckets: list[list[tuple[int, int]]] = [[]]  # (start, end) per tensor, from the bucket's start
    end = 0
    for size in reversed(sizes):
        start = math.ceil(end / 64) * 64 if buckets[-1] else 0
        end = start + size
        buckets[-1].append((start, end))
        if end >= limit:
            buckets, end = [*buckets, []], 0
    most = 0
    for spans in (b for b in buckets if b):
        shard = math.ceil(spans[-1][1] / align) * align // ranks
        starts, ends = [start for start, _ in spans], [end for _, end in spans]
        # rank r's shard [r s, (r + 1) s) overlaps the tensors from the first ending after r s to the last starting
        # before (r + 1) s
        most += max(
            bisect.bisect_left(starts, (r + 1) * shard) - bisect.bisect_right(ends, r * shard) for r in range(ranks)
        )
    return most


def _optimizer_tensors(inp: PlanInputs, stage: int) -> int:
    """The parameter tensors a rank of pipeline stage ``stage`` steps, each with its own optimizer states (which an
    offload copies out one by one): megatron's own parameters on the rank (planner.sizes.actor_stage_param_tensors: one
    fused qkv, a tensor per local expert's fc1 and fc2), with the distributed optimizer the parts of those its shard
    overlaps (:func:`_shard_tensors`), the dense ones' over DP, the routed experts' (their own buffer) over expert DP."""
    a = inp.actor
    dp, expert_dp = (inp.actor_dp, inp.expert_dp) if inp.distributed_optimizer else (1, 1)
    return _layout_optimizer_tensors(inp.shape, a.tp, a.pp, a.ep, a.etp, stage, inp.attention, dp, expert_dp)


@functools.lru_cache(maxsize=4096)  # a search plans many layouts of one model: each layout's count once
def _layout_optimizer_tensors(shape, tp, pp, ep, etp, stage, attention, dp, expert_dp) -> int:
    te_norms = attention != "unfused"  # Transformer Engine's spec (CUDA); megatron's local spec on CPU
    dense, experts = actor_stage_param_tensors(shape, tp, pp, stage, ep, etp, te_norms=te_norms)
    return _shard_tensors(dense, dp) + _shard_tensors(experts, expert_dp)


def _actor_forward_flops(inp: PlanInputs, stage: int, tokens: float, span: float) -> float:
    """A forward of ``tokens`` tokens (each attending to ``span`` on average) on one rank of pipeline stage ``stage``."""
    s, a = inp.shape, inp.actor
    params = actor_stage_param_count(s, a.tp, a.pp, stage, a.ep, a.etp)
    experts = actor_stage_expert_param_count(s, a.tp, a.pp, stage, a.ep, a.etp)
    vocab_rows = megatron_padded_vocab(s.vocab_size, a.tp) // a.tp * s.hidden_size
    if stage == 0:
        params -= vocab_rows  # the embedding is a lookup
    if experts:  # a token meets its top-k experts of E / ep local ones: k x ep / E of the local expert params; the
        # rank whose experts received the most copies (the one the others wait for at the all-to-alls) that many times
        params += experts * (s.moe_top_k * a.ep / s.num_experts * inp.routed_copies_ratio - 1)
    layers = len(stage_layers(s, a.pp, stage))
    attention = 2 * tokens * span * s.num_heads * s.head_dim / a.tp * layers  # causal: half of 4 t s H d
    return 2 * params * tokens + attention


def torch_adamw_bytes_per_param(element_bytes: int, weight_decay: bool) -> tuple[int, int]:
    """(bytes read or written in mapped memory, bytes written into fresh tensors) per shard parameter of one step of
    torch's AdamW, megatron's optimizer without Transformer Engine or apex (megatron/core/optimizer/__init__.py),
    on fp32 masters and fp32 grads. On CPU torch runs it tensor by tensor (foreach kernels are for cuda, xpu and mtia:
    torch/utils/_foreach_utils.py), each op a pass (torch/optim/adam.py::_single_tensor_adam, torch 2.13): with
    weight decay ``param.mul_`` (8); ``exp_avg.lerp_(grad)`` (reads m and g, writes m: 12); ``exp_avg_sq.mul_`` (8)
    and ``.addcmul_(grad, grad)`` (12); ``exp_avg_sq.sqrt()`` (reads 4, writes a new tensor) and its division (reads
    4, writes another); ``.add_(eps)`` (8); ``param.addcdiv_(exp_avg, denom)`` (reads three, writes one: 16). A 16-bit
    model then takes its params from the masters (megatron's ``_copy_main_params_to_model_params``: reads 4, writes
    e)."""
    f = FP32_BYTES
    mapped = (2 * f if weight_decay else 0) + 3 * f + 2 * f + 3 * f + f + f + 2 * f + 4 * f
    if element_bytes < f:
        mapped += f + element_bytes
    return mapped, 2 * f


def sampler_bytes_per_logit(engine: str, element_bytes: int) -> int:
    """Bytes an engine's sampler (temperature > 0, no top-k / top-p) moves per element of its [B, V] logits, each
    torch op's reads and writes as torch 2.13's CPU kernels make them; ``.float()`` reads e and writes 4 (none in
    fp32). native (rollout/native/sampling.py): ``logsumexp`` (ReduceOps.cpp: amax reads, ``self - maxes`` reads
    and writes, ``exp`` reads and writes, ``sum`` reads: 24), the temperature's division (8), ``softmax`` (the
    last-dim kernel: max, exp-and-sum, scale: 3 reads, 2 writes: 20), ``multinomial``'s one-sample path
    (Distributions.cpp: ``exponential_`` writes its draws, ``div`` reads two and writes, ``argmax`` reads: 20; the
    draws themselves are :func:`sampler_draws`). vLLM (v1/sample: raw log-probs, then
    topk_topp_sampler.py::forward_cpu): ``log_softmax`` (3 reads, 1 write: 16), the temperature's in-place
    division (8), ``fused_gumbel_argmax`` (reads: 4; its SplitMix64 noise is made in registers)."""
    cast = 0 if element_bytes == FP32_BYTES else element_bytes + FP32_BYTES
    return cast + FP32_BYTES * ((6 + 2 + 5 + 5) if engine == "native" else (4 + 2 + 1))


def sampler_draws(engine: str, vocab: int) -> int:
    """Random draws per sampled token: the native sampler's ``torch.multinomial`` draws an exponential per vocab
    entry (its one-sample path, Distributions.cpp); vLLM's CPU sampler hashes its noise in the fused kernel."""
    return vocab if engine == "native" else 0


def logprob_bytes_per_logit(element_bytes: int, backward: bool, keep_softmax: bool, entropy_grad: bool) -> int:
    """Bytes megatron_backend/logprobs.py's fused log-prob/entropy pass moves per element of a response row's
    [V/t] logits: forward, or (``backward``) backward's recompute and gradient. Forward: ``index_select`` (read and
    write e), ``.float()`` (read e, write 4; none in fp32), ``max`` (4), ``sub_`` (8), ``exp`` (8), ``sum`` (4),
    ``mul_`` by exp (12), ``sum`` (4), and with ``keep_softmax`` the ``div_`` (8). Backward: unless kept, the
    recompute (``index_select``, ``.float()``, ``sub_``, ``exp_``: 2e + cast + 16); the gradient: ``mul_`` (8), or
    with an entropy gradient ``xlogy`` (12), two ``addcmul_`` (24) and ``mul_`` (8); ``.to(dtype)`` (read 4,
    write e; none in fp32) and ``index_add_`` into the zeroed grad (read the row's gradient e, read and write 2e)."""
    e, f = element_bytes, FP32_BYTES
    cast = 0 if e == f else e + f
    if not backward:
        return 2 * e + cast + 10 * f + (2 * f if keep_softmax else 0)
    recompute = 0 if keep_softmax else 2 * e + cast + 4 * f
    gradient = 11 * f if entropy_grad else 2 * f
    return recompute + gradient + cast + 3 * e


def _engine_work(inp: PlanInputs, lengths: StepLengths) -> PhaseWork:
    """Rollout on one engine rank: prefill of its prompts, then decode steps until its longest response ends."""
    s, r = inp.shape, inp.rollout
    replicas = max(1, inp.world_size // r.tp)
    seqs = math.ceil(inp.sequences_per_step / replicas)
    waves = math.ceil(seqs / r.max_num_seqs)
    steps = waves * max(1, lengths.longest_response)
    prompt, response = lengths.mean_prompt, lengths.mean_response
    params = engine_param_count(s, r.tp, *inp.engine_expert_split)
    active, expert_params = params, 0
    if s.is_moe:  # a token meets its top-k of the E experts: the rank's expert params x k / (E / ep) it holds
        ep, etp = inp.engine_expert_split
        expert_params = len(s.moe_layers) * s.num_experts // ep * 3 * s.hidden_size * s.moe_intermediate_size // etp
        active = params - expert_params * (1 - s.moe_top_k * ep / s.num_experts)
    e = inp.element_bytes
    tokens = seqs * (prompt + response)
    span = prompt + response / 2
    attention = 2 * tokens * span * s.num_heads * s.head_dim / r.tp * s.num_layers
    kv_per_token = kv_bytes_per_token(s, r.tp, e)
    kv_read, kv_gathered = seqs * response * span * kv_per_token, 0.0
    if r.engine == "native":
        # each decode step gathers, per layer, its running sequences' context blocks into a new tensor
        # (rollout/native/model.py::decode, index_select): [2, B x kv, width, d], the width the blocks covering the
        # longest context + the new token (kv_cache.py::decode_rows), then reads it (baddbmm, bmm); the scores
        # [B x kv, Hq / kv, width] and their softmax are new tensors too
        block = inp.kv_block_size
        width = lengths.longest_prompt + lengths.longest_response / 2 + block / 2
        scores_per_token = 2 * s.num_heads // r.tp * e * s.num_layers
        kv_gathered = seqs * response * width * (kv_per_token + scores_per_token)
        kv_read = 2 * kv_gathered
    # the vocab tables, [V/t, h] each (rollout/native/model.py): the embedding is a lookup of the step's rows (no
    # FLOPs, not read whole); the lm_head runs on the sampled positions only (prefill's last, each decode step's)
    table = vllm_padded_vocab(s.vocab_size) // r.tp * s.hidden_size
    lookup = 0 if s.tie_word_embeddings else table
    sampled = seqs * response
    flops = 2 * (active - lookup - table) * tokens + 2 * table * sampled + attention
    weight_reads = steps * (params - lookup) * e
    gemms: dict[float, float] = {}
    allocated = 0.0
    if r.engine == "native":  # torch's F.linear, each at its row count (rollout/native/model.py): no FLOPs or
        # weight reads of its own beside them
        flops, weight_reads = attention, 0.0
        layer_bytes, expert_bytes = (params - lookup - table) * e, expert_params * e
        gemms, allocated = _native_engine_passes(inp, lengths, seqs, waves, steps, layer_bytes, expert_bytes, table * e)
    vocab = vllm_padded_vocab(s.vocab_size)  # the sampler's rows, gathered over TP
    sampler = sampled * vocab * sampler_bytes_per_logit(r.engine, e)
    tp_bytes = tokens * 2 * s.num_layers * s.hidden_size * e * 2 * (r.tp - 1) / r.tp
    # per layer step over TP (rollout/native/model.py): the embedding's and 2 per layer's all-reduces, the logits'
    # all-gather and the sampled tokens' broadcast (rollout/native/sampling.py)
    collectives = (steps + waves) * ((1 + 2 * s.num_layers) * 2 * (r.tp - 1) + 2 * (r.tp - 1))
    work_links = {"intra_node": tp_bytes}
    gloo = r.engine == "native" and not inp.on_cuda  # its collectives are torch.distributed's on gloo
    replicas_gathered = inp.engine_moe_gathered_replicas
    if replicas_gathered > 1:
        # vLLM's MoE layers span its R replicas (all2all_backend "allgather_reducescatter",
        # vllm/distributed/device_communicators/all2all.py AgRsAll2AllManager): per MoE layer and step, an all-gather
        # over the DP group of every replica's hidden states [M, h] and router logits [M, E]
        # (dispatch_router_logits), then a reduce-scatter of the experts' output [R M, h] back to [M, h] (combine);
        # a ring sends (R - 1) of the rank's M rows of each. The DP group strides the TP ranks: it spans the world
        moe_layers = len(s.moe_layers)
        gathered = tokens * moe_layers * (2 * s.hidden_size + s.num_experts) * e * (replicas_gathered - 1)
        _add_by_key(work_links, _by_link(inp, {"world": gathered}))
        collectives += (steps + waves) * moe_layers * 3 * (replicas_gathered - 1)
    return PhaseWork(
        flops=flops,
        memory_bytes=weight_reads + kv_read,
        fresh_bytes=kv_gathered + allocated,
        gemms=gemms,
        vocab_bytes=sampler,
        draws=sampled * sampler_draws(r.engine, vocab),
        link_bytes=work_links,
        collective_steps=0.0 if gloo else collectives,
        gloo_steps=collectives if gloo else 0.0,
        engine_layer_steps=(steps + waves) * s.num_layers,  # decode steps + one prefill per wave
        engine_steps=steps + waves,
    )


def _native_engine_passes(
    inp: PlanInputs,
    lengths: StepLengths,
    seqs: int,
    waves: int,
    steps: int,
    layer_bytes: float,
    expert_bytes: float,
    table_bytes: float,
) -> tuple[dict[float, float], float]:
    """The native engine's passes on one rank (rollout/native/model.py): per wave a prefill of its prompts' tokens,
    then decode steps of its running sequences (the wave's decoded tokens over its steps). Returns its GEMMs as
    {rows: weight bytes multiplied at that row count}, the lm_head on the sampled rows only, and the bytes of the new
    tensors whose pages it faults in (CPU). ``layer_bytes``: the layers' weights (the routed experts',
    ``expert_bytes``, among them; their norms' few bytes too), ``table_bytes``: the lm_head's. An MoE layer runs each
    local expert it routes rows to on those rows alone (``moe``'s loop): of R rows' top-k choices over E experts, a
    local expert is hit with probability 1 - (1 - k/E)^R and the local share of the R k choices, R k / ep, spreads
    over the hit ones.

    On CPU a run's allocator maps each buffer of a page or more afresh unless glibc's free heap still holds it
    (colocation/host_memory.py ``configure_host_allocator``): every new tensor of
    ``colocation.host_memory.FAULTING_TENSOR_BYTES`` or more faults its pages in, at the measured fresh-write rate
    (planner.sizes ``native_new_tensor_bytes_per_row``; the gathered KV blocks and scores are counted with the
    context). CUDA's caching allocator reuses its blocks: nothing."""
    s, e, r = inp.shape, inp.element_bytes, inp.rollout
    per_wave = seqs / waves
    decode_rows = seqs * lengths.mean_response / steps if steps else 0.0
    ep = inp.engine_expert_split[0] if s.is_moe else 1
    gemms: dict[float, float] = {}
    allocated = 0.0

    def add(rows: float, weight_bytes: float) -> None:
        if rows > 0 and weight_bytes > 0:
            gemms[rows] = gemms.get(rows, 0.0) + weight_bytes

    def faulted(tensors: dict[int, int], rows: float, times: float) -> float:
        return sum(n * times * rows * w for w, n in tensors.items() if rows * w >= FAULTING_TENSOR_BYTES)

    decode_scripted = r.tp == 1 and e == FP32_BYTES and not s.is_moe  # decode_tp1.py's TorchScript layers
    # (rows through the layers, rows through the lm_head, how many times, prefill; TorchScript): prefill, decode
    passes = (
        (per_wave * lengths.mean_prompt, per_wave, waves, True, False),
        (decode_rows, decode_rows, steps, False, decode_scripted),
    )
    for rows, sampled, times, prefill, scripted in passes:
        add(rows, times * (layer_bytes - expert_bytes))
        add(sampled, times * table_bytes)
        tensors = {} if inp.on_cuda else native_new_tensor_bytes_per_row(s, r.tp, e, prefill=prefill, scripted=scripted)
        allocated += faulted(tensors.get("token", {}), rows, times) + faulted(
            tensors.get("sampled", {}), sampled, times
        )
        if expert_bytes:
            k, local = s.moe_top_k, s.num_experts // ep
            hit = local * (1 - (1 - k / s.num_experts) ** rows)
            add(rows * k / ep / hit, times * expert_bytes * hit / local)
            allocated += faulted(tensors.get("expert", {}), rows * k / ep / hit, times * hit)
    return gemms, allocated


def moe_dispatch_steps(inp: PlanInputs, moe_layers: int, train: bool) -> int:
    """Ring steps of megatron-core 0.16's token dispatcher per micro-batch over ``moe_layers`` MoE layers
    (megatron/core/transformer/moe/token_dispatcher.py; a collective over n ranks takes n - 1 steps, none on one rank:
    tensor_parallel/mappings.py returns its input). ``alltoall``, forward: preprocess's all-gather of the per-expert
    counts over expert TP x EP, token_dispatch's all-to-alls of the tokens and of their probs over EP, with expert TP
    dispatch_postprocess's all-gathers of both and combine_preprocess's reduce-scatter of the output over it, and
    token_combine's all-to-all back; backward, each differentiable one again (the counts carry no gradient).
    ``allgather``: the routing map's, the probs' and the tokens' all-gathers over expert TP x EP and the output's
    reduce-scatter; backward, the probs', the tokens' and the output's again."""
    a = inp.actor
    ep, etp, tp_ep = a.ep - 1, inp.expert_tp - 1, a.ep * inp.expert_tp - 1
    if a.moe_token_dispatcher == "alltoall":
        forward, backward = tp_ep + 3 * ep + 3 * etp, 3 * ep + 3 * etp
    else:
        forward, backward = 4 * tp_ep, 3 * tp_ep
    return moe_layers * (forward + (backward if train else 0))


def _actor_pass_work(inp: PlanInputs, stage: int, train: bool) -> PhaseWork:
    """A log-prob pass (``train=False``) or the train step's forwards and backwards, on a rank of ``stage``."""
    s, a = inp.shape, inp.actor
    mb = inp.micro_batches(train=train)
    tokens = mb.count * mb.model_tokens
    stage_layer_ids = stage_layers(s, a.pp, stage)
    layers = len(stage_layer_ids)
    forward = _actor_forward_flops(inp, stage, tokens, mb.attention_span / 2)
    e = inp.element_bytes
    passes = 1
    ops = mb.count * (_layer_ops(inp, "forward", stage_layer_ids) + LOCAL_MODEL_OPS["forward"])
    backward_ops = 0
    if train:
        passes = 3 + (1 if a.recompute == "full" else 0)
        backward_ops = mb.count * (_layer_ops(inp, "backward", stage_layer_ids) + LOCAL_MODEL_OPS["backward"])
        if a.recompute == "full":
            ops *= 2
    # megatron_backend/logprobs.py's chunks of a micro-batch's response rows
    chunks = math.ceil(mb.response_tokens / (a.logprob_chunk_tokens or mb.response_tokens or 1))
    if stage == a.pp - 1:  # the log-prob pass and the loss around the model's output (megatron_backend/logprobs.py)

        def loss_ops(kind: str) -> int:
            fixed, per_chunk = LOSS_CHUNKED_OPS[kind]
            return mb.count * (LOSS_OPS[kind] if chunks == 1 else fixed + chunks * per_chunk)

        ops += loss_ops("forward")
        backward_ops += loss_ops("backward") if train else 0
    # TP: 2 all-reduces of [tokens, h] per layer and pass direction; PP: the activations sent on; EP: the routed copies
    activation = tokens * s.hidden_size * e
    tp_bytes = activation * 2 * layers * (2 if train else 1) * 2 * (a.tp - 1) / a.tp
    pp_bytes = activation * (2 if train else 1) if a.pp > 1 else 0
    moe_layers = sum(1 for layer in stage_layer_ids if s.is_moe_layer(layer))
    ep_bytes = (  # the most any rank receives: routed_copies_ratio times balanced routing's
        activation * s.moe_top_k * inp.routed_copies_ratio * 2 * moe_layers * (2 if train else 1) * (a.ep - 1) / a.ep
        if a.ep > 1
        else 0
    )
    # bytes the pass writes to fresh memory (on CPU each buffer of a page or more is a fresh mapping, faulted in:
    # colocation/host_memory.py): megatron's local layer (CPU), every new tensor of its forward and backward
    # (planner.sizes.local_layer_written_bytes_per_token), the padded attention rows per padded row, the weight
    # gradients per micro-batch, a full recompute's forward again; Transformer Engine's (CUDA), what a layer keeps
    # for backward (planner.sizes), twice in train. Then the logits in the dtype and the log-prob pass's fp32 rows
    # and their exp on the last stage
    if inp.attention == "unfused":
        padded_rows = mb.count * mb.sequences * inp.seq_len if a.remove_padding else tokens
        pad = local_packed_attention_padding_bytes_per_token(s, a.tp)
        pad_backward = local_packed_attention_backward_padding_bytes_per_token(s, a.tp)

        def layer_writes(backward: bool) -> float:
            per_token = sum(
                local_layer_written_bytes_per_token(
                    s,
                    a.tp,
                    e,
                    backward,
                    sparse=s.is_moe_layer(layer),
                    etp=inp.expert_tp,
                    routed_copies_ratio=inp.routed_copies_ratio,
                )
                for layer in stage_layer_ids
            )
            per_pad = layers * (pad_backward if backward else pad)
            return tokens * (per_token - per_pad) + padded_rows * per_pad

        written = layer_writes(False)
        if train:
            params, _ = actor_stage_counts(inp, stage)
            # the weight gradients, one per parameter (and in 16 bits each norm's in fp32 first) per micro-batch
            grads = params * e + (2 * s.hidden_size * FP32_BYTES * layers if e < FP32_BYTES else 0)
            written += layer_writes(True) + mb.count * grads + (written if a.recompute == "full" else 0)
    else:
        kept = sum(
            layer_activation_bytes_per_token(
                s,
                a.tp,
                e,
                inp.attention,
                sparse=s.is_moe_layer(layer),
                etp=a.etp,
                routed_copies_ratio=inp.routed_copies_ratio,
                packed=a.remove_padding,
            )
            for layer in stage_layer_ids
        )
        written = tokens * kept * (2 if train else 1)
    vocab_bytes = 0.0
    # collectives per micro-batch: TP's all-reduces (2 per layer forward, RowParallelLinear's; 2 backward,
    # ColumnParallelLinear's input grads; the embedding's forward on the first stage, the output layer's backward on
    # the last); PP's send or receive per pass direction (two on a middle stage)
    all_reduces = 2 * layers * (2 if train else 1) + (stage == 0) + (train and stage == a.pp - 1)
    p2p = 0 if a.pp == 1 else (2 if 0 < stage < a.pp - 1 else 1)
    if stage == a.pp - 1:  # the output layer writes [tokens, V/t] logits (backward: their zeroed gradient); the
        # log-prob pass then runs over the response rows (planner.plan's logprob pass: its chunking, kept softmax)
        vocab = megatron_padded_vocab(s.vocab_size, a.tp) // a.tp
        rows = mb.count * mb.response_tokens
        keep = a.logprob_chunk_tokens is None or (inp.entropy_grad and not a.entropy_recompute)
        entropy = train and inp.entropy_grad
        written += tokens * vocab * e * (2 if train else 1)
        vocab_bytes = rows * vocab * logprob_bytes_per_logit(e, False, keep, entropy)
        # megatron_backend/logprobs.py all-reduces 4 figures (max, sum of exp, target logit, sum p l) per chunk
        all_reduces += 4 * chunks
        if train:
            vocab_bytes += rows * vocab * logprob_bytes_per_logit(e, True, keep, entropy)
    work = PhaseWork(
        flops=forward * passes,
        fresh_bytes=written,
        vocab_bytes=vocab_bytes,
        actor_ops=ops,
        actor_backward_ops=backward_ops,
        micro_batch_passes=mb.count * (2 if train else 1),
        link_bytes=_by_link(inp, {"tp": tp_bytes, "pp": pp_bytes, "ep": ep_bytes}),
        bubble=(a.pp - 1) / (mb.count * (a.vpp or 1)),
        collective_steps=mb.count * (p2p * (2 if train else 1) + moe_dispatch_steps(inp, moe_layers, train)),
    )
    tp_steps = mb.count * all_reduces * 2 * (a.tp - 1)
    if inp.on_cuda:
        work.collective_steps += tp_steps
    else:  # gloo's: at the probe's measured all-reduce
        work.actor_gloo_steps = tp_steps
    if train:  # the optimizer step: read and write params, grads and states; DP's gradient reduction
        params, expert_params = actor_stage_counts(inp, stage)
        # each rank steps its shard: the dense params' over DP, the routed experts' over the expert-DP group
        shards = optimizer_shards(inp, params, expert_params)
        if inp.on_cuda:  # a fused Adam (TE's or apex's): one pass over each param's bytes, read and written
            work.memory_bytes += 2 * sum(n * (2 * e + optimizer_bytes_per_param(e)) / shard for n, shard in shards)
        else:  # torch's AdamW, tensor by tensor, over each rank's shard
            mapped, fresh = torch_adamw_bytes_per_param(e, inp.actor.weight_decay > 0)
            shard_params = sum(n / shard for n, shard in shards)
            work.memory_bytes += shard_params * mapped
            work.fresh_bytes += shard_params * fresh
        if inp.actor_dp > 1:  # DDP scales every local fp32 grad by 1 / dp before reducing it (read and written;
            # param_and_grad_buffer.py's start_grad_sync, the experts' buffer by 1 / dp too)
            work.memory_bytes += params * 2 * FP32_BYTES
        work.param_tensors += _optimizer_tensors(inp, stage)
        # DP's gradient reduction (megatron DDP, grad_reduce_in_fp32: megatron_backend/actor_train.py): the fp32 main
        # grads of the dense params over DP, of the routed experts over the expert-DP group (planner.plan's
        # optimizer_shards); per bucket (its default: max(40M, 1M x n) params) a ring all-reduce, or with the
        # distributed optimizer a reduce-scatter and, after the step, an all-gather of the params in their dtype:
        # (n - 1) / n of the bucket each, n - 1 steps each. The expert-DP group strides the experts' TP x EP: it
        # spans what DP's does
        for count, n in ((params - expert_params, inp.actor_dp), (expert_params, inp.expert_dp)):
            if n == 1 or not count:
                continue
            sent = count * (n - 1) / n
            if inp.distributed_optimizer:
                _add_by_key(work.reduce_scatter_bytes, _by_link(inp, {"dp": sent * FP32_BYTES}))
                _add_by_key(work.all_gather_bytes, _by_link(inp, {"dp": sent * e}))
            else:
                _add_by_key(work.link_bytes, _by_link(inp, {"dp": sent * 2 * FP32_BYTES}))
            work.collective_steps += math.ceil(count / max(40_000_000, 1_000_000 * n)) * 2 * (n - 1)
        if inp.actor_dp > 1:  # the grad norm's all-reduce
            work.collective_steps += 2 * (inp.actor_dp - 1)
        return _summed((work, inp.ppo_epochs))  # run/loop.py: the train phase runs trainer.ppo_epochs train steps
    return work


# weight_sync/verify.py::checksum of an n-element slice, counted with torch's dispatcher (tests/test_step_time.py):
# 10 ops (a column slice's copy: 11); int64 buffers written fresh by _to_copy, arange, remainder, add and mul (8 bytes
# per element each) and read by remainder, add, mul (two) and sum, beside the slice's own read
CHECKSUM_OPS = 10
CHECKSUM_WRITTEN_BYTES_PER_ELEMENT = 5 * 8
CHECKSUM_READ_BYTES_PER_ELEMENT = 5 * 8


def weight_sync_work(inp: PlanInputs, engine_weight_bytes: int) -> PhaseWork:
    """The weight sync on its busiest rank (``inp.sync_traffic``, the plan's counts): its local copies (read and
    written), what it exchanges with other ranks over the link (one point-to-point round per bucket) and of that
    what it stages in fresh buffers, with
    ``weight_sync.verify`` a checksum of every slice it sends or holds, then the reference check
    (:func:`reference_check_work`). Without the plan's counts, the bound: every byte local when PP = 1 and both
    sides split alike, else every engine byte over the link; a checksum per engine tensor, on each side. vLLM on CPU
    unpacks and repacks its weights around the writes."""
    a, r, e = inp.actor, inp.rollout, inp.element_bytes
    staged_sent = staged_received = 0
    if inp.sync_traffic is not None:
        local = max(t.local_bytes for t in inp.sync_traffic)
        crossing = max(t.crossing_bytes for t in inp.sync_traffic)
        staged_sent = max(t.staged_sent_bytes for t in inp.sync_traffic)
        staged_received = max(t.staged_received_bytes for t in inp.sync_traffic)
        checked = max(2 * t.local_bytes + t.sent_bytes + t.received_bytes for t in inp.sync_traffic)
        checksums = max(t.checksums for t in inp.sync_traffic)
    else:
        same_split = not inp.shape.is_moe or (a.ep, inp.expert_tp) == inp.engine_expert_split
        local, crossing = (
            (engine_weight_bytes, 0) if a.pp == 1 and a.tp == r.tp and same_split else (0, engine_weight_bytes)
        )
        checked = 2 * engine_weight_bytes
        checksums = 2 * _param_tensors(inp, range(inp.shape.num_layers))
    # the staged part (weight_sync/execute.py): a fresh buffer per peer and bucket, written by the pack (which reads
    # the shard) or by the transport; a received one is read again by the unpack, which writes the engine's tensor
    work = PhaseWork(
        memory_bytes=2 * local + staged_sent + 2 * staged_received,
        fresh_bytes=staged_sent + staged_received,
        exchange_bytes=_by_link(inp, {"world": crossing}),
        collective_steps=math.ceil(crossing / inp.sync_bucket_bytes),
    )
    if inp.engine_profile.repacks_weights(inp.device.kind):
        # vLLM's CPU build keeps packed copies of its weights for its kernels (rollout/vllm_engine.py): a sync first
        # gives each layer back its unprocessed weights, new and zeroed (materialize_layer, zero_), and after the
        # writes repacks them into new copies (process_weights_after_loading): two fresh writes and a read of the
        # engine's weights (the memory plan's reload copy, planner/plan.py). On CUDA the kernels use them as loaded
        work.fresh_bytes += 2 * engine_weight_bytes
        work.memory_bytes += engine_weight_bytes
    if inp.verify_sync:  # then all_gather_object of the checksums
        elements = checked / e
        written = CHECKSUM_WRITTEN_BYTES_PER_ELEMENT * elements
        work.memory_bytes += checked + CHECKSUM_READ_BYTES_PER_ELEMENT * elements
        work.fresh_bytes += 0 if inp.on_cuda else written
        work.memory_bytes += written if inp.on_cuda else 0
        work.plain_ops += CHECKSUM_OPS * checksums
        work.collective_steps += 2 * (inp.world_size - 1)
    return _summed((work, 1), (reference_check_work(inp), 1))


def all_gather_object_written_bytes(own: float, largest: float, gathered: float, ranks: int) -> float:
    """What torch 2.13's ``all_gather_object`` over gloo writes into fresh memory on a rank whose object is ``own``
    bytes pickled (``largest``: the largest rank's; ``gathered``: every rank's, summed), distributed_c10d.py:
    pickling 4 copies (a storage's ``torch.save`` into its own buffer, that buffer's bytes, the pickle stream,
    ``ByteStorage._from_buffer``), the gathered [ranks x largest] tensor, each rank's ``tobytes`` (ranks x largest),
    and unpickling 2 per rank's object (its storage's bytes, the storage). Measured with page faults
    (tests/test_step_time.py)."""
    return 4 * own + 2 * ranks * largest + 2 * gathered


def reference_check_work(inp: PlanInputs) -> PhaseWork:
    """The weight sync's reference check on the rank that sends the most (weight_sync/reference.py; the sample:
    planner.plan.reference_sample). megatron_backend/checkpoint.py::gather_hf_tensors clones the rank's blocks
    (``own``) and all-gathers them with torch.distributed's all_gather_object over gloo
    (:func:`all_gather_object_written_bytes`). Then the full HF tensors are assembled and compared with the engine's
    slices (both read). On CPU each fresh write copies a source the rank reads, but for the bytes gloo receives (the
    gather's), and the gather runs at the probe's gloo all-gather rate (it is one). On CUDA the copies are the
    host's, each copy's bytes once at the host link's rate as an offload's (a CUDA profile has no host memory
    rate), the gather over the link."""
    sample = reference_sample(inp)
    if sample is None:
        return PhaseWork()
    e = inp.element_bytes
    own = max(sample.own)
    gathered = all_gather_object_written_bytes(own, sample.largest, sample.gathered, sample.ranks)
    received = (sample.ranks - 1) * sample.largest
    written = e * (own + gathered + sample.full)  # the clones, the gather, the full tensors
    # the check's all_gather_object (sizes, then bytes) and its verdict's, each a ring of w - 1 steps
    work = PhaseWork(all_gather_bytes=_by_link(inp, {"world": e * received}), collective_steps=4 * (sample.ranks - 1))
    if inp.on_cuda:
        work.host_bytes = written + 2 * e * sample.full
    else:  # every copy reads its source but gloo's received bytes; the comparison reads both full tensors
        work.fresh_bytes, work.memory_bytes = written, written - e * received + 2 * e * sample.full
    return work


def _summed(*parts: tuple[PhaseWork, float]) -> PhaseWork:
    """``parts``, each (work, times), run one after another on one rank; the first one's bubble (a fraction)."""
    # {link: bytes} each, {rows: weight bytes}
    by_key = ("link_bytes", "exchange_bytes", "reduce_scatter_bytes", "all_gather_bytes", "gemms")
    counts = {
        f.name: sum(getattr(work, f.name) * times for work, times in parts)
        for f in fields(PhaseWork)
        if f.name not in (*by_key, "bubble")
    }
    for name in by_key:
        counts[name] = {}
        for work, times in parts:
            _add_by_key(counts[name], {key: value * times for key, value in getattr(work, name).items()})
    return PhaseWork(**counts, bubble=parts[0][0].bubble)


def _add_by_key(into: dict, more: dict) -> None:
    """Add ``more``'s values into ``into`` key by key (bytes per link, weight bytes per GEMM row count)."""
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value


def _by_link(inp: PlanInputs, bytes_by_group: dict[str, float]) -> dict[str, float]:
    """Collective bytes by the link they cross: a group within one node uses NVLink (CPU: memory), else the network.
    Megatron orders ranks TP, then EP/DP..., then PP; a group spans nodes when its stride x size exceeds a node
    (``world``: every rank, as the weight sync's exchanges)."""
    a, node = inp.actor, inp.ranks_per_node
    spans = {"tp": a.tp, "ep": a.tp * a.ep, "dp": a.tp * inp.actor_dp, "pp": a.tp * inp.actor_dp * a.pp}
    spans["world"] = inp.world_size
    out: dict[str, float] = {}
    for group, value in bytes_by_group.items():
        if value:
            link = "intra_node" if spans[group] <= node else "inter_node"
            out[link] = out.get(link, 0.0) + value
    return out


def phase_work(plan: Plan, lengths: StepLengths | None = None) -> dict[str, PhaseWork]:
    """Every phase's work on the slowest rank (the pipeline stage whose sum is largest is taken per phase)."""
    inp = plan.inputs
    lengths = lengths or inp.planned_lengths()
    if lengths != inp.planned_lengths():
        inp = inp.at_lengths(lengths, plan.kv_cache_bytes)
    flags = step_flags(inp)
    engine_sleeps = inp.engine_profile.sleeps
    sizes = {"weights": plan.engine_weight_bytes, "kv_cache": plan.kv_cache_bytes}
    stages = range(inp.actor.pp)
    # the actor's state as the memory plan sizes it (its planned stage)
    state_bytes = {
        comp: max(p.components.get(comp, 0) for p in plan.phases)
        for comp in ("actor_params", "actor_grads", "optimizer", "ref_params")
    }
    engine_tensors = _param_tensors(inp, range(inp.shape.num_layers))
    # the storages an offload copies out, each to a host buffer of its own (megatron_backend/memory.py): params (and a
    # reference's) live in DDP's contiguous buffer (MoE: and its experts'); the optimizer's states per parameter tensor
    # are Adam's two moments, torch's step on a CPU device (on CUDA the device filter leaves it) and the fp32 master of
    # a 16-bit param
    buffers = 1 + (1 if inp.shape.is_moe else 0)
    per_param = 2 + (1 if inp.device.kind == "cpu" else 0) + (1 if inp.element_bytes < FP32_BYTES else 0)
    actor_tensors = max(_optimizer_tensors(inp, st) for st in stages)
    storages = {"actor_params": buffers, "ref_params": buffers, "optimizer": per_param * actor_tensors}
    out: dict[str, PhaseWork] = {}
    for phase in step_phases(flags):
        if not phase.every_step:
            continue
        work = PhaseWork()
        if phase.name == "rollout":
            work = _engine_work(inp, lengths)
        elif phase.name in ("old_logprob", "ref_logprob") and (phase.name == "old_logprob" or inp.reference_model):
            work = max((_actor_pass_work(inp, st, train=False) for st in stages), key=_size)
        elif phase.name == "train":
            work = max((_actor_pass_work(inp, st, train=True) for st in stages), key=_size)
        elif phase.name == "weight_sync":
            work = weight_sync_work(inp, plan.engine_weight_bytes)
            work.param_tensors = engine_tensors
        for state in (*phase.adds, *phase.drops):
            if state == "actor_grads":  # released, handed back zeroed, never copied (megatron_backend/actor_offload.py)
                work.fresh_bytes += state_bytes[state] if state in phase.adds else 0
            elif state in (*ACTOR_STATE, "ref_params"):  # an offload or onload copies it over the host link
                if state in phase.drops:
                    work.host_bytes += state_bytes[state]
                    work.host_storages += storages[state]
                else:
                    work.host_in_bytes += state_bytes[state]
            elif state in sizes and state in phase.adds and engine_sleeps:  # a wake maps and touches it
                work.fresh_bytes += sizes[state]
        out[phase.name] = work
    return out


def _size(work: PhaseWork) -> float:
    return work.flops + work.actor_ops * 1e6 + work.param_tensors


def raw_terms(work: PhaseWork, inp: PlanInputs, speed: SpeedSpec) -> dict[str, float]:
    """Each term's seconds at efficiency 1 and op factor 1 (a fit's columns; the engine's ops under its own name)."""
    # a pass's span is the longer of its critical path (a rank's work and the pipeline's bubble on it) and the node's
    # work over its cores (CPU: ranks waiting in the bubble leave their core to the others); a rank's math runs on
    # cores / ranks threads (at least one: speed.compute_stretch)
    over = speed.oversubscription(inp.ranks_per_node)
    stretch = max(over, 1 + work.bubble)
    shared = speed.compute_stretch(inp.ranks_per_node)
    compute_stretch = max(shared, min(shared, 1.0) * (1 + work.bubble))
    # GEMMs at their row count: the measured seconds per weight byte (a rank's share of the cores, as its math);
    # without a measurement (CUDA) their FLOPs at the peak and their weights read at the bandwidth
    gemm, flops, memory_bytes = 0.0, work.flops, work.memory_bytes
    for rows, weight_bytes in work.gemms.items():
        seconds_per_byte = speed.gemm_seconds_per_byte(inp.dtype, rows)
        if seconds_per_byte is None:
            flops += 2 * rows * weight_bytes / inp.element_bytes
            memory_bytes += weight_bytes
        else:
            gemm += weight_bytes * seconds_per_byte
    gloo, exchange = speed.gloo_all_reduce_seconds, speed.gloo_exchange_bytes_per_s
    over_links = dict(work.link_bytes)
    if not exchange:  # unmeasured: the sync's exchange crosses the link as the collectives' bytes do
        _add_by_key(over_links, work.exchange_bytes)
    scatter, gather = speed.gloo_reduce_scatter_bytes_per_s, speed.gloo_all_gather_bytes_per_s
    buckets = 0.0
    if scatter and gather:  # CPU: gloo's measured rates, not stretched (the probe's two ranks share the cores)
        buckets = sum(work.reduce_scatter_bytes.values()) / scatter + sum(work.all_gather_bytes.values()) / gather
    else:
        _add_by_key(over_links, work.reduce_scatter_bytes)
        _add_by_key(over_links, work.all_gather_bytes)
    return {
        "compute": flops / speed.flops(inp.dtype) * compute_stretch,
        "gemm": gemm * shared,
        "memory": (memory_bytes / speed.memory_bytes_per_s + work.fresh_bytes / speed.fresh_write_bytes_per_s) * over,
        "vocab": work.vocab_bytes / speed.memory_bytes_per_s * over,
        "draws": work.draws * speed.seconds_per_draw * over,
        "host": work.host_bytes / speed.host_bytes_per_s + work.host_in_bytes / speed.onload_bytes_per_s,
        "link": sum(b / getattr(speed, f"{link}_bytes_per_s") for link, b in over_links.items()),
        "exchange": sum(work.exchange_bytes.values()) / exchange if exchange else 0.0,
        "buckets": buckets,
        # gloo's steps at the measured all-reduce's half, not stretched: the probe's two ranks already share the
        # node's cores, and more groups do not slow one (two TP-2 groups over 4 processes on 2 cores all-reduce in
        # 1.0-1.15 ms, one group of 2 in 1.6-1.7: docs/plan-validation.md); unmeasured, as any collective's
        "collective_ops": (work.collective_steps + (0 if gloo else work.gloo_steps + work.actor_gloo_steps))
        * speed.op_seconds
        * over,
        "gloo": work.gloo_steps * gloo / 2 if gloo else 0.0,
        # the actor's are stretched: at 4 ranks on 2 cores a call waits for its partner's share (PhaseWork)
        "actor_gloo": work.actor_gloo_steps * gloo / 2 * over if gloo else 0.0,
        "storage_ops": work.host_storages * speed.op_seconds * over,
        "actor_ops": work.actor_ops * speed.op_seconds * stretch,
        "actor_backward_ops": work.actor_backward_ops * speed.op_seconds * stretch,
        f"{inp.rollout.engine}_ops": work.engine_layer_steps * speed.op_seconds * over,
        # an engine's step beyond its layers (its scheduler, sampler, embedding and lm_head): a native decode step of
        # tiny:qwen2 at 4 and 16 layers, timed alone, costs ~270-290 us beside ~57-86 us a layer (docs/plan-validation.md)
        f"{inp.rollout.engine}_step_ops": work.engine_steps * speed.op_seconds * over,
        "tensor_ops": work.param_tensors * speed.op_seconds * over,
        "plain_ops": work.plain_ops * speed.op_seconds * over,
        "micro_batch_ops": work.micro_batch_passes * speed.op_seconds * stretch,
        # a phase that moves nothing and runs nothing (an onload of what stays resident) costs nothing
        "phase_ops": speed.op_seconds * over if _does_work(work) else 0.0,
    }


def _does_work(work: PhaseWork) -> bool:
    moves = work.memory_bytes or work.fresh_bytes or work.vocab_bytes or work.host_bytes or work.host_in_bytes
    return bool(
        work.flops
        or work.gemms
        or moves
        or work.draws
        or work.engine_layer_steps
        or work.param_tensors
        or work.plain_ops
    )


def coefficient(constants: Calibration, column: str) -> float:
    """What multiplies a raw term: 1 / efficiency, or the op factor."""
    name = COLUMN_CONSTANT[column]
    if name is None:
        return 1.0
    return 1.0 / constants.value(name) if name in EFFICIENCIES else constants.value(name)


def scaled_terms(raw: dict[str, float], constants: Calibration) -> dict[str, float]:
    """Each term's seconds: the raw terms times their constants' coefficients, the engines' ops as ``engine_ops``."""
    terms = dict.fromkeys(TERMS, 0.0)
    for column, seconds in raw.items():
        terms[COLUMN_TERM.get(column, column)] += seconds * coefficient(constants, column)
    return terms


def combined_seconds(terms: dict[str, float], device_kind: str) -> float:
    """A phase's seconds from its terms. On CPU one core launches an op and runs it: everything adds up. On CUDA the
    host launches kernels while the device runs earlier ones: the device's work (compute, memory) and the launches
    overlap, the slower of the two counts; host copies, collectives and the phase's own cost add."""
    if device_kind == "cpu":
        return sum(terms.values())
    device = terms["compute"] + terms["memory"]
    launches = terms["actor_ops"] + terms["engine_ops"] + terms["tensor_ops"] + terms["micro_batch_ops"]
    return max(device, launches) + terms["host"] + terms["link"] + terms["phase_ops"]


def phase_seconds(name: str, work: PhaseWork, inp: PlanInputs, speed: SpeedSpec, constants: Calibration) -> PhaseTime:
    terms = scaled_terms(raw_terms(work, inp, speed), constants)
    return PhaseTime(name, combined_seconds(terms, speed.kind), terms, max(terms, key=terms.get))


def predict_step_time(
    plan: Plan, speed: SpeedSpec, constants: Calibration | None = None, lengths: StepLengths | None = None
) -> StepTime:
    """Seconds per phase of one step of ``plan``'s run on a device of ``speed`` (``lengths``: a step's recorded
    lengths; None: the plan's own), the every-step phases only (save_checkpoint, eval and export_hf run on some)."""
    if speed.kind != plan.inputs.device.kind:
        raise ValueError(f"speed {speed.name!r} is a {speed.kind} device; the plan is for {plan.inputs.device.kind}")
    constants = constants or time_constants(speed.kind)
    works = phase_work(plan, lengths)
    return StepTime(tuple(phase_seconds(n, w, plan.inputs, speed, constants) for n, w in works.items()))
