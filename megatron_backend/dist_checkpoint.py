"""The actor's training state (params + optimizer) as a megatron-core distributed checkpoint.

``megatron.core.dist_checkpointing`` (format ``torch_dist``): every rank writes its own shards of the
model's ``sharded_state_dict()`` (one ``ShardedTensor`` per parameter, keyed by its global name with
the layer axis and the TP split as metadata), so a checkpoint saved at actor TP x PP (x VPP) loads at
any other layout: each rank reads the pieces that overlap its own shards. Vocab-padded tensors are
marked ``allow_shape_mismatch`` by megatron (padding differs with TP) and are cut or padded on load.

The optimizer state is keyed the same way, in model space, whatever megatron optimizer class wrote it:
``optimizer.state.exp_avg.<param key>`` / ``optimizer.state.exp_avg_sq.<param key>`` per parameter, plus
``optimizer.state.fp32_param.<param key>`` (the fp32 main param) for 16-bit params, each a ShardedTensor
with the param's sharding (``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``: megatron's
``sharded_state_dict``; ``DistributedOptimizer``: its ``fully_sharded_model_space`` tensors, each DP rank
its flat slice), and the step count, equal for every parameter, once as ``common_step``. So a checkpoint
reshards across TP, PP, VPP and DP and across the three classes (DP = 1 <-> DP > 1), and the checkpoints
of the torch AdamW path CPU runs used before megatron's optimizer (the same keys and ``common_step``,
float32 only) resume with their moments. Group hyper-parameters come from the run's config, not the file.

Saving and loading need the params, grads and optimizer states resident (``Actor.onload`` first); the
loop saves inside the step, after ``train``, when they are.

Saves are synchronous (``async_sharded_save=False``): megatron's ``FileSystemWriterAsync`` then runs its
writer in this process (forking short-lived per-bucket workers) and only hands its results to this
process. Its results queue is by default a ``multiprocessing.Manager().Queue()``, i.e. a spawned server
process per rank that outlives a SIGKILLed rank as an orphan; :func:`_in_process_results_queue` gives it
a plain ``queue.Queue`` instead, which is all the synchronous path needs (``put`` / ``get_nowait``).
"""

from __future__ import annotations

import queue
from dataclasses import replace
from pathlib import Path

import torch

# megatron-core's distributed-optimizer format that reshards across TP, PP and DP (see the module doc)
MEGATRON_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
COMMON_STEP = "common_step"
_TENSORS = "model_space_tensors"
_STATE_PREFIX = "optimizer.state."
_FP32_PARAM = _STATE_PREFIX + "fp32_param."


def model_sharded_state_dict(chunks) -> dict:
    """{vp stage: that chunk's sharded state dict}; the ShardedTensors hold the parameters themselves."""
    return {vp: chunk.sharded_state_dict() for vp, chunk in enumerate(chunks)}


def _inner_optimizers(actor) -> list:
    return [opt for opt in actor.optimizer.chained_optimizers if not getattr(opt, "is_stub_optimizer", False)]


# the DistributedOptimizer's model-space exchange: gathered on DP rank 0 over its gloo DP group (also on CUDA)
_FULLY_RESHARDABLE = {"distrib_optim_fully_reshardable_mem_efficient": True}


def _canonical(t, fp32_model_keys: set):
    """A megatron optimizer-state ShardedTensor under its model-space key, or None when not saved (fp32
    params are their own main params: their ``fp32_param`` is the model weight, saved under "model")."""

    key = t.key.replace(_STATE_PREFIX + "param.", _FP32_PARAM, 1)  # the DistributedOptimizer's name for it
    if key.startswith(_FP32_PARAM) and key[len(_FP32_PARAM) :] in fp32_model_keys:
        return None
    return replace(t, key=key) if key != t.key else t


def _init_state(opt) -> None:
    """States to load into: zero moments from megatron's own allocator; its CPU offload has none
    (``init_state_fn=None``, optimizer/__init__.py), so a fresh HybridDeviceOptimizer takes one step of random
    grads to make them, where they live, as megatron's DistributedOptimizer.load_state_dict does
    (distrib_optimizer.py, megatron-core 0.16.1). The load then replaces moments, masters and params alike."""
    if opt.init_state_fn is not None:
        opt.init_state_fn(opt.optimizer, opt.config)
    elif not opt.optimizer.state and hasattr(opt.optimizer, "dummy_step"):
        opt.optimizer.dummy_step()


