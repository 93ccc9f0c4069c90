"""featherweight: fine-tune LLMs in JAX inside a memory budget you state.

Public API (pure functions over pytrees; frozen and trainable parameters always separate):

- models and files: `load_model`, `Model`, `ModelConfig`, `builtin_config`, `model_config_from`,
  `convert`, `generate`, `logits`
- adapters and quantization: `LoraConfig`, `init_lora`, `quantize_frozen_base`, `NF4Tensor`
- steps: `build_streamed_step` (optimizer inside the backward pass), `build_reference_step`
  (`jax.grad`), `init_streamed_opt_state`, `MemoryPolicy`, `Batch`, `adamw_8bit`
- training: `TrainConfig`, `load_config`, `train`, `export_run`, `export_merged`, `export_peft`,
  `export_merged_gguf`, `export_adapter_gguf` (llama.cpp / Ollama)
- memory: `resolve` (every "auto" setting chosen from the shapes: what is planned, built and
  recorded), `plan_for_config`, `fit_budget`, `measure_compiled`, `measure_device_peak`,
  `host_base_estimate` (`memory.base: host`: transfer and compute per step on a target);
  `load_model(..., layers_on_host=True)` loads a base for it
"""

from featherweight.parallel.backend import quiet_cuda_plugin

quiet_cuda_plugin()  # before jax is imported: see featherweight/parallel/backend.py

from featherweight import errors
from featherweight.inference.generate import generate, generate_ids, logits
from featherweight.io.convert import convert
from featherweight.io.gguf_export import export_adapter_gguf, export_merged_gguf
from featherweight.io.loader import load_model, open_checkpoint, params_nbytes
from featherweight.io.model_source import model_config_from
from featherweight.io.peft_export import export_merged, export_peft
from featherweight.io.tokenizer import Tokenizer
from featherweight.memory.budget import fit_budget, parse_budget, plan_within_budget
from featherweight.memory.defaults import resolve
from featherweight.memory.measure import MemoryMeasurement, measure_compiled, measure_device_peak
from featherweight.memory.plan import MemoryPlan, plan_for_config
from featherweight.memory.step_cost import host_base_estimate
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig, config_from_hf_dict
from featherweight.models.model import Model
from featherweight.models.registry import BUILTIN_MODELS, builtin_config
from featherweight.optim.adamw8bit import adam_8bit_state_bytes, adamw_8bit, scale_by_adam_8bit
from featherweight.peft.lora import LoraConfig, init_lora, merge_lora_weight, quantize_frozen_base
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4
from featherweight.recipe.schema import TrainConfig, load_config
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.preference import PreferenceObjective, preference_loss
from featherweight.step.reference import build_reference_step
from featherweight.step.streamed import build_streamed_step
from featherweight.train.export_run import export_run
from featherweight.train.loop import train

__all__ = [
    "BUILTIN_MODELS",
    "Batch",
    "LoraConfig",
    "MemoryMeasurement",
    "MemoryPlan",
    "MemoryPolicy",
    "Model",
    "ModelConfig",
    "NF4Tensor",
    "PreferenceObjective",
    "Tokenizer",
    "TrainConfig",
    "adam_8bit_state_bytes",
    "adamw_8bit",
    "build_reference_step",
    "build_streamed_step",
    "builtin_config",
    "config_from_hf_dict",
    "convert",
    "dequantize_nf4",
    "errors",
    "export_adapter_gguf",
    "export_merged",
    "export_merged_gguf",
    "export_peft",
    "export_run",
    "fit_budget",
    "generate",
    "generate_ids",
    "host_base_estimate",
    "init_lora",
    "init_streamed_opt_state",
    "load_config",
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
    "preference_loss",
    "quantize_frozen_base",
    "quantize_nf4",
    "resolve",
    "scale_by_adam_8bit",
    "train",
]
