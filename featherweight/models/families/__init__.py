"""The model families featherweight runs, by config.json `model_type` (see `base.Family`).

Adding a dense family: a module building its `Family`, and its line in `FAMILIES`.
"""

from __future__ import annotations

from featherweight.errors import UnsupportedModelError
from featherweight.models.families.base import Family
from featherweight.models.families.gemma import GEMMA2, GEMMA3
from featherweight.models.families.gpt_oss import GPT_OSS
from featherweight.models.families.llama import LLAMA, MINISTRAL, MISTRAL, QWEN2
from featherweight.models.families.moe import MIXTRAL, QWEN3_MOE
from featherweight.models.families.phi3 import PHI3
from featherweight.models.families.qwen3 import QWEN3

FAMILIES: tuple[Family, ...] = (
    LLAMA, MISTRAL, MINISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, QWEN3_MOE, MIXTRAL, GPT_OSS,
)  # fmt: skip

BY_MODEL_TYPE: dict[str, Family] = {
    model_type: family for family in FAMILIES for model_type in family.model_types
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(BY_MODEL_TYPE)
BY_GGUF_ARCHITECTURE: dict[str, Family] = {}
for _family in FAMILIES:  # the first family of an architecture reads it (llama: Llama)
    BY_GGUF_ARCHITECTURE.setdefault(_family.gguf_architecture, _family)


def family_of(model_type: str, source: str = "config.json") -> Family:
    """The family of a config.json `model_type`, or an error naming the supported ones."""
    family = BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return family


__all__ = ["BY_GGUF_ARCHITECTURE", "FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "family_of"]
