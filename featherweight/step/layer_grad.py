"""One transformer layer's forward (keeping chosen intermediates) and its VJP, as the streamed
step's backward loop calls it: frozen weights are closed over, only the trainable slice and the
input are differentiated.

With nothing saved the VJP is `jax.vjp(block)`: the block's forward is recomputed once (remat).
With saved intermediates ("qkv", "attention", "mlp_hidden") the layer is split into stages and the
VJPs are chained; a saved stage output is taken from the forward pass, so XLA drops the matmuls
that made it (their backward needs only their inputs). "attention" keeps the attention's output
(the o projection's input) and the attention residual (the MLP's input), so that with all three
kept no projection of the layer runs forward again in the backward pass; the attention core's
own forward (the score products, for its log-sum-exp) and the LoRA adapters' first matmuls
(rank-wide, for the adapters' gradients) still run again.

"dequantized" (QLoRA) keeps the layer's NF4 linear weights dense: the forward dequantizes them
once, up front, into the compute dtype (the values `linear` would make, bit for bit), runs the
layer on them and returns them among the saved intermediates; the backward puts them in place
of the NF4 tensors, so `linear` reads dense weights and nothing is dequantized again. It
combines with the activation classes: they decide which matmuls run again, it decides what
those matmuls read. (Compiled, XLA dequantizes once more to write the kept stack, and the
backward loop copies each layer's weights out of it: `memory/step_cost.py` prices both.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from featherweight.models.config import ModelConfig
from featherweight.models.llama import (
    AttentionInputs,
    LoraSpec,
    Params,
    attention_core,
    attention_in,
    attention_out,
    block_with_router,
    mlp_in_with_router,
    mlp_out,
    mlp_residual_with_router,
    split_dropout_key,
)
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4
from featherweight.step.policy import DEQUANTIZED


def merge_layer(frozen_layer: Params, trainable_layer: Params) -> Params:
    """One layer's read-only view of its frozen and trainable tensors."""
    return {**frozen_layer, **trainable_layer}


class _Stages:
    """The layer's stages (`models/llama.py`: `block` runs the same ones in order) as functions
    of the trainable slice, the frozen slice closed over: qkv -> attention residual -> gate/up
    -> MLP residual."""

    def __init__(self, frozen_layer, inputs, config, lora, dropout_key, mlp_chunk=None):
        self.frozen_layer = frozen_layer
        self.inputs = inputs
        self.config = config
        self.lora = lora
        self.mlp_chunk = mlp_chunk
        self.attn_key, self.mlp_key = split_dropout_key(dropout_key)

    def layer(self, trainable):
        return merge_layer(self.frozen_layer, trainable)

    def qkv(self, trainable, x):
        return attention_in(
            self.layer(trainable), x, self.inputs, self.config, self.lora, self.attn_key
        )

    def attention_residual(self, trainable, x, qkv):
        return self.attention_output(trainable, x, self.attention(trainable, qkv))

    def attention(self, trainable, qkv):
        sinks = self.layer(trainable).get("sinks")
        return attention_core(*qkv, self.inputs, self.config, sinks)

    def attention_output(self, trainable, x, attended):
        return attention_out(
            self.layer(trainable), x, attended, self.config, self.lora, self.attn_key
        )

    def gate_up(self, trainable, a):
        """(the MLP's hidden state, the router's logits or None)."""
        return mlp_in_with_router(self.layer(trainable), a, self.config, self.lora, self.mlp_key)

    def mlp_residual(self, trainable, a, gate_up):
        return mlp_out(self.layer(trainable), a, gate_up, self.config, self.lora, self.mlp_key)

    def mlp_block(self, trainable, a):
        """(the whole MLP residual from its input (sequence-chunked when `mlp_chunk` is set), the
        router's logits or None)."""
        return mlp_residual_with_router(
            self.layer(trainable), a, self.config, self.lora, self.mlp_key, self.mlp_chunk
        )


def dequantized_weights(frozen_layer: Params, dtype: Any) -> Params:
    """{name: dense weight in `dtype`} of the layer's NF4 tensors: the copies `linear` would
    dequantize for its matmuls, made once so the backward pass can read them."""
    return {
        name: dequantize_nf4(weight, dtype)
        for name, weight in frozen_layer.items()
        if isinstance(weight, NF4Tensor)
    }


def layer_forward(
    frozen_layer: Params,
    trainable_layer: Params,
    x: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None,
    dropout_key: jax.Array | None,
    save: tuple[str, ...],
    mlp_chunk: int | None = None,
) -> tuple[jax.Array, dict[str, Any], jax.Array | None]:
    """The layer's output, the intermediates named in `save`, and the router's logits [N, E]
    (None in a dense layer: what the load-balancing loss reads)."""
    if DEQUANTIZED in save:
        dense = dequantized_weights(frozen_layer, x.dtype)
        rest = tuple(name for name in save if name != DEQUANTIZED)
        y, saved, logits = layer_forward(
            {**frozen_layer, **dense}, trainable_layer, x, inputs, config, lora, dropout_key,
            rest, mlp_chunk,
        )  # fmt: skip
        return y, {**saved, DEQUANTIZED: dense}, logits
    if not save:
        layer = merge_layer(frozen_layer, trainable_layer)
        y, logits = block_with_router(layer, x, inputs, config, lora, dropout_key, mlp_chunk)
        return y, {}, logits
    stages = _Stages(frozen_layer, inputs, config, lora, dropout_key, mlp_chunk)
    qkv = stages.qkv(trainable_layer, x)
    attended = stages.attention(trainable_layer, qkv)
    a = stages.attention_output(trainable_layer, x, attended)
    saved = {"qkv": qkv} if "qkv" in save else {}
    if "attention" in save:
        saved["attention"] = (attended, a)
    if "mlp_hidden" not in save:
        y, logits = stages.mlp_block(trainable_layer, a)
        return y, saved, logits
    gate_up, logits = stages.gate_up(trainable_layer, a)
    y = stages.mlp_residual(trainable_layer, a, gate_up)
    return y, {**saved, "mlp_hidden": gate_up}, logits


