"""Preference objectives (DPO, IPO, ORPO): the losses and the adapters' gradients equal a plain
PyTorch implementation of TRL's formulas on the same tiny Llama (transformers + PEFT) and pairs,
padded and packed; the streamed step equals the `jax.grad` reference step over 20 steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

from featherweight.errors import StepConfigError
from featherweight.io.loader import load_model
from featherweight.models.batch import Batch
from featherweight.peft.lora import PEFT_MODULES, LoraConfig
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.preference import PreferenceObjective
from featherweight.step.reference import build_reference_step, objective_model_loss
from featherweight.step.streamed import build_streamed_step
from tests.conftest import relative_difference
from tests.peft.lora_helpers import peft_model_with, random_adapters
from tests.tiny_checkpoints import VOCAB, hf_config, random_hf_model, save_hf

LORA = LoraConfig(rank=4, alpha=8, targets=("q", "v", "down"))
OBJECTIVES = {
    "dpo": PreferenceObjective("dpo", beta=0.1),
    "ipo": PreferenceObjective("dpo", beta=0.5, loss="ipo"),
    "orpo": PreferenceObjective("orpo", beta=0.2),
}
RNG = np.random.default_rng(7)
# three pairs: (prompt, chosen, rejected) token lists, the prompt shared by both completions
PAIRS = [
    tuple(list(RNG.integers(0, VOCAB, n)) for n in lengths)
    for lengths in ((5, 4, 5), (3, 6, 2), (6, 3, 4))
]
SEQ = 32


def _sequences():
    """(tokens, completion start, sequence id) of every completion: pair p's chosen is 2p."""
    for pair, (prompt, chosen, rejected) in enumerate(PAIRS):
        yield prompt + chosen, len(prompt), 2 * pair
        yield prompt + rejected, len(prompt), 2 * pair + 1


def _row(examples):
    """One row's arrays [SEQ + 1] from (tokens, completion start, id) examples packed in order."""
    tokens, completion = np.zeros(SEQ + 1, np.int32), np.zeros(SEQ + 1, bool)
    segments, positions = np.zeros(SEQ + 1, np.int32), np.zeros(SEQ + 1, np.int32)
    ids, start = np.full(SEQ + 1, -1, np.int32), 0
    for segment, (example, first, sequence) in enumerate(examples, start=1):
        end = start + len(example)
        tokens[start:end], segments[start:end], ids[start:end] = example, segment, sequence
        completion[start + first : end] = True
        positions[start:end] = np.arange(len(example))
        start = end
    return tokens, completion, segments, positions, ids


def _batch(rows) -> Batch:
    tokens, completion, segments, positions, ids = (
        np.stack(part) for part in zip(*map(_row, rows))
    )
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    return Batch(
        tokens[:, :-1], tokens[:, 1:], (completion[:, 1:] & same).astype(np.float32),
        positions[:, :-1], segments[:, :-1], ids[:, :-1],
    )  # fmt: skip


def padded_batch() -> Batch:
    """One completion per row: the pairs' chosen and rejected rows side by side."""
    return _batch([[sequence] for sequence in _sequences()])


def packed_batch() -> Batch:
    """Completions packed two rows deep, pair 1 split across the rows (the numbering pairs them)."""
    sequences = list(_sequences())
    return _batch([sequences[:3], sequences[3:]])


@pytest.fixture(scope="module")
def tiny():
    """(transformers model, featherweight base params, config, adapters with non-zero B)."""
    hf_model = random_hf_model(hf_config("llama2"))
    directory = save_hf(hf_model, __import__("tempfile").mkdtemp() + "/llama")
    model = load_model(directory, dtype="float32")
    adapters = random_adapters(jax.random.PRNGKey(3), model.config, LORA)
    return hf_model, model.params, model.config, adapters


# --- the reference in PyTorch: TRL's formulas over transformers + PEFT --------------------------


def _torch_logps(model, tokens, first):
    """(summed completion log-prob, completion length) of one sequence, a tensor with grad."""
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0, :-1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logps[first - 1 :].sum(), len(tokens) - first


