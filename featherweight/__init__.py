"""featherweight: fine-tune LLMs in JAX inside a memory budget you state.

Public API (pure functions over pytrees; frozen and trainable parameters always separate).
"""

from featherweight import errors
from featherweight.inference import generate, generate_ids, logits
from featherweight.io.convert import convert
from featherweight.io.loader import Model, load_model, open_checkpoint, params_nbytes
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.config import ModelConfig, config_from_hf_dict
from featherweight.optim.adamw8bit import adam_8bit_state_bytes, adamw_8bit, scale_by_adam_8bit
from featherweight.peft.export import export_merged, export_peft
from featherweight.peft.lora import (
    LoraConfig,
    init_lora,
    lora_spec,
    merge_lora_weight,
    quantize_frozen_base,
)
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

__all__ = [
    "LoraConfig",
    "Model",
    "ModelConfig",
    "NF4Tensor",
    "Tokenizer",
    "adam_8bit_state_bytes",
    "adamw_8bit",
    "config_from_hf_dict",
    "convert",
    "dequantize_nf4",
    "errors",
    "export_merged",
    "export_peft",
    "generate",
    "generate_ids",
    "init_lora",
    "load_model",
    "logits",
    "lora_spec",
    "merge_lora_weight",
    "open_checkpoint",
    "params_nbytes",
    "quantize_frozen_base",
    "quantize_nf4",
    "scale_by_adam_8bit",
]