def _add_trees(*trees):
    return jax.tree.map(lambda *leaves: sum(leaves[1:], leaves[0]), *trees)


def _vjp_with_router(fn, router_term, *primals) -> Callable:
    """The VJP of `fn(*primals) -> (output, router logits)` as a function of the output's
    cotangent; with `router_term` (a scalar of the logits), that term's gradient is added (its
    cotangent 1): the load-balancing loss's share of this layer."""
    if router_term is None:
        _, vjp = jax.vjp(lambda *args: fn(*args)[0], *primals)
        return vjp

    def with_term(*args):
        output, logits = fn(*args)
        return output, router_term(logits)

    _, vjp = jax.vjp(with_term, *primals)
    return lambda cotangent: vjp((cotangent, jnp.ones((), jnp.float32)))


def layer_vjp(
    frozen_layer: Params,
    trainable_layer: Params,
    x: jax.Array,
    saved: dict[str, Any],
    output_cotangent: jax.Array,
    inputs: AttentionInputs,
    config: ModelConfig,
    lora: LoraSpec | None,
    dropout_key: jax.Array | None,
    mlp_chunk: int | None = None,
    router_term: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[Params, jax.Array]:
    """(gradient of the trainable slice, cotangent of the layer input). `router_term` (a float32
    scalar of the layer's router logits [N, E]; None: no such term) adds the gradient of a loss
    on the routing: the load-balancing loss's (`step/router_loss.py`)."""
    if DEQUANTIZED in saved:  # the dense weights kept from the forward pass replace the NF4 ones
        saved = dict(saved)
        frozen_layer = {**frozen_layer, **saved.pop(DEQUANTIZED)}
    if not saved:

        def layer_fn(trainable, hidden):
            layer = merge_layer(frozen_layer, trainable)
            return block_with_router(layer, hidden, inputs, config, lora, dropout_key, mlp_chunk)

        return _vjp_with_router(layer_fn, router_term, trainable_layer, x)(output_cotangent)
    stages = _Stages(frozen_layer, inputs, config, lora, dropout_key, mlp_chunk)
    recomputed_qkv, vjp_qkv = jax.vjp(stages.qkv, trainable_layer, x)
    qkv = saved.get("qkv", recomputed_qkv)  # a kept qkv: XLA drops the projections' forward
    a = (
        saved["attention"][1]
        if "attention" in saved
        else stages.attention_residual(trainable_layer, x, qkv)
    )
    if "mlp_hidden" in saved:
        _, vjp_mlp = jax.vjp(stages.mlp_residual, trainable_layer, a, saved["mlp_hidden"])
        grad_mlp, g_a, g_gate_up = vjp_mlp(output_cotangent)
        vjp_gate_up = _vjp_with_router(stages.gate_up, router_term, trainable_layer, a)
        grad_gate_up, g_a_norm = vjp_gate_up(g_gate_up)
        grad_mlp, g_a = _add_trees(grad_mlp, grad_gate_up), g_a + g_a_norm
    else:
        vjp_mlp = _vjp_with_router(stages.mlp_block, router_term, trainable_layer, a)
        grad_mlp, g_a = vjp_mlp(output_cotangent)
    grad_attention, g_x, g_qkv = _attention_vjp(stages, trainable_layer, x, qkv, saved, g_a)
    grad_qkv, g_x_norm = vjp_qkv(g_qkv)
    return _add_trees(grad_mlp, grad_attention, grad_qkv), g_x + g_x_norm


def _attention_vjp(stages: _Stages, trainable_layer, x, qkv, saved, g_a):
    """(gradient of the attention's trainable slice, cotangent of x, of q, k, v): from the kept
    attention output when "attention" is saved (the o projection is not run again), else
    through the whole attention residual."""
    if "attention" not in saved:
        _, vjp_attention = jax.vjp(stages.attention_residual, trainable_layer, x, qkv)
        return vjp_attention(g_a)
    _, vjp_output = jax.vjp(stages.attention_output, trainable_layer, x, saved["attention"][0])
    grad_attention, g_x, g_attended = vjp_output(g_a)
    _, vjp_core = jax.vjp(stages.attention, trainable_layer, qkv)
    grad_core, g_qkv = vjp_core(g_attended)  # the core's trainable part: gpt-oss's sinks
    return _add_trees(grad_attention, grad_core), g_x, g_qkv
