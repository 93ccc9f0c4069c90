"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) as pure functions over parameter pytrees.

Parameters (shapes for L layers, hidden D, vocab V, heads H, kv heads K, head dim h, MLP width F):

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D], "q": [L, H*h, D], "k": [L, K*h, D], "v": [L, K*h, D],
                "o": [L, D, H*h], "mlp_norm": [L, D], "gate": [L, F, D], "up": [L, F, D],
                "down": [L, D, F],
                # Qwen2 only:       "q_bias": [L, H*h], "k_bias": [L, K*h], "v_bias": [L, K*h]
                # LoRA (trainable): "lora": {target: {"a": [L, r, in], "b": [L, out, r]}}},
     "final_norm": [D],
     "lm_head": [V, D]}            # absent when the embeddings are tied

Linear weights keep Hugging Face's `[out, in]` layout (so loading, NF4 blocks and export need no
transposes). A linear weight may be an `NF4Tensor`; it is dequantized inside the block, one layer at
a time. The layers are stacked on a leading axis so that `lax.scan` runs one compiled block.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import StepConfigError
from featherweight.models.attention import IMPLEMENTATIONS, attend
from featherweight.models.config import ModelConfig
from featherweight.models.fused_attention import DEFAULT_PACKED_SLOTS
from featherweight.parallel.memory_kinds import host_table_rows, on_host, scan_layers
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, take_rows_nf4

Params = dict[str, Any]

LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


class LoraSpec(NamedTuple):
    """Static LoRA settings the block needs: the scale applied to `B @ A` and the dropout rate."""

    scale: float
    dropout: float = 0.0


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("cos", "sin", "segment_ids"),
    meta_fields=("implementation", "packed_slots"),
)
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Per-batch attention context, computed once and shared by every layer.

    cos, sin: [B, S, h] rotary tables in float32. segment_ids: [B, S] int or None; tokens attend
    only to earlier tokens of the same segment (packed examples never see each other).
    implementation: which attention runs (`featherweight.models.attention.IMPLEMENTATIONS`); a
    static field of the pytree, so it reaches every layer through scans and VJPs unchanged.
    packed_slots: the documents a row cuDNN's packed layout holds ("cudnn"; static likewise).
    """

    cos: jax.Array
    sin: jax.Array
    segment_ids: jax.Array | None
    implementation: str = "blockwise"
    packed_slots: int = DEFAULT_PACKED_SLOTS


# --- rotary position embeddings ----------------------------------------------------------------


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [h/2] with `rope_theta`, and Llama 3's scaling when configured."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.int64).astype(np.float32)
    inv_freq = 1.0 / (config.rope_theta ** (exponents / config.head_dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def attention_inputs(
    config: ModelConfig,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
    implementation: str = "blockwise",
    packed_slots: int = DEFAULT_PACKED_SLOTS,
) -> AttentionInputs:
    """Rotary tables for integer `positions` [B, S] (float32, as transformers computes them), the
    segment ids, and the attention implementation every layer calls (with cuDNN's packed slots)."""
    if implementation not in IMPLEMENTATIONS:
        raise StepConfigError(
            f"attention implementation {implementation!r} is unknown; use one of {IMPLEMENTATIONS}"
        )
    inv_freq = jnp.asarray(rope_inverse_frequencies(config))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, h/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, S, h]
    return AttentionInputs(
        jnp.cos(angles), jnp.sin(angles), segment_ids, implementation, packed_slots
    )


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate [B, S, N, h] by the tables [B, S, h] (the `rotate_half` convention of HF)."""
    with jax.named_scope("rotary"):
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        cos = cos[:, :, None, :].astype(x.dtype)
        sin = sin[:, :, None, :].astype(x.dtype)
        return x * cos + rotated * sin


# --- building blocks -----------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to the input dtype before the weight (as transformers)."""
    with jax.named_scope("rms_norm"):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return weight.astype(x.dtype) * normed.astype(x.dtype)


