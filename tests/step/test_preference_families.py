"""DPO and ORPO on the families beside Llama: on tiny random Hugging Face checkpoints of Qwen3
(QK-norm, head_dim != D/H), Gemma 3 (sliding and global layers, attention and final softcaps,
(1 + w) and sandwich norms), Phi-3 (q, k, v and gate, up fused on disk, partial rotary, a window
on every layer) and Qwen3-MoE (routed experts, an adapter on the experts' down projections), the
streamed step's loss, reward metrics and adapter gradients equal the `jax.grad` reference step's
(float32, the Llama tests' tolerance). The window (4) is shorter than every sequence, and the
pairs are packed two completions to a row, so windows and documents both cut the attention."""

import jax
import numpy as np
import pytest
import transformers

from featherweight.io.loader import load_model
from featherweight.step.policy import MemoryPolicy
from featherweight.step.reference import build_reference_step
from tests.conftest import relative_difference
from tests.peft.lora_helpers import random_adapters
from tests.step.test_preference import (
    LORA,
    OBJECTIVES,
    keep_gradient,
    packed_batch,
    streamed_loss_and_grads,
)
from tests.tiny_checkpoints import SIZES, random_hf_model, save_hf

WINDOW = 4  # every sequence of the pairs is 7 to 9 tokens long

# family -> (transformers config class, settings beyond SIZES)
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=True)),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "phi3": (
        transformers.Phi3Config,
        dict(
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
            pad_token_id=0,
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, featherweight's float32 load of the family's checkpoint, adapters with non-zero B)."""
    config_class, settings = FAMILIES[request.param]
    hf_model = random_hf_model(config_class(**{**SIZES, **settings}))
    model = load_model(save_hf(hf_model, tmp_path_factory.mktemp(request.param)), "float32")
    adapters = random_adapters(jax.random.PRNGKey(3), model.config, LORA)
    return request.param, model, adapters


def test_the_checkpoints_carry_their_families_features(family):
    name, model, adapters = family
    config = model.config
    features = {
        "qwen3": config.qk_norm and config.head_dim * config.num_heads != config.hidden_size,
        "gemma3": config.attn_softcap == 2.0
        and config.final_softcap == 3.0
        and config.sliding_layers == (True, False)
        and config.sandwich_norms,
        "phi3": config.windows == "all" and config.rotary_dim == config.head_dim // 2,
        "qwen3_moe": config.num_experts == 8 and adapters["layers"]["lora"]["down"]["a"].ndim == 4,
    }
    assert features[name] and config.sliding_window in (None, WINDOW)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_streamed_step_equals_the_reference_step(family, objective):
    name, model, adapters = family
    config, frozen, batch = model.config, model.params, packed_batch()
    preference = OBJECTIVES[objective]
    reference = build_reference_step(
        config, keep_gradient(), lora=LORA.spec, donate=False, objective=preference
    )
    _, expected_grads, expected = reference(
        adapters, keep_gradient().init(adapters), frozen, batch, None
    )
    policy = MemoryPolicy(loss_chunk=8, vocab_chunk=64)
    metrics, grads = streamed_loss_and_grads(config, frozen, adapters, batch, preference, policy)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
    assert int(metrics["pairs"]) == int(expected["pairs"]) == 3
    for key in ("rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(metrics[key], expected[key], rtol=1e-5, atol=1e-7)
    assert relative_difference(expected_grads, grads) <= 1e-5, name
    assert all(float(np.abs(leaf).max()) > 0 for leaf in jax.tree.leaves(expected_grads))
