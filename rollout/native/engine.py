"""``NativeEngine``: the rollout protocol (:class:`rollout.engine.RolloutEngine`) over the native parts.

Builds, in order: the parameters (:mod:`~rollout.native.weights`), the KV cache sized from what the
weights leave (:mod:`~rollout.native.kv_cache`), the forward (:mod:`~rollout.native.model`) and the
continuous-batching scheduler (:mod:`~rollout.native.scheduler`); ``generate`` hands each call's
sequences and a :class:`~rollout.native.sampling.Sampler` to the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from configs.rollout import RolloutConfig
from modelspec import ModelShape, torch_dtype
from rollout.engine import Completion, SamplingParams
from rollout.layout import ExpertSplit, tp_shape, vllm_param_layouts
from rollout.memory_saver import TAGS, MemorySaver
from rollout.native.kv_cache import KVCache
from rollout.native.model import NativeModel, check_supported
from rollout.native.sampling import Sampler
from rollout.native.scheduler import Scheduler
from rollout.native.weights import NativeWeights, iter_safetensors


class NativeEngine:
    """Plain torch, CPU or CUDA, tensor parallel with exactly vLLM's weight layout.

    ``group`` is the process group of this rank's replica: its rollout.tp x rollout.ep ranks (None: one rank,
    no collectives); ``load=False`` starts with zero weights (a weight sync fills them). With rollout.ep > 1
    (rollout.tp = 1) the replica's ranks each hold E / ep experts and run the same tokens.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        group: dist.ProcessGroup | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "float32",
        load: bool = True,
        shape: ModelShape | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        self.shape = shape if shape is not None else ModelShape.from_pretrained(model_path)
        check_supported(self.shape)
        self.group = group
        replica_size = 1 if group is None else dist.get_world_size(group)
        replica_rank = 0 if group is None else dist.get_rank(group)
        if replica_size != cfg.tp * cfg.ep:
            raise ValueError(
                f"rollout.tp x rollout.ep = {cfg.tp} x {cfg.ep} but the process group given has {replica_size} "
                "ranks; make them agree"
            )
        self.tp, self.tp_rank = cfg.tp, replica_rank % cfg.tp
        self.ep, self.ep_rank = cfg.ep, replica_rank // cfg.tp
        tp_group = group if cfg.ep == 1 else None  # rollout.ep > 1 runs with rollout.tp = 1 (RolloutConfig)
        self.tps = tp_shape(self.shape, self.tp, self.tp_rank)
        experts = ExpertSplit(etp=self.tp, etp_rank=self.tp_rank, ep=self.ep, ep_rank=self.ep_rank)
        self.layouts = vllm_param_layouts(self.shape, self.tp, self.tp_rank, experts)
        self.max_model_len = cfg.max_model_len or self.shape.max_position_embeddings
        self.saver = MemorySaver(cfg.memory_saver, self.device)

        self.weights = NativeWeights(
            self.shape, self.layouts, self.saver, self.device, self.dtype, cpu_backup=cfg.sleep_level == 1
        )
        if load:
            self.weights.load_hf(iter_safetensors(model_path))
        self.kv_cache = KVCache(
            cfg, self.shape, self.tps, self.max_model_len, self.saver, self.device, self.dtype, self.weights.num_bytes
        )
        self.model = NativeModel(
            self.shape,
            self.tps,
            self.weights,
            self.kv_cache,
            self.max_model_len,
            tp_group,
            self.device,
            self.dtype,
            moe_group=group,
            first_expert=experts.experts(self.shape).start,
        )
        self.scheduler = Scheduler(
            self.model,
            self.kv_cache,
            cfg.max_num_seqs,
            self.max_model_len,
            self.shape.eos_token_id,
            self.device,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
        )
        self._src_rank = 0 if group is None else dist.get_global_rank(group, 0)

    # ------------------------------------------------------------------ memory
    def memory(self) -> dict[str, int]:
        by_tag = self.saver.bytes_by_tag()
        return {tag: by_tag.get(tag, 0) for tag in TAGS}

    def _parts(self, tags: Sequence[str]) -> list[NativeWeights | KVCache]:
        """The parts holding the memory of ``tags`` (each sleeps and wakes its own region)."""
        parts = {"weights": self.weights, "kv_cache": self.kv_cache}
        for tag in tags:
            if tag not in parts:
                raise ValueError(f"unknown memory tag {tag!r}; tags are {TAGS}")
        return [parts[tag] for tag in tags]

    def sleep(self, tags: Sequence[str] = TAGS) -> None:
        for part in self._parts(tags):
            part.sleep()

    def wake_up(self, tags: Sequence[str] = TAGS) -> None:
        for part in self._parts(tags):
            part.wake_up()

    # ------------------------------------------------------------------ weights
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under vLLM's names (the live tensors): for reading. To write them in
        place, go through :meth:`begin_weight_update` / :meth:`finish_weight_update`."""
        return dict(self.weights.params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights.load_hf(weights)
        self.model.refresh_weights()

    def begin_weight_update(self) -> dict[str, torch.Tensor]:
        """The live parameter tensors under vLLM's names, writable in place until :meth:`finish_weight_update`
        (the weights must be awake; generate refuses to run in between)."""
        return self.weights.begin_update()

    def finish_weight_update(self) -> None:
        """The tensors are written: mark them loaded and rebuild the forward's derived copies (norms)."""
        self.weights.finish_update()
        self.model.refresh_weights()

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if self.weights.asleep or self.kv_cache.asleep:
            raise RuntimeError("engine is asleep; wake_up(['weights', 'kv_cache']) first")
        if self.weights.updating:
            raise RuntimeError("a weight update is in progress; call finish_weight_update() before generate")
        if not self.weights.loaded:
            raise RuntimeError(
                "weights were released by sleep(); load_weights(...) or begin_weight_update() / "
                "finish_weight_update() after wake_up before generating"
            )
        return self.scheduler.run(prompts, params, Sampler(params, self.device, self.group, self._src_rank))