def linear(
    layer: Params,
    name: str,
    x: jax.Array,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """`x @ W.T (+ bias) (+ scale * B A dropout(x))` for the weight `layer[name]` in [out, in].

    An NF4 weight is dequantized here, in the compute dtype, so only this layer's copy exists.
    """
    weight = layer[name]
    if isinstance(weight, NF4Tensor):
        weight = dequantize_nf4(weight, x.dtype)
    y = jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))
    bias = layer.get(f"{name}_bias")
    if bias is not None:
        y = y + bias.astype(y.dtype)
    adapter = layer.get("lora", {}).get(name)
    if adapter is not None and lora is not None:
        with jax.named_scope("lora"):
            y = y + _lora_update(x, adapter, lora, name, dropout_key)
    return y


def _lora_update(
    x: jax.Array, adapter: Params, lora: LoraSpec, name: str, dropout_key: jax.Array | None
) -> jax.Array:
    """`scale * B A dropout(x)` of the adapter on the linear `name`: [..., in] -> [..., out]."""
    x_in = x
    if lora.dropout > 0.0 and dropout_key is not None:
        keep = jax.random.bernoulli(
            jax.random.fold_in(dropout_key, LINEAR_NAMES.index(name)),
            1.0 - lora.dropout,
            x.shape,
        )
        x_in = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(x.dtype)
    down = jnp.einsum("...i,ri->...r", x_in, adapter["a"].astype(x.dtype))
    return lora.scale * jnp.einsum("...r,or->...o", down, adapter["b"].astype(x.dtype))


