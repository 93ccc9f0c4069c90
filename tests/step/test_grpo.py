"""GRPO: the loss and the adapters' gradients equal a plain PyTorch implementation of TRL's
formulas (`GRPOTrainer._compute_loss`, `_generate_and_score_completions`) on the same tiny Llama
(transformers + PEFT), completions, rollout log-probs and rewards, for each loss type; the
streamed step equals the `jax.grad` reference step over several steps."""

import jax
import numpy as np
import optax
import pytest
import torch

from featherweight.errors import StepConfigError
from featherweight.io.loader import load_model
from featherweight.models.batch import Batch
from featherweight.peft.lora import PEFT_MODULES, LoraConfig
from featherweight.step.grpo import GrpoObjective, group_advantages
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.reference import build_reference_step, objective_model_loss
from featherweight.step.streamed import build_streamed_step
from tests.conftest import relative_difference
from tests.peft.lora_helpers import peft_model_with, random_adapters
from tests.step.test_preference import LORA, streamed_loss_and_grads
from tests.tiny_checkpoints import VOCAB, hf_config, random_hf_model, save_hf

GENERATIONS, SEQ, TEMPERATURE = 3, 16, 0.7
RNG = np.random.default_rng(11)
PROMPTS = [list(RNG.integers(0, VOCAB, n)) for n in (4, 6)]
# one completion per row, a prompt's completions adjacent; the last fills the row to the end
COMPLETIONS = [list(RNG.integers(0, VOCAB, n)) for n in (3, 7, 1, 5, 2, SEQ + 1 - 6)]
REWARDS = np.asarray([1.0, 0.0, 0.5, 2.0, np.nan, 1.0], np.float32)  # one unscored
OBJECTIVES = {
    loss_type: GrpoObjective(0.04, 0.2, 0.28, loss_type, 12, TEMPERATURE)
    for loss_type in ("grpo", "dr_grpo", "dapo")
}


