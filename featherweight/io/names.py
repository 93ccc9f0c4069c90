"""Tensor names: featherweight's keys and their Hugging Face and GGUF spellings, and the check
that a checkpoint holds exactly the tensors its config implies (run on headers, before any read)."""

from __future__ import annotations

import re

from featherweight.errors import MissingTensorError, TensorShapeError, UnexpectedTensorError
from featherweight.models.config import ModelConfig
from featherweight.models.shapes import layer_shapes, top_level_shapes

# A tensor key: (name, layer index) for layer tensors, (name, None) for the others.
TensorKey = tuple[str, int | None]

HF_TOP = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
HF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
GGUF_TOP = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}
GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "o": "attn_output.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "mlp_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "down": "ffn_down.weight",
}

# Buffers some checkpoints carry that hold nothing featherweight needs.
HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")

_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(key: TensorKey) -> str:
    """The Hugging Face name of a tensor key."""
    name, layer = key
    return HF_TOP[name] if layer is None else f"model.layers.{layer}.{HF_LAYER[name]}"


def gguf_name(key: TensorKey) -> str:
    """The GGUF name of a tensor key."""
    name, layer = key
    return GGUF_TOP[name] if layer is None else f"blk.{layer}.{GGUF_LAYER[name]}"


def _parse(
    name: str, top: dict[str, str], layer_names: dict[str, str], pattern
) -> TensorKey | None:
    for key, spelled in top.items():
        if name == spelled:
            return key, None
    match = pattern.match(name)
    if match:
        for key, spelled in layer_names.items():
            if match.group(2) == spelled:
                return key, int(match.group(1))
    return None


def parse_hf_name(name: str) -> TensorKey | None:
    """The key of a Hugging Face tensor name, or None if featherweight has no such tensor."""
    return _parse(name, HF_TOP, HF_LAYER, _HF_LAYER_RE)


def parse_gguf_name(name: str) -> TensorKey | None:
    """The key of a GGUF tensor name, or None if featherweight has no such tensor."""
    return _parse(name, GGUF_TOP, GGUF_LAYER, _GGUF_LAYER_RE)


def expected_shapes(config: ModelConfig) -> dict[TensorKey, tuple[int, ...]]:
    """Every tensor the config implies, by key."""
    shapes: dict[TensorKey, tuple[int, ...]] = {
        (name, None): shape for name, shape in top_level_shapes(config).items()
    }
    for layer in range(config.num_layers):
        for name, shape in layer_shapes(config).items():
            shapes[(name, layer)] = shape
    return shapes


def validate_tensors(
    config: ModelConfig,
    found: dict[TensorKey, tuple[int, ...]],
    unknown_names: list[str],
    source: str,
    spell=hf_name,
) -> None:
    """Raise a typed error naming the first missing, unexpected or misshapen tensor."""
    expected = expected_shapes(config)
    if unknown_names:
        raise UnexpectedTensorError(
            f"{source} holds tensor {unknown_names[0]!r} that a {config.model_type} model with this "
            f"config does not have ({len(unknown_names)} such tensor(s)); is config.json for "
            "this checkpoint?"
        )
    extra = [key for key in found if key not in expected]
    if extra:
        raise UnexpectedTensorError(
            f"{source} holds tensor {spell(extra[0])!r} that this config does not expect "
            f"({len(extra)} such tensor(s)); check num_hidden_layers / attention_bias / "
            "tie_word_embeddings in the config"
        )
    missing = [key for key in expected if key not in found]
    if missing:
        raise MissingTensorError(
            f"{source} lacks tensor {spell(missing[0])!r} ({len(missing)} missing in all); "
            "the checkpoint is incomplete or belongs to another config"
        )
    for key, shape in expected.items():
        if tuple(found[key]) != shape:
            raise TensorShapeError(
                f"{source}: tensor {spell(key)!r} has shape {tuple(found[key])}, expected {shape} "
                "from the config; the checkpoint and config.json do not match"
            )