def attention_qkv(
    layer: Params,
    normed: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries [B, S, H, h] and keys, values [B, S, K, h] of the normed input."""
    batch, seq, _ = normed.shape
    q = linear(layer, "q", normed, lora, dropout_key).reshape(batch, seq, config.num_heads, -1)
    k = linear(layer, "k", normed, lora, dropout_key).reshape(batch, seq, config.num_kv_heads, -1)
    v = linear(layer, "v", normed, lora, dropout_key).reshape(batch, seq, config.num_kv_heads, -1)
    return apply_rotary(q, inputs.cos, inputs.sin), apply_rotary(k, inputs.cos, inputs.sin), v


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, inputs: AttentionInputs) -> jax.Array:
    """Causal (and segment-masked) grouped-query attention by `inputs.implementation`: -> [B, S, H*h].

    The default, blockwise, never builds an S x S array (`featherweight.models.attention`).
    """
    batch, seq = q.shape[:2]
    with jax.named_scope("attention"):
        out = attend(q, k, v, inputs.segment_ids, inputs.implementation, inputs.packed_slots)
    return out.reshape(batch, seq, -1)


def self_attention(
    layer: Params,
    normed: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query causal self-attention over the whole sequence: [B, S, D] -> [B, S, D]."""
    q, k, v = attention_qkv(layer, normed, inputs, config, lora, dropout_key)
    return linear(layer, "o", attention_core(q, k, v, inputs), lora, dropout_key)


def mlp_gate_up(
    layer: Params,
    normed: jax.Array,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The two input projections of the MLP: gate and up, [B, S, F] each."""
    with jax.named_scope("mlp"):
        gate = linear(layer, "gate", normed, lora, dropout_key)
        return gate, linear(layer, "up", normed, lora, dropout_key)


def mlp_down(
    layer: Params,
    gate: jax.Array,
    up: jax.Array,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """SwiGLU output: down(silu(gate) * up)."""
    with jax.named_scope("mlp"):
        return linear(layer, "down", jax.nn.silu(gate) * up, lora, dropout_key)


def mlp(
    layer: Params,
    normed: jax.Array,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
    seq_chunk: int | None = None,
) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)).

    With `seq_chunk`, the sequence is cut into chunks run one after another, each rematerialized:
    the [B, S, F] hidden activations never exist, only [B, seq_chunk, F] (long context). With LoRA
    dropout each chunk draws its own mask.
    """
    batch, seq, width = normed.shape
    if seq_chunk is None or seq_chunk >= seq:
        gate, up = mlp_gate_up(layer, normed, lora, dropout_key)
        return mlp_down(layer, gate, up, lora, dropout_key)
    if seq % seq_chunk:
        raise ValueError(f"mlp seq_chunk {seq_chunk} must divide the sequence length {seq}")
    count = seq // seq_chunk
    chunks = jnp.moveaxis(normed.reshape(batch, count, seq_chunk, width), 1, 0)

    def one_chunk(args):
        index, chunk = args
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
        return mlp(layer, chunk, lora, key)

    outputs = jax.lax.map(jax.checkpoint(one_chunk), (jnp.arange(count), chunks))
    return jnp.moveaxis(outputs, 0, 1).reshape(batch, seq, -1)


def split_dropout_key(dropout_key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """The attention and MLP dropout keys of one layer (None without dropout)."""
    if dropout_key is None:
        return None, None
    attn_key, mlp_key = jax.random.split(dropout_key)
    return attn_key, mlp_key


def block(
    layer: Params,
    x: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
    mlp_chunk: int | None = None,
) -> jax.Array:
    """One transformer layer (pre-norm attention and MLP, each with a residual): [B,S,D]->[B,S,D]."""
    attn_key, mlp_key = split_dropout_key(dropout_key)
    x = x + self_attention(
        layer, rms_norm(x, layer["attn_norm"], config.rms_norm_eps), inputs, config, lora, attn_key
    )
    normed = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    return x + mlp(layer, normed, lora, mlp_key, mlp_chunk)


def embed(params: Params, token_ids: jax.Array) -> jax.Array:
    """Token embeddings [B, S, D] in the compute dtype (the final norm's dtype).

    An NF4 table (a quantized, tied head) is dequantized only for the looked-up rows; a table in
    host memory streams over in row chunks, each giving the rows whose ids fall in it (XLA cannot
    gather from host memory), so the device never holds the table.
    """
    table = params["embed"]
    if isinstance(table, NF4Tensor):
        return take_rows_nf4(table, token_ids, params["final_norm"].dtype)
    if on_host(table):
        return host_table_rows(table, token_ids)
    return jnp.take(table, token_ids, axis=0)


def lm_head_weight(params: Params) -> jax.Array:
    """The [V, D] output projection: `lm_head`, or the embedding table when tied."""
    weight = params.get("lm_head")
    if weight is None:
        weight = params["embed"]
    if isinstance(weight, NF4Tensor):
        weight = dequantize_nf4(weight, params["final_norm"].dtype)
    return weight


def head(params: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """Final norm and LM head: hidden [B, S, D] -> float32 logits [B, S, V]."""
    normed = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    weight = lm_head_weight(params)
    return jnp.einsum("...d,vd->...v", normed, weight.astype(normed.dtype)).astype(jnp.float32)


def run_layers(
    layers: Params,
    x: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    remat: bool = False,
    dropout_keys: jax.Array | None = None,
    mlp_chunk: int | None = None,
) -> jax.Array:
    """Scan `block` over the stacked layers; `dropout_keys` [L, ...] gives each layer its key.
    Stacks in pinned host memory (`memory.base: host`) come to the device one layer ahead."""
    layer_fn = jax.checkpoint(block, static_argnums=(3, 4, 6)) if remat else block

    def step(hidden, per_layer):
        layer, key = per_layer
        return layer_fn(layer, hidden, inputs, config, lora, key, mlp_chunk), None

    x, _ = scan_layers(step, x, layers, dropout_keys, config.num_layers)
    return x


def forward(
    params: Params,
    token_ids: jax.Array,
    config: ModelConfig,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    lora: LoraSpec | None = None,
    attention: str = "blockwise",
) -> jax.Array:
    """Whole model: token ids [B, S] -> float32 logits [B, S, V], with the `attention`
    implementation."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1]), token_ids.shape)
    inputs = attention_inputs(config, positions, segment_ids, attention)
    x = run_layers(params["layers"], embed(params, token_ids), inputs, config, lora)
    return head(params, x, config)


def merge_params(frozen: Params, trainable: Params) -> Params:
    """One read-only view of frozen and trainable parameters (no copies: dicts of the same arrays).

    The split stays at every function boundary that differentiates; this view is what the pure
    model functions read.
    """
    merged = {**frozen, **{k: v for k, v in trainable.items() if k != "layers"}}
    merged["layers"] = {**frozen.get("layers", {}), **trainable.get("layers", {})}
    return merged
