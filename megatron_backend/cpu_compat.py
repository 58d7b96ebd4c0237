"""megatron-core 0.16 on CPU, or without Transformer Engine and apex: the one place that papers over what it
assumes of the device and of those libraries.

Two scopes. Where a library is absent, on any device (a plain PyTorch CUDA image has neither TE nor apex):
``moe_utils.te_general_gemm`` is defined as None (:func:`_define_missing_te_gemm`), torch's norms take sequence
parallelism (:func:`_torch_norms_under_sequence_parallel`), and :func:`fused_softmax_available` tells the model
config whether apex's softmax kernels exist. Where CUDA is absent (``torch.cuda.is_available()`` False), the rest
below; on a GPU machine those stay off. We never fork or vendor megatron-core. Instead, inside the few megatron modules listed in
``PATCHED_MODULES`` (and nowhere else), the module-global name ``torch`` is rebound to
:class:`_TorchOnCpu`, a thin proxy that forwards everything to the real ``torch`` except:

- factory functions (``zeros``, ``ones``, ``empty``, ...) called with ``device="cuda"`` build on CPU
  (``get_default_causal_mask``; ``total_num_tokens = torch.zeros(..., device="cuda")`` in the
  pipeline schedules; the p2p shape buffers);
- ``torch.cuda`` is :class:`_CudaOnCpu`: ``current_device()`` is the CPU (RoPE ``inv_freq``, p2p,
  the global memory buffer that local-spec attention takes its matmul input from, the MoE router's and
  experts' weights), ``synchronize()`` is a no-op (p2p), ``Stream()`` / ``current_stream()`` /
  ``stream()`` are do-nothing streams (the MoE alltoall dispatcher's device-to-host side stream), and
  the RNG calls use the CPU default generator (the model-parallel RNG tracker's ``add``/``fork``; on CPU
  dropout draws from that generator).

The RNG tracker's ``fork`` also reads ``_get_cuda_rng_state``/``_set_cuda_rng_state``; those two
module functions are rebound to the CPU generator's state. ``fork`` warns when the CPU RNG state
changes inside a fork, which on CPU is exactly what a fork is for, so that one message is filtered.

``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings with PP > 1) moves the shared
weight with ``weight.data.cuda()`` before its first-stage/last-stage all-reduce; that method is
wrapped to skip the ``.cuda()`` and run the same all-reduce on the CPU tensor.

megatron's optimizers (``get_megatron_optimizer``: ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer``) sort parameters by comparing ``param.type()`` with CUDA type names
(``'torch.cuda.FloatTensor'``, ...) and raise ``TypeError`` for anything else; ``clip_grad_by_total_norm_fp32``
asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``. The three functions that compare are wrapped
(:func:`_answer_cuda_type_names`): during the call, and on the tensors they are handed only, ``.type()``
answers the CUDA name of the tensor's dtype (an instance attribute that shadows the method, removed when
the call returns); ``torch.Tensor`` itself is never patched.

MoE (megatron's router, experts, token dispatchers): their modules get the proxy (router / expert weights
on ``current_device()``, the alltoall dispatcher's side stream), its split sizes become numpy arrays as
they do from CUDA (:func:`_host_split_sizes_as_on_cuda`), and ``moe_utils.te_general_gemm``, which
megatron reads but defines only when Transformer Engine imports, is defined as None
(:func:`_define_missing_te_gemm`); at expert TP > 1 with sequence parallelism the dispatcher gathers unequal
token counts over TP, which gloo's all-gather refuses (:func:`_gather_uneven_by_padding`). Sequence
parallelism on the local spec: torch's norms refuse it unless built as megatron's own norms are
(:func:`_torch_norms_under_sequence_parallel`). Their scalars (``found_inf``, the loss scale,
the norm buffers) come from the modules' ``torch`` proxy like the others.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
import logging
import types

import torch

# module -> the CUDA assumption it makes in megatron-core 0.16
PATCHED_MODULES = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "inv_freq on torch.cuda.current_device()",
    "megatron.core.transformer.utils": 'get_default_causal_mask builds on device="cuda"',
    "megatron.core.tensor_parallel.random": "RNG tracker add()/fork() use the CUDA generator",
    "megatron.core.pipeline_parallel.schedules": 'torch.zeros(..., device="cuda") for token counts',
    "megatron.core.pipeline_parallel.p2p_communication": "torch.cuda.synchronize(), shape buffers on cuda",
    "megatron.core.utils": "GlobalMemoryBuffer.get_tensor (attention matmul buffer) on torch.cuda.current_device()",
    "megatron.core.distributed.param_and_grad_buffer": "DDP grad buffers on torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "torch.cuda.synchronize() after the D2H preload",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": 'save status flags on device="cuda"',
    "megatron.core.optimizer.optimizer": 'found_inf, loss-scale and overflow scalars on device="cuda"',
    "megatron.core.optimizer.clip_grads": 'grad-norm and overflow buffers on device="cuda"',
    "megatron.core.optimizer.distrib_optimizer": "state shards allocated on torch.cuda.current_device()",
    "megatron.core.optimizer.grad_scaler": 'fp16 loss scale on device="cuda"',
    "megatron.core.transformer.moe.router": "router weight and token-count buffers on torch.cuda.current_device()",
    "megatron.core.transformer.moe.experts": "expert weights (use_cpu_initialization) on torch.cuda.current_device()",
    "megatron.core.transformer.moe.moe_utils": 'aux-loss tracker values on device="cuda"',
    "megatron.core.transformer.moe.token_dispatcher": "alltoall dispatcher's D2H torch.cuda.Stream() and its events",
    "megatron.core.tensor_parallel.mappings": "all-gather / all-to-all outputs on torch.cuda.current_device()",
    "megatron.core.tensor_parallel.layers": "sequence parallel's reduce-scatter output on torch.cuda.current_device()",
}

# dtype -> the name ``Tensor.type()`` gives on CUDA, which megatron's optimizers compare with
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint")
_applied = False  # the CPU patches
_libraries_applied = False  # the absent libraries' compat


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CudaOnCpu:
    """Stands in for ``torch.cuda`` inside the patched modules."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    # the alltoall token dispatcher copies its split sizes to the host on a side stream and waits on an
    # event; on CPU they are host tensors already (``maybe_move_tensor_to_cpu`` keeps non-CUDA tensors), so
    # the stream, its context and its event do nothing
    @staticmethod
    def Stream(*args, **kwargs) -> _StreamOnCpu:  # noqa: N802 (torch.cuda.Stream's name)
        return _StreamOnCpu()

    @staticmethod
    def current_stream(device=None) -> _StreamOnCpu:
        return _StreamOnCpu.CURRENT

    @staticmethod
    def stream(stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _StreamOnCpu:
    """A CUDA stream (or event) that does nothing: CPU ops are synchronous."""

    CURRENT: _StreamOnCpu

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None) -> _StreamOnCpu:
        return self

    def synchronize(self) -> None:
        return None


