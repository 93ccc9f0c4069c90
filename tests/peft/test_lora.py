"""LoRA adapters: settings are validated, initialization is PEFT's, and the adapted forward pass
and the merge equal PEFT's (PyTorch) on the same tiny model and adapter weights."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from featherweight.errors import AdapterConfigError
from featherweight.io.loader import load_model
from featherweight.models.linear import LINEAR_NAMES
from featherweight.peft.lora import (
    PEFT_MODULES,
    LoraConfig,
    abstract_lora,
    check_adapters,
    init_lora,
    merge_lora_weight,
)
from tests.conftest import tiny_config
from tests.peft.lora_helpers import lora_logits, peft_model_with, random_adapters
from tests.tiny_checkpoints import VOCAB, hf_config, hf_logits, random_hf_model, save_hf

FLOAT32_TOLERANCE = 1e-4
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 24))

# --- settings ------------------------------------------------------------------------------------


def test_unknown_target_is_refused_with_the_valid_names():
    with pytest.raises(AdapterConfigError, match="'qkv'") as error:
        LoraConfig(targets=("q", "qkv"))
    for name in LINEAR_NAMES:
        assert name in str(error.value)


def test_targets_accept_peft_names_and_strings_in_model_order():
    assert LoraConfig(targets=("down_proj", "q_proj", "q")).targets == ("q", "down")
    assert LoraConfig(targets="v, k").targets == ("k", "v")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rank": 0}, "rank=0"),
        ({"rank": -4}, "rank=-4"),
        ({"rank": 2.0}, "rank=2.0"),
        ({"alpha": 0.0}, "alpha=0.0"),
        ({"alpha": -1.0}, "alpha=-1.0"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"dropout": -0.1}, "dropout=-0.1"),
        ({"targets": ()}, "at least one target"),
    ],
)
def test_bad_settings_raise_typed_errors(settings, message):
    with pytest.raises(AdapterConfigError, match=message):
        LoraConfig(**settings)


def test_rank_above_the_smaller_dimension_of_a_target_is_refused():
    config = tiny_config()  # k and v are [32, 64]; q is [64, 64]
    with pytest.raises(AdapterConfigError, match=r"target 'k'.*\[32, 64\].*rank <= 32"):
        init_lora(jax.random.PRNGKey(0), config, LoraConfig(rank=33, targets=("q", "k")))
    adapters = init_lora(jax.random.PRNGKey(0), config, LoraConfig(rank=33, targets=("q",)))
    assert adapters["layers"]["lora"]["q"]["a"].shape == (config.num_layers, 33, 64)


def test_scale_is_alpha_over_rank_or_over_its_root_with_rslora():
    assert LoraConfig(rank=16, alpha=32).spec.scale == 2.0
    assert LoraConfig(rank=16, alpha=32, rslora=True).spec.scale == 8.0
    assert LoraConfig(dropout=0.1).spec.dropout == 0.1


# --- initialization --------------------------------------------------------------------------------


def test_init_matches_peft_kaiming_uniform_a_and_zero_b():
    config = tiny_config()
    lora_config = LoraConfig(rank=8)
    adapters = init_lora(jax.random.PRNGKey(0), config, lora_config)["layers"]["lora"]
    assert set(adapters) == set(LINEAR_NAMES)
    for name, pair in adapters.items():
        in_features = pair["a"].shape[-1]
        torch_a = torch.empty(64 * lora_config.rank, in_features)
        torch.nn.init.kaiming_uniform_(torch_a, a=math.sqrt(5))  # what PEFT does to lora_A
        bound = 1 / math.sqrt(in_features)
        assert float(torch_a.abs().max()) <= bound
        assert float(jnp.abs(pair["a"]).max()) <= bound
        assert float(jnp.std(pair["a"])) == pytest.approx(bound / math.sqrt(3), rel=0.1), name
        assert not jnp.any(pair["b"]), f"{name}: B must start at zero"
    shapes = jax.tree.map(lambda leaf: leaf.shape, adapters)
    assert (
        shapes
        == jax.tree.map(lambda leaf: leaf.shape, abstract_lora(config, lora_config))["layers"][
            "lora"
        ]
    )


def test_check_adapters_refuses_another_rank():
    config = tiny_config()
    adapters = init_lora(jax.random.PRNGKey(0), config, LoraConfig(rank=4))["layers"]["lora"]
    with pytest.raises(AdapterConfigError, match=r"q\.a has shape \(2, 4, 64\)"):
        check_adapters(adapters, config, LoraConfig(rank=8))
    with pytest.raises(AdapterConfigError, match="targets"):
        check_adapters(adapters, config, LoraConfig(rank=4, targets=("q",)))


# --- parity with PEFT ---------------------------------------------------------------------------

# case -> (family, LoRA settings)
PARITY_CASES = {
    "llama-all-targets": ("llama2", LoraConfig(rank=4, alpha=8)),
    "smollm2-subset-rslora": (
        "smollm2",
        LoraConfig(rank=8, alpha=4, targets=("q", "v", "down"), rslora=True),
    ),
}


@pytest.fixture(scope="module", params=list(PARITY_CASES))
def parity_case(request, tmp_path_factory):
    """(transformers model, featherweight model, LoRA config, adapters with non-zero B)."""
    family, lora_config = PARITY_CASES[request.param]
    hf_model = random_hf_model(hf_config(family))
    model = load_model(save_hf(hf_model, tmp_path_factory.mktemp(family)), dtype="float32")
    adapters = random_adapters(jax.random.PRNGKey(3), model.config, lora_config)
    return hf_model, model, lora_config, adapters


def test_lora_forward_equals_peft(parity_case):
    hf_model, model, lora_config, adapters = parity_case
    ours = lora_logits(model.params, adapters, jnp.asarray(TOKENS), model.config, lora_config.spec)
    theirs = hf_logits(peft_model_with(hf_model, adapters, lora_config), TOKENS)
    diff = np.abs(np.asarray(ours) - theirs).max()
    assert diff <= FLOAT32_TOLERANCE, f"max abs diff {diff:.2e} vs peft"
    # the adapters move the logits far more than the tolerance: the parity is not vacuous
    assert np.abs(theirs - hf_logits(hf_model, TOKENS)).max() > 1000 * FLOAT32_TOLERANCE


def test_merge_equals_peft_merge_and_unload(parity_case):
    hf_model, model, lora_config, adapters = parity_case
    merged = peft_model_with(hf_model, adapters, lora_config).merge_and_unload()
    scale = lora_config.scale
    for target, pair in adapters["layers"]["lora"].items():
        ours = merge_lora_weight(model.params["layers"][target], pair["a"], pair["b"], scale)
        for index, layer in enumerate(merged.model.layers):
            theirs = layer.get_submodule(PEFT_MODULES[target]).weight.detach().numpy()
            np.testing.assert_allclose(ours[index], theirs, atol=1e-6)