def torch_loss_and_grads(hf_model, adapters, objective: PreferenceObjective):
    """TRL's loss for these pairs, and its gradient for every adapter (per target: a, b [L, ...])."""
    model = peft_model_with(hf_model, adapters, LORA)
    policy = [_torch_logps(model, t, f) for t, f, _ in _sequences()]
    logps = torch.stack([value for value, _ in policy]).reshape(-1, 2)
    lengths = torch.tensor([float(n) for _, n in policy]).reshape(-1, 2)
    beta = objective.beta
    if objective.kind == "orpo":
        average = logps / lengths
        pc, pr = average[:, 0], average[:, 1]
        log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
        nll = -logps[:, 0].sum() / lengths[:, 0].sum()
        loss = nll - (beta * F.logsigmoid(log_odds)).mean()
        logged = {  # TRL's ORPOTrainer's names
            "log_odds_ratio": float(F.logsigmoid(log_odds).mean()),
            "log_odds_chosen": float(log_odds.mean()),
        }
    else:
        logged = {}
        with torch.no_grad(), model.disable_adapter():
            reference = torch.stack([_torch_logps(model, t, f)[0] for t, f, _ in _sequences()])
        reference = reference.reshape(-1, 2)
        if objective.loss == "ipo":
            logps, reference = logps / lengths, reference / lengths
        z = (logps[:, 0] - logps[:, 1]) - (reference[:, 0] - reference[:, 1])
        losses = (z - 1 / (2 * beta)) ** 2 if objective.loss == "ipo" else -F.logsigmoid(beta * z)
        loss = losses.mean()
    loss.backward()
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
    return float(loss.detach()), {"layers": {"lora": grads}}, logged


def keep_gradient() -> optax.GradientTransformation:
    """An 'optimizer' whose state is the last gradient (and which changes nothing): what the
    streamed step computed, read back from its state."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
    )


def streamed_loss_and_grads(config, frozen, adapters, batch, objective, policy=None):
    step = build_streamed_step(
        config, keep_gradient(), adapters, frozen, lora=LORA.spec, policy=policy,
        donate=False, objective=objective,
    )  # fmt: skip
    state = init_streamed_opt_state(keep_gradient(), adapters)
    _, state, metrics = step(adapters, state, frozen, batch, None)
    treedef = jax.tree.structure(adapters["layers"])
    return metrics, {"layers": jax.tree.unflatten(treedef, state.layers)}


LAYOUTS = {"padded": padded_batch, "packed": packed_batch}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_loss_and_adapter_gradients_equal_trl_formulas_in_pytorch(tiny, name, layout):
    hf_model, frozen, config, adapters = tiny
    objective, batch = OBJECTIVES[name], LAYOUTS[layout]()
    expected_loss, expected_grads, logged = torch_loss_and_grads(hf_model, adapters, objective)

    def loss_of(trainable):
        return objective_model_loss(trainable, frozen, batch, config, objective, LORA.spec)

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(adapters)
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
    assert int(metrics["pairs"]) == len(PAIRS)
    assert relative_difference(expected_grads, grads) <= 1e-5
    # the streamed step: the objective's token weights through the chunked head and layer loop
    policy = MemoryPolicy(loss_chunk=8, vocab_chunk=64)
    streamed_metrics, streamed = streamed_loss_and_grads(
        config, frozen, adapters, batch, objective, policy
    )
    np.testing.assert_allclose(float(streamed_metrics["loss"]), expected_loss, rtol=1e-5)
    assert relative_difference(expected_grads, streamed) <= 1e-5
    for key in ("rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(streamed_metrics[key], metrics[key], rtol=1e-5, atol=1e-7)
    for key, value in logged.items():
        np.testing.assert_allclose(streamed_metrics[key], value, rtol=1e-5, atol=1e-6)


def _reference_token_logps(config, frozen, batch):
    """The base model's log-prob of each target [B, S]: what `reference: precomputed` stores."""
    from featherweight.models.llama import forward

    logits = forward(frozen, batch.input_ids, config, batch.positions, batch.segment_ids)
    logps = jax.nn.log_softmax(logits, -1)
    return jnp.take_along_axis(logps, batch.target_ids[..., None], -1)[..., 0] * batch.loss_mask


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_twenty_streamed_steps_equal_the_reference_step(tiny, name):
    _, frozen, config, adapters = tiny
    objective, batch = OBJECTIVES[name], packed_batch()
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
    accuracies = []
    for step in range(20):
        key = jax.random.PRNGKey(step)
        ref_params, ref_state, ref_metrics = reference(ref_params, ref_state, frozen, batch, key)
        st_params, st_state, st_metrics = streamed(st_params, st_state, frozen, batch, key)
        np.testing.assert_allclose(st_metrics["loss"], ref_metrics["loss"], rtol=1e-5)
        accuracies.append(float(st_metrics["rewards/accuracies"]))
    assert relative_difference(ref_params, st_params) <= 2e-5
    assert relative_difference(adapters, st_params) > 1e-2  # the steps did train
    assert accuracies[-1] == 1.0  # three pairs, learned


