"""The layer-streamed train step: the optimizer runs inside the backward pass, one layer at a time.

No `jax.grad` of the whole model. The step is, in one jitted and donated program:

1. forward (`layer_loop.forward_layers`): scan the block over the stacked layers, keeping each
   layer's input (the residual stream) -- on device or in pinned host memory -- and any
   intermediates the policy saves;
2. head: value and VJP of final norm + LM head + chunked cross-entropy; the head's parameters are
   updated at once (`top_update.top_update`);
3. backward (`layer_loop.backward_layers`): last layer to first, each layer's VJP and then each of
   its tensors' updates, in place; at most one layer's gradient is alive;
4. embedding (`top_update.embedding_update`): the input cotangent is scattered into the
   embedding's gradient (a tied table adds the head's gradient of it) and the table is updated
   once.

An objective (DPO, IPO, ORPO: `preference.py`; GRPO: `grpo.py`) changes step 2 only: each token's
loss is read first (forward only, at the objective's temperature), the objective's per-token
weights are its gradient with respect to them (`objective.py`), and the head's VJP is that of the
weighted token loss; reference log-probs (DPO, GRPO's KL) come from the same frozen base run with
the adapters off, or from the batch when precomputed.

An MoE router's load-balancing loss (`router_loss.py`) rides along: step 1 counts every layer's
expert choices, step 2 adds coef x aux to the loss, and step 3's layer VJPs add its gradient.

Frozen weights (bf16 or NF4) are closed over in every VJP, so no gradient of them is ever built.
Any optax `GradientTransformation` works, applied per tensor (its state is initialised per layer
and stacked: `opt_state.py`). Each update sits in a `lax.cond` on the loss being finite
(`opt_state.guarded_update`).

Clipping and accumulation, exactly as the reference step does them (`gradient_mode`):

- "fused" (no `clip_norm`, one micro-batch): the one-pass step above. An optax chain that clips
  (`per_tensor_clipping`) sees one tensor at a time: each layer's slice, the head, the embedding
  is clipped on its own -- per-tensor clipping, not global.
- "two_pass" (`clip_norm`, `two_pass=True`): global-norm clipping without a gradient buffer
  (LOMO, Lv et al. 2023): one forward, a first backward pass that only sums the squared norm,
  then the updating pass with every gradient times min(1, clip_norm / norm). The head's gradient
  is kept between the passes; the layers are differentiated twice (measured cost:
  benchmarks/results/clipping_two_pass.md).
- "kept" (`clip_norm` without `two_pass`, or `accumulation_steps` > 1): the backward loop adds
  each layer's gradient into a float32 buffer the size of the trainable parameters (adapters:
  small), over `accumulation_steps` micro-batches of the batch (scanned: one micro-batch's
  activations at a time); then the global norm, the clip, and one update per tensor. Each
  micro-batch's loss is weighted by its share of the batch's counted tokens, so the summed
  gradient is the whole batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig
from featherweight.models.llama import (
    LoraSpec,
    Params,
    attention_inputs,
    embed,
    embedding_rows_cotangent,
    merge_params,
    run_layers,
)
from featherweight.parallel.memory_kinds import on_host, placed_like
from featherweight.step.common import (
    HEAD_PARAMS,
    activation_constraint,
    all_finite,
    clip_scale,
    head_param_names,
    jit_shardings,
    layer_dropout_keys,
    micro_batches,
    scaled,
    squared_norm,
)
from featherweight.step.layer_loop import (
    LayerContext,
    accumulate_sink,
    backward_layers,
    forward_layers,
    norm_sink,
    update_layers,
    update_sink,
)
from featherweight.step.loss import head_form, head_loss, token_losses_sum, token_nll
from featherweight.step.objective import Objective, check_objective, token_weights
from featherweight.step.opt_state import StreamedOptState
from featherweight.step.policy import MemoryPolicy
from featherweight.step.router_loss import (
    check_router_loss,
    load_balancing_loss,
    probability_weights,
    router_mask,
)
from featherweight.step.top_update import (
    embedding_gradient,
    embedding_squared_norm,
    embedding_update,
    top_update,
)
from featherweight.step.validate import check_optimizer, check_uniform_layers, refuse_multisteps


def gradient_mode(clip_norm: float | None, two_pass: bool, accumulation_steps: int) -> str:
    """ "fused", "two_pass" or "kept": how the streamed step meets its clipping and accumulation
    (module docstring). Refuses combinations with nothing to do or a simpler exact form."""
    if accumulation_steps < 1:
        raise StepConfigError(f"accumulation_steps={accumulation_steps} must be at least 1")
    if two_pass and clip_norm is None:
        raise StepConfigError("two_pass clipping needs clip_norm (the global norm to clip to)")
    if two_pass and accumulation_steps > 1:
        raise StepConfigError(
            "two_pass clipping with accumulation_steps > 1: accumulation keeps the gradient, "
            "which clips globally in one pass; drop two_pass"
        )
    if two_pass:
        return "two_pass"
    return "kept" if clip_norm is not None or accumulation_steps > 1 else "fused"


class _StepModel:
    """The model as one step sees it: its configuration and memory policy, the trainable and
    frozen parameters (separate, so the frozen ones are only ever closed over), the objective
    (None: next-token cross-entropy; else an `Objective`), and the pass every gradient
    mode starts with -- one micro-batch's forward and the head's VJP."""

    def __init__(
        self, config, lora, policy, constrain, trainable, frozen, objective=None, router_coef=0.0
    ) -> None:
        self.config, self.lora, self.policy, self.constrain = config, lora, policy, constrain
        self.trainable, self.frozen, self.objective = trainable, frozen, objective
        self.router_coef = router_coef  # the load-balancing loss's weight (0: not trained)
        self.frozen_layers = frozen.get("layers", {})
        self.trainable_layers = trainable.get("layers", {})

    def context(self, batch: Batch, key) -> LayerContext:
        return LayerContext(
            self.config,
            attention_inputs(
                self.config, batch.positions, batch.segment_ids, self.policy.attention,
                self.policy.packed_slots,
            ),
            self.lora, layer_dropout_keys(key, self.lora, self.config.num_layers), self.policy,
            self.constrain, router_mask(batch) if self.router_coef else None,
        )  # fmt: skip

    def forward_and_head(self, batch: Batch, key, weight):
        """(loss, head gradients, cotangent of the last hidden state, stored activations,
        context, the objective's metrics), the VJP seeded with `weight` (1, or a micro-batch's
        share of the tokens). A trained load-balancing loss joins the loss, and the context
        carries its weights for the backward pass (`router_loss.py`)."""
        top = merge_params(self.frozen, self.trainable)
        context = self.context(batch, key)
        hidden, stored, load = forward_layers(
            self.frozen_layers,
            self.trainable_layers,
            embed(top, batch.input_ids, self.config),
            context,
        )
        head_names = [name for name in head_param_names(self.config) if name in top]
        head_trainable = {
            name: self.trainable[name] for name in head_names if name in self.trainable
        }
        head_frozen = {name: top[name] for name in head_names if name not in self.trainable}
        hidden = self.constrain(hidden)
        chunks = (self.policy.loss_chunk, self.policy.vocab_chunk)
        temperature = 1.0 if self.objective is None else self.objective.temperature
        if self.objective is None:
            metrics, mask = {}, None
        else:  # the objective's token weights, then the weighted token loss's VJP
            head_params = {**head_frozen, **head_trainable}
            nll = token_nll(
                head_params, hidden, batch.target_ids, self.config, *chunks, temperature
            )
            loss, mask, metrics = token_weights(
                self.objective, nll, batch, self.reference_logps(batch, top, context, head_params)
            )

        def head_fn(head_params, h):
            params = {**head_frozen, **head_params}
            if mask is None:
                return head_loss(params, h, batch, self.config, *chunks)
            head = params.get("lm_head", params.get("embed"))
            return token_losses_sum(
                h, params["final_norm"], head, batch.target_ids, mask,
                head_form(self.config, temperature), *chunks,
            )  # fmt: skip

        value, head_vjp = jax.vjp(head_fn, head_trainable, hidden)
        head_grads, cotangent = head_vjp(jnp.asarray(weight, value.dtype))
        loss = value if mask is None else loss
        if load is not None:
            aux = load_balancing_loss(load)
            loss, metrics = loss + self.router_coef * aux, {**metrics, "aux_loss": aux}
            weights = probability_weights(load, self.router_coef * weight)
            context = context._replace(router_weights=weights)
        return loss, head_grads, cotangent, stored, context, metrics

    def reference_logps(self, batch: Batch, top, context: LayerContext, head_params):
        """The reference model's log-prob of each target [B, S] (None when the objective reads
        none): read from the batch when precomputed, else one forward pass of the frozen base
        with the adapters off (`lora=None`: the same weights, no second copy), nothing kept for
        a backward pass."""
        objective = self.objective
        if not objective.needs_reference:
            return None
        if objective.reference == "precomputed":
            return batch.reference_logps
        hidden = run_layers(
            self.frozen_layers, embed(top, batch.input_ids, self.config), context.inputs, self.config,
            None, mlp_chunk=self.policy.mlp_chunk,
        )  # fmt: skip
        chunks = (self.policy.loss_chunk, self.policy.vocab_chunk)
        nll = token_nll(
            head_params, self.constrain(hidden), batch.target_ids, self.config, *chunks,
            objective.temperature,
        )  # fmt: skip
        return -jax.lax.stop_gradient(nll)

    def update_top(self, optimizer, ok, names, gradient_of, opt_state):
        """(trainable, top optimizer state) with each of `names` the model trains (the head's
        tensors, and the embedding where given) updated at once by `gradient_of(name)`; the
        layers are the backward loop's."""
        trainable, new_trainable, new_top_state = (
            self.trainable,
            dict(self.trainable),
            dict(opt_state.top),
        )
        for name in names:
            if name in trainable:
                new_trainable[name], new_top_state[name] = top_update(
                    optimizer, ok, gradient_of(name), opt_state.top[name], trainable[name],
                    self.policy.vocab_chunk,
                )  # fmt: skip
        return new_trainable, new_top_state