_StreamOnCpu.CURRENT = _StreamOnCpu()


class _TorchOnCpu:
    """Stands in for the ``torch`` module inside the patched megatron modules."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:

            def factory(*args, _fn=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _fn(*args, **kwargs)

            return factory
        return attr


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _patch_tied_embedding_setup() -> None:
    # first use: at the top megatron-core (~4 s) would load with `import checkpointing.checkpoint, megatron_backend.model ...`, which do not need it
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self) -> None:
        in_group = torch.distributed.is_initialized() and self._is_in_embd_group()
        self._is_in_embd_group = lambda: False  # instance attribute: skips the weight.data.cuda() branch
        try:
            original(self)
        finally:
            del self._is_in_embd_group
        if in_group:  # the all-reduce megatron would have run (first stage + zeroed last-stage copy)
            torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


@contextlib.contextmanager
def _cuda_type_names(tensors):
    """Inside the block, each of ``tensors`` answers ``.type()`` (no arguments) with its dtype's CUDA type
    name; ``.type(dtype)`` still converts. An instance attribute on these tensor objects only."""
    marked = []
    for tensor in tensors:
        if tensor is None or tensor.dtype not in _CUDA_TYPE_NAMES or "type" in vars(tensor):
            continue
        tensor.type = functools.partial(_type_as_on_cuda, tensor.type, _CUDA_TYPE_NAMES[tensor.dtype])
        marked.append(tensor)
    try:
        yield
    finally:
        for tensor in marked:
            del tensor.type


def _type_as_on_cuda(original, cuda_name, *args, **kwargs):
    return original(*args, **kwargs) if args or kwargs else cuda_name


def _answer_cuda_type_names(owner, name: str, tensors_of) -> None:
    """Wrap ``owner.<name>`` so that the tensors ``tensors_of(*args, **kwargs)`` answer CUDA type names
    while it runs (see the module doc)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with _cuda_type_names(list(tensors_of(*args, **kwargs))):
            return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _optimizer_params(self, optimizer, *args, **kwargs):
    """The params of ``optimizer.param_groups`` (the Float16/Distributed optimizers' ``__init__``)."""
    return [p for group in (optimizer.param_groups if optimizer is not None else []) for p in group["params"]]


