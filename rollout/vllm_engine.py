"""The vLLM rollout engine for GPU clusters, colocated with the training ranks.

Each torchrun rank builds ``vllm.LLM(..., distributed_executor_backend="external_launcher",
enable_sleep_mode=True)``: vLLM then runs SPMD inside the existing ranks (the engine core in-process,
consecutive ranks forming the rollout TP groups), so ``collective_rpc`` reaches this process's worker
and passes tensors without serialization. Weight updates go through :class:`WeightSyncWorkerExtension`
(``worker_extension_cls``) into ``model_runner.model.load_weights``, which takes full tensors under
Hugging Face names and keeps the local slices (vLLM's layout, see :mod:`rollout.layout`).

Sleep follows vLLM's sleep mode: ``sleep(level=1)`` keeps a host copy of the weights and drops the KV
cache, ``level=2`` drops both (the RL loop re-syncs weights after ``wake_up(tags=["weights"])``, then
``wake_up(tags=["kv_cache"])``). vLLM is imported only when this engine is built.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rollout.config import RolloutConfig
from rollout.engine import Completion, SamplingParams
from rollout.memory_saver import TAGS

INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM and a CUDA GPU: run `make install EXTRAS=dev,gpu` on a CUDA machine, "
    "or set rollout.engine=native"
)
WORKER_EXTENSION = "rollout.vllm_engine.WeightSyncWorkerExtension"


def check_vllm_available() -> None:
    """Raise one line saying how to install the ``gpu`` extra when vLLM or CUDA is missing."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    if not torch.cuda.is_available():
        raise RuntimeError(INSTALL_HINT)


class WeightSyncWorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``); ``self`` is the worker."""

    def rollout_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Full tensors under HF names -> the model's own ``load_weights`` (it slices for this TP rank)."""
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize()

    def rollout_named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under vLLM's names (the live tensors; in-process with external_launcher)."""
        return dict(self.model_runner.model.named_parameters())

    def rollout_bytes_by_tag(self) -> dict[str, int]:
        """Bytes mapped per tag by vLLM's sleep-mode allocator (``weights``, ``kv_cache``).

        Falls back to the parameter and KV-cache tensor sizes where the allocator's bookkeeping differs.
        """
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            by_tag: dict[str, int] = {}
            for data in CuMemAllocator.get_instance().pointer_to_data.values():
                if getattr(data, "is_asleep", False):
                    continue
                by_tag[data.tag] = by_tag.get(data.tag, 0) + int(data.handle[1])  # (device, size, ptr, handle)
            return by_tag
        except (ImportError, AttributeError, IndexError, TypeError):
            weights = sum(p.numel() * p.element_size() for p in self.model_runner.model.parameters())
            caches = getattr(self.model_runner, "kv_caches", [])
            flat = [t for c in caches for t in (c if isinstance(c, (list, tuple)) else [c])]
            return {"weights": weights, "kv_cache": sum(t.numel() * t.element_size() for t in flat)}


def to_vllm_sampling_params(params: SamplingParams):
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        seed=params.seed,
        logprobs=0,  # the sampled token's log-prob only
    )


class VllmEngine:
    """The rollout protocol over ``vllm.LLM`` (see the module doc)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        dtype: str = "auto",
        seed: int | None = None,
        distributed_executor_backend: str = "external_launcher",
        **llm_kwargs: Any,
    ) -> None:
        check_vllm_available()
        if cfg.gpu_memory_utilization == "auto":
            raise ValueError(
                "rollout.gpu_memory_utilization='auto' must be resolved by the planner before the engine starts"
            )
        from vllm import LLM

        self.cfg = cfg
        kwargs: dict[str, Any] = dict(
            model=model_path,
            tensor_parallel_size=cfg.tp,
            distributed_executor_backend=distributed_executor_backend,
            enable_sleep_mode=True,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_num_seqs=cfg.max_num_seqs,
            block_size=cfg.block_size,
            dtype=dtype,
            # every rank of a TP group must sample the same tokens: same seed everywhere
            seed=cfg.seed if seed is None else seed,
            worker_extension_cls=WORKER_EXTENSION,
        )
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if distributed_executor_backend == "external_launcher" and world_size > cfg.tp:
            # torchrun world = rollout TP x data-parallel replicas (vLLM's torchrun_dp_example layout)
            kwargs["data_parallel_size"] = world_size // cfg.tp
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self._asleep: set[str] = set()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if self._asleep:
            raise RuntimeError(f"engine is asleep ({sorted(self._asleep)}); wake_up first")
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], to_vllm_sampling_params(params), use_tqdm=False
        )
        results = []
        for i, request in enumerate(outputs):
            samples = []
            for out in sorted(request.outputs, key=lambda o: o.index):
                token_ids = list(out.token_ids)
                # out.logprobs: per token a {token_id: Logprob} dict holding (at least) the sampled token
                logprobs = [step[t].logprob for t, step in zip(token_ids, out.logprobs or [])]
                samples.append(Completion(i, out.index, token_ids, logprobs, out.finish_reason))
            results.append(samples)
        return results

    def sleep(self, tags: Sequence[str] = TAGS) -> None:
        if set(tags) != set(TAGS):
            raise ValueError(f"vLLM sleeps weights and KV cache together; call sleep({list(TAGS)}) (got {list(tags)})")
        self.llm.sleep(level=self.cfg.sleep_level)
        self._asleep = set(TAGS)

    def wake_up(self, tags: Sequence[str] = TAGS) -> None:
        for tag in tags:
            if tag not in TAGS:
                raise ValueError(f"unknown memory tag {tag!r}; tags are {TAGS}")
        self.llm.wake_up(tags=list(tags))
        self._asleep -= set(tags)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._asleep:
            raise RuntimeError("weights are asleep; call wake_up(['weights']) before load_weights")
        self.llm.collective_rpc("rollout_load_weights", args=(list(weights),))

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return self.llm.collective_rpc("rollout_named_parameters")[0]

    def memory(self) -> dict[str, int]:
        mapped = self.llm.collective_rpc("rollout_bytes_by_tag")[0]
        return {tag: 0 if tag in self._asleep else int(mapped.get(tag, 0)) for tag in TAGS}