def _head_sq(head_grads) -> jax.Array:
    return squared_norm({k: v for k, v in head_grads.items() if k != "embed"})


def _metrics(loss, grad_sq, ok, params_finite) -> dict[str, jax.Array]:
    """What every gradient mode reports: the loss, the global norm before clipping, whether the
    update was applied (a finite loss) and whether the parameters it wrote are finite."""
    return {
        "loss": loss,
        "grad_norm": jnp.sqrt(grad_sq),
        "updated": ok,
        "params_finite": params_finite,
    }


def _fused(model: _StepModel, optimizer, opt_state, batch, key, clip_norm, two_pass):
    """The one-pass step (and, with `two_pass`, its norm-only first pass before it)."""
    trainable = model.trainable
    loss, head_grads, cotangent, stored, context, extra = model.forward_and_head(batch, key, 1.0)
    ok = jnp.isfinite(loss)
    scale = None
    if two_pass:
        cotangent_in, _, layers_sq = backward_layers(
            cotangent, stored, model.frozen_layers, context, norm_sink(model.trainable_layers), ()
        )
        cotangent_in = embedding_rows_cotangent(model.config, cotangent_in)
        embed_sq = (
            embedding_squared_norm(batch.input_ids, cotangent_in, head_grads, trainable["embed"])
            if "embed" in trainable
            else jnp.float32(0)
        )
        grad_sq = _head_sq(head_grads) + layers_sq + embed_sq
        scale = clip_scale(grad_sq, clip_norm)
    new_trainable, new_top_state = model.update_top(
        optimizer, ok, HEAD_PARAMS, lambda name: scaled(head_grads[name], scale), opt_state
    )
    stacks, treedef = jax.tree.flatten(model.trainable_layers)
    sink, target = update_sink(optimizer, ok, treedef, stacks, opt_state.layers, scale)
    cotangent, (stacks, layer_states, layers_finite), layers_sq = backward_layers(
        cotangent, stored, model.frozen_layers, context, sink, target
    )
    cotangent = embedding_rows_cotangent(model.config, cotangent)
    if model.trainable_layers:
        new_trainable["layers"] = jax.tree.unflatten(treedef, stacks)
    embed_sq, embed_finite = jnp.float32(0), jnp.bool_(True)
    if "embed" in trainable:
        new_trainable["embed"], new_top_state["embed"], embed_sq, embed_finite = embedding_update(
            optimizer, ok, batch.input_ids, cotangent, head_grads, opt_state.top["embed"],
            trainable["embed"], model.policy.vocab_chunk, scale,
        )  # fmt: skip
    if not two_pass:
        grad_sq = _head_sq(head_grads) + layers_sq + embed_sq
    finite = layers_finite & embed_finite & _top_finite(new_trainable, "embed")
    metrics = {**_metrics(loss, grad_sq, ok, finite), **extra}
    return new_trainable, StreamedOptState(layer_states, new_top_state), metrics