def _param_grads(parameters, *args, **kwargs):
    """``clip_grad_by_total_norm_fp32(parameters, ...)``: the grads of ``parameters``."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    return [p.grad for p in parameters if p.grad is not None]


def _patch_optimizer_type_checks() -> None:
    # first use: at the top megatron-core (~4 s) would load with `import checkpointing.checkpoint, megatron_backend.model ...`, which do not need it
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as optimizer_module

    _answer_cuda_type_names(optimizer_module.Float16OptimizerWithFloat16Params, "__init__", _optimizer_params)
    # __init__ compares, then builds the shards in _build_model_and_main_param_groups, which compares again
    _answer_cuda_type_names(distrib_optimizer.DistributedOptimizer, "__init__", _optimizer_params)
    # bound by name where it is called (ChainedOptimizer.step, MegatronOptimizer.clip_grad_norm)
    for module in (clip_grads, optimizer_module):
        _answer_cuda_type_names(module, "clip_grad_by_total_norm_fp32", _param_grads)


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16's router gating (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None``,
    a name its ``moe_utils`` only defines when Transformer Engine imports: without TE every MoE forward raises
    NameError. Define it as None there (its torch.mm branch), only when the import did not."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _host_split_sizes_as_on_cuda() -> None:
    """The alltoall dispatcher hands its split sizes to ``all_to_all_single`` as the numpy arrays that
    ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` makes of a CUDA tensor; a CPU tensor comes back unchanged
    and ``all_to_all_single`` refuses a tensor as split sizes. Rebind the name in the dispatcher's module to
    one that converts host tensors as it converts CUDA ones."""
    token_dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _gather_uneven_by_padding() -> None:
    """Sequence parallelism with the alltoall dispatcher at expert TP > 1: ``token_permutation`` gathers each
    TP rank's tokens, as many as it received, with ``mappings._gather_along_first_dim(output_split_sizes=...)``,
    a ``torch.distributed.all_gather`` of unequal tensors, which gloo refuses ("invalid tensor size"; NCCL
    takes it). Rebind that name in ``mappings`` (its gather autograd functions call it there) to one that pads
    each rank's rows to the largest share, gathers equal tensors and drops the pad rows: the same values. Its
    backward, the reduce-scatter of unequal splits, runs on gloo as it is."""
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        padded = torch.nn.functional.pad(input_, (0, 0) * (input_.dim() - 1) + (0, rows - input_.shape[0]))
        gathered = original(padded, group)  # [world * rows, ...]
        return torch.cat([part[:n] for part, n in zip(gathered.split(rows), output_split_sizes)])

    mappings._gather_along_first_dim = _gather_along_first_dim


def _torch_norms_under_sequence_parallel() -> None:
    """Without Transformer Engine or Apex the local spec's norms are ``WrappedTorchNorm`` (torch's RMSNorm),
    which asserts ``not config.sequence_parallel`` because it does not mark its weight for sequence
    parallelism: each TP rank's norm then sees S / tp of the tokens, so its weight grad is a partial sum that
    ``finalize_model_grads`` must all-reduce over TP, and it does so for params with ``sequence_parallel``
    set. Build the torch norm as megatron would without SP and set that attribute on its params, as
    megatron's ``FusedLayerNorm`` and TE's norms do."""
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        without_sp = copy.copy(config)
        without_sp.sequence_parallel = False
        norm = original(cls, without_sp, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def fused_softmax_available() -> bool:
    """apex's fused softmax kernels, which ``FusedScaleMaskSoftmax`` imports when ``masked_softmax_fusion`` is
    on (megatron/core/fusions/fused_softmax.py): absent on CPU and on a CUDA image without apex."""
    kernels = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
    return torch.cuda.is_available() and all(importlib.util.find_spec(name) is not None for name in kernels)


def _apply_library_compat() -> None:
    """What an absent Transformer Engine or apex needs on any device: the TE gemm's name, and the local spec's
    torch norm (megatron builds WrappedTorchNorm for RMSNorm without TE, apex or not) under sequence parallelism."""
    global _libraries_applied
    if _libraries_applied:
        return
    _define_missing_te_gemm()
    _torch_norms_under_sequence_parallel()
    _libraries_applied = True


def apply() -> bool:
    """The compat for absent libraries, then the modules in ``PATCHED_MODULES`` if CUDA is absent. Idempotent;
    returns whether the CPU patches are active."""
    global _applied
    _apply_library_compat()
    if _applied or torch.cuda.is_available():
        return _applied
    proxy = _TorchOnCpu()
    for name in PATCHED_MODULES:
        module: types.ModuleType = importlib.import_module(name)
        module.torch = proxy
    random_module = importlib.import_module("megatron.core.tensor_parallel.random")
    random_module._get_cuda_rng_state = _get_cpu_rng_state
    random_module._set_cuda_rng_state = _set_cpu_rng_state
    logging.getLogger(random_module.__name__).addFilter(_DropForkWarning())
    _patch_tied_embedding_setup()
    _patch_optimizer_type_checks()
    _host_split_sizes_as_on_cuda()
    _gather_uneven_by_padding()
    _applied = True
    return True
