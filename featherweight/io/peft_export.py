"""Exports of a LoRA / QLoRA fine-tune: merged Hugging Face weights, or a PEFT adapter.

Merged: every tensor of the base is streamed out one at a time; targeted linear weights get
`scale * B A` added in float32 (an NF4 base is dequantized one layer at a time first), and the
result is cast (bf16 by default) and written in shards. PEFT: `adapter_config.json` and
`adapter_model.safetensors` under PEFT's tensor names, which `peft.PeftModel.from_pretrained`
loads. Both are atomic: the directory appears complete or not at all.

A family that stores projections fused (Phi-3's `qkv_proj`, `gate_up_proj`) has one module where
featherweight trains one adapter per part; the parts' adapters are exported as one LoRA of rank
k r on the fused module (`stored_adapters`): A their A's stacked, B block-diagonal, so B A is
each part's B A in its own rows; PEFT's `rank_pattern` / `alpha_pattern` keep the scale.

An MoE layer's experts are one 3-D parameter per projection in transformers (5): `gate_up_proj`
[E, 2F, D] (gate's rows, then up's; gpt-oss: [E, D, 2F], the two interleaved) and `down_proj`,
which PEFT adapts with `target_parameters` (its `ParamWrapper`: lora_A [E r, in], expert by
expert; lora_B [out, r E], rank-major). featherweight's per-expert adapters are written in that
form (`expert_adapters`), gate and up as one block LoRA per expert. PEFT refuses dropout on such
a parameter, so an adapter with expert targets records `lora_dropout` 0 (it only acts in
training).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from safetensors.numpy import save_file

from featherweight.errors import ExportError
from featherweight.io.atomic import atomic_directory, check_output_dir
from featherweight.io.hf_writer import DEFAULT_SHARD_BYTES, iter_hf_tensors, save_hf_checkpoint
from featherweight.io.names import stored_tensors
from featherweight.io.output_paths import resolved
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params
from featherweight.models.shapes import layer_shapes
from featherweight.peft.lora import LoraConfig, check_adapters, merge_lora_weight

PEFT_PREFIX = "base_model.model.model.layers"
MERGED_DTYPES = ("bfloat16", "float16", "float32", None)
# The merged export is the model that was trained: W + scale * B A in float32. bfloat16 keeps 8
# significant bits, so rounding the merged sum moves each weight by up to 0.4% of its size -- the
# order of a small LoRA update, part of which it undoes (a demo run answered "12 plus 30 is 32"
# from a bfloat16 export where the run itself said 42). float32 costs twice bfloat16's size;
# `--dtype bfloat16` halves the files, and a check says whether greedy outputs changed.
MERGED_DEFAULT_DTYPE = "float32"


def adapter_stacks(
    trainable: Params | None, model_config: ModelConfig, lora_config: LoraConfig, export_format: str
) -> dict[str, dict[str, np.ndarray]]:
    """The {target: {"a", "b"}} stacks of a trainable pytree, on the host, checked.

    Raises `ExportError` when there is nothing to export as LoRA: no trainable pytree, no
    adapters in it, or (for the PEFT format) trained weights other than adapters.
    """
    if not trainable:
        raise ExportError(
            f"no adapters to export (got {trainable!r}); pass the trainable pytree of a LoRA run, "
            '{"layers": {"lora": ...}}'
        )
    layers = trainable.get("layers", {})
    adapters = layers.get("lora")
    others = sorted(({*trainable} - {"layers"}) | ({*layers} - {"lora"}))
    if export_format == "peft" and others:
        raise ExportError(
            f"format 'peft' holds LoRA adapters only, but this run also trains {others} "
            "(a full fine-tune); export it with format 'merged'"
        )
    if not adapters:
        raise ExportError(
            f"this run has no LoRA adapters (trainable holds {others}); a full fine-tune "
            "exports with save_hf_checkpoint, and format 'peft' needs a LoRA run"
        )
    check_adapters(adapters, model_config, lora_config)
    return jax.device_get(adapters)


def check_merged_dtype(dtype: str | None) -> None:
    """Refuse a merged-export dtype that is not a float type (an int8 cast would ruin weights)."""
    if dtype not in MERGED_DTYPES:
        raise ExportError(
            f"merged export dtype {dtype!r} is not supported; use 'float32' (default), "
            "'bfloat16', 'float16', or None to keep the stored dtypes"
        )


def export_merged(
    frozen: Params,
    adapters: Params,
    model_config: ModelConfig,
    lora_config: LoraConfig,
    tokenizer: Tokenizer | None,
    out: str | Path,
    dtype: str | None = MERGED_DEFAULT_DTYPE,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a Hugging Face model directory with the adapters merged into the base weights.

    `frozen` may hold NF4 linear weights (QLoRA): each layer is dequantized, merged in float32 and
    cast to `dtype` on its own, so host memory holds one shard at most and the device nothing new.
    Shards hold at most `max_shard_bytes` each (with an index file when there are several).
    """
    check_merged_dtype(dtype)
    stacks = adapter_stacks(adapters, model_config, lora_config, "merged")
    check_output_dir(Path(out), overwrite)
    scale = lora_config.scale

    def merge(name: str, layer: int | None, tensor: np.ndarray) -> np.ndarray:
        if layer is None or name not in stacks:
            return tensor
        return merge_lora_weight(tensor, stacks[name]["a"][layer], stacks[name]["b"][layer], scale)

    tensors = iter_hf_tensors(frozen, model_config, transform=merge)
    return save_hf_checkpoint(
        out, model_config, tensors, tokenizer, dtype, max_shard_bytes, overwrite
    )


