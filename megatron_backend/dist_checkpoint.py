"""The actor's training state (params + optimizer) as a megatron-core distributed checkpoint.

``megatron.core.dist_checkpointing`` (format ``torch_dist``): every rank writes its own shards of the
model's ``sharded_state_dict()`` (one ``ShardedTensor`` per parameter, keyed by its global name with
the layer axis and the TP split as metadata), so a checkpoint saved at actor TP x PP (x VPP) loads at
any other layout: each rank reads the pieces that overlap its own shards. Vocab-padded tensors are
marked ``allow_shape_mismatch`` by megatron (padding differs with TP) and are cut or padded on load.

The optimizer state is keyed the same way, so it reshards with the params:

- CPU (torch ``AdamW`` stepping on DDP ``main_grad``, see ``actor.py``): ``exp_avg`` / ``exp_avg_sq`` of
  each parameter become ``optimizer.state.<key>.<param key>`` ShardedTensors with the param's sharding
  (megatron's ``optim_state_to_sharding_state``, the helper its own FP32 optimizer uses); the step
  count, equal for every parameter, is saved once as ``common_step``; group hyper-parameters from rank 0.
- CUDA (megatron's optimizer): its own ``sharded_state_dict`` with the distributed optimizer's
  ``fully_sharded_model_space`` format (one ShardedTensor per parameter, reshardable across TP/PP/DP).

Saving and loading need the params, grads and optimizer states resident (``Actor.onload`` first); the
loop saves inside the step, after ``train``, when they are.

Saves are synchronous (``async_sharded_save=False``): megatron's ``FileSystemWriterAsync`` then runs its
writer in this process (forking short-lived per-bucket workers) and only hands its results to this
process. Its results queue is by default a ``multiprocessing.Manager().Queue()``, i.e. a spawned server
process per rank that outlives a SIGKILLed rank as an orphan; :func:`_in_process_results_queue` gives it
a plain ``queue.Queue`` instead, which is all the synchronous path needs (``put`` / ``get_nowait``).
"""

from __future__ import annotations

from pathlib import Path

import torch

# megatron-core's distributed-optimizer format that reshards across TP, PP and DP (see the module doc)
MEGATRON_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
COMMON_STEP = "common_step"


def model_sharded_state_dict(chunks) -> dict:
    """{vp stage: that chunk's sharded state dict}; the ShardedTensors hold the parameters themselves."""
    return {vp: chunk.sharded_state_dict() for vp, chunk in enumerate(chunks)}


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero moments for every parameter that has none yet (a load template needs them allocated)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _torch_optimizer_sharded_state_dict(optimizer: torch.optim.Optimizer, model_sd: dict, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    if is_loading:
        _init_adam_state(optimizer)
    state = optimizer.state_dict()  # {"state": {index: {step, exp_avg, exp_avg_sq}}, "param_groups": [...]}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer step counts differ between parameters ({sorted(steps)}); cannot save one")
    id_to_sharded = get_param_id_to_sharded_param_map(model_sd, params)
    if len(id_to_sharded) != len(params):
        raise RuntimeError(f"{len(params) - len(id_to_sharded)} optimizer parameters have no sharded model tensor")
    optim_state_to_sharding_state(state, id_to_sharded, exclude_keys=("step",))
    state["state"][COMMON_STEP] = torch.tensor(steps.pop() if steps else 0.0)
    return state


def _load_torch_optimizer(optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    step = loaded["state"].pop(COMMON_STEP)
    for param_state in loaded["state"].values():
        param_state["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
    optimizer.load_state_dict(loaded)


def sharded_state_dict(actor, is_loading: bool) -> dict:
    """What one rank saves (or, ``is_loading``, the template it loads into): model and optimizer."""
    model_sd = model_sharded_state_dict(actor.chunks)
    state = {"model": model_sd}
    if actor.optimizer is None:
        return state
    if actor.optimizer_impl == "megatron":
        state["optimizer"] = actor.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=MEGATRON_OPTIMIZER_METADATA
        )
    else:
        state["optimizer"] = _torch_optimizer_sharded_state_dict(actor.optimizer, model_sd, is_loading)
    return state


def _in_process_results_queue() -> None:
    """See the module doc: the synchronous writer's results stay in this process (no Manager server)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save(actor, directory: str | Path) -> None:
    """Write this rank's shards of params and optimizer into ``directory`` (collective: every rank calls it)."""
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded_state_dict(actor, is_loading=False), str(directory))


@torch.no_grad()
def load(actor, directory: str | Path) -> None:
    """Fill params (and optimizer state, when the actor has an optimizer) from ``directory``, resharding to this
    actor's layout (collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    template = sharded_state_dict(actor, is_loading=True)
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
    if actor.optimizer_impl == "megatron":
        actor.optimizer.load_state_dict(loaded["optimizer"])
    else:
        _load_torch_optimizer(actor.optimizer, loaded["optimizer"])