def test_precomputed_reference_equals_the_same_step_reference(tiny):
    _, frozen, config, adapters = tiny
    batch = packed_batch()
    same_step, _ = streamed_loss_and_grads(config, frozen, adapters, batch, OBJECTIVES["dpo"])
    stored = batch._replace(reference_logps=_reference_token_logps(config, frozen, batch))
    precomputed = OBJECTIVES["dpo"]._replace(reference="precomputed")
    read, _ = streamed_loss_and_grads(config, frozen, adapters, stored, precomputed)
    for key in ("loss", "rewards/chosen", "rewards/rejected"):
        np.testing.assert_allclose(read[key], same_step[key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("objective", "lora", "steps", "message"),
    [
        (PreferenceObjective("dpo"), None, 1, "precomputed"),
        (PreferenceObjective("orpo"), LORA.spec, 2, "accumulation_steps"),
        (PreferenceObjective("kto"), LORA.spec, 1, "unknown"),
        (PreferenceObjective("dpo", beta=0.0), LORA.spec, 1, "beta"),
    ],
)
def test_objectives_the_step_cannot_compute_are_refused(tiny, objective, lora, steps, message):
    _, frozen, config, adapters = tiny
    with pytest.raises(StepConfigError, match=message):
        build_streamed_step(
            config, optax.sgd(0.1), adapters, frozen, lora=lora, accumulation_steps=steps,
            objective=objective,
        )  # fmt: skip


def test_global_clipping_keeps_the_gradient_and_equals_the_reference(tiny):
    """The streamed step's kept-gradient mode (global clipping) with a preference objective."""
    _, frozen, config, adapters = tiny
    objective, batch = OBJECTIVES["ipo"], packed_batch()
    optimizer = optax.sgd(0.5)
    reference = build_reference_step(
        config, optax.chain(optax.clip_by_global_norm(1e-3), optimizer), lora=LORA.spec,
        donate=False, objective=objective,
    )  # fmt: skip
    streamed = build_streamed_step(
        config, optimizer, adapters, frozen, lora=LORA.spec, clip_norm=1e-3, donate=False,
        objective=objective,
    )  # fmt: skip
    ref_params, _, ref_metrics = reference(adapters, optax.chain(
        optax.clip_by_global_norm(1e-3), optimizer).init(adapters), frozen, batch, None)  # fmt: skip
    st_params, _, st_metrics = streamed(
        adapters, init_streamed_opt_state(optimizer, adapters), frozen, batch, None
    )
    np.testing.assert_allclose(st_metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    assert float(st_metrics["grad_norm"]) > 1e-3  # the clip did act
    assert relative_difference(ref_params, st_params) <= 1e-6
    np.testing.assert_allclose(
        st_metrics["rewards/margins"], ref_metrics["rewards/margins"], rtol=1e-5
    )
