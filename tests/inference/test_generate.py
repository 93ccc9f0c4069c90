"""Inference: generation with the KV cache equals generation without it (tiny random models of
each layout, and the real SmolLM2), cached step logits equal the full forward pass, greedy output
equals transformers', and token ids are validated."""

from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from featherweight.errors import ConfigError
from featherweight.inference.generate import (
    _cached_step,
    _cached_token,
    empty_cache,
    generate,
    generate_ids,
    logits,
    longest_padded_prompt,
    prompt_bucket,
    validate_token_ids,
)
from featherweight.io.loader import load_model
from featherweight.models.config import RopeScaling
from featherweight.models.init import init_params
from featherweight.models.llama import merge_params
from featherweight.models.model import Model
from featherweight.peft.lora import LoraConfig, merge_lora_weight
from tests.conftest import tiny_config
from tests.tiny_checkpoints import VOCAB, hf_config, random_hf_model, save_hf

PROMPT = [3, 141, 59, 26, 53, 58, 97, 93, 23, 84]
NEW_TOKENS = 12
SMOLLM2_TOKENS = 12


@pytest.fixture(scope="module", params=["llama2", "qwen2"])
def tiny(request, tmp_path_factory):
    """(featherweight model, transformers model): GQA llama, and qwen2 with q/k/v biases."""
    hf_model = random_hf_model(hf_config(request.param))
    directory = save_hf(hf_model, tmp_path_factory.mktemp(request.param))
    return load_model(directory, dtype="float32"), hf_model


def test_cached_greedy_equals_uncached(tiny):
    model, _ = tiny
    cached = generate_ids(model, PROMPT, NEW_TOKENS, use_cache=True)
    assert cached == generate_ids(model, PROMPT, NEW_TOKENS, use_cache=False)
    assert len(cached) == NEW_TOKENS and len(set(cached)) > 1


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The llama2 case alone (same config and shapes as in `tiny`: the compiled steps are shared)."""
    directory = save_hf(random_hf_model(hf_config("llama2")), tmp_path_factory.mktemp("llama"))
    return load_model(directory, dtype="float32")


def test_cached_sampling_equals_uncached(llama):
    model = llama
    kwargs = dict(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=7)
    sampled = generate_ids(model, PROMPT, use_cache=True, **kwargs)
    assert sampled == generate_ids(model, PROMPT, use_cache=False, **kwargs)
    assert sampled != generate_ids(model, PROMPT, NEW_TOKENS)  # it did sample


def test_greedy_equals_transformers_generate(tiny):
    model, hf_model = tiny
    with torch.no_grad():
        output = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )
    assert generate_ids(model, PROMPT, NEW_TOKENS) == output[0, len(PROMPT) :].tolist()


def test_cached_step_logits_equal_the_full_forward(tiny):
    """Prefill of the prompt padded to its bucket, then decode steps through the cache, against
    `logits` of the whole sequence (shapes as in `generate_ids`, so the compiled steps are
    shared)."""
    model, _ = tiny
    config = model.config
    sequence = np.asarray([[*PROMPT, 7, 11]], dtype=np.int32)
    full = np.asarray(logits(model, sequence))[0]
    bucket = prompt_bucket(len(PROMPT), longest_padded_prompt(config, len(PROMPT), NEW_TOKENS))
    assert bucket > len(PROMPT)  # the prompt runs padded
    padded = np.full((1, bucket), 5, np.int32)  # padding of any id changes nothing
    padded[:, : len(PROMPT)] = PROMPT
    total = bucket + NEW_TOKENS
    cache = empty_cache(config, 1, total, jax.numpy.float32, ring_at_least=bucket)
    last = jax.numpy.int32(len(PROMPT) - 1)
    prefill, cache = _cached_step(
        model.params, padded, cache, 0, config, total, prefill=True, last=last
    )
    np.testing.assert_allclose(np.asarray(prefill)[0], full[-3], atol=1e-5)
    step, cache = _cached_step(model.params, sequence[:, -2:-1], cache, len(PROMPT), config, total)
    np.testing.assert_allclose(np.asarray(step)[0], full[-2], atol=1e-5)
    two, _ = _cached_step(model.params, sequence[:, -1:], cache, len(PROMPT) + 1, config, total)
    np.testing.assert_allclose(np.asarray(two)[0], full[-1], atol=1e-5)


def test_prompts_of_one_bucket_share_their_programs(llama):
    """Prompts of 10, 17 and 32 tokens run padded to 32: one prefill and one decode program for
    all three (no other test generates 3 tokens, so these programs are new), and the padded
    prompt generates what the unpadded one does."""
    prompts = [PROMPT, (PROMPT * 4)[:17], (PROMPT * 4)[:32]]
    before = _cached_token._cache_size()
    replies = [generate_ids(llama, prompt, 3) for prompt in prompts]
    assert _cached_token._cache_size() - before == 2
    assert replies[1] == generate_ids(llama, prompts[1], 3, use_cache=False)


def test_padding_stays_on_the_prompts_side_of_longropes_threshold():
    """Phi-3 picks its rotary factors by the sequence's length: a prompt is never padded past
    the original context it fits in, and one beyond it may be padded up to the model's end."""
    scaling = RopeScaling(
        rope_type="longrope", factor=4.0, original_max_position_embeddings=128,
        short_factor=(1.0,) * 8, long_factor=(2.0,) * 8, attention_factor=1.2,
    )  # fmt: skip
    config = tiny_config(rope_scaling=scaling, max_position_embeddings=512)
    assert longest_padded_prompt(config, 100, 16) == 112  # 112 + 16 = the original 128
    assert prompt_bucket(100, longest_padded_prompt(config, 100, 16)) == 112
    assert longest_padded_prompt(config, 120, 16) == 496  # already past it: the model's end
    assert longest_padded_prompt(tiny_config(max_position_embeddings=512), 100, 16) == 496


