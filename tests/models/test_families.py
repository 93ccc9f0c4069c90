"""Every family against transformers on tiny random checkpoints (float32, eager attention):
logits within 1e-4 and greedy generation token for token, with sequences longer than the
sliding window; and the streamed step's staged backward of each family against `jax.vjp` of its
forward (the layer is written once: `models/llama.py`'s stages serve all three).

Each case carries the feature it is named for (`test_case_exercises_its_feature`), so a family
whose feature were ignored could not pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from featherweight.inference.generate import generate_ids, logits
from featherweight.models.llama import attention_inputs, block
from featherweight.step.layer_grad import layer_forward, layer_vjp
from tests.tiny_checkpoints import TOKENS, reference_and_loaded

TOLERANCE = 1e-4
WINDOW = 8  # shorter than TOKENS' 48 positions and the generation's prompt

_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)

# case -> (transformers config class, settings beyond _SMALL, the feature it shows)
CASES = {
    "qwen3-qk-norm": (
        transformers.Qwen3Config,
        dict(num_hidden_layers=2, head_dim=24, rope_theta=1e6, tie_word_embeddings=True),
        "qk_norm",
    ),
    "qwen3-sliding-upper-layers": (
        transformers.Qwen3Config,
        dict(
            num_hidden_layers=3,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            tie_word_embeddings=False,
        ),
        "some_windows",
    ),
    "gemma2-softcaps": (
        transformers.Gemma2Config,
        dict(
            num_hidden_layers=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
        "softcaps",
    ),
    "gemma3-local-rope": (
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
        "local_rope",
    ),
    "phi3-fused-partial-rotary": (
        transformers.Phi3Config,
        dict(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
            pad_token_id=0,
        ),
        "partial_rotary",
    ),
    "mistral-sliding-window": (
        transformers.MistralConfig,
        dict(num_hidden_layers=2, sliding_window=WINDOW, rope_theta=1e6),
        "all_windows",
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, loaded float32 model) of one case."""
    config_class, settings, _ = CASES[request.param]
    config = config_class(**{**_SMALL, **settings})
    directory = tmp_path_factory.mktemp(request.param)
    return (request.param, *reference_and_loaded(config, directory))


def test_logits_equal_transformers(case):
    name, hf_model, model = case
    with torch.no_grad():
        expected = hf_model(torch.as_tensor(TOKENS)).logits.float().numpy()
    diff = np.abs(np.asarray(logits(model, TOKENS)) - expected).max()
    assert diff <= TOLERANCE, f"{name}: max abs diff {diff:.2e} vs transformers"
    assert np.abs(expected).max() > 1.0


def test_greedy_generation_equals_transformers(case):
    """A prompt longer than the window, and a reply that runs past it: the cache's window ring
    and the layers' patterns decide every token."""
    name, hf_model, model = case
    prompt = [int(token) for token in TOKENS[0, :20]]
    with torch.no_grad():
        output = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    expected = output[0, len(prompt) :].tolist()
    assert generate_ids(model, prompt, 12) == expected, name


def test_case_exercises_its_feature(case):
    name, _, model = case
    config = model.config
    feature = CASES[name][2]
    checks = {
        "qk_norm": config.qk_norm and config.head_dim * config.num_heads != config.hidden_size,
        "some_windows": config.windows == "some" and config.sliding_layers == (False, True, True),
        "softcaps": config.attn_softcap == 2.0
        and config.final_softcap == 3.0
        and config.norm_offset == 1.0
        and config.sandwich_norms
        and config.embed_scale
        and config.query_scale == pytest.approx(24**-0.5),
        "local_rope": config.local_rope_theta == 1000.0
        and config.qk_norm
        and config.rope_scaling.rope_type == "linear"
        and config.windows == "some",
        "partial_rotary": config.rotary_dim == config.head_dim // 2 and config.windows == "all",
        "all_windows": config.windows == "all" and config.sliding_window == WINDOW,
    }
    assert checks[feature], f"{name} does not carry {feature}"


@pytest.mark.parametrize("save", [(), ("qkv", "attention", "mlp_hidden")], ids=["remat", "kept"])
def test_staged_backward_equals_vjp_of_the_forward(case, save):
    """Every layer of the model (sliding and global alike): `layer_vjp` from `layer_forward`'s
    kept intermediates equals `jax.vjp` of `block`, the forward pass's layer (float32, 1e-5)."""
    _, _, model = case
    config = model.config
    tokens = jnp.asarray(TOKENS[:, :24])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    inputs = attention_inputs(config, positions)
    x = jax.random.normal(jax.random.PRNGKey(0), (*tokens.shape, config.hidden_size))
    cotangent = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    for index in range(config.num_layers):
        layer = jax.tree.map(lambda leaf, i=index: leaf[i], model.params["layers"])
        trainable = {name: layer[name] for name in ("q", "v", "down")}
        frozen = {name: value for name, value in layer.items() if name not in trainable}
        at_layer = inputs.at_layer(jnp.int32(index))

        def forward(trainable, x, frozen=frozen, at_layer=at_layer):
            return block({**frozen, **trainable}, x, at_layer, config)

        _, pull = jax.vjp(forward, trainable, x)
        expected = pull(cotangent)
        _, saved, _ = layer_forward(frozen, trainable, x, at_layer, config, None, None, save)
        actual = layer_vjp(frozen, trainable, x, saved, cotangent, at_layer, config, None, None)
        for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
            scale = float(jnp.abs(want).max())
            assert float(jnp.abs(want - got).max()) <= 1e-5 * max(scale, 1.0)
