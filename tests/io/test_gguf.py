"""GGUF checkpoints: featherweight reads them as transformers does (`from_pretrained(dir,
gguf_file=...)`) -- the real SmolLM2-135M-Instruct file (logits, tokenizer, greedy generation) and
tiny files written here in every supported tensor type, which exercise dequantization and the q/k
row un-permutation. Llama 3 rope factors (`rope_freqs.weight`) are read where transformers drops
them."""

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from featherweight.errors import UnsupportedModelError
from featherweight.inference.generate import generate_ids, logits
from featherweight.io.gguf_reader import unpermute_rotary_rows
from featherweight.io.loader import load_model
from tests.tiny_checkpoints import (
    TOKENS,
    hf_config,
    hf_from_gguf,
    hf_logits,
    llama3_rope_factors,
    llama_cpp_permute,
    random_hf_model,
    write_gguf,
)

TINY_TOLERANCE = 1e-4
REAL_TOLERANCE = 1e-3
TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. 1234567890!?",
    "unicode": "Ünïcödé: café, naïve, 日本語のテキスト, Ελληνικά, emoji 🤗🚀 — done.",
    "code": 'def square(x: int) -> int:\n\t"""Square."""\n    return x ** 2  # {x}\n\nprint([square(i) for i in range(3)])',
    "chat": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
}
PROMPT = "What is the capital of France? Answer in one sentence."


# --- the real SmolLM2-135M-Instruct GGUF ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(demo_gguf):
    """(featherweight model, transformers model, transformers tokenizer) of the same GGUF."""
    ours = load_model(demo_gguf)
    theirs = hf_from_gguf(demo_gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(demo_gguf.parent), gguf_file=demo_gguf.name
    )
    return ours, theirs, tokenizer


def _prompt_ids(ours) -> list[int]:
    text = ours.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    return ours.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    ours, theirs, _tokenizer = smollm2
    ids = np.asarray([_prompt_ids(ours)])
    diff = np.abs(np.asarray(logits(ours, ids)) - hf_logits(theirs, ids)).max()
    assert diff <= REAL_TOLERANCE, f"SmolLM2 GGUF: max abs logit diff {diff:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TEXTS))
def test_smollm2_tokenization_matches_transformers(smollm2, kind):
    ours, _theirs, tokenizer = smollm2
    text = TEXTS[kind]
    ids = ours.tokenizer.encode(text)
    assert ids == tokenizer(text)["input_ids"]
    assert ours.tokenizer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2):
    ours, _theirs, tokenizer = smollm2
    messages = [{"role": "user", "content": PROMPT}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(messages) == expected


@pytest.mark.slow
def test_smollm2_greedy_generation_matches_transformers(smollm2):
    ours, theirs, _tokenizer = smollm2
    prompt = _prompt_ids(ours)
    with torch.no_grad():
        output = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None
        )
    expected = output[0, len(prompt) :].tolist()
    assert generate_ids(ours, prompt, max_new_tokens=20) == expected
    assert len(expected) == 20


# --- tiny GGUF files written in the test --------------------------------------------------------

TENSOR_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(scope="module")
def tiny_llama():
    """A random untied GQA llama (the layout whose q/k rows GGUF permutes)."""
    return random_hf_model(hf_config("llama2"))


@pytest.mark.parametrize("type_name", TENSOR_TYPES)
def test_tiny_gguf_matches_transformers_reading_the_same_file(tiny_llama, type_name, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama, GGMLQuantizationType[type_name])
    ours = np.asarray(logits(load_model(path), TOKENS))
    diff = np.abs(ours - hf_logits(hf_from_gguf(path), TOKENS)).max()
    assert diff <= TINY_TOLERANCE, f"{type_name}: max abs diff {diff:.2e}"


def test_f32_gguf_equals_the_original_model(tiny_llama, tmp_path):
    """Independent of transformers' GGUF reader: unpermuted q/k give the original logits."""
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama)
    diff = np.abs(np.asarray(logits(load_model(path), TOKENS)) - hf_logits(tiny_llama, TOKENS))
    assert diff.max() <= TINY_TOLERANCE


@pytest.mark.parametrize(("family", "type_name"), [("qwen2", "Q8_0"), ("smollm2", "Q4_1")])
def test_other_layouts_match_transformers(family, type_name, tmp_path):
    """Qwen2 (q/k/v biases, rows not permuted) and a tied-embedding llama."""
    model = random_hf_model(hf_config(family))
    path = write_gguf(tmp_path / f"{family}.gguf", model, GGMLQuantizationType[type_name])
    loaded = load_model(path)
    assert loaded.config.attention_bias == (family == "qwen2")
    assert loaded.config.tie_word_embeddings == (family == "smollm2")
    diff = np.abs(np.asarray(logits(loaded, TOKENS)) - hf_logits(hf_from_gguf(path), TOKENS))
    assert diff.max() <= TINY_TOLERANCE


def test_llama3_rope_factors_are_applied(tmp_path):
    """A Llama 3.1-style GGUF carries its rope scaling only as `rope_freqs.weight`: featherweight
    matches the original model; transformers' GGUF reader ignores the factors and does not."""
    model = random_hf_model(hf_config("llama3"))
    path = write_gguf(
        tmp_path / "llama3.gguf",
        model,
        extra_tensors={"rope_freqs.weight": llama3_rope_factors(model.config)},
    )
    loaded = load_model(path)
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling.factor == 8.0
    expected = hf_logits(model, TOKENS)
    assert np.abs(np.asarray(logits(loaded, TOKENS)) - expected).max() <= TINY_TOLERANCE
    assert np.abs(hf_logits(hf_from_gguf(path), TOKENS) - expected).max() > 1e-3


def test_unknown_rope_factors_are_refused(tmp_path):
    model = random_hf_model(hf_config("llama2"))
    factors = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    path = write_gguf(tmp_path / "odd.gguf", model, extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(UnsupportedModelError, match=r"rope_freqs\.weight.*safetensors"):
        load_model(path)


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        permuted = llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        np.testing.assert_array_equal(unpermute_rotary_rows(permuted, heads), weight)
