"""The router's load-balancing loss of a mixture of experts: Switch Transformer's auxiliary loss
as transformers computes it for Qwen3-MoE, Mixtral and gpt-oss (`load_balancing_loss_func`).

Over every layer's router logits and the batch's real tokens (padding excluded, as
transformers' attention mask excludes it: `router_mask`), with E experts, top k, L layers and
T real tokens:

    aux = E x sum_e f_e x P_e,   f_e = C_e / (L T),   P_e = S_e / (L T),

C_e the times expert e is among a token's top k of softmax(logits) (all layers and tokens
counted together), S_e the sum of its softmax probabilities. The softmax is over every expert
in every family (gpt-oss's routing softmaxes only its top k logits; its loss does not). f is a
count and has no gradient; the gradient flows through P. The trained loss is the task loss
+ coef x aux, and `aux_loss` (transformers' and TRL's name) is reported unscaled.

Normalisation: aux is a per-token mean like the cross-entropy (`loss.head_loss`), so the sum
is the same at any batch size; with accumulation each micro-batch's total loss (cross-entropy
+ coef x its own aux) is weighted by its share of the counted tokens, as transformers'
trainers add each micro-batch's aux loss.

The streamed step needs every layer's counts before any layer's backward pass, and the forward
pass has them: it sums each layer's `ExpertLoad` ([E] counts and probability sums, and the
tokens) on the way up. With the counts fixed, aux is linear in each layer's probability sums,
so layer l's share of the gradient is that of `probability_term(logits_l)` -- the masked
probabilities weighted by d(coef aux)/dS (`probability_weights`) -- which layer l's VJP adds
(`layer_grad.layer_vjp`'s `router_term`). The reference step differentiates
`load_balancing_loss_of_layers` through the whole model instead.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig

METRIC_NAMES = ("aux_loss",)  # transformers' output and TRL's logged name: aux unscaled


class ExpertLoad(NamedTuple):
    """What the loss reads of the routing, summed over tokens (and layers): each expert's top-k
    choices `counts` [E] and softmax probabilities `probability_sums` [E] (float32), and the
    real `tokens` they cover (a scalar; summed over layers: L x T)."""

    counts: jax.Array
    probability_sums: jax.Array
    tokens: jax.Array


def router_mask(batch: Batch) -> jax.Array:
    """[B*S] float32: 1 for a real input token, 0 for padding -- a packed row's slots of
    segment 0, or an all-padding row's (`data/packing.py`); every token when the batch has no
    segment ids. Prompt tokens are real (the loss mask's zeros are not padding)."""
    if batch.segment_ids is None:
        return jnp.ones(batch.input_ids.size, jnp.float32)
    return (batch.segment_ids.reshape(-1) > 0).astype(jnp.float32)


def _probabilities(logits: jax.Array) -> jax.Array:
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


def expert_load(logits: jax.Array, mask: jax.Array, top_k: int) -> ExpertLoad:
    """One layer's `ExpertLoad` from its router logits [N, E] and the token mask [N]."""
    probabilities = _probabilities(logits)
    _, chosen = jax.lax.top_k(probabilities, top_k)  # [N, k]
    counts = (
        jnp.zeros(logits.shape[-1], jnp.float32).at[chosen.reshape(-1)].add(jnp.repeat(mask, top_k))
    )
    return ExpertLoad(
        jax.lax.stop_gradient(counts),
        jnp.einsum("ne,n->e", probabilities, mask),
        jnp.sum(mask),
    )


def load_balancing_loss(load: ExpertLoad) -> jax.Array:
    """aux = E x sum_e (counts_e / tokens) (probability_sums_e / tokens) of the load summed over
    every layer (0 when no token is real)."""
    tokens = jnp.maximum(load.tokens, 1.0)
    fractions = load.counts / tokens
    return load.counts.shape[-1] * jnp.sum(fractions * load.probability_sums / tokens)


def load_balancing_loss_of_layers(logits: jax.Array, mask: jax.Array, top_k: int) -> jax.Array:
    """aux of every layer's router logits [L, N, E] with the token mask [N] (the reference
    step's form, differentiated through the logits)."""
    per_layer = jax.vmap(expert_load, in_axes=(0, None, None))(logits, mask, top_k)
    return load_balancing_loss(jax.tree.map(lambda leaf: jnp.sum(leaf, axis=0), per_layer))


def probability_weights(load: ExpertLoad, scale: jax.Array | float) -> jax.Array:
    """[E] float32: d(scale x aux) / d(a layer's probability sums), the counts held fixed --
    the same for every layer."""
    return jax.grad(lambda sums: scale * load_balancing_loss(load._replace(probability_sums=sums)))(
        load.probability_sums
    )


def probability_term(logits: jax.Array, mask: jax.Array, weights: jax.Array) -> jax.Array:
    """sum over real tokens and experts of softmax(logits) [N, E] x `weights` [E]: a float32
    scalar whose gradient is a layer's share of the loss's (`probability_weights`)."""
    return jnp.einsum("ne,n,e->", _probabilities(logits), mask, jax.lax.stop_gradient(weights))


def check_router_loss(coef: float, config: ModelConfig, objective) -> None:
    """Refuse a load-balancing loss a step cannot train (`StepConfigError`)."""
    if coef == 0:
        return
    if coef < 0:
        raise StepConfigError(f"router_aux_loss_coef={coef} must be >= 0 (0: off)")
    if not config.num_experts:
        raise StepConfigError(
            f"router_aux_loss_coef={coef}: {config.model_type} is a dense model with no router; "
            "drop the setting"
        )
    if objective is not None:
        raise StepConfigError(
            f"router_aux_loss_coef={coef} is trained with next-token cross-entropy only; set it "
            "to 0 (or drop it) for this objective"
        )
