"""The decoder of every family (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, SmolLM2) as pure
functions over parameter pytrees, written once: the forward pass, the streamed step's staged
backward (`step/layer_grad.py`) and cached generation (`inference/generate.py`) all call the
stages below, which read the family's differences from the `ModelConfig`.

Parameters (shapes for L layers, hidden D, vocab V, heads H, kv heads K, head dim h, MLP width F):

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D], "q": [L, H*h, D], "k": [L, K*h, D], "v": [L, K*h, D],
                "o": [L, D, H*h], "mlp_norm": [L, D], "gate": [L, F, D], "up": [L, F, D],
                "down": [L, D, F],
                # attention_bias (Qwen2): "q_bias": [L, H*h], "k_bias": [L, K*h], "v_bias": [L, K*h]
                # qk_norm (Qwen3, Gemma 3): "q_norm": [L, h], "k_norm": [L, h]
                # sandwich_norms (Gemma):   "post_attn_norm": [L, D], "post_mlp_norm": [L, D]
                # LoRA (trainable): "lora": {target: {"a": [L, r, in], "b": [L, out, r]}}},
     "final_norm": [D],
     "lm_head": [V, D]}            # absent when the embeddings are tied

The layer is four stages: `attention_in` (norm, q/k/v, QK-norm, RoPE) -> the attention core ->
`attention_out` (o, post-norm, residual) -> `mlp_in` (norm, gate/up) -> `mlp_out` (activation,
down, post-norm, residual). Linear weights keep Hugging Face's `[out, in]` layout (so loading,
NF4 blocks and export need no transposes). A linear weight may be an `NF4Tensor`; it is
dequantized inside the stage, one layer at a time. The layers are stacked on a leading axis so
that `lax.scan` runs one compiled block; a family whose layers differ (sliding and global
attention, Gemma's two RoPE bases) reads the layer's index from `AttentionInputs.layer`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from featherweight.errors import StepConfigError
from featherweight.models import moe
from featherweight.models.attention import IMPLEMENTATIONS, attend
from featherweight.models.config import ModelConfig
from featherweight.models.fused_attention import DEFAULT_PACKED_SLOTS
from featherweight.models.linear import LoraSpec, Params, linear
from featherweight.models.rotary import apply_rotary, rotary_tables
from featherweight.parallel.memory_kinds import host_table_rows, on_host, scan_layers
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, take_rows_nf4


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("cos", "sin", "segment_ids", "local_cos", "local_sin", "layer"),
    meta_fields=("implementation", "packed_slots"),
)
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Per-batch attention context, computed once and shared by every layer.

    cos, sin: [B, S, r] rotary tables in float32 (r: the rotated dims of a head).
    segment_ids: [B, S] int or None; tokens attend only to earlier tokens of the same segment
    (packed examples never see each other).
    local_cos, local_sin: the sliding layers' own tables when their RoPE base differs (Gemma 3).
    layer: the index of the layer being run (a scalar the layer scan sets: `at_layer`), for
    families whose layers differ; None outside a scan.
    implementation: which attention runs (`featherweight.models.attention.IMPLEMENTATIONS`); a
    static field of the pytree, so it reaches every layer through scans and VJPs unchanged.
    packed_slots: the documents a row cuDNN's packed layout holds ("cudnn"; static likewise).
    """

    cos: jax.Array
    sin: jax.Array
    segment_ids: jax.Array | None
    implementation: str = "blockwise"
    packed_slots: int = DEFAULT_PACKED_SLOTS
    local_cos: jax.Array | None = None
    local_sin: jax.Array | None = None
    layer: jax.Array | None = None

    def at_layer(self, index: jax.Array) -> AttentionInputs:
        """The same context for the layer `index` (a scan's counter)."""
        return dataclasses.replace(self, layer=index)


def attention_inputs(
    config: ModelConfig,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
    implementation: str = "blockwise",
    packed_slots: int = DEFAULT_PACKED_SLOTS,
    seq_len: int | None = None,
) -> AttentionInputs:
    """Rotary tables for integer `positions` [B, S] (float32, as transformers computes them), the
    segment ids, and the attention implementation every layer calls (with cuDNN's packed slots).
    `seq_len`: the sequence the positions belong to (generation: the whole cache)."""
    if implementation not in IMPLEMENTATIONS:
        raise StepConfigError(
            f"attention implementation {implementation!r} is unknown; use one of {IMPLEMENTATIONS}"
        )
    cos, sin = rotary_tables(config, positions, seq_len=seq_len)
    local_cos = local_sin = None
    if config.local_rope_theta is not None and config.windows != "none":
        local_cos, local_sin = rotary_tables(config, positions, local=True)
    return AttentionInputs(
        cos, sin, segment_ids, implementation, packed_slots, local_cos, local_sin
    )