# transformers' fused expert parameters of each MoE family: name within the layer -> (the keys
# whose adapters it takes, along its rows; rows interleaved rather than concatenated)
EXPERT_PARAMETERS = {
    "qwen3_moe": {"mlp.experts.gate_up_proj": (("gate", "up"), False)},
    "mixtral": {"mlp.experts.gate_up_proj": (("gate", "up"), False)},
    "gpt_oss": {"mlp.experts.gate_up_proj": (("gate", "up"), True)},
}
EXPERT_MODULE = "mlp.experts"


class StoredAdapter(NamedTuple):
    """A LoRA on one tensor as a file stores it: A [L, k r, in], B [L, out, k r], from k adapters."""

    a: np.ndarray
    b: np.ndarray
    parts: int


def stored_adapters(
    stacks: dict[str, dict[str, np.ndarray]], model_config: ModelConfig, gguf: bool = False
) -> dict[str, StoredAdapter]:
    """The adapter stacks on the layer tensors a Hugging Face (or GGUF) file stores, by their name
    within a layer ("self_attn.q_proj.weight"): a fused tensor's targeted parts as one block LoRA
    (zero rows of B where a part is not targeted)."""
    shapes = layer_shapes(model_config)
    prefix = "blk.0." if gguf else "model.layers.0."
    result = {}
    for name, parts in stored_tensors(model_config, gguf):
        if not name.startswith(prefix):
            continue
        targeted = [part for part, _ in parts if part in stacks]
        if len(parts) == 1 and targeted:
            result[name[len(prefix) :]] = StoredAdapter(**stacks[targeted[0]], parts=1)
        elif targeted:
            a = np.concatenate([stacks[part]["a"] for part in targeted], axis=1)
            rank = stacks[targeted[0]]["a"].shape[1]
            rows = sum(shapes[part][0] for part, _ in parts)
            b = np.zeros((model_config.num_layers, rows, a.shape[1]), a.dtype)
            row = 0
            for part, _ in parts:
                if part in stacks:
                    column = targeted.index(part) * rank
                    b[:, row : row + shapes[part][0], column : column + rank] = stacks[part]["b"]
                row += shapes[part][0]
            result[name[len(prefix) :]] = StoredAdapter(a, b, len(targeted))
    return result


def expert_adapters(
    stacks: dict[str, dict[str, np.ndarray]], model_config: ModelConfig
) -> dict[str, StoredAdapter]:
    """The expert adapters (a [L, E, r, in], b [L, E, out, r]) on transformers' fused expert
    parameters, by name within the layer ("mlp.experts.gate_up_proj"), in PEFT's `ParamWrapper`
    layout: A [L, E k r, in], B [L, out, k r E] -- k parts as one block LoRA per expert."""
    if not model_config.num_experts:
        return {}
    layout = {
        **EXPERT_PARAMETERS[model_config.model_type],
        f"{EXPERT_MODULE}.down_proj": (("down",), False),
    }
    result = {}
    for name, (parts, interleaved) in layout.items():
        targeted = [part for part in parts if part in stacks]
        if not targeted:
            continue
        a = np.concatenate([stacks[part]["a"] for part in targeted], axis=2)  # [L, E, k r, in]
        layers, experts, ranks, _ = a.shape
        rank, rows = ranks // len(targeted), stacks[targeted[0]]["b"].shape[2]
        b = np.zeros((layers, experts, rows * len(parts), ranks), a.dtype)
        for index, part in enumerate(parts):
            if part in stacks:
                span = (
                    slice(index, None, len(parts))
                    if interleaved
                    else slice(index * rows, (index + 1) * rows)
                )
                column = targeted.index(part) * rank
                b[:, :, span, column : column + rank] = stacks[part]["b"]
        result[name] = StoredAdapter(
            a.reshape(layers, experts * ranks, -1),
            b.transpose(0, 2, 3, 1).reshape(layers, -1, ranks * experts),
            len(targeted),
        )
    return result


def peft_modules(experts: dict[str, StoredAdapter]) -> dict[str, StoredAdapter]:
    """The expert adapters by the module PEFT saves each under: one `ParamWrapper` per targeted
    parameter, nested in the order the experts module registers them (gate_up_proj innermost),
    each inner one a `base_layer` deeper."""
    names = list(experts)
    return {
        EXPERT_MODULE + ".base_layer" * (len(names) - 1 - index): experts[name]
        for index, name in enumerate(names)
    }


