"""K-quant GGUF files (what people download: Q4_K_M, Q5_K_M, Q6_K) and the other block formats
the `gguf` package dequantizes: featherweight reads them as transformers does from the same file,
chunk by chunk, and QLoRA trains straight from a Q4_K_M file.

The files are written with the test encoder of tests/kquant_encoder.py (checked here against
gguf's own dequantizer), since `gguf.quants.quantize` cannot write K-quants.
"""

import json

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from featherweight.errors import UnsupportedModelError
from featherweight.inference.generate import logits
from featherweight.io import gguf_reader
from featherweight.io.gguf_reader import GGUFSource, dequantizable_types
from featherweight.io.loader import load_model
from featherweight.recipe.schema import parse_config
from featherweight.train.loop import train
from tests.conftest import run_settings
from tests.kquant_encoder import quantize_k
from tests.tiny_checkpoints import (
    TOKENS,
    hf_config,
    hf_from_gguf,
    hf_logits,
    random_hf_model,
    write_gguf,
)

Q = GGMLQuantizationType
TOLERANCE = 1e-4
# K-quant super-blocks hold 256 values, so every row of the model is 256 or 512 wide.
KQUANT_SIZES = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
)


def q4_k_m(name: str) -> GGMLQuantizationType:
    """llama.cpp's Q4_K_M recipe in small: Q6_K for the head and for attn_v / ffn_down of every
    other layer, Q4_K for the rest."""
    if name == "output.weight":
        return Q.Q6_K
    if name.startswith("blk.0.") and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return Q.Q6_K
    return Q.Q4_K


MIXES = {
    "Q4_K_M": q4_k_m,
    "Q5_K": lambda name: Q.Q5_K,
    "Q6_K": lambda name: Q.Q6_K,
    "Q5_0": lambda name: Q.Q5_0,
    "Q5_1": lambda name: Q.Q5_1,
}


@pytest.fixture(scope="module")
def kquant_llama():
    """A random untied GQA llama whose rows are whole K-quant super-blocks."""
    return random_hf_model(hf_config("llama2", **KQUANT_SIZES))


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_test_encoder_writes_what_gguf_dequantizes(kind):
    """The fixture encoder's bytes decode (by gguf) to the values it encoded, within the format's
    step: a misplaced nibble, scale or half-block would be off by the whole value range."""
    values = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    packed = quantize_k(values, kind)
    assert packed.shape == (16, 2 * GGML_QUANT_SIZES[kind][1])
    error = np.abs(quants.dequantize(packed, kind) - values)
    bits = {Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}[kind]
    assert error.mean() < 0.5 * 8 / 2**bits  # half a step of an 8-wide range in 2^bits levels
    assert error.max() < 8 / 2**bits


def test_every_block_format_gguf_dequantizes_is_accepted():
    supported = {kind.name for kind in dequantizable_types()}
    expected = (
        "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS IQ2_XXS"
    )
    assert set(expected.split()) <= supported
    assert "Q8_K" not in supported  # an intermediate format llama.cpp never stores in a file


@pytest.mark.parametrize("mix", list(MIXES))
def test_kquant_gguf_matches_transformers_reading_the_same_file(kquant_llama, mix, tmp_path):
    path = write_gguf(tmp_path / f"{mix}.gguf", kquant_llama, type_of=MIXES[mix])
    ours = np.asarray(logits(load_model(path), TOKENS))
    theirs = hf_logits(hf_from_gguf(path), TOKENS)
    diff = np.abs(ours - theirs).max()
    assert diff <= TOLERANCE, f"{mix}: max abs logit diff {diff:.2e}"
    assert (
        np.abs(theirs - hf_logits(kquant_llama, TOKENS)).max() > 10 * TOLERANCE
    )  # really quantized


def test_reading_in_chunks_equals_reading_whole(kquant_llama, tmp_path, monkeypatch):
    """One row per chunk (q/k rows scattered to their un-permuted places) equals one chunk."""
    path = write_gguf(tmp_path / "mix.gguf", kquant_llama, type_of=q4_k_m)
    source = GGUFSource(path)
    keys = source.keys()
    whole = {key: source.read(key) for key in keys}
    monkeypatch.setattr(gguf_reader, "CHUNK_VALUES", 1)
    for key in keys:
        np.testing.assert_array_equal(source.read(key), whole[key], err_msg=str(key))


def test_unknown_tensor_type_is_refused_before_reading(kquant_llama, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "mix.gguf", kquant_llama, type_of=q4_k_m)
    monkeypatch.setattr(gguf_reader, "dequantizable_types", lambda: frozenset({Q.F32, Q.Q4_K}))
    with pytest.raises(
        UnsupportedModelError, match=r"'blk.0.attn_v.weight' is stored as Q6_K.*Upgrade gguf"
    ):
        GGUFSource(path)


@pytest.mark.slow
def test_qlora_trains_straight_from_a_q4_k_m_file(kquant_llama, tmp_path):
    """QLoRA on a Q4_K_M file: each weight goes from its K-quant blocks to NF4 on load, and the
    loss goes down over a few steps (on text records: the tiny file has no chat template)."""
    path = write_gguf(tmp_path / "model.gguf", kquant_llama, type_of=q4_k_m)
    data = tmp_path / "train.jsonl"
    lines = [json.dumps({"text": f"item {i}: the cat sat on the mat. " * 3}) for i in range(32)]
    data.write_text("\n".join(lines) + "\n")
    settings = run_settings(path, data, tmp_path / "run", method="qlora", steps=8)
    settings["data"]["eval_fraction"] = 0.0
    result = train(parse_config(settings))
    losses = [
        json.loads(line)["loss"]
        for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]
    assert len(losses) >= 8
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1, losses
