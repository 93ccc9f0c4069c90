"""featherweight: fine-tune LLMs in JAX inside a memory budget you state.

Public API (pure functions over pytrees; frozen and trainable parameters always separate).
"""

from featherweight import errors
from featherweight.inference import generate, generate_ids, logits
from featherweight.io.convert import convert
from featherweight.io.loader import Model, load_model, open_checkpoint, params_nbytes
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.config import ModelConfig, config_from_hf_dict
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

__all__ = [
    "Model",
    "ModelConfig",
    "NF4Tensor",
    "Tokenizer",
    "config_from_hf_dict",
    "convert",
    "dequantize_nf4",
    "errors",
    "generate",
    "generate_ids",
    "load_model",
    "logits",
    "open_checkpoint",
    "params_nbytes",
    "quantize_nf4",
]
