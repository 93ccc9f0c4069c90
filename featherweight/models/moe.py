"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, and
only those run -- dropless, on the routed tokens alone.

The expert weights of a layer are stacked: `gate`, `up` [E, F, D] and `down` [E, D, F] (the
names of the dense MLP's weights, so LoRA targets, NF4 and the name maps read them the same way;
a LoRA adapter on an expert weight is per expert: a [E, r, in], b [E, out, r]), and `router`
[E, D].

Routing (`route`): softmax over the router's logits in float32, the top k experts of each token,
renormalized to sum to one where the family does it (`norm_topk_prob`; Mixtral always). The
router's logits also leave the layer (`experts_in`, `llama.block_with_router`): the router's
load-balancing loss reads them (`featherweight.step.router_loss`).

Grouped matmuls (`grouped_linear`): the N x k (token, expert) pairs are sorted by expert, and
each expert's group is padded to whole blocks of `block` rows, so every block belongs to one
expert. A scan over the blocks multiplies each by its expert's weight (an NF4 expert is
dequantized when its first block comes and carried while its blocks last: one expert dense at a
time, each dequantized once; a layer's experts are never dense at once). So the work
is the routed rows' -- N x k + at most E x (block - 1) padding rows -- never a dense pass of
every token through every expert, and nothing is dropped (no capacity factor). `jax.lax.ragged_dot`
would express the same products, but XLA:CPU lowers it to a masked dense product over all E
experts (an [E, N, D] buffer): E times the work and the memory the design avoids.

The routed buffers -- the rows [R, D] gathered by expert, their gate and up [R, F] -- are what
the `mlp_hidden` kept-activation class keeps for an MoE layer (R = N k + padding).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from featherweight.models.config import ModelConfig
from featherweight.models.linear import lora_update
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4


class Routing(NamedTuple):
    """Where each routed row goes and comes from.

    weights: [N, k] each token's expert weights (differentiable: they depend on the input);
    pair_row: [N, k] int, the padded row holding each (token, expert) pair;
    row_token: [R] int, the token each padded row holds (-1: a padding row);
    block_expert: [R / block] int, the expert of each block of rows.
    """

    weights: jax.Array
    pair_row: jax.Array
    row_token: jax.Array
    block_expert: jax.Array


def block_rows(pairs: int, experts: int) -> int:
    """Rows per block: a power of two from 8 to 128, small enough that the padding of E groups
    (at most E x (block - 1) rows) stays about a sixteenth of the N x k routed rows."""
    target = pairs / (16 * experts)
    return int(min(128, max(8, 2 ** math.floor(math.log2(max(target, 1.0))))))


def padded_rows(pairs: int, experts: int, block: int) -> int:
    """The routed rows' static bound: every pair, each group padded up to whole blocks."""
    return -(-(pairs + experts * (block - 1)) // block) * block


def router_logits(layer, x: jax.Array) -> jax.Array:
    """The router's logits [N, E] in x's dtype of the tokens x [N, D] (with its bias: gpt-oss):
    what transformers' MoE block returns as `router_logits`, and what the load-balancing loss
    reads (`featherweight.step.router_loss`)."""
    with jax.named_scope("router"):
        logits = jnp.einsum("nd,ed->ne", x, layer["router"].astype(x.dtype))
        if "router_bias" in layer:
            logits = logits + layer["router_bias"].astype(logits.dtype)
        return logits


def route(logits: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] in the logits' dtype, experts [N, k] int32) from the router's logits
    [N, E]."""
    with jax.named_scope("router"):
        if config.routing == "topk_softmax":  # gpt-oss: the top k logits, then their softmax
            top, experts = jax.lax.top_k(logits, config.experts_per_token)
            return jax.nn.softmax(top, axis=-1).astype(logits.dtype), experts.astype(jnp.int32)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, config.experts_per_token)
        if config.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights.astype(logits.dtype), experts.astype(jnp.int32)


def layout(experts: jax.Array, num_experts: int, block: int) -> tuple[jax.Array, ...]:
    """(pair_row [N, k], row_token [R], block_expert [R / block]) of the experts [N, k] each
    token is routed to (`Routing`): pairs sorted by expert (stable), each group padded."""
    tokens, k = experts.shape
    pairs = tokens * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts)
    padded = (counts + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    sorted_experts = flat[order]
    rank = jnp.arange(pairs) - (jnp.cumsum(counts) - counts)[sorted_experts]
    row_of_sorted = (padded_end - padded)[sorted_experts] + rank
    pair_row = jnp.zeros(pairs, jnp.int32).at[order].set(row_of_sorted.astype(jnp.int32))
    rows = padded_rows(pairs, num_experts, block)
    row_token = jnp.full(rows, -1, jnp.int32).at[pair_row].set(jnp.arange(pairs) // k)
    starts = jnp.arange(rows // block) * block
    block_expert = jnp.searchsorted(padded_end, starts, side="right")
    return (
        pair_row.reshape(tokens, k),
        row_token,
        jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32),
    )


def _expert(weight, index: jax.Array, dtype) -> jax.Array:
    """Expert `index`'s [out, in] weight in `dtype` (dequantized alone when NF4)."""
    one = jax.tree.map(
        lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), weight
    )
    return dequantize_nf4(one, dtype) if isinstance(one, NF4Tensor) else one.astype(dtype)