def _rows():
    """(tokens [B, SEQ + 1], completion target mask [B, SEQ]) of prompt + completion rows."""
    tokens, mask = np.zeros((len(COMPLETIONS), SEQ + 1), np.int32), np.zeros((6, SEQ), np.float32)
    for row, completion in enumerate(COMPLETIONS):
        prompt = PROMPTS[row // GENERATIONS]
        tokens[row, : len(prompt) + len(completion)] = prompt + completion
        mask[row, len(prompt) - 1 : len(prompt) + len(completion) - 1] = 1.0
    return tokens, mask


def _torch_token_logps(model, tokens) -> torch.Tensor:
    """Each target's log-prob [B, SEQ] at the sampling temperature (TRL divides the logits)."""
    ids = torch.tensor(tokens, dtype=torch.long)
    logits = model(input_ids=ids[:, :-1]).logits.float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def _torch_advantages(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """TRL's `sum_then_normalize` advantages, its `nanstd` written out."""

    def nanstd(x, dim=None):
        mean = torch.nanmean(x, dim=dim, keepdim=True)
        variance = torch.nanmean((x - mean) ** 2, dim=dim)
        count = torch.sum(~torch.isnan(x), dim=dim)
        return torch.sqrt(variance * count / (count - 1))

    grouped = rewards.view(-1, GENERATIONS)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(GENERATIONS)
    std = nanstd(grouped, 1).repeat_interleave(GENERATIONS) if scale == "group" else nanstd(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.fixture(scope="module")
def tiny():
    """(transformers model, base params, config, adapters, the GRPO batch, rollout log-probs)."""
    hf_model = random_hf_model(hf_config("llama2"))
    directory = save_hf(hf_model, __import__("tempfile").mkdtemp() + "/llama")
    model = load_model(directory, dtype="float32")
    adapters = random_adapters(jax.random.PRNGKey(5), model.config, LORA)
    tokens, mask = _rows()
    with torch.no_grad():  # the rollout's log-probs: the policy's, moved so that clips happen
        current = _torch_token_logps(peft_model_with(hf_model, adapters, LORA), tokens)
    rollout = (current.numpy() + RNG.normal(0, 0.25, current.shape).astype(np.float32)) * mask
    positions = np.broadcast_to(np.arange(SEQ), (len(COMPLETIONS), SEQ))
    batch = Batch(
        tokens[:, :-1], tokens[:, 1:], mask, positions, rollout_logps=rollout,
        advantages=np.asarray(group_advantages(REWARDS, GENERATIONS, "group")),
    )  # fmt: skip
    return hf_model, model.params, model.config, adapters, batch


def torch_loss_and_grads(hf_model, adapters, batch, objective: GrpoObjective):
    """TRL's GRPO loss over these completions, and its gradient for every adapter."""
    model = peft_model_with(hf_model, adapters, LORA)
    tokens = np.concatenate([batch.input_ids, batch.target_ids[:, -1:]], axis=1)
    logps = _torch_token_logps(model, tokens)
    mask, old = torch.tensor(batch.loss_mask), torch.tensor(batch.rollout_logps)
    advantages = torch.tensor(batch.advantages)[:, None]
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - objective.epsilon, 1 + objective.epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    with torch.no_grad(), model.disable_adapter():
        ref = _torch_token_logps(model, tokens)
    per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
    per_token_loss = per_token_loss + objective.beta * per_token_kl
    if objective.loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif objective.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (mask.size(0) * objective.max_completion_length)
    else:
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    per_token_kl, coef_1 = per_token_kl.detach(), coef_1.detach()
    is_low = (coef_1 < 1 - objective.epsilon) & (advantages < 0)
    is_high = (coef_1 > 1 + objective.epsilon_high) & (advantages > 0)
    metrics = {
        "kl": float((per_token_kl * mask).sum() / mask.sum()),
        "clip_ratio/low_mean": float((is_low * mask).sum() / mask.sum()),
        "clip_ratio/high_mean": float((is_high * mask).sum() / mask.sum()),
        "clip_ratio/high_max": float(((is_high * mask).sum(-1) / mask.sum(-1)).max()),
    }
    layers = model.base_model.model.model.layers
    grads = {
        target: {
            part: np.stack([
                getattr(layer.get_submodule(PEFT_MODULES[target]), f"lora_{part.upper()}")[
                    "default"
                ].weight.grad.numpy()
                for layer in layers
            ])
            for part in ("a", "b")
        }
        for target in LORA.targets
    }  # fmt: skip
    return float(loss.detach()), metrics, {"layers": {"lora": grads}}


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale):
    expected = _torch_advantages(torch.tensor(REWARDS), scale).numpy()
    actual = np.asarray(group_advantages(REWARDS, GENERATIONS, scale))
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)
    assert actual[4] == 0.0  # the unscored completion moves nothing


@pytest.mark.parametrize("loss_type", list(OBJECTIVES))
def test_loss_and_adapter_gradients_equal_trl_formulas_in_pytorch(tiny, loss_type):
    hf_model, frozen, config, adapters, batch = tiny
    objective = OBJECTIVES[loss_type]
    expected_loss, expected_metrics, expected_grads = torch_loss_and_grads(
        hf_model, adapters, batch, objective
    )
    assert expected_metrics["clip_ratio/high_mean"] > 0  # the clip acts on this batch
    assert expected_metrics["clip_ratio/low_mean"] > 0

    def loss_of(trainable):
        return objective_model_loss(trainable, frozen, batch, config, objective, LORA.spec)

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(adapters)
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
    assert relative_difference(expected_grads, grads) <= 1e-5
    # the streamed step: GRPO's token weights through the chunked head and the layer loop
    policy = MemoryPolicy(loss_chunk=8, vocab_chunk=64)
    streamed_metrics, streamed = streamed_loss_and_grads(
        config, frozen, adapters, batch, objective, policy
    )
    np.testing.assert_allclose(float(streamed_metrics["loss"]), expected_loss, rtol=1e-5)
    assert relative_difference(expected_grads, streamed) <= 1e-5
    for name, value in expected_metrics.items():
        np.testing.assert_allclose(streamed_metrics[name], value, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-7)


def test_streamed_steps_equal_the_reference_step(tiny):
    _, frozen, config, adapters, batch = tiny
    objective = OBJECTIVES["dapo"]
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    lora = LoraConfig(rank=4, alpha=8, targets=LORA.targets, dropout=0.1).spec  # dropout too
    reference = build_reference_step(
        config, optimizer, lora=lora, donate=False, objective=objective
    )
    streamed = build_streamed_step(
        config, optimizer, adapters, frozen, lora=lora, donate=False, objective=objective,
        policy=MemoryPolicy(loss_chunk=8, save=("qkv",)),
    )  # fmt: skip
    ref_params, ref_state = adapters, optimizer.init(adapters)
    st_params, st_state = adapters, init_streamed_opt_state(optimizer, adapters)
    for step in range(6):
        key = jax.random.PRNGKey(step)
        ref_params, ref_state, ref_metrics = reference(ref_params, ref_state, frozen, batch, key)
        st_params, st_state, st_metrics = streamed(st_params, st_state, frozen, batch, key)
        np.testing.assert_allclose(st_metrics["loss"], ref_metrics["loss"], rtol=1e-5)
        np.testing.assert_allclose(st_metrics["kl"], ref_metrics["kl"], rtol=1e-4, atol=1e-8)
    assert relative_difference(ref_params, st_params) <= 2e-5
    assert relative_difference(adapters, st_params) > 1e-2  # the steps did train
    assert float(st_metrics["kl"]) > 0  # and moved away from the reference


@pytest.mark.parametrize(
    ("objective", "message"),
    [
        (GrpoObjective(loss_type="bnpo"), "loss_type"),
        (GrpoObjective(beta=-0.1), "beta"),
        (GrpoObjective(epsilon=1.5), "epsilon"),
        (GrpoObjective(temperature=0.0), "temperature"),
    ],
)
def test_settings_the_step_cannot_compute_are_refused(objective, message):
    with pytest.raises(StepConfigError, match=message):
        objective.check()


def test_full_fine_tuning_with_a_kl_is_refused(tiny):
    _, frozen, config, adapters, _ = tiny
    with pytest.raises(StepConfigError, match="beta: 0"):
        build_streamed_step(
            config, optax.sgd(0.1), adapters, frozen, lora=None, objective=GrpoObjective(0.1)
        )