def _optimizer_tensors(actor, model_sd: dict, is_loading: bool) -> tuple[list, list]:
    """The optimizer state in model space (module doc) as ShardedTensors (the layers of a stage share a key and
    differ in offset), and per tensor where a loaded value goes: (None, target) copies into the optimizer's
    own tensor; (DistributedOptimizer, (param index, state key)) is sliced to this DP rank by megatron."""
    # first use: at the top megatron-core (~4 s) would load with `import run.main, run.preflight`, which do not need it
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.optimizer import DistributedOptimizer

    sharded = (ShardedTensor, ShardedTensorFactory)  # factories: e.g. the SwiGLU fc1 split in two halves
    fp32_model_keys = {
        t.key for t in nested_values(model_sd) if isinstance(t, sharded) and t.data.dtype == torch.float32
    }
    tensors, routes = [], []
    for opt in _inner_optimizers(actor):
        if is_loading:
            _init_state(opt)
        if isinstance(opt, DistributedOptimizer):
            # model-param-shaped (TP shard) tensors gathered over DP: on DP rank 0 when saving (None elsewhere),
            # on every rank (empty, to be filled) when loading
            by_param = opt.sharded_param_state_fully_reshardable(model_sd, is_loading, _FULLY_RESHARDABLE) or {}
            for index, states in by_param.items():
                for name, t in states.items():
                    t = _canonical(t, fp32_model_keys)
                    if t is not None:
                        tensors.append(t)
                        routes.append((opt, (index, "fp32_param" if name == "param" else name)))
            continue
        for t in nested_values(opt.sharded_state_dict(model_sd, is_loading=is_loading)):
            if isinstance(t, sharded) and t.key.startswith(_STATE_PREFIX):
                t = _canonical(t, fp32_model_keys)
                if t is not None:
                    tensors.append(t)
                    routes.append((None, t.data))
    return tensors, routes


def _load_optimizer_tensors(actor, routes: list, values: list) -> None:
    """Put the loaded model-space tensors where :func:`_optimizer_tensors` said they go."""
    per_dist_opt = {}
    for (opt, where), value in zip(routes, values, strict=True):
        if opt is None:
            if value is not where:
                where.copy_(value)
        else:
            index, name = where
            per_dist_opt.setdefault(opt, {}).setdefault(index, {})[name] = value
    for opt, by_param in per_dist_opt.items():
        for state in opt.optimizer.state.values():
            state.pop("step", None)  # megatron copies every state it holds; the step is set after
        # the order megatron numbers them in (sharded_param_state_fully_reshardable): buffer by buffer
        model_params = [p for buffer in opt.buffers for p in buffer.param_index_map]
        for index, model_param in enumerate(model_params):
            by_param.setdefault(index, {}).setdefault("fp32_param", model_param.detach())  # fp32: itself
        opt.load_parameter_state_from_fully_reshardable(by_param)


def _groups_with_params(inner) -> list[dict]:
    """TE's FusedAdam before 2.19 skips an empty group before advancing its ``step`` (the distributed optimizer
    leaves a group empty on a DP rank whose shard holds none of its params): megatron's
    ChainedOptimizer._synchronize_steps reads and sets the step of the other groups only, and so do we."""
    return [group for group in inner.param_groups if group["params"]]


def _step_counters(actor) -> list:
    """The optimizers that count steps: a HybridDeviceOptimizer's sub-optimizers (its host and device Adams) count
    their own; its states are theirs (the same dicts), its param groups hold no step."""
    return [
        sub for opt in _inner_optimizers(actor) for sub in getattr(opt.optimizer, "sub_optimizers", [opt.optimizer])
    ]


def _common_step(actor) -> float:
    """The step count every parameter shares (torch Adam keeps it per parameter, TE's FusedAdam per group)."""
    steps = set()
    for inner in _step_counters(actor):
        if isinstance(inner, torch.optim.Optimizer) and inner.state:
            steps |= {float(s["step"]) for s in inner.state.values() if "step" in s}
        steps |= {float(g["step"]) for g in _groups_with_params(inner) if "step" in g}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer step counts differ between parameters ({sorted(steps)}); cannot save one")
    return steps.pop() if steps else 0.0


def _set_common_step(actor, step: float) -> None:
    for inner in _step_counters(actor):
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                for p in group["params"]:
                    if p in inner.state:  # torch's fused / capturable Adam keeps the step on the param's device
                        on_param = group.get("fused") or group.get("capturable")
                        device = p.device if on_param else torch.device("cpu")
                        inner.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
        else:  # TE / Apex FusedAdam: one step per group
            for group in _groups_with_params(inner):
                group["step"] = int(step)