def is_sliding(config: ModelConfig, inputs: AttentionInputs) -> bool | jax.Array:
    """Whether the layer being run attends within the window: static when every layer is alike,
    else the layer's entry in the family's pattern (a traced bool)."""
    if config.windows != "some":
        return config.windows == "all"
    if inputs.layer is None:
        raise StepConfigError(
            "this model's layers differ (sliding and global attention): run them through a layer "
            "scan that sets AttentionInputs.layer"
        )
    return jnp.asarray(config.sliding_layers)[inputs.layer]


def layer_rotary(config: ModelConfig, inputs: AttentionInputs) -> tuple[jax.Array, jax.Array]:
    """The rotary tables of the layer being run (Gemma 3's sliding layers have their own)."""
    if inputs.local_cos is None:
        return inputs.cos, inputs.sin
    sliding = is_sliding(config, inputs)
    return (
        jnp.where(sliding, inputs.local_cos, inputs.cos),
        jnp.where(sliding, inputs.local_sin, inputs.sin),
    )


# --- building blocks -----------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm as transformers computes it: Llama's casts the normalized input back to its dtype
    before the weight; with `offset` (Gemma) the weight is applied as (offset + w) in float32."""
    with jax.named_scope("rms_norm"):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        if offset:
            return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
        return weight.astype(x.dtype) * normed.astype(x.dtype)


def norm(config: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """The family's RMSNorm of `x` with `weight` (its epsilon and weight form)."""
    return rms_norm(x, weight, config.rms_norm_eps, config.norm_offset)


