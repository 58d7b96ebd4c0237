"""The supported model families, one file each (a :class:`modelspec.family.Family` named ``FAMILY``).

Adding a family: write ``<name>.py`` (its HF tensors, quirks and tiny checkpoint sizes) and add it to the
tuple below; docs/DESIGN.md has the recipe.
"""

from __future__ import annotations

from modelspec.families import llama, mixtral, phi3, qwen2, qwen3, qwen3_moe
from modelspec.family import Family

# config.json's model_type -> its family
FAMILIES: dict[str, Family] = {
    module.FAMILY.model_type: module.FAMILY for module in (qwen2, llama, qwen3, phi3, qwen3_moe, mixtral)
}
