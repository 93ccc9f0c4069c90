"""GGUF files of Qwen3, Gemma 2, Gemma 3 and Phi-3 as llama.cpp's converter writes them (their
architectures' metadata, names and layouts: Gemma's norms + 1, Phi-3's fused `attn_qkv` and
`ffn_up`) load with the transformers model's logits; featherweight's own GGUF export of each has
llama.cpp's tensor names, shapes and family metadata, and loads back with the same logits; a
config llama.cpp would run otherwise is refused before anything is written."""

import dataclasses

import numpy as np
import pytest
from gguf import GGUFReader

from featherweight.errors import ExportError
from featherweight.inference.generate import logits
from featherweight.io.gguf_export import export_merged_gguf
from featherweight.io.loader import load_model
from featherweight.io.ollama import MODEL_FILE
from tests.tiny_checkpoints import (
    LLAMA_CPP_FAMILIES,
    TOKENS,
    WINDOW,
    family_config,
    hf_from_gguf,
    hf_logits,
    random_hf_model,
    write_family_gguf,
)

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=list(LLAMA_CPP_FAMILIES))
def case(request, tmp_path_factory):
    """(family, transformers model, its GGUF as llama.cpp writes it, featherweight's load)."""
    hf_model = random_hf_model(family_config(request.param))
    path = write_family_gguf(tmp_path_factory.mktemp(request.param) / "model.gguf", hf_model)
    return request.param, hf_model, path, load_model(path, dtype="float32")


def _diff(model, hf_model) -> float:
    return float(np.abs(np.asarray(logits(model, TOKENS)) - hf_logits(hf_model, TOKENS)).max())


def test_llama_cpps_gguf_loads_with_transformers_logits(case):
    family, hf_model, path, model = case
    assert model.config.model_type.startswith(family)
    assert _diff(model, hf_model) <= TOLERANCE, family
    if family == "qwen3":  # transformers' GGUF reading keeps Qwen3's settings, not the others'
        assert _diff(model, hf_from_gguf(path)) <= TOLERANCE, f"{family}: transformers' GGUF read"


def test_the_file_carries_its_familys_features(case):
    family, _, _, model = case
    config = model.config
    expected = {
        "qwen3": config.qk_norm and config.head_dim == 128,
        "gemma2": (config.attn_softcap, config.final_softcap, config.sliding_layers)
        == (2.0, 3.0, (True, False, True, False))
        and config.norm_offset == 1.0,
        "gemma3": config.sliding_layers == (True,) * 5 + (False,)
        and config.local_rope_theta == 10000.0
        and config.rope_scaling.rope_type == "linear"
        and config.qk_norm,
        "phi3": config.rotary_dim == config.head_dim // 2 and config.windows == "all",
    }
    assert expected[family], config


def _gguf_contents(path):
    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    metadata = {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith(f"{arch}.") and name != f"{arch}.vocab_size"
    }
    shapes = {tensor.name: tuple(tensor.shape.tolist()) for tensor in reader.tensors}
    return arch, metadata, shapes


def test_export_has_llama_cpps_names_and_metadata_and_loads_back(case, tmp_path):
    _, hf_model, path, model = case
    out = export_merged_gguf(
        model.params, None, model.config, None, model.tokenizer, tmp_path / "gguf", quant="f32"
    )
    theirs, ours = _gguf_contents(path), _gguf_contents(out / MODEL_FILE)
    assert ours[0] == theirs[0] and ours[2] == theirs[2]  # architecture, tensor names and shapes
    for key, value in theirs[1].items():  # every setting llama.cpp's converter writes
        assert ours[1][key] == pytest.approx(value), key
    assert _diff(load_model(out / MODEL_FILE, dtype="float32"), hf_model) <= TOLERANCE


def test_export_refuses_what_llama_cpp_would_run_otherwise(case, tmp_path):
    family, _, _, model = case
    changed = {
        "qwen3": dict(sliding_window=WINDOW, sliding_layers=(True, True)),
        "gemma2": dict(query_scale=0.1),
        "gemma3": dict(local_rope_theta=1000.0),
        "phi3": dict(sliding_layers=(True, False)),
    }[family]
    config = dataclasses.replace(model.config, **changed)
    with pytest.raises(ExportError, match="--format merged"):
        export_merged_gguf(model.params, None, config, None, model.tokenizer, tmp_path / "g")
    assert not (tmp_path / "g").exists()