def attention_in(
    layer: Params,
    x: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention's inputs from the residual stream x [B, S, D]: rotated queries [B, S, H, h]
    and keys, values [B, S, K, h] (normed first; each query and key head normed again with
    QK-norm)."""
    batch, seq, _ = x.shape
    normed = norm(config, x, layer["attn_norm"])
    q = linear(layer, "q", normed, lora, dropout_key).reshape(batch, seq, config.num_heads, -1)
    k = linear(layer, "k", normed, lora, dropout_key).reshape(batch, seq, config.num_kv_heads, -1)
    v = linear(layer, "v", normed, lora, dropout_key).reshape(batch, seq, config.num_kv_heads, -1)
    if config.qk_norm:
        q, k = norm(config, q, layer["q_norm"]), norm(config, k, layer["k_norm"])
    cos, sin = layer_rotary(config, inputs)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def attention_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal (and segment-masked) grouped-query attention by `inputs.implementation`, with the
    family's score scale and softcap (and the layer's sinks [H]), within the window on a sliding
    layer: -> [B, S, H*h].

    Where layers differ, both variants are compiled and a `lax.cond` on the layer runs one. The
    default, blockwise, never builds an S x S array (`featherweight.models.attention`).
    """
    batch, seq = q.shape[:2]

    def run(window: int | None) -> jax.Array:
        return attend(
            q, k, v, inputs.segment_ids, inputs.implementation, inputs.packed_slots,
            scale=config.attention_scale, softcap=config.attn_softcap, window=window, sinks=sinks,
        )  # fmt: skip

    with jax.named_scope("attention"):
        sliding = is_sliding(config, inputs)
        if isinstance(sliding, bool):
            out = run(config.sliding_window if sliding else None)
        else:
            out = jax.lax.cond(sliding, lambda: run(config.sliding_window), lambda: run(None))
    return out.reshape(batch, seq, -1)


def attention_out(
    layer: Params,
    x: jax.Array,
    attended: jax.Array,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """The residual stream after attention: x + o(attended) (normed first with sandwich norms)."""
    out = linear(layer, "o", attended, lora, dropout_key)
    if config.sandwich_norms:
        out = norm(config, out, layer["post_attn_norm"])
    return x + out


def mlp_in(
    layer: Params,
    a: jax.Array,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple:
    """The MLP's hidden state from the residual a [B, S, D], normed: its two input projections
    gate and up [B, S, F] -- of the routed rows, with their `moe.Routing`, in an MoE layer."""
    return mlp_in_with_router(layer, a, config, lora, dropout_key)[0]


def mlp_in_with_router(
    layer: Params,
    a: jax.Array,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[tuple, jax.Array | None]:
    """(`mlp_in`'s hidden state, the router's logits [N, E] -- None in a dense layer)."""
    return mlp_hidden(layer, norm(config, a, layer["mlp_norm"]), config, lora, dropout_key)


def mlp_hidden(
    layer: Params,
    normed: jax.Array,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[tuple, jax.Array | None]:
    """`mlp_in_with_router` of an input already normed."""
    if config.num_experts:
        return moe.experts_in(layer, normed, config, lora, dropout_key)
    with jax.named_scope("mlp"):
        gate = linear(layer, "gate", normed, lora, dropout_key)
        return (gate, linear(layer, "up", normed, lora, dropout_key)), None


def gated(config: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The MLP's hidden activation from its gate and up projections: SiLU (SwiGLU), GELU with
    the tanh approximation (Gemma's GeGLU), or gpt-oss's clamped SwiGLU."""
    if config.activation == "gelu_pytorch_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    if config.activation == "clamped_swiglu":
        limit = config.swiglu_limit
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * config.swiglu_alpha)
    return jax.nn.silu(gate) * up


def mlp_out(
    layer: Params,
    a: jax.Array,
    hidden: tuple,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """The residual stream after the MLP: a + `mlp_output` of `mlp_in`'s hidden state."""
    return a + mlp_output(layer, hidden, config, lora, dropout_key).reshape(a.shape)


def mlp_output(
    layer: Params,
    hidden: tuple,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """down(act(gate) * up) of the MLP's hidden state (each token's experts summed by their
    weights in an MoE layer: [N, D]), normed after with sandwich norms."""
    if config.num_experts:
        out = moe.experts_out(layer, hidden, config, gated, lora, dropout_key)
    else:
        gate, up = hidden
        with jax.named_scope("mlp"):
            out = linear(layer, "down", gated(config, gate, up), lora, dropout_key)
    if config.sandwich_norms:
        out = norm(config, out, layer["post_mlp_norm"])
    return out


def mlp_residual(
    layer: Params,
    a: jax.Array,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
    seq_chunk: int | None = None,
) -> jax.Array:
    """The MLP's residual block, `mlp_out(mlp_in(a))`: [B, S, D] -> [B, S, D].

    With `seq_chunk`, the normed sequence is cut into chunks run one after another, each
    rematerialized: the [B, S, F] hidden activations never exist, only [B, seq_chunk, F] (long
    context; every operation between the norm and the residual add is per position). With LoRA
    dropout each chunk draws its own mask.
    """
    return mlp_residual_with_router(layer, a, config, lora, dropout_key, seq_chunk)[0]


def mlp_residual_with_router(
    layer: Params,
    a: jax.Array,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
    seq_chunk: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(`mlp_residual`, the router's logits [N, E] in token order -- None in a dense layer)."""
    batch, seq, width = a.shape
    if seq_chunk is None or seq_chunk >= seq:
        hidden, logits = mlp_in_with_router(layer, a, config, lora, dropout_key)
        return mlp_out(layer, a, hidden, config, lora, dropout_key), logits
    if seq % seq_chunk:
        raise ValueError(f"mlp seq_chunk {seq_chunk} must divide the sequence length {seq}")
    count = seq // seq_chunk
    normed = norm(config, a, layer["mlp_norm"])
    chunks = jnp.moveaxis(normed.reshape(batch, count, seq_chunk, width), 1, 0)

    def one_chunk(args):
        index, chunk = args
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
        hidden, logits = mlp_hidden(layer, chunk, config, lora, key)
        return mlp_output(layer, hidden, config, lora, key).reshape(chunk.shape), logits

    outputs, logits = jax.lax.map(jax.checkpoint(one_chunk), (jnp.arange(count), chunks))
    if logits is not None:  # [count, B * seq_chunk, E] -> [B * S, E]
        logits = jnp.moveaxis(logits.reshape(count, batch, seq_chunk, -1), 0, 1)
        logits = logits.reshape(batch * seq, -1)
    return a + jnp.moveaxis(outputs, 0, 1).reshape(batch, seq, -1), logits


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
    """One transformer layer, its four stages in order: [B, S, D] -> [B, S, D]."""
    return block_with_router(layer, x, inputs, config, lora, dropout_key, mlp_chunk)[0]


def block_with_router(
    layer: Params,
    x: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
    mlp_chunk: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(`block`, the router's logits [B*S, E] -- None in a dense layer), as transformers' MoE
    layers return them for the load-balancing loss."""
    attn_key, mlp_key = split_dropout_key(dropout_key)
    q, k, v = attention_in(layer, x, inputs, config, lora, attn_key)
    attended = attention_core(q, k, v, inputs, config, layer.get("sinks"))
    a = attention_out(layer, x, attended, config, lora, attn_key)
    return mlp_residual_with_router(layer, a, config, lora, mlp_key, mlp_chunk)


def embedding_scale(config: ModelConfig, dtype) -> jax.Array | None:
    """The factor on the embeddings (sqrt(D) in the compute dtype, Gemma), or None."""
    return jnp.asarray(config.hidden_size**0.5, dtype) if config.embed_scale else None


def embed(params: Params, token_ids: jax.Array, config: ModelConfig) -> jax.Array:
    """Token embeddings [B, S, D] in the compute dtype (the final norm's dtype), scaled when the
    family scales them.

    An NF4 table (a quantized, tied head) is dequantized only for the looked-up rows; a table in
    host memory streams over in row chunks, each giving the rows whose ids fall in it (XLA cannot
    gather from host memory), so the device never holds the table.
    """
    table = params["embed"]
    if isinstance(table, NF4Tensor):
        rows = take_rows_nf4(table, token_ids, params["final_norm"].dtype)
    elif on_host(table):
        rows = host_table_rows(table, token_ids)
    else:
        rows = jnp.take(table, token_ids, axis=0)
    scale = embedding_scale(config, rows.dtype)
    return rows if scale is None else rows * scale


def embedding_rows_cotangent(config: ModelConfig, cotangent: jax.Array) -> jax.Array:
    """The cotangent of the looked-up table rows from that of `embed`'s output [B, S, D] (the
    embedding scale applied again): what the embedding's gradient scatters."""
    scale = embedding_scale(config, cotangent.dtype)
    return cotangent if scale is None else cotangent * scale


def lm_head_weight(params: Params) -> jax.Array:
    """The [V, D] output projection: `lm_head`, or the embedding table when tied."""
    weight = params.get("lm_head")
    if weight is None:
        weight = params["embed"]
    if isinstance(weight, NF4Tensor):
        weight = dequantize_nf4(weight, params["final_norm"].dtype)
    return weight


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit softcap), or x when there is no cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def head(params: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """Final norm and LM head: hidden [B, S, D] -> float32 logits [B, S, V] (softcapped)."""
    normed = norm(config, x, params["final_norm"])
    weight = lm_head_weight(params)
    logits = jnp.einsum("...d,vd->...v", normed, weight.astype(normed.dtype))
    return softcap(logits.astype(jnp.float32), config.final_softcap)


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
    return run_layers_with_router(layers, x, inputs, config, lora, remat, dropout_keys, mlp_chunk)[
        0
    ]


def run_layers_with_router(
    layers: Params,
    x: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    remat: bool = False,
    dropout_keys: jax.Array | None = None,
    mlp_chunk: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(`run_layers`, every layer's router logits [L, B*S, E] -- None for a dense model)."""
    layer_fn = (
        jax.checkpoint(block_with_router, static_argnums=(3, 4, 6)) if remat else block_with_router
    )

    def step(hidden, per_layer):
        layer, (key, index) = per_layer
        return layer_fn(layer, hidden, inputs.at_layer(index), config, lora, key, mlp_chunk)

    indices = jnp.arange(config.num_layers, dtype=jnp.int32)
    return scan_layers(step, x, layers, (dropout_keys, indices), config.num_layers)


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
    x = run_layers(params["layers"], embed(params, token_ids, config), inputs, config, lora)
    return head(params, x, config)


def merge_params(frozen: Params, trainable: Params) -> Params:
    """One read-only view of frozen and trainable parameters (no copies: dicts of the same arrays).

    The split stays at every function boundary that differentiates; this view is what the pure
    model functions read.
    """
    merged = {**frozen, **{k: v for k, v in trainable.items() if k != "layers"}}
    merged["layers"] = {**frozen.get("layers", {}), **trainable.get("layers", {})}
    return merged
