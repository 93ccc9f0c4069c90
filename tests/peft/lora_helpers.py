"""Shared pieces of the LoRA tests: featherweight's LoRA logits, adapters with a non-zero B (a fresh
adapter changes nothing, so parity on one proves nothing), and PEFT models holding them."""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import peft
import torch

from featherweight.models.config import ModelConfig
from featherweight.models.llama import LoraSpec, Params, forward, merge_params
from featherweight.peft.lora import PEFT_MODULES, LoraConfig, init_lora


@functools.partial(jax.jit, static_argnames=("config", "lora"))
def lora_logits(
    frozen: Params, adapters: Params, token_ids, config: ModelConfig, lora: LoraSpec
) -> jax.Array:
    """Float32 logits of the base plus adapters (no dropout)."""
    return forward(merge_params(frozen, adapters), token_ids, config, lora=lora)


def random_adapters(
    key: jax.Array, config: ModelConfig, lora_config: LoraConfig, dtype=jnp.float32
) -> Params:
    """PEFT-initialized A, and B ~ N(0, 1/r): an adapter whose update is as large as the weight."""
    adapters = init_lora(key, config, lora_config, dtype)
    stacks = adapters["layers"]["lora"]
    keys = jax.random.split(jax.random.fold_in(key, 1), len(stacks))
    for b_key, pair in zip(keys, stacks.values()):
        noise = jax.random.normal(b_key, pair["b"].shape) / np.sqrt(lora_config.rank)
        pair["b"] = noise.astype(dtype)
    return adapters


def peft_model_with(
    hf_model: torch.nn.Module, adapters: Params, lora_config: LoraConfig
) -> torch.nn.Module:
    """A PEFT LoRA model on a copy of `hf_model` holding featherweight's adapter weights."""
    config = peft.LoraConfig(
        r=lora_config.rank,
        lora_alpha=lora_config.alpha,
        lora_dropout=0.0,
        use_rslora=lora_config.rslora,
        target_modules=[PEFT_MODULES[t].split(".")[-1] for t in lora_config.targets],
    )
    model = peft.get_peft_model(copy.deepcopy(hf_model), config).eval()
    layers = model.base_model.model.model.layers
    with torch.no_grad():
        for target, pair in adapters["layers"]["lora"].items():
            for index, layer in enumerate(layers):
                module = layer.get_submodule(PEFT_MODULES[target])
                module.lora_A["default"].weight.copy_(torch.tensor(np.asarray(pair["a"][index])))
                module.lora_B["default"].weight.copy_(torch.tensor(np.asarray(pair["b"][index])))
    return model
