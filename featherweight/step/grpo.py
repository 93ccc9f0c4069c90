"""GRPO (Shao et al. 2024) as a function of per-token log-probs, with TRL's formulas and names.

A batch holds one completion per row: the prompt, then the completion the policy sampled, padded
on the right; `loss_mask` marks the completion's targets (up to and including its EOS).
`Batch.rollout_logps` [B, S] are the log-probs the rollout sampled them with (at the sampling
temperature), `Batch.advantages` [B] each completion's group-normalised advantage
(`group_advantages`). Per token, with r = exp(logp - rollout logp):

  loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta KL_t,
  KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (Schulman's k3; the reference is the
                                                       frozen base with the adapters off)

aggregated as TRL's `loss_type` says: "grpo" the mean over completions of each one's token mean;
"dr_grpo" the token sum over (completions x max_completion_length); "dapo" the token sum over the
batch's completion tokens. The log-probs are those of the logits divided by the sampling
temperature, as TRL's are. With one update per rollout (TRL's `num_iterations: 1`) r is 1 up to
the rollout's numerics; the clip acts where the two differ.

Metrics carry TRL's names: kl (beta > 0), clip_ratio/low_mean, clip_ratio/high_mean,
clip_ratio/region_mean, clip_ratio/low_min, clip_ratio/high_max.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
METRIC_NAMES = (
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


class GrpoObjective(NamedTuple):
    """GRPO's loss settings, TRL's names and defaults (`GRPOConfig`): `beta` the KL coefficient
    (0 skips the reference model), `epsilon` and `epsilon_high` (None: `epsilon`) the clip
    range, `loss_type`, `max_completion_length` (dr_grpo's constant) and the sampling
    `temperature` the log-probs are read at."""

    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    max_completion_length: int = 512
    temperature: float = 1.0

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    @property
    def reference(self) -> str:
        return "same_step"

    def abstract_batch(self, batch_size: int, seq_len: int) -> Batch:
        """Rollout rows as shapes (one completion a row, right-padded, no segment ids): the
        token arrays int32 [B, S], the loss mask and the sampling log-probs float32 [B, S], each
        row's advantage float32 [B]."""
        ids = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
        mask = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)
        advantages = jax.ShapeDtypeStruct((batch_size,), jnp.float32)
        return Batch(ids, ids, mask, ids, rollout_logps=mask, advantages=advantages)

    def plan_settings(self) -> dict[str, Any]:
        """The objective's name (the rollout chunk is a memory setting, named by the plan)."""
        return {"objective": "grpo"}

    def plan_note(self, tokens: int) -> str:
        """What the objective costs beyond its batch arrays (`tokens`: the batch's)."""
        reference = (
            "beta > 0: one more forward pass of the frozen base with the adapters off per step "
            "(the KL's reference), nothing stored for it"
            if self.needs_reference
            else "beta 0: no reference model"
        )
        return (
            "objective grpo: per-token losses read before the weighted head VJP (one more "
            f"forward pass of the LM head); {reference}; the rollouts are the plan's second phase"
        )

    def check(self) -> None:
        """Refuse settings the step cannot compute (`StepConfigError`)."""
        if self.loss_type not in LOSS_TYPES:
            raise StepConfigError(
                f"grpo loss_type {self.loss_type!r} is unknown; use one of {LOSS_TYPES}"
            )
        if self.beta < 0:
            raise StepConfigError(f"grpo beta={self.beta} must be >= 0 (0 skips the KL)")
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if not (0 <= self.epsilon < 1 and high >= 0):
            raise StepConfigError(
                f"grpo epsilon={self.epsilon}, epsilon_high={self.epsilon_high} must be a clip "
                "range: 0 <= epsilon < 1, epsilon_high >= 0 (e.g. 0.2 and 0.28)"
            )
        if not self.temperature > 0:
            raise StepConfigError(f"grpo temperature={self.temperature} must be positive")
        if self.max_completion_length < 1:
            raise StepConfigError(
                f"grpo max_completion_length={self.max_completion_length} must be >= 1"
            )

    def loss_of(
        self, token_logps: jax.Array, batch: Batch, reference_logps: jax.Array | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics) of the batch's completions (module docstring)."""
        mask = batch.loss_mask.astype(jnp.float32)
        counted = mask > 0
        # outside the completions the ratio is 1 (a padding token's log-prob never reaches exp)
        log_ratio = jnp.where(counted, token_logps - batch.rollout_logps, 0.0)
        ratio = jnp.exp(log_ratio)
        advantages = batch.advantages.astype(jnp.float32)[:, None]
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = jnp.clip(ratio, 1.0 - self.epsilon, 1.0 + high)
        per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
        metrics = {}
        if self.needs_reference:
            if reference_logps is None:
                raise StepConfigError("GRPO with beta > 0 needs the reference model's log-probs")
            gap = jnp.where(counted, reference_logps - token_logps, 0.0)
            kl = jnp.exp(gap) - gap - 1.0
            per_token = per_token + self.beta * kl
            metrics["kl"] = _masked_mean(kl, mask)
        loss = self._aggregate(per_token * mask, mask)
        low = (ratio < 1.0 - self.epsilon) & (advantages < 0)
        high_clip = (ratio > 1.0 + high) & (advantages > 0)
        metrics.update(_clip_metrics(low, high_clip, mask))
        metrics["completions"] = jnp.sum(jnp.any(counted, axis=-1)).astype(jnp.float32)
        return loss, {name: jax.lax.stop_gradient(value) for name, value in metrics.items()}

    def _aggregate(self, masked_loss: jax.Array, mask: jax.Array) -> jax.Array:
        if self.loss_type == "grpo":
            per_row = jnp.sum(masked_loss, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
            return jnp.mean(per_row)
        if self.loss_type == "dr_grpo":
            return jnp.sum(masked_loss) / (mask.shape[0] * self.max_completion_length)
        return jnp.sum(masked_loss) / jnp.maximum(jnp.sum(mask), 1.0)


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _clip_metrics(low: jax.Array, high: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """TRL's clip_ratio/* from the tokens clipped below (low) and above (high): token means over
    the batch, and the least (most) clipped completion's share."""
    low, high = low.astype(jnp.float32), high.astype(jnp.float32)
    rows = jnp.sum(mask, -1)
    has_tokens = rows > 0

    def row_share(values):
        return jnp.sum(values * mask, -1) / jnp.maximum(rows, 1.0)

    return {
        "clip_ratio/low_mean": _masked_mean(low, mask),
        "clip_ratio/high_mean": _masked_mean(high, mask),
        "clip_ratio/region_mean": _masked_mean(jnp.maximum(low, high), mask),
        "clip_ratio/low_min": jnp.min(jnp.where(has_tokens, row_share(low), jnp.inf)),
        "clip_ratio/high_max": jnp.max(jnp.where(has_tokens, row_share(high), -jnp.inf)),
    }


def group_advantages(rewards: jax.Array, num_generations: int, scale_rewards: str) -> jax.Array:
    """Each completion's advantage [N] from its reward [N] (N = prompts x num_generations, a
    prompt's completions adjacent; NaN: unscored): the reward less its group's mean, divided by
    the group's (scale_rewards "group") or the batch's ("batch") standard deviation (Bessel's,
    ignoring NaN) + 1e-4, or not divided ("none"); an unscored completion's advantage is 0.
    TRL's `sum_then_normalize`."""
    if scale_rewards not in SCALE_REWARDS:
        raise StepConfigError(
            f"grpo scale_rewards {scale_rewards!r} is unknown; use one of {SCALE_REWARDS}"
        )
    grouped = rewards.reshape(-1, num_generations)
    mean = jnp.repeat(jnp.nanmean(grouped, axis=1), num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        spread = _nanstd(grouped, axis=1) if scale_rewards == "group" else _nanstd(rewards, None)
        spread = jnp.repeat(spread, num_generations) if scale_rewards == "group" else spread
        advantages = advantages / (spread + 1e-4)
    return jnp.nan_to_num(advantages, nan=0.0)


def _nanstd(values: jax.Array, axis) -> jax.Array:
    """The standard deviation with Bessel's correction, ignoring NaN (TRL's `nanstd`)."""
    count = jnp.sum(~jnp.isnan(values), axis=axis)
    mean = jnp.nanmean(values, axis=axis, keepdims=True)
    variance = jnp.nanmean(jnp.square(values - mean), axis=axis)
    return jnp.sqrt(variance * count / (count - 1))
