"""Tensor names: featherweight's keys and their Hugging Face and GGUF spellings (Llama's below,
a family's own from its `Family`), the parts of tensors a family stores fused, and the check that
a checkpoint holds exactly the tensors its config implies (run on headers, before any read)."""

from __future__ import annotations

import re

from featherweight.errors import MissingTensorError, TensorShapeError, UnexpectedTensorError
from featherweight.models.config import ModelConfig
from featherweight.models.families import family_of
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
# A multimodal checkpoint's other towers (Gemma 3's vision tower and projector).
HF_OTHER_TOWERS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
# Where a multimodal checkpoint keeps its language model (transformers 5, then 4).
_HF_LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."))
_HF_LANGUAGE_HEAD = "language_model.lm_head.weight"

_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_layer_names(config: ModelConfig) -> dict[str, str]:
    """The Hugging Face spelling of each layer tensor key of `config`'s family."""
    return {**HF_LAYER, **family_of(config.model_type).hf_layer_names}


def gguf_layer_names(config: ModelConfig) -> dict[str, str]:
    """The GGUF spelling of each layer tensor key of `config`'s family."""
    return {**GGUF_LAYER, **family_of(config.model_type).gguf_layer_names}


def hf_name(key: TensorKey, config: ModelConfig) -> str:
    """The Hugging Face name of a tensor key (a fused tensor's part is named by its own key)."""
    name, layer = key
    return HF_TOP[name] if layer is None else f"model.layers.{layer}.{hf_layer_names(config)[name]}"


def gguf_name(key: TensorKey, config: ModelConfig) -> str:
    """The GGUF name of a tensor key."""
    name, layer = key
    return GGUF_TOP[name] if layer is None else f"blk.{layer}.{gguf_layer_names(config)[name]}"


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


def language_model_name(name: str) -> str:
    """A multimodal checkpoint's language-model tensor name as a causal LM spells it."""
    for prefix, plain in _HF_LANGUAGE_PREFIXES:
        if name.startswith(prefix):
            return plain + name[len(prefix) :]
    return "lm_head.weight" if name == _HF_LANGUAGE_HEAD else name


def hf_layer_part(name: str) -> tuple[int, str] | None:
    """(layer index, name within the layer) of a Hugging Face layer tensor, or None."""
    match = _HF_LAYER_RE.match(language_model_name(name))
    return None if match is None else (int(match.group(1)), match.group(2))


def hf_expert_part(name: str, config: ModelConfig) -> tuple[TensorKey, int] | None:
    """(key, expert index) of one expert's tensor of an MoE layer (a family name with "{e}"),
    or None for any other name."""
    match = _HF_LAYER_RE.match(language_model_name(name))
    if not match:
        return None
    for key, spelled in hf_layer_names(config).items():
        if "{e}" not in spelled:
            continue
        head, tail = spelled.split("{e}")
        within = match.group(2)
        if within.startswith(head) and within.endswith(tail):
            index = within[len(head) : len(within) - len(tail)]
            if index.isdigit():
                return (key, int(match.group(1))), int(index)
    return None


def hf_expert_names(config: ModelConfig) -> dict[str, str]:
    """The layer keys stored one tensor per expert, with their name templates ("{e}")."""
    return {key: spelled for key, spelled in hf_layer_names(config).items() if "{e}" in spelled}


def parse_hf_name(name: str, config: ModelConfig) -> TensorKey | None:
    """The key of a Hugging Face tensor name, or None if featherweight has no such tensor."""
    return _parse(language_model_name(name), HF_TOP, hf_layer_names(config), _HF_LAYER_RE)


def parse_gguf_name(name: str, config: ModelConfig) -> TensorKey | None:
    """The key of a GGUF tensor name, or None if featherweight has no such tensor."""
    return _parse(name, GGUF_TOP, gguf_layer_names(config), _GGUF_LAYER_RE)


FusedParts = list[tuple[TensorKey, int, int]]


def _fused_parts(name: str, fused: dict, pattern, config: ModelConfig) -> FusedParts | None:
    """[(key, first row, end row)] of a tensor its family stores fused (Phi-3's `qkv_proj`),
    or None for any other name."""
    match = pattern.match(name)
    if not match or match.group(2) not in fused:
        return None
    shapes, layer, parts, row = layer_shapes(config), int(match.group(1)), [], 0
    for part in fused[match.group(2)]:
        parts.append(((part, layer), row, row + shapes[part][0]))
        row += shapes[part][0]
    return parts


def hf_fused_parts(name: str, config: ModelConfig) -> FusedParts | None:
    """The parts of a fused Hugging Face tensor (`_fused_parts`)."""
    fused = family_of(config.model_type).hf_fused
    return _fused_parts(language_model_name(name), fused, _HF_LAYER_RE, config)


def gguf_fused_parts(name: str, config: ModelConfig) -> FusedParts | None:
    """The parts of a fused GGUF tensor (`_fused_parts`)."""
    return _fused_parts(name, family_of(config.model_type).gguf_fused, _GGUF_LAYER_RE, config)


StoredTensor = tuple[str, tuple[TensorKey, ...]]


def stored_tensors(config: ModelConfig, gguf: bool = False) -> list[StoredTensor]:
    """Every tensor as a file stores it, Hugging Face's (or with `gguf`, llama.cpp's): (name, the
    keys concatenated along its rows: one, or a fused tensor's parts), in `expected_shapes` order
    with a fused tensor where its last part comes -- the order a writer streaming keyed tensors
    can write them in."""
    family = family_of(config.model_type)
    fused = dict(family.gguf_fused if gguf else family.hf_fused)
    if not gguf:  # a composed tensor (gpt-oss's interleaved experts) stands where a fused one would
        fused.update({stored: parts for stored, (parts, _) in family.hf_composed.items()})
    spell = gguf_name if gguf else hf_name
    group_of = {part: spelled for spelled, parts in fused.items() for part in parts}
    stored: list[StoredTensor] = []
    for name, layer in expected_shapes(config):
        if layer is None or name not in group_of:
            stored.append((spell((name, layer), config), ((name, layer),)))
            continue
        parts = fused[group_of[name]]
        if name == parts[-1]:
            prefix = "blk" if gguf else "model.layers"
            joined = tuple((part, layer) for part in parts)
            stored.append((f"{prefix}.{layer}.{group_of[name]}", joined))
    return stored


def composition(config: ModelConfig, stored_name: str):
    """The numpy function that makes the Hugging Face tensor `stored_name` from its keys'
    tensors (`Family.hf_composed`), or None: the parts are concatenated along their rows."""
    layer_part = hf_layer_part(stored_name)
    composed = family_of(config.model_type).hf_composed
    if layer_part is None or layer_part[1] not in composed:
        return None
    return composed[layer_part[1]][1]


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
            f"{source} holds tensor {spell(extra[0], config)!r} that this config does not expect "
            f"({len(extra)} such tensor(s)); check num_hidden_layers / attention_bias / model_type / "
            "tie_word_embeddings in the config"
        )
    missing = [key for key in expected if key not in found]
    if missing:
        raise MissingTensorError(
            f"{source} lacks tensor {spell(missing[0], config)!r} ({len(missing)} missing in all); "
            "the checkpoint is incomplete or belongs to another config"
        )
    for key, shape in expected.items():
        if tuple(found[key]) != shape:
            raise TensorShapeError(
                f"{source}: tensor {spell(key, config)!r} has shape {tuple(found[key])}, expected {shape} "
                "from the config; the checkpoint and config.json do not match"
            )