def _top_finite(trainable, *checked: str) -> jax.Array:
    """Whether the trainable tensors outside the layer stack are finite (the layers' slices are
    checked as the backward loop updates them: `update_sink`; `checked` names others already
    checked as they were updated: the embedding)."""
    skip = {"layers", *checked}
    return all_finite({name: value for name, value in trainable.items() if name not in skip})


def _accumulate(model: _StepModel, batch, key, accumulation_steps):
    """(float32 gradient buffer of every trainable tensor, the batch's loss, whether every
    micro-batch's loss was finite, the objective's metrics): the micro-batches scanned, each
    one's gradient added in."""
    trainable = model.trainable
    total_tokens = jnp.maximum(jnp.sum(batch.loss_mask.astype(jnp.float32)), 1.0)
    buffer = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32), trainable)
    if key is None:
        keys = None
    elif accumulation_steps == 1:
        keys = key[None]  # one micro-batch: the same dropout as the fused step
    else:
        keys = jax.random.split(key, accumulation_steps)

    def micro_step(carry, inputs):
        buffer, loss_sum, ok = carry
        micro, micro_key = inputs
        weight = jnp.sum(micro.loss_mask.astype(jnp.float32)) / total_tokens
        loss, head_grads, cotangent, stored, context, extra = model.forward_and_head(
            micro, micro_key, weight
        )
        buffer = dict(buffer)
        for name in HEAD_PARAMS:
            if name in trainable:
                buffer[name] = buffer[name] + head_grads[name].astype(jnp.float32)
        if model.trainable_layers:
            layer_buffer, treedef = jax.tree.flatten(buffer["layers"])
            cotangent, layer_buffer, _ = backward_layers(
                cotangent, stored, model.frozen_layers, context,
                accumulate_sink(model.trainable_layers), layer_buffer,
            )  # fmt: skip
            buffer["layers"] = jax.tree.unflatten(treedef, layer_buffer)
        if "embed" in trainable:
            if on_host(trainable["embed"]):
                raise StepConfigError(
                    "an embedding trained in host memory has no gradient buffer on the device; "
                    "use memory.embed: device with clipping or accumulation"
                )
            embed_grad = embedding_gradient(
                micro.input_ids,
                embedding_rows_cotangent(model.config, cotangent),
                head_grads,
                trainable["embed"],
            )
            buffer["embed"] = buffer["embed"] + embed_grad.astype(jnp.float32)
        return (buffer, loss_sum + loss * weight, ok & jnp.isfinite(loss)), extra

    (buffer, loss, ok), extra = jax.lax.scan(
        micro_step,
        (buffer, jnp.float32(0), jnp.bool_(True)),
        (micro_batches(batch, accumulation_steps), keys),
    )
    return buffer, loss, ok, jax.tree.map(lambda values: jnp.mean(values, axis=0), extra)


