"""modelspec.family: a family's tensor table is checked when it is written, not when a layout misplaces rows."""

from __future__ import annotations

import pytest

from modelspec.families.llama import FAMILY as LLAMA
from modelspec.families.llama import LLAMA_LAYER_TENSORS
from modelspec.family import DOWN, K_NORM, O_PROJ, UP, Family, HfTensor


def llama_with(layer_tensors) -> Family:
    return Family(
        model_type="test",
        config_class="LlamaConfig",
        layer_tensors=tuple(layer_tensors),
        qkv_bias=False,
        tiny_config={},
    )


def test_llama_table_is_accepted():
    assert llama_with(LLAMA_LAYER_TENSORS).layer_parts(qkv_bias=False) == LLAMA.layer_parts(qkv_bias=False)


@pytest.mark.parametrize(
    "layer_tensors, message",
    [
        ([t for t in LLAMA_LAYER_TENSORS if t.parts != (O_PROJ,)], r"no HF tensor holds part\(s\) \['o'\]"),
        ([*LLAMA_LAYER_TENSORS, HfTensor("self_attn.k_norm", (K_NORM,))], "q_norm and k_norm come together"),
        ([*LLAMA_LAYER_TENSORS, HfTensor("mlp.up_again", (UP,))], "part 'up' is in two HF tensors"),
        (
            [t for t in LLAMA_LAYER_TENSORS if t.parts not in ((UP,), (DOWN,))] + [HfTensor("mlp.up_down", (UP, DOWN))],
            "stacks parts of other widths",
        ),
    ],
)
def test_inconsistent_tables_are_refused(layer_tensors, message):
    with pytest.raises(ValueError, match=message):
        llama_with(layer_tensors)
