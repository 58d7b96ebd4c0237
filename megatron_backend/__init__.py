"""Everything that touches megatron-core and ``parallel_state`` lives in this package.

- ``layout``: pure HF <-> megatron TP/PP/VPP weight layout (slice pieces per rank; no megatron import).
- ``checkpoint``: streaming HF safetensors -> shards loader, shards -> HF exporter (uses ``layout``).
- ``model`` / ``parallel`` / ``cpu_compat``: GPTModel from a HF config, process groups, CPU shims.
- ``logprobs``: log-probs and chunked entropy from vocab-parallel logits (no full-vocab gather).
- ``memory``: the per-tag byte ledger (actor_params, actor_grads, optimizer) and the offloader.
- ``actor``: the :class:`~megatron_backend.actor.Actor` the RL loop holds, a composition of ``actor_model``
  (building, forward passes, log-probs), ``actor_train`` (optimizer, train step and its guard) and
  ``actor_offload`` (the states moved to host and back).
- ``hf_export`` / ``dist_checkpoint``: the actor's weights as a HF directory, megatron's distributed checkpoint.
- ``packing``: sequence packing into micro-batches.

``make parity`` and ``make bench-entropy`` are ``tools/parity.py`` and ``tools/bench_entropy.py``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys


def _compile_at_first_call(model=None, **options):
    """``torch.compile`` that imports torch's compiler at ``model``'s first call instead of at decoration."""
    if model is None:  # used as @torch.compile(**options)
        return functools.partial(_compile_at_first_call, **options)
    compiled = None

    @functools.wraps(model)
    def first_call_compiles(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(model, **options)
        return compiled(*args, **kwargs)

    return first_call_compiles


class _DeferMegatronCompiles(importlib.abc.MetaPathFinder):
    """megatron-core 0.16's ``megatron.core.jit.jit_fuser`` is ``torch.compile``, applied as a decorator to its fused
    bias-activation and RoPE functions when they are imported. Each application imports torch's compiler (dynamo,
    inductor, sympy's solvers): ~2 s of CPU in every process that imports megatron-core, used or not (a run's
    launcher and each of its ranks; every subprocess of the tests). Right after ``megatron/core/jit.py`` runs, its
    ``jit_fuser`` becomes :func:`_compile_at_first_call`: the same compile of the same function, at its first call
    (where torch.compile compiles anyway), so a process that never calls a fused function never imports the
    compiler. Nothing of megatron-core is copied or edited; only that one module global is replaced."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_defer(module) -> None:
            exec_module(module)
            import torch

            if module.jit_fuser is torch.compile:  # megatron's default; a jit_fuser it chose otherwise stays
                module.jit_fuser = _compile_at_first_call

        spec.loader.exec_module = exec_then_defer  # this spec's own loader object
        return spec


if not any(isinstance(finder, _DeferMegatronCompiles) for finder in sys.meta_path):
    sys.meta_path.insert(0, _DeferMegatronCompiles())
