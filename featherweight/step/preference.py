"""Preference objectives (DPO, IPO, ORPO) as functions of per-token log-probs.

Every objective here is a function of each completion's summed log-probability (and token count)
under the policy -- and, for DPO, under the reference model; the steps train it as a weighted
token loss (`objective.py`).

Batch layout (`Batch.sequence_ids`, [B, S] int32): the completion each token's loss belongs to,
numbered in the batch: pair p's chosen completion is 2p, its rejected one 2p + 1, and -1 marks a
token in no completion (prompt, padding). The two completions of a pair may share a row (packed)
or lie in two rows (padded); any numbering up to B x S works, and a pair without both completions
is left out of the mean.

The formulas are TRL's (`DPOTrainer`, `ORPOTrainer`), from the papers:

- DPO (Rafailov et al. 2023), `loss: sigmoid`: z = (pi_c - pi_r) - (ref_c - ref_r) over summed
  completion log-probs; loss = mean over pairs of -log sigmoid(beta z).
- IPO (Azar et al. 2023), `loss: ipo`: the same z over length-averaged log-probs (TRL divides by
  the completion's length for IPO); loss = mean of (z - 1 / (2 beta))^2.
- ORPO (Hong et al. 2024): over length-averaged log-probs, log odds = (pi_c - pi_r) -
  (log(1 - e^pi_c) - log(1 - e^pi_r)); loss = chosen NLL (the mean over the batch's chosen
  completion tokens) - beta x mean log sigmoid(log odds). No reference model.

Metrics carry TRL's names: rewards/chosen, rewards/rejected (beta x (pi - ref) for DPO and IPO,
beta x pi for ORPO), rewards/accuracies (chosen reward above rejected), rewards/margins,
logps/chosen, logps/rejected (the policy's, as the loss sees them: averaged for IPO and ORPO);
ORPO adds nll_loss, log_odds_ratio (the mean log-sigmoid of the log odds: the term beta weighs)
and log_odds_chosen (the mean log odds), as TRL's `ORPOTrainer` logs them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch

OBJECTIVES = ("dpo", "orpo")
DPO_LOSSES = ("sigmoid", "ipo")
REFERENCE_MODES = ("same_step", "precomputed")
METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# in metrics.jsonl and loggers; ORPO's as TRL names them: log_odds_ratio the mean log-sigmoid of
# the log odds, log_odds_chosen the mean log odds
REPORTED_METRICS = (*METRIC_NAMES, "nll_loss", "log_odds_ratio", "log_odds_chosen")


class PreferenceObjective(NamedTuple):
    """A preference objective: `kind` "dpo" or "orpo", its beta, DPO's loss ("sigmoid" or
    "ipo"), and where DPO's reference log-probs come from: "same_step" (a forward pass with the
    adapters off, in the step) or "precomputed" (`Batch.reference_logps`, made before training)."""

    kind: str
    beta: float = 0.1
    loss: str = "sigmoid"
    reference: str = "same_step"

    def abstract_batch(self, batch_size: int, seq_len: int) -> Batch:
        """Padded or packed pairs as shapes: the token arrays int32 [B, S], the loss mask float32,
        each token's completion id (`sequence_ids`: pair p's chosen 2p, rejected 2p + 1), and
        DPO's precomputed reference log-probs float32 [B, S] where it reads them."""
        ids = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        mask = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)
        precomputed = self.needs_reference and self.reference == "precomputed"
        return Batch(ids, ids, mask, ids, ids, ids, mask if precomputed else None)

    def plan_settings(self) -> dict[str, Any]:
        """The objective and DPO's reference mode (None for ORPO, which has no reference)."""
        return {"objective": self.kind, "reference": self.reference if self.kind == "dpo" else None}

    def plan_note(self, tokens: int) -> str:
        """What the objective costs beyond its batch arrays, for a batch of `tokens` tokens."""
        head = (
            f"objective {self.kind}: per-token losses read before the weighted head VJP (one more "
            "forward pass of the LM head)"
        )
        if not self.needs_reference:
            return head + "; no reference model"
        if self.reference == "same_step":
            return (
                head + "; dpo.reference same_step: one more forward pass of the frozen base with "
                "the adapters off per step, nothing stored for it (its working set is a forward "
                "layer's, below the backward pass's); precomputed would instead cost a forward "
                "pass over the data before training and 4 B per token in host memory"
            )
        return (
            head + f"; dpo.reference precomputed: one forward pass over the data before "
            f"training, 4 B per token in host memory, and {4 * tokens:,} B of reference log-probs "
            "in each batch (planned in batch); same_step would cost one more forward pass per "
            "step instead"
        )

    def check(self) -> None:
        """Refuse an objective the step cannot compute (`StepConfigError`)."""
        if self.kind not in OBJECTIVES:
            raise StepConfigError(f"objective {self.kind!r} is unknown; use one of {OBJECTIVES}")
        if self.loss not in DPO_LOSSES:
            raise StepConfigError(f"dpo loss {self.loss!r} is unknown; use one of {DPO_LOSSES}")
        if self.reference not in REFERENCE_MODES:
            raise StepConfigError(
                f"reference {self.reference!r} is unknown; use one of {REFERENCE_MODES}"
            )
        if not self.beta > 0:
            raise StepConfigError(f"beta={self.beta} must be positive, e.g. 0.1")

    @property
    def needs_reference(self) -> bool:
        return self.kind == "dpo"

    @property
    def temperature(self) -> float:
        return 1.0

    def loss_of(
        self, token_logps: jax.Array, batch: Batch, reference_logps: jax.Array | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics) of the batch's pairs (`preference_loss`) from per-token log-probs."""
        reference = (
            None
            if reference_logps is None
            else pair_logps(reference_logps, batch.loss_mask, batch.sequence_ids)
        )
        policy = pair_logps(token_logps, batch.loss_mask, batch.sequence_ids)
        return preference_loss(self, policy, reference)

    @property
    def averages(self) -> bool:
        """Whether the objective reads length-averaged log-probs (IPO and ORPO, as in TRL)."""
        return self.kind == "orpo" or self.loss == "ipo"


