"""A loaded model as one value: config, parameters, tokenizer, where it came from.

`featherweight.io.loader.load_model` builds it; inference and export read it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from featherweight.models.config import ModelConfig
from featherweight.models.llama import LoraSpec, Params


@dataclasses.dataclass
class Model:
    """A loaded model: config, parameter pytree (layers stacked on axis 0) and tokenizer."""

    config: ModelConfig
    params: Params
    tokenizer: Any  # featherweight.io.tokenizer.Tokenizer (io reads it from the checkpoint) or None
    source: Path
    lora: LoraSpec | None = None  # set when params hold LoRA adapters (layers["lora"])

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (that of the final norm weight)."""
        return self.params["final_norm"].dtype
