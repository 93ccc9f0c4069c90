"""GGUF exports of a fine-tune: the merged model (`model.gguf`), or the LoRA adapter alone as a
llama.cpp adapter (`adapter.gguf`, for `llama-server --lora` and Ollama's `ADAPTER`); each with
an Ollama Modelfile beside it, written atomically (the directory appears complete or not at all).

Merged: the base streams out one tensor at a time (an NF4 base dequantized one layer at a time),
`scale * B A` is added in float32 to each targeted weight, and the result is quantized to the
requested type and written before the next tensor is built.

Adapter: llama.cpp's layout (its `convert_lora_to_gguf.py`): `general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha`, and per target `blk.N.<tensor>.weight.lora_a`
[r, in] / `.lora_b` [out, r] in F32. llama.cpp scales by alpha / r, so alpha is written as
`scale * r` (rsLoRA's alpha / sqrt(r) included); for `llama` files, B's rows get the q/k
permutation the base's rows have (permuting the rows of B A is permuting the rows of B); Phi-3's
fused `attn_qkv` / `ffn_up` get one block LoRA of their parts' adapters (`stored_adapters`).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from featherweight.io.atomic import atomic_directory, check_output_dir
from featherweight.io.gguf_writer import check_quant, gguf_architecture, to_gguf_layout
from featherweight.io.hf_writer import iter_tensors
from featherweight.io.ollama import ADAPTER_FILE, MODELFILE, modelfile_text, write_gguf_directory
from featherweight.io.peft_export import adapter_stacks, stored_adapters
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params
from featherweight.peft.lora import LoraConfig, merge_lora_weight


def export_merged_gguf(
    params: Params,
    adapters: Params | None,
    model_config: ModelConfig,
    lora_config: LoraConfig | None,
    tokenizer: Tokenizer | None,
    out: str | Path,
    quant: str = "f16",
    overwrite: bool = False,
) -> Path:
    """Write `out/model.gguf` (+ Modelfile): `params` (the frozen base, or a full fine-tune's
    weights) with `adapters` merged when `lora_config` is given."""
    check_quant(quant)
    transform = None
    if lora_config is not None:
        stacks = adapter_stacks(adapters, model_config, lora_config, "merged")
        scale = lora_config.scale

        def transform(name: str, layer: int | None, tensor: np.ndarray) -> np.ndarray:
            if layer is None or name not in stacks:
                return tensor
            pair = stacks[name]
            return merge_lora_weight(tensor, pair["a"][layer], pair["b"][layer], scale)

    check_output_dir(Path(out), overwrite)
    tensors = iter_tensors(params, model_config, transform)
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        write_gguf_directory(staging, model_config, tensors, tokenizer, quant)
    return Path(out).expanduser().resolve()


def write_adapter_gguf(
    path: Path, stacks: dict[str, dict[str, np.ndarray]], model_config: ModelConfig, scale: float
) -> Path:
    """Write the adapter stacks ({target: {"a": [L, r, in], "b": [L, out, r]}}) as llama.cpp's
    LoRA adapter GGUF at `path`. llama.cpp scales each tensor by alpha / its rank, so a fused
    tensor's block LoRA of k parts (rank k r, `stored_adapters`) has B multiplied by k."""
    writer = gguf.GGUFWriter(str(path), gguf_architecture(model_config))
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    rank = next(iter(stacks.values()))["a"].shape[-2]
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(scale * rank))
    laid_out = {
        target: {
            "a": np.asarray(pair["a"], dtype=np.float32),
            "b": np.stack(
                [
                    to_gguf_layout(model_config, (target, layer), np.asarray(pair["b"][layer]))
                    for layer in range(model_config.num_layers)
                ]
            ).astype(np.float32),
        }
        for target, pair in stacks.items()
    }
    adapters = stored_adapters(laid_out, model_config, gguf=True)
    for layer in range(model_config.num_layers):
        for name, adapter in adapters.items():
            b = adapter.b[layer] * np.float32(adapter.parts)
            writer.add_tensor(f"blk.{layer}.{name}.lora_a", np.ascontiguousarray(adapter.a[layer]))
            writer.add_tensor(f"blk.{layer}.{name}.lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def export_adapter_gguf(
    adapters: Params,
    model_config: ModelConfig,
    lora_config: LoraConfig,
    out: str | Path,
    base_model: str | Path,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `out/adapter.gguf` and a Modelfile (`FROM base_model`, `ADAPTER ./adapter.gguf`)."""
    stacks = adapter_stacks(adapters, model_config, lora_config, "peft")
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        write_adapter_gguf(staging / ADAPTER_FILE, stacks, model_config, lora_config.scale)
        modelfile = modelfile_text(tokenizer, str(Path(base_model)), f"./{ADAPTER_FILE}")
        (staging / MODELFILE).write_text(modelfile)
    return Path(out).expanduser().resolve()