def peft_adapter_config(
    lora_config: LoraConfig,
    base_model_name_or_path: str | None,
    adapters: dict[str, StoredAdapter],
    experts: dict[str, StoredAdapter] | None = None,
) -> dict[str, object]:
    """The `adapter_config.json` PEFT reads for these settings (unlisted fields: its defaults):
    a block LoRA of k parts gets rank k r and the alpha that keeps alpha / r (or / sqrt r);
    `experts` (`expert_adapters`) are PEFT's `target_parameters`."""
    experts = experts or {}
    modules = {
        name.removesuffix(".weight").split(".")[-1]: adapter
        for name, adapter in {**adapters, **experts}.items()
    }
    blocks = {module: adapter.parts for module, adapter in modules.items() if adapter.parts > 1}
    growth = (lambda parts: parts**0.5) if lora_config.rslora else (lambda parts: parts)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora_config.rank,
        "lora_alpha": lora_config.alpha,
        "lora_dropout": 0.0 if experts else lora_config.dropout,
        "use_rslora": lora_config.rslora,
        "target_modules": [name.removesuffix(".weight").split(".")[-1] for name in adapters],
        "target_parameters": list(experts),
        "rank_pattern": {module: parts * lora_config.rank for module, parts in blocks.items()},
        "alpha_pattern": {
            module: growth(parts) * lora_config.alpha for module, parts in blocks.items()
        },
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
    }


def peft_tensors(adapters: dict[str, StoredAdapter]) -> dict[str, np.ndarray]:
    """Adapters under PEFT's names: `...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in]."""
    tensors = {}
    for name, adapter in adapters.items():
        for layer in range(adapter.a.shape[0]):
            prefix = f"{PEFT_PREFIX}.{layer}.{name.removesuffix('.weight')}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(adapter.a[layer])
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(adapter.b[layer])
    return tensors


def _experts_of(model_config: ModelConfig) -> tuple[str, ...]:
    """The targets that are expert stacks in this model (none in a dense one)."""
    return ("gate", "up", "down") if model_config.num_experts else ()


BASE_DIR = "base"  # a GGUF base, written as an HF directory inside the adapter's export
BNB_CONFIG = (
    "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
    "bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)"
)


def adapter_readme(base: str | None, quantized_base: bool) -> str:
    """How to load the adapter: peft over its recorded base (and, for QLoRA, the NF4 base)."""
    lines = [
        "# LoRA adapter (exported by featherweight)",
        "",
        "```python",
        "import torch",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"base = AutoModelForCausalLM.from_pretrained({base!r})",
        "model = PeftModel.from_pretrained(base, 'PATH/TO/THIS/DIRECTORY')",
        "```",
        "",
        f"`adapter_config.json` names the base model: `{base}`.",
    ]
    if quantized_base:
        lines += [
            "",
            "## QLoRA: the base was NF4 during training",
            "",
            "These adapters were trained on the base quantized to NF4 with double quantization",
            "(bit-compatible with bitsandbytes). To reproduce training's outputs exactly, load the",
            "base quantized the same way (needs bitsandbytes):",
            "",
            "```python",
            "from transformers import BitsAndBytesConfig",
            f"base = AutoModelForCausalLM.from_pretrained({base!r},",
            f"    quantization_config={BNB_CONFIG})",
            "```",
            "",
            "On a full-precision base the adapters work too; outputs differ slightly from training.",
        ]
    return "\n".join(lines) + "\n"


def export_peft(
    adapters: Params,
    model_config: ModelConfig,
    lora_config: LoraConfig,
    out: str | Path,
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
    write_base: Callable[[Path], Path] | None = None,
    quantized_base: bool = False,
) -> Path:
    """Write a PEFT LoRA adapter directory, loadable with `PeftModel.from_pretrained(base, out)`,
    with a README saying how to load it (and, with `quantized_base`, how to load the NF4 base).

    The adapters keep their dtype; `base_model_name_or_path` is recorded for PEFT's loaders.
    `write_base(directory)`, when given, writes the base as an HF directory into `out/base`
    (for a base transformers cannot load, a GGUF file), which is then the recorded base.
    """
    stacks = adapter_stacks(adapters, model_config, lora_config, "peft")
    final = resolved(out)
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        if write_base is not None:
            write_base(staging / BASE_DIR)
            base_model_name_or_path = str(final / BASE_DIR)
        experts = expert_adapters(stacks, model_config)
        dense = {
            target: stack
            for target, stack in stacks.items()
            if target not in _experts_of(model_config)
        }
        adapters_on_disk = stored_adapters(dense, model_config)
        config = peft_adapter_config(
            lora_config, base_model_name_or_path, adapters_on_disk, experts
        )
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
        save_file(
            peft_tensors({**adapters_on_disk, **peft_modules(experts)}),
            str(staging / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        readme = adapter_readme(base_model_name_or_path, quantized_base)
        (staging / "README.md").write_text(readme)
    return final