def _kept(model: _StepModel, optimizer, opt_state, batch, key, clip_norm, accumulation_steps):
    """Gradients summed into a float32 buffer over the micro-batches, then clip and update."""
    trainable = model.trainable
    buffer, loss, ok, extra = _accumulate(model, batch, key, accumulation_steps)
    grad_sq = squared_norm(buffer)
    scale = None if clip_norm is None else clip_scale(grad_sq, clip_norm)
    new_trainable, new_top_state = model.update_top(
        optimizer, ok, (*HEAD_PARAMS, "embed"),
        lambda name: scaled(buffer[name], scale).astype(trainable[name].dtype), opt_state,
    )  # fmt: skip
    layer_states, layers_finite = opt_state.layers, jnp.bool_(True)
    if model.trainable_layers:
        stacks, treedef = jax.tree.flatten(model.trainable_layers)
        sink, target = update_sink(optimizer, ok, treedef, stacks, opt_state.layers, scale)
        stacks, layer_states, layers_finite = update_layers(
            sink, jax.tree.leaves(buffer["layers"]), target, model.config.num_layers
        )
        new_trainable["layers"] = jax.tree.unflatten(treedef, stacks)
    metrics = {**_metrics(loss, grad_sq, ok, layers_finite & _top_finite(new_trainable)), **extra}
    return new_trainable, StreamedOptState(layer_states, new_top_state), metrics