def _prefill_temp_bytes(config, prompt_len, prefill):
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, jax.numpy.float32))
    ids = jax.ShapeDtypeStruct((1, prompt_len), jax.numpy.int32)
    cache = jax.eval_shape(lambda: empty_cache(config, 1, prompt_len, jax.numpy.float32))
    lowered = _cached_step.lower(params, ids, cache, 0, config, prompt_len, prefill=prefill)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_prefill_never_builds_the_prompt_scores():
    """A 2048-token prompt's prefill stays under one float32 P x P score matrix per head; the
    same prompt attended through the masked cache path (negative control) does not."""
    config, prompt_len = tiny_config(), 2048
    scores = config.num_heads * prompt_len * prompt_len * 4
    assert _prefill_temp_bytes(config, prompt_len, prefill=True) < scores / 4
    assert _prefill_temp_bytes(config, prompt_len, prefill=False) > scores


def test_stop_ids_end_generation(llama):
    model = llama
    first = generate_ids(model, PROMPT, NEW_TOKENS)[0]
    for use_cache in (True, False):
        assert generate_ids(model, PROMPT, NEW_TOKENS, stop_ids={first}, use_cache=use_cache) == [
            first
        ]


def test_validate_token_ids_accepted_forms():
    flat = validate_token_ids([1, 2, 3], VOCAB)
    assert flat.shape == (1, 3) and flat.dtype == np.int32
    batch = validate_token_ids(np.array([[0, VOCAB - 1]], dtype=np.uint16), VOCAB)
    assert batch.tolist() == [[0, VOCAB - 1]] and batch.dtype == np.int32


def test_generate_settings_are_checked(llama):
    model = llama
    with pytest.raises(ConfigError, match="max_new_tokens=0"):
        generate_ids(model, PROMPT, 0)
    with pytest.raises(ConfigError, match="temperature=-1"):
        generate_ids(model, PROMPT, 4, temperature=-1.0)
    with pytest.raises(ConfigError, match="has no tokenizer; generate from token ids"):
        generate(model, "hello")


@pytest.fixture(scope="module")
def smollm2(demo_gguf):
    return load_model(demo_gguf)


@pytest.mark.slow
def test_smollm2_cached_generation_equals_uncached(smollm2):
    tokenizer = smollm2.tokenizer
    question = "What is 2 + 2?"
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    prompt = tokenizer.encode(text, add_special_tokens=False)
    cached = generate_ids(smollm2, prompt, SMOLLM2_TOKENS, use_cache=True)
    assert cached == generate_ids(smollm2, prompt, SMOLLM2_TOKENS, use_cache=False)
    assert len(cached) == SMOLLM2_TOKENS
    reply = generate(smollm2, question, SMOLLM2_TOKENS)  # chat template, stops at <|im_end|>
    stops = tokenizer.stop_ids()
    end = next((i + 1 for i, token in enumerate(cached) if token in stops), len(cached))
    assert reply == tokenizer.decode(cached[:end]) and reply.strip()


def test_lora_model_generates_as_its_merged_weights():
    """A Model carrying adapters (and their LoraSpec) equals the model with them merged in."""
    config = tiny_config()
    base = init_params(jax.random.PRNGKey(0), config)
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down"))
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 6))
    adapters = {}
    for name in lora.targets:
        out_features, in_features = base["layers"][name].shape[1:]
        adapters[name] = {
            "a": 0.1 * jax.random.normal(next(keys), (config.num_layers, lora.rank, in_features)),
            "b": 0.1 * jax.random.normal(next(keys), (config.num_layers, out_features, lora.rank)),
        }
    trainable = {"layers": {"lora": adapters}}
    with_adapters = Model(config, merge_params(base, trainable), None, Path("."), lora=lora.spec)
    merged_layers = dict(base["layers"])
    for name, pair in adapters.items():
        merged_layers[name] = merge_lora_weight(
            np.asarray(base["layers"][name]),
            np.asarray(pair["a"]),
            np.asarray(pair["b"]),
            lora.scale,
        )
    merged = Model(config, {**base, "layers": merged_layers}, None, Path("."))
    tokens = np.arange(12, dtype=np.int32)[None] % config.vocab_size
    np.testing.assert_allclose(logits(with_adapters, tokens), logits(merged, tokens), atol=1e-5)
    assert (
        np.abs(
            np.asarray(
                logits(with_adapters, tokens) - logits(Model(config, base, None, Path(".")), tokens)
            )
        ).max()
        > 1e-2
    )
    assert generate_ids(with_adapters, tokens[0], 6) == generate_ids(merged, tokens[0], 6)


def test_generation_past_the_models_last_position_is_refused():
    config = tiny_config(max_position_embeddings=16)
    model = Model(config, init_params(jax.random.PRNGKey(0), config), None, Path("tiny"))
    with pytest.raises(
        ConfigError, match=r"the prompt is 16 tokens but the model reads at most 16"
    ):
        generate_ids(model, list(range(16)), max_new_tokens=1)
    with pytest.raises(ConfigError, match=r"lower max_new_tokens to 6 or shorten the prompt"):
        generate_ids(model, PROMPT, max_new_tokens=7)
    assert len(generate_ids(model, PROMPT, max_new_tokens=6)) == 6
