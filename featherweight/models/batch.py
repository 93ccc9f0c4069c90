"""A training batch: the token rows, targets, loss mask, positions and segment ids every step takes.

It lives with the model (below `step`) because the data pipeline builds it and the steps consume it;
neither should import the other for it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Batch(NamedTuple):
    """One micro-batch, all [B, S]: inputs, next-token targets, a loss mask (1 = counted),
    positions (reset per packed example) and segment ids (packed examples never attend across).

    Preference pairs (DPO, ORPO) add `sequence_ids` int32: the completion each target belongs
    to (pair p's chosen 2p, rejected 2p + 1, -1 none; `featherweight.step.preference`), and with
    precomputed reference log-probs `reference_logps` float32: the reference model's log-prob of
    each target.

    GRPO's rows (one sampled completion each; `featherweight.step.grpo`) add `rollout_logps`
    [B, S] float32, the log-prob each completion token was sampled with, and `advantages` [B]
    float32, each completion's group-normalised advantage."""

    input_ids: jax.Array
    target_ids: jax.Array
    loss_mask: jax.Array
    positions: jax.Array
    segment_ids: jax.Array | None = None
    sequence_ids: jax.Array | None = None
    reference_logps: jax.Array | None = None
    rollout_logps: jax.Array | None = None
    advantages: jax.Array | None = None


def batch_from_tokens(tokens: jax.Array) -> Batch:
    """A plain causal-LM batch from token rows [B, S+1]: predict token t+1 from tokens <= t."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    return Batch(inputs, targets, jnp.ones(inputs.shape, jnp.float32), positions, None)