def _sweep(blocks: jax.Array, weight, block_expert: jax.Array, product) -> jax.Array:
    """`product(block, expert's dense weight [out, in])` for each block [NB, m, ...] in turn.
    Blocks come sorted by expert, so an NF4 expert is dequantized when its first block comes and
    carried while its blocks last: one expert dense at a time, each dequantized once."""
    nf4 = isinstance(weight, NF4Tensor)

    def one_block(current, inputs):
        x, expert = inputs
        if not nf4:
            return current, product(x, _expert(weight, expert, x.dtype))
        last, dense = current
        dense = jax.lax.cond(
            expert == last, lambda: dense, lambda: _expert(weight, expert, x.dtype)
        )
        return (expert, dense), product(x, dense)

    start = (jnp.int32(-1), jnp.zeros(weight.shape[-2:], blocks.dtype)) if nf4 else None
    return jax.lax.scan(one_block, start, (blocks, block_expert))[1]


def _blocks(rows: jax.Array, block_expert: jax.Array) -> jax.Array:
    return rows.reshape(block_expert.shape[0], -1, rows.shape[-1])


@jax.custom_vjp
def _grouped(rows: jax.Array, weight, block_expert: jax.Array) -> jax.Array:
    """rows [R, in] -> [R, out]: each block of rows times its expert's weight [E, out, in]."""
    out = _sweep(_blocks(rows, block_expert), weight, block_expert, lambda x, w: x @ w.T)
    return out.reshape(rows.shape[0], -1)


def _grouped_fwd(rows, weight, block_expert):
    """The product, and what its backward reads: the rows only where the weights are trained
    (`symbolic_zeros`: a frozen stack gets no gradient, and no [E, out, in] buffer)."""
    trained = any(leaf.perturbed for leaf in jax.tree.leaves(weight))
    rows, weight, block_expert = (
        jax.tree.map(lambda leaf: leaf.value, x) for x in (rows, weight, block_expert)
    )
    out = _grouped(rows, weight, block_expert)
    return out, (rows if trained else None, weight, block_expert, rows.shape)


def _grouped_bwd(residuals, d_out):
    """d rows from the same sweep (no expert's weight is kept from the forward pass: the scan's
    own VJP would keep one copy per block); d weight, for trained dense experts, summed per
    expert in a float32 buffer of the stack's shape."""
    rows, weight, block_expert, shape = residuals
    d_blocks = _blocks(d_out, block_expert)
    d_rows = _sweep(d_blocks, weight, block_expert, lambda g, w: g @ w.astype(g.dtype))
    d_weight = None
    if rows is not None and not isinstance(weight, NF4Tensor):

        def add(buffer, inputs):
            g, x, expert = inputs
            part = jnp.einsum("mo,mi->oi", g, x, preferred_element_type=jnp.float32)
            return buffer.at[expert].add(part), None

        start = jnp.zeros(weight.shape, jnp.float32)
        inputs = (d_blocks, _blocks(rows, block_expert), block_expert)
        d_weight = jax.lax.scan(add, start, inputs)[0].astype(weight.dtype)
    return d_rows.reshape(shape), d_weight, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd, symbolic_zeros=True)


def grouped_linear(layer, name: str, rows: jax.Array, block_expert: jax.Array, lora, key):
    """rows [R, in] -> [R, out]: each block of rows times its expert's weight `layer[name]`
    [E, out, in] (`_grouped`), plus its bias [E, out] and its LoRA adapter when present (the
    adapters' block products rematerialized in the backward pass: only the rows are kept)."""
    weight, bias = layer[name], layer.get(f"{name}_bias")
    out = _grouped(rows, weight, block_expert)
    if bias is not None:
        row_expert = jnp.repeat(block_expert, rows.shape[0] // block_expert.shape[0])
        out = out + bias[row_expert].astype(out.dtype)
    adapter = layer.get("lora", {}).get(name)
    if adapter is None or lora is None:
        return out

    @jax.checkpoint
    def one_block(index, x, expert):
        pair = jax.tree.map(lambda leaf: leaf[expert], adapter)
        block_key = None if key is None else jax.random.fold_in(key, index)
        return lora_update(x, pair, lora, name, block_key)

    def scan_block(_, inputs):
        return None, one_block(*inputs)

    count = block_expert.shape[0]
    inputs = (jnp.arange(count), _blocks(rows, block_expert), block_expert)
    update = jax.lax.scan(scan_block, None, inputs)[1]
    return out + update.reshape(out.shape)


def experts_in(layer, normed: jax.Array, config: ModelConfig, lora=None, key=None):
    """The routed MLP's first half on the normed residual [B, S, D]: ((gate, up [R, F],
    `Routing`), the router's logits [N, E])."""
    x = normed.reshape(-1, normed.shape[-1])  # [N, D]
    logits = router_logits(layer, x)
    weights, experts = route(logits, config)
    block = block_rows(experts.size, config.num_experts)
    pair_row, row_token, block_expert = layout(experts, config.num_experts, block)
    with jax.named_scope("experts"):
        rows = jnp.where(
            (row_token >= 0)[:, None], x[jnp.maximum(row_token, 0)], jnp.zeros((), x.dtype)
        )  # [R, D]: each routed token's copy, sorted by expert
        gate = grouped_linear(layer, "gate", rows, block_expert, lora, key)
        up = grouped_linear(layer, "up", rows, block_expert, lora, key)
    return (gate, up, Routing(weights, pair_row, row_token, block_expert)), logits


def experts_out(layer, hidden, config: ModelConfig, gated, lora=None, key=None) -> jax.Array:
    """The routed MLP's second half: down(act(gate) * up) of each routed row, each token's rows
    summed with its expert weights -> [N, D]."""
    gate, up, routing = hidden
    with jax.named_scope("experts"):
        rows = grouped_linear(
            layer, "down", gated(config, gate, up), routing.block_expert, lora, key
        )  # [R, D]
        picked = rows[routing.pair_row]  # [N, k, D]
        return jnp.einsum("nkd,nk->nd", picked, routing.weights.astype(picked.dtype))
