"""What a step needs of a training objective other than next-token cross-entropy, and the token
weights every such objective trains with.

An objective (`PreferenceObjective`: DPO, IPO, ORPO; `GrpoObjective`: GRPO) is a function of the
policy's per-token log-probs -- and, where it says so, of a reference model's. So its gradient
with respect to the model is the gradient of a *weighted* token loss: with w_t = dL/d nll_t (the
objective's gradient with respect to the per-token losses, a stop-gradient),
dL/dtheta = sum_t w_t dnll_t/dtheta. The streamed step uses exactly that: it reads the per-token
losses at the top of the stack, evaluates the objective and its weights here (`token_weights`),
and runs its usual chunked head VJP and layer-by-layer backward pass with the weights as the loss
mask. The reference step differentiates `objective.loss_of` through the whole model instead.

An objective provides:

- `loss_of(token_logps, batch, reference_logps) -> (loss, metrics)`: token_logps [B, S] float32 are
  the policy's log-probs of the batch's targets; reference_logps the reference model's (None
  when `needs_reference` is false);
- `needs_reference`, and `reference`: "same_step" (the frozen base with the adapters off, one
  forward pass more in the step) or "precomputed" (`Batch.reference_logps`);
- `temperature`: the logits' divisor the log-probs are read at (1 but for GRPO's sampling);
- `check()`: a `StepConfigError` for settings it cannot compute;
- `abstract_batch(batch_size, seq_len)`: its data layout, the `Batch` its steps take as
  `jax.ShapeDtypeStruct`s -- what the plan counts as `batch` and what a step is compiled on
  (`abstract_batch` below, next-token cross-entropy's packed rows for no objective);
- `plan_settings()`: what a plan of it names ({"objective": ..., its own choices});
- `plan_note(tokens)`: what it costs beyond its batch arrays, in words (the plan's note).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch


class Objective(Protocol):
    """A training objective over per-token log-probs (module docstring)."""

    @property
    def needs_reference(self) -> bool: ...

    @property
    def reference(self) -> str: ...

    @property
    def temperature(self) -> float: ...

    def check(self) -> None: ...

    def abstract_batch(self, batch_size: int, seq_len: int) -> Batch: ...

    def plan_settings(self) -> dict[str, Any]: ...

    def plan_note(self, tokens: int) -> str: ...

    def loss_of(
        self, token_logps: jax.Array, batch: Batch, reference_logps: jax.Array | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...


def abstract_batch(objective: Objective | None, batch_size: int, seq_len: int) -> Batch:
    """The `Batch` a step of `objective` takes, as shapes: its own layout, or for next-token
    cross-entropy (None) packed rows -- ids, targets, positions and segment ids int32 [B, S],
    the loss mask float32 [B, S]."""
    if objective is not None:
        return objective.abstract_batch(batch_size, seq_len)
    ids = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)
    return Batch(ids, ids, mask, ids, ids)


def token_weights(
    objective: Objective,
    token_nll: jax.Array,
    batch: Batch,
    reference_logps: jax.Array | None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(loss, per-token weights [B, S] float32, metrics): the objective of the policy's per-token
    losses `token_nll` [B, S] and its gradient with respect to them -- the weights whose weighted
    token loss has the objective's gradient (module docstring)."""
    reference = None if reference_logps is None else jax.lax.stop_gradient(reference_logps)

    def objective_of(nll):
        return objective.loss_of(-nll, batch, reference)

    (loss, metrics), weights = jax.value_and_grad(objective_of, has_aux=True)(
        jax.lax.stop_gradient(token_nll).astype(jnp.float32)
    )
    return loss, weights, metrics


def check_objective(objective: Objective | None, lora: Any, accumulation_steps: int) -> None:
    """Refuse an objective a step cannot compute exactly (`StepConfigError`); `lora` is the
    step's `LoraSpec` (None: full fine-tuning)."""
    if objective is None:
        return
    objective.check()
    if accumulation_steps > 1:
        raise StepConfigError(
            "this objective averages over its whole batch, so accumulation_steps > 1 is not "
            "supported with it; use memory.accumulation_steps: 1 (a smaller batch_size, or "
            "memory.residuals: host, to fit)"
        )
    if objective.needs_reference and objective.reference == "same_step" and lora is None:
        raise StepConfigError(
            "the reference model in the same step is the frozen base with the adapters off; "
            "full fine-tuning has no frozen copy, so use reference: precomputed (DPO: "
            "reference log-probs computed once before training), beta: 0 (GRPO), or "
            "method: lora / qlora"
        )
