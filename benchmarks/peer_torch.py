"""The torch + peft peer of `benchmarks/peers.py` (on CPU) and of the GPU check's speed rows
(`benchmarks/gpu_check_speed.py`, on a CUDA device): the train step a PyTorch user runs.

transformers' `LlamaForCausalLM` from the model's config (random init, float32 on the CPU, bf16 on
a CUDA device, SDPA attention),
gradient checkpointing per layer (as the JAX programs recompute each layer in the backward pass),
cross-entropy over the full logits, `torch.optim.AdamW`. LoRA: peft's `LoraConfig` r 8, alpha 16
on every linear of the blocks. QLoRA: the blocks' linears replaced by bitsandbytes' NF4
`Linear4bit` (double quantization, the model's compute dtype), each quantized where the model
was made: on a GPU straight from its bf16 weights there, no round trip through the host (with
one, the 8B peer ran past the 58 s left to it on an H200). Then the same peft adapters. Full
fine-tuning: every parameter trained.

torch's OpenMP threads wait passively (`OMP_WAIT_POLICY=PASSIVE`, set here before torch is first
imported): on a shared, loaded machine spinning OpenMP barriers made the LoRA step at b2 x 64 25x
slower (measured: 65 s against 2.6 s), which would measure the machine's load, not torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from featherweight.models.config import ModelConfig
from featherweight.peft.lora import PEFT_MODULES

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP


def _quantize_linears(model, compute_dtype, device: str) -> None:
    """Every linear of the decoder layers as a bitsandbytes NF4 `Linear4bit` (frozen), quantized
    as it moves to `device`."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for path in PEFT_MODULES.values():
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            dense = getattr(parent, name)
            quantized = bnb.nn.Linear4bit(
                dense.in_features,
                dense.out_features,
                bias=False,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
            )
            quantized.weight = bnb.nn.Params4bit(
                dense.weight.data,  # where the model is: quantized there, no round trip
                requires_grad=False,
                compress_statistics=True,
                quant_type="nf4",
            )
            setattr(parent, name, quantized.to(device))  # quantizes the weight


def build_torch_step(
    model_config: ModelConfig,
    method: str,
    input_ids: np.ndarray,
    target_ids: np.ndarray,
    device: str = "cpu",
) -> Callable[[], float]:
    """A closure running one train step on the given batch; returns the loss. On a CUDA `device`
    the model is bf16 (and QLoRA computes in bf16), as a GPU user runs it; float32 on the CPU."""
    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = model_config.to_hf_dict()
    hf.pop("architectures")
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], input_ids.shape[1])
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype on its device: no float32 copy first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**hf, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(default_dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if method == "qlora":
        _quantize_linears(model, dtype, device)
    if method != "full":
        targets = [path.split(".")[1] for path in PEFT_MODULES.values()]
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
        )
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-4, weight_decay=0.0)
    inputs = torch.from_numpy(np.asarray(input_ids, np.int64)).to(device)
    targets = torch.from_numpy(np.asarray(target_ids, np.int64)).to(device)

    def step() -> float:
        logits = model(input_ids=inputs).logits  # [B, S, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step
