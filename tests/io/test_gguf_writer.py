"""Writing GGUF (`convert --to gguf`): round trips HF -> GGUF -> featherweight and -> transformers'
GGUF reader, per family and type; the tokenizer and hyper-parameters in the metadata; the Ollama
Modelfile; refusals before anything is written."""

import dataclasses

import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType, GGUFReader

from featherweight.errors import ConfigError
from featherweight.inference.generate import logits
from featherweight.io.convert import convert
from featherweight.io.gguf_reader import GGUFSource, unpermute_rotary_rows
from featherweight.io.gguf_tokenizer import LLAMA_CPP_PRE_NAMES
from featherweight.io.gguf_writer import GGUF_QUANTS, permute_rotary_rows
from featherweight.io.loader import load_model
from featherweight.io.ollama import MODEL_FILE, MODELFILE, chat_family
from tests.tiny_checkpoints import (
    TOKENS,
    hf_config,
    hf_from_gguf,
    hf_logits,
    llama_cpp_permute,
    random_hf_model,
    save_byte_level_tokenizer,
    save_hf,
    with_weights_through,
)

EXACT = 1e-4  # float32 rounding of two computations of the same weights
Q = GGMLQuantizationType


def hf_dir(tmp_path, family: str):
    model = random_hf_model(hf_config(family))
    return model, save_byte_level_tokenizer(save_hf(model, tmp_path / f"hf-{family}"))


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def test_permutation_is_llama_cpps_and_inverts_the_readers():
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        np.testing.assert_array_equal(
            permute_rotary_rows(weight, heads), llama_cpp_permute(weight, heads)
        )
        np.testing.assert_array_equal(
            unpermute_rotary_rows(permute_rotary_rows(weight, heads), heads), weight
        )


@pytest.mark.parametrize("family", ["llama2", "qwen2", "smollm2", "llama3"])
def test_f32_gguf_holds_the_model_exactly(family, tmp_path):
    """Names, q/k permutation, biases, tied head, Llama 3 rope factors: nothing lost."""
    model, directory = hf_dir(tmp_path, family)
    out = convert(directory, tmp_path / "gguf", to="gguf", quant="f32")
    assert max_diff(logits(load_model(out / MODEL_FILE), TOKENS), hf_logits(model, TOKENS)) <= EXACT


@pytest.mark.parametrize(("family", "quant"), [("llama2", "f16"), ("qwen2", "q8_0"), ("smollm2", "q4_0"),
                                               ("llama2", "bf16")])  # fmt: skip
def test_quantized_gguf_equals_the_model_through_its_type(family, quant, tmp_path):
    """featherweight and transformers both read the file as the original model whose weights went
    through the type's rounding (f16, bf16) or blocks (q8_0, q4_0): the file holds exactly the
    quantization error of its type, and the q/k layout is what transformers' reader expects."""
    model, directory = hf_dir(tmp_path, family)
    out = convert(directory, tmp_path / "gguf", to="gguf", quant=quant)
    reference = hf_logits(with_weights_through(model, GGUF_QUANTS[quant][0]), TOKENS)
    ours = logits(load_model(out / MODEL_FILE), TOKENS)
    assert max_diff(ours, reference) <= EXACT
    assert max_diff(hf_logits(hf_from_gguf(out / MODEL_FILE), TOKENS), reference) <= EXACT
    kinds = {t.name: t.tensor_type for t in GGUFReader(str(out / MODEL_FILE)).tensors}
    assert kinds["blk.0.attn_q.weight"] == GGUF_QUANTS[quant][0]
    assert kinds["blk.0.attn_norm.weight"] == Q.F32


@pytest.fixture(scope="module")
def smollm2_gguf(tiny_model_dir, tmp_path_factory):
    """The tiny model with SmolLM2's tokenizer and chat template, as an f16 GGUF directory."""
    return convert(tiny_model_dir, tmp_path_factory.mktemp("smollm2") / "gguf", to="gguf")


@pytest.mark.slow
def test_f16_export_of_a_model_at_initialisation_scale_is_within_1e_3(tiny_model_dir, smollm2_gguf):
    """SmolLM2's vocabulary and tokenizer, weights at initialisation scale: f16 GGUF logits are
    within 1e-3 of float32, read by featherweight and by transformers."""
    out = smollm2_gguf
    ids = np.asarray([[1, 504, 3458, 282, 4933, 30, 2, 198, 28, 3]])
    original = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    reference = hf_logits(original, ids)
    assert max_diff(logits(load_model(out / MODEL_FILE), ids), reference) <= 1e-3
    assert max_diff(hf_logits(hf_from_gguf(out / MODEL_FILE), ids), reference) <= 1e-3


TEXTS = [
    "The quick brown fox, 1234567890!",
    "Ünïcödé café 日本語 🤗",
    "<|im_start|>user\nHi<|im_end|>\n",
]


@pytest.mark.slow
def test_tokenizer_and_hyperparameters_survive_the_round_trip(tiny_model_dir, smollm2_gguf):
    out = smollm2_gguf
    original = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    theirs = transformers.AutoTokenizer.from_pretrained(str(out), gguf_file=MODEL_FILE)
    source = GGUFSource(out / MODEL_FILE)
    ours = source.tokenizer()
    for text in TEXTS:
        expected = original(text)["input_ids"]
        assert ours.encode(text) == expected
        assert theirs(text)["input_ids"] == expected
    assert ours.chat_template == original.chat_template
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    fields = {
        name: source._get(name) for name in source.fields if not name.startswith("tokenizer.ggml.t")
    }
    assert fields["general.architecture"] == "llama"
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] in LLAMA_CPP_PRE_NAMES  # llama.cpp refuses other names
    assert fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.freq_base"] == 10000.0
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    types = source._get("tokenizer.ggml.token_type")
    assert types[0] == types[1] == types[2] == 3  # <|endoftext|>, <|im_start|>, <|im_end|>: CONTROL
    expected = load_model(tiny_model_dir).config
    assert source.config == dataclasses.replace(
        expected, rms_norm_eps=source.config.rms_norm_eps, bos_token_id=1, eos_token_id=2
    )
    assert source.config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # float32 in GGUF


@pytest.mark.slow
def test_modelfile_carries_the_chat_template_and_stops(smollm2_gguf):
    out = smollm2_gguf
    modelfile = (out / MODELFILE).read_text()
    assert modelfile.startswith(f"FROM ./{MODEL_FILE}\n")
    assert "<|im_start|>{{ .Role }}" in modelfile
    assert (
        'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""'
        in modelfile
    )
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    family, _system = chat_family(GGUFSource(out / MODEL_FILE).tokenizer())
    assert family.name == "chatml"


@pytest.mark.parametrize(
    ("quant", "hint"), [("q4_k_m", "llama-quantize"), ("int8", "f32, f16, bf16")]
)
def test_unsupported_quant_is_refused_before_writing(quant, hint, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=hint):
        convert(tiny_model_dir, tmp_path / "out", to="gguf", quant=quant)
    assert not (tmp_path / "out").exists()


def test_unknown_target_format_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="hf, gguf"):
        convert(tiny_model_dir, tmp_path / "out", to="onnx")
