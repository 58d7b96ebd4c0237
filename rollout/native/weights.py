"""The native engine's parameters: one tensor per vLLM parameter, in the memory-saver region ``weights``.

Names, local shapes and vocab padding come from :mod:`rollout.layout` (vLLM's layout), so a resharder
can write each rank's slices straight into these tensors. Two ways in:

- :meth:`NativeWeights.load_hf`: full Hugging Face tensors (a checkpoint, or the gather-and-reload
  baseline); each rank copies its own slices.
- :meth:`NativeWeights.begin_update` / :meth:`NativeWeights.finish_update`: a planned weight sync writes
  the returned tensors in place between the two calls.

Either way the weights count as loaded afterwards. :meth:`NativeWeights.sleep` without a host copy
(``rollout.sleep_level=2``, or any level on CPU) drops them, and generation refuses to run until they
are written again.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open

from modelspec import ModelShape
from rollout.layout import ParamLayout, copy_hf_into_local, hf_to_vllm_index
from rollout.memory_saver import MemorySaver


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor of the checkpoint directory (one or many shards)."""

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {model_path}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class NativeWeights:
    """This rank's parameters under vLLM's names, and whether they hold a model (see the module doc)."""

    def __init__(
        self,
        shape: ModelShape,
        layouts: list[ParamLayout],
        saver: MemorySaver,
        device: torch.device,
        dtype: torch.dtype,
        cpu_backup: bool,
    ) -> None:
        self.shape = shape
        self.saver = saver
        self.device, self.dtype = device, dtype
        with saver.region("weights", cpu_backup=cpu_backup):
            self.params: dict[str, torch.Tensor] = {
                p.name: saver.track(torch.zeros(p.local_shape, dtype=dtype, device=device)) for p in layouts
            }
        self.num_bytes = sum(t.numel() * t.element_size() for t in self.params.values())
        # a host copy is kept only off CPU (on CPU it would not release anything, see MemorySaver.pause)
        self.survives_sleep = cpu_backup and device.type != "cpu"
        self._hf_index = hf_to_vllm_index(layouts)
        # HF tensors a checkpoint may hold that no parameter reads: a tied model's lm_head (the engine's is
        # model.embed_tokens.weight); RoPE buffers (``rotary_emb``) are skipped by name below
        self._unread_hf_names = {shape.family.lm_head} if shape.tie_word_embeddings else set()
        self.loaded = False  # the tensors hold a model (not zeros from allocation or a dropping sleep)
        self.updating = False  # between begin_update() and finish_update()

    @property
    def asleep(self) -> bool:
        return self.saver.is_paused("weights")

    def _check_awake(self, action: str) -> None:
        if self.asleep:
            raise RuntimeError(f"weights are asleep; call wake_up(['weights']) before {action}")

    @torch.no_grad()
    def load_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors under Hugging Face names -> this rank's slices (any non-empty subset of the model)."""
        self._check_awake("load_weights")
        num_tensors = 0
        for name, tensor in weights:
            num_tensors += 1
            targets = self._hf_index.get(name)
            if targets is None:
                if name in self._unread_hf_names or "rotary_emb" in name:
                    continue
                raise KeyError(f"{name!r} is not a Hugging Face tensor of this {self.shape.model_type} model")
            tensor = tensor.to(self.device, self.dtype)
            for layout, spec in targets:
                copy_hf_into_local(self.params[layout.name], layout, spec, tensor)
        if num_tensors == 0:
            raise ValueError(
                "load_weights got no tensors; a sync that writes the engine's tensors in place goes through "
                "begin_weight_update() / finish_weight_update()"
            )
        self.loaded = True

    def begin_update(self) -> dict[str, torch.Tensor]:
        """The live parameter tensors, to be written in place until :meth:`finish_update`."""
        self._check_awake("begin_weight_update")
        self.updating = True
        return dict(self.params)

    def finish_update(self) -> None:
        if not self.updating:
            raise RuntimeError("finish_weight_update() without begin_weight_update()")
        self._check_awake("finish_weight_update")
        self.updating = False
        self.loaded = True

    def sleep(self) -> None:
        self.saver.pause("weights")
        if not self.survives_sleep:
            self.loaded = False  # write them again (load_hf or an update) before generating
            self.updating = False  # an update in progress lost its writes: begin it again

    def wake_up(self) -> None:
        self.saver.resume("weights")