def completion_sums(values: jax.Array, sequence_ids: jax.Array) -> jax.Array:
    """Per-completion sums [B x S / 2, 2] (pair, chosen/rejected) of per-token `values` [B, S];
    tokens with id -1 are in no completion."""
    slots = values.size + (values.size % 2)
    ids = jnp.where(sequence_ids < 0, slots, sequence_ids).reshape(-1)
    sums = jax.ops.segment_sum(values.reshape(-1), ids, num_segments=slots + 1)
    return sums[:slots].reshape(-1, 2)


class PairLogps(NamedTuple):
    """Summed completion log-probs [P, 2] and completion token counts [P, 2] of a batch's pairs
    (column 0 chosen, 1 rejected); a pair is counted when both completions have a token."""

    logps: jax.Array
    counts: jax.Array

    @property
    def valid(self) -> jax.Array:
        return (self.counts[:, 0] > 0) & (self.counts[:, 1] > 0)

    def as_used(self, averaged: bool) -> jax.Array:
        """The log-probs the objective reads: summed, or averaged over each completion."""
        return self.logps / jnp.maximum(self.counts, 1.0) if averaged else self.logps


def pair_logps(token_logps: jax.Array, loss_mask: jax.Array, sequence_ids: jax.Array) -> PairLogps:
    """The pairs' summed log-probs from per-token log-probs [B, S] (only tokens in the loss mask
    and in a completion count)."""
    mask = loss_mask.astype(jnp.float32)
    return PairLogps(
        completion_sums(token_logps * mask, sequence_ids), completion_sums(mask, sequence_ids)
    )


def _pair_mean(values: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def preference_loss(
    objective: PreferenceObjective, policy: PairLogps, reference: PairLogps | None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of the objective over the batch's valid pairs (module docstring)."""
    valid, beta = policy.valid, objective.beta
    # a slot with no pair reads -1 (log(1 - e^0) would make its zero gradient NaN)
    pi = jnp.where(valid[:, None], policy.as_used(objective.averages), -1.0)
    if objective.kind == "orpo":
        pi_c, pi_r = pi[:, 0], pi[:, 1]
        log_odds = (pi_c - pi_r) - (jnp.log1p(-jnp.exp(pi_c)) - jnp.log1p(-jnp.exp(pi_r)))
        chosen = jnp.where(valid, policy.counts[:, 0], 0.0)
        nll = -jnp.sum(jnp.where(valid, policy.logps[:, 0], 0.0)) / jnp.maximum(jnp.sum(chosen), 1)
        loss = nll - beta * _pair_mean(jax.nn.log_sigmoid(log_odds), valid)
        rewards = beta * jax.lax.stop_gradient(pi)
        extra = {
            "nll_loss": nll,
            "log_odds_ratio": _pair_mean(jax.nn.log_sigmoid(log_odds), valid),
            "log_odds_chosen": _pair_mean(log_odds, valid),
        }
    else:
        if reference is None:
            raise StepConfigError("DPO needs the reference model's log-probs")
        ref = jax.lax.stop_gradient(reference.as_used(objective.averages))
        z = (pi[:, 0] - pi[:, 1]) - (ref[:, 0] - ref[:, 1])
        losses = (
            jnp.square(z - 1.0 / (2.0 * beta))
            if objective.loss == "ipo"
            else -jax.nn.log_sigmoid(beta * z)
        )
        loss = _pair_mean(losses, valid)
        rewards = beta * jax.lax.stop_gradient(pi - ref)
        extra = {}
    logps = jax.lax.stop_gradient(pi)
    metrics = {
        "rewards/chosen": _pair_mean(rewards[:, 0], valid),
        "rewards/rejected": _pair_mean(rewards[:, 1], valid),
        "rewards/accuracies": _pair_mean(
            (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32), valid
        ),
        "rewards/margins": _pair_mean(rewards[:, 0] - rewards[:, 1], valid),
        "logps/chosen": _pair_mean(logps[:, 0], valid),
        "logps/rejected": _pair_mean(logps[:, 1], valid),
        "pairs": jnp.sum(valid).astype(jnp.float32),
        **{name: jax.lax.stop_gradient(value) for name, value in extra.items()},
    }
    return loss, metrics