def sharded_state_dict(actor, is_loading: bool) -> tuple[dict, list]:
    """What one rank saves (or, ``is_loading``, the template it loads into): model and optimizer; and where
    the optimizer's loaded tensors go (:func:`_optimizer_tensors`)."""
    model_sd = model_sharded_state_dict(actor.chunks)
    state = {"model": model_sd}
    if actor.optimizer is None:
        return state, []
    tensors, routes = _optimizer_tensors(actor, model_sd, is_loading)
    # none on a DP rank > 0 of the DistributedOptimizer when saving (DP rank 0 writes the gathered state);
    # an empty list would be a "common" item that differs between ranks
    state["optimizer"] = {"state": {_TENSORS: tensors} if tensors else {}}
    if not is_loading:
        state["optimizer"]["state"][COMMON_STEP] = torch.tensor(_common_step(actor))
        scaler = actor.optimizer.chained_optimizers[0].grad_scaler if actor.dtype == "float16" else None
        if scaler is not None:
            state["optimizer"]["grad_scaler"] = scaler.state_dict()
    return state, routes


def _in_process_results_queue() -> None:
    """See the module doc: the synchronous writer's results stay in this process (no Manager server)."""

    # first use: at the top megatron-core (~4 s) would load with `import run.main, run.preflight`, which do not need it
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save(actor, directory: str | Path) -> None:
    """Write this rank's shards of params and optimizer into ``directory`` (collective: every rank calls it)."""
    # first use: at the top megatron-core (~4 s) would load with `import run.main, run.preflight`, which do not need it
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded_state_dict(actor, is_loading=False)[0], str(directory))


def save_params(chunks, directory: str | Path) -> None:
    """Write this rank's shards of the params alone into the existing ``directory`` (collective; the HF export's
    source, :func:`megatron_backend.hf_export.save_live`)."""
    # first use: at the top megatron-core (~4 s) would load with `import run.main, run.preflight`, which do not need it
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    dist_checkpointing.save({"model": model_sharded_state_dict(chunks)}, str(directory))


def saved_param_dtype(directory: str | Path) -> str | None:
    """The dtype the model's params were saved in (``"float32"``, ``"bfloat16"``, ...), from the checkpoint's
    ``torch_dist`` metadata alone (no megatron, no tensor read); None: no model tensor in it. A run resumed in
    another ``model.dtype`` would otherwise fail inside megatron's load on the 16-bit optimizer's fp32 main
    params (``optimizer.state.fp32_param.*``), which a float32 checkpoint does not have."""

    # first use: at the top torch.distributed.checkpoint (~1 s: DTensor, sympy) would load in every run's launcher
    from torch.distributed.checkpoint import FileSystemReader

    for key, item in FileSystemReader(str(directory)).read_metadata().state_dict_metadata.items():
        properties = getattr(item, "properties", None)  # TensorStorageMetadata; bytes (extra state) have none
        if not key.startswith("optimizer.") and properties is not None:
            return str(properties.dtype).removeprefix("torch.")
    return None


@torch.no_grad()
def load(actor, directory: str | Path) -> None:
    """Fill params (and optimizer state, when the actor has an optimizer) from ``directory``, resharding to this
    actor's layout (collective)."""
    # first use: at the top megatron-core (~4 s) would load with `import run.main, run.preflight`, which do not need it
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    template, routes = sharded_state_dict(actor, is_loading=True)
    if actor.optimizer is not None and "optimizer" not in dist_checkpointing.load_common_state_dict(str(directory)):
        # a params-only checkpoint (e.g. from a reference actor) cannot restore a training actor
        raise ValueError(f"{directory} holds no optimizer state; it cannot resume training")
    # an actor without an optimizer (make eval) reads the params of a full checkpoint: the optimizer's keys are
    # left in the file, while a key the actor needs and the checkpoint lacks still raises
    strict = StrictHandling.RAISE_ALL if actor.optimizer is not None else StrictHandling.RAISE_UNEXPECTED
    loaded = dist_checkpointing.load(template, str(directory), strict=strict)
    for vp, chunk in enumerate(actor.chunks):
        chunk.load_state_dict(loaded["model"][vp], strict=True)
    if actor.optimizer is None:
        return
    state = loaded["optimizer"]["state"]
    _load_optimizer_tensors(actor, routes, state[_TENSORS])
    _set_common_step(actor, float(state[COMMON_STEP]))
    if "grad_scaler" in loaded["optimizer"] and actor.dtype == "float16":
        actor.optimizer.chained_optimizers[0].grad_scaler.load_state_dict(loaded["optimizer"]["grad_scaler"])
