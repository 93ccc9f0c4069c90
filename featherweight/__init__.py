"""featherweight: fine-tune LLMs in JAX inside a memory budget you state.

Public API (pure functions over pytrees; frozen and trainable parameters always separate).
"""

from featherweight import errors
from featherweight.inference.generate import generate, generate_ids, logits
from featherweight.io.convert import convert
from featherweight.io.loader import load_model, open_checkpoint, params_nbytes
from featherweight.io.model_source import model_config_from
from featherweight.io.peft_export import export_merged, export_peft
from featherweight.io.tokenizer import Tokenizer
from featherweight.memory.budget import fit_budget, parse_budget, plan_within_budget
from featherweight.memory.measure import MemoryMeasurement, measure_compiled, measure_device_peak
from featherweight.memory.plan import MemoryPlan, plan_for_config
from featherweight.models.config import ModelConfig, config_from_hf_dict
from featherweight.models.model import Model
from featherweight.models.registry import BUILTIN_MODELS, builtin_config
from featherweight.optim.adamw8bit import adam_8bit_state_bytes, adamw_8bit, scale_by_adam_8bit
from featherweight.peft.lora import (
    LoraConfig,
    init_lora,
    merge_lora_weight,
    quantize_frozen_base,
)
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

__all__ = [
    "BUILTIN_MODELS",
    "LoraConfig",
    "MemoryMeasurement",
    "MemoryPlan",
    "Model",
    "ModelConfig",
    "NF4Tensor",
    "Tokenizer",
    "adam_8bit_state_bytes",
    "adamw_8bit",
    "builtin_config",
    "config_from_hf_dict",
    "convert",
    "dequantize_nf4",
    "errors",
    "export_merged",
    "export_peft",
    "fit_budget",
    "generate",
    "generate_ids",
    "init_lora",
    "load_model",
    "logits",
    "measure_compiled",
    "measure_device_peak",
    "merge_lora_weight",
    "model_config_from",
    "open_checkpoint",
    "params_nbytes",
    "parse_budget",
    "plan_for_config",
    "plan_within_budget",
    "quantize_frozen_base",
    "quantize_nf4",
    "scale_by_adam_8bit",
]