def build_streamed_step(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    trainable: Params,
    frozen: Params,
    lora: LoraSpec | None = None,
    policy: MemoryPolicy | None = None,
    accumulation_steps: int = 1,
    clip_norm: float | None = None,
    two_pass: bool = False,
    donate: bool = True,
    shardings: Any = None,
    objective: Objective | None = None,
    router_aux_loss_coef: float = 0.0,
) -> Callable[..., tuple[Params, StreamedOptState, dict[str, jax.Array]]]:
    """A jitted `step(trainable, opt_state, frozen, batch, key) -> (trainable, opt_state, metrics)`.

    `trainable` and `frozen` (arrays or abstract shapes) fix the structure; `trainable` and
    `opt_state` are donated, so the caller keeps exactly one copy (the returned one). Works for
    full fine-tuning (trainable = all parameters), LoRA (trainable = adapters) and QLoRA (LoRA
    over an NF4 frozen base). `clip_norm` clips the global gradient norm (kept gradient, or two
    passes with `two_pass`); `accumulation_steps` splits each batch into that many micro-batches
    whose gradients are summed before one update (see the module docstring for what each costs).
    `metrics["grad_norm"]` is the global norm before clipping. `shardings`
    (`featherweight.parallel.sharding.StepShardings`) compiles for a device mesh: the arguments
    and results keep their layouts, and the residual stream and its cotangent stay split over
    the batch (so XLA gathers each layer's weights, FSDP-style, rather than resharding
    activations); None compiles for one device. `objective` (an `Objective`: preference pairs,
    GRPO; None: next-token cross-entropy): its per-token weights become the loss mask of the same
    backward pass, and its metrics (TRL's names) join the step's. `router_aux_loss_coef` > 0
    trains an MoE router's load-balancing loss beside the cross-entropy (`router_loss.py`;
    `metrics["aux_loss"]`, and `metrics["loss"]` includes coef x aux).
    """
    policy = policy or MemoryPolicy()
    check_objective(objective, lora, accumulation_steps)
    check_router_loss(router_aux_loss_coef, config, objective)
    check_optimizer(optimizer)
    refuse_multisteps(optimizer, trainable)
    mode = gradient_mode(clip_norm, two_pass, accumulation_steps)
    check_uniform_layers(frozen, trainable, config.num_layers)
    constrain = activation_constraint(shardings)

    def step(trainable, opt_state: StreamedOptState, frozen, batch: Batch, key):
        model = _StepModel(
            config, lora, policy, constrain, trainable, frozen, objective, router_aux_loss_coef
        )
        if mode == "kept":
            new_trainable, new_state, metrics = _kept(
                model, optimizer, opt_state, batch, key, clip_norm, accumulation_steps
            )
        else:
            new_trainable, new_state, metrics = _fused(
                model, optimizer, opt_state, batch, key, clip_norm, mode == "two_pass"
            )
        metrics = {**metrics, "tokens": jnp.sum(batch.loss_mask)}
        # each result in the memory its argument came from: host outputs declared as such
        return placed_like(new_trainable, trainable), placed_like(new_state, opt_state), metrics

    return jax.jit(step, donate_argnums=(0, 1) if donate else (), **jit_shardings(shardings))
