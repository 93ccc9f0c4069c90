"""GGUF files of Qwen3, Gemma 2, Gemma 3, Phi-3 and gpt-oss as llama.cpp's converter writes them
(their architectures' metadata, names and layouts: Gemma's norms + 1, Phi-3's fused `attn_qkv` and
`ffn_up`, gpt-oss's experts split and transposed) load with the transformers model's logits; featherweight's own GGUF export of each has
llama.cpp's tensor names, shapes and family metadata, and loads back with the same logits; a
config llama.cpp would run otherwise is refused before anything is written."""

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

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
        "gpt_oss": (config.num_experts, config.experts_per_token, config.intermediate_size)
        == (4, 2, 32)
        and config.sliding_layers == (True, False)
        and config.attention_sinks
        and config.expert_bias
        and config.rope_scaling.rope_type == "yarn",
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
        "gpt_oss": dict(swiglu_limit=5.0),
    }[family]
    config = dataclasses.replace(model.config, **changed)
    with pytest.raises(ExportError, match="--format merged"):
        export_merged_gguf(model.params, None, config, None, model.tokenizer, tmp_path / "g")
    assert not (tmp_path / "g").exists()
    if family == "qwen3":  # MXFP4 is for experts, and a dense model has none
        with pytest.raises(ExportError, match=r"mxfp4 writes the experts.*has none"):
            export_merged_gguf(*(model.params, None, model.config, None, model.tokenizer),
                               tmp_path / "x", quant="mxfp4")  # fmt: skip
        assert not (tmp_path / "x").exists()


# What llama.cpp's convert_hf_to_gguf.py (GptOssModel, TextModel.set_gguf_parameters) names for
# gpt-oss: a layer's tensors and the metadata keys beyond the shapes.
GPT_OSS_LAYER = {
    "attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight",
    "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight",
    "attn_v.bias", "attn_output.weight", "attn_output.bias", "ffn_gate_inp.weight",
    "ffn_gate_inp.bias", "ffn_gate_exps.weight", "ffn_gate_exps.bias", "ffn_up_exps.weight",
    "ffn_up_exps.bias", "ffn_down_exps.weight", "ffn_down_exps.bias",
}  # fmt: skip
GPT_OSS_KEYS = {
    "gpt-oss.expert_count": 4,
    "gpt-oss.expert_used_count": 2,
    "gpt-oss.expert_feed_forward_length": 32,
    "gpt-oss.attention.sliding_window": WINDOW,
    "gpt-oss.rope.scaling.type": "yarn",
    "gpt-oss.rope.scaling.factor": 32.0,
    "gpt-oss.rope.scaling.original_context_length": 512,
    "gpt-oss.rope.scaling.yarn_beta_fast": 32.0,
    "gpt-oss.rope.scaling.yarn_beta_slow": 1.0,
    "gpt-oss.attention.key_length": 16,
}


def _through(values, kind):
    return quants.dequantize(quants.quantize(np.asarray(values, np.float32), kind), kind)


@pytest.mark.parametrize("case", ["gpt_oss"], indirect=True)
def test_gpt_oss_export_is_llama_cpps_and_loads_back_exactly(case, tmp_path):
    """f32, and mxfp4 (experts MXFP4, the other weights BF16) of weights those types hold
    exactly: both load back with the same float32 logits."""
    _, _, _, model = case
    exact = dict(model.params)
    layers = {name: np.asarray(values) for name, values in model.params["layers"].items()}
    for name, values in layers.items():
        kind = GGMLQuantizationType.MXFP4 if name in ("gate", "up", "down") else None
        if kind is None and values.ndim > 1 and not name.endswith("bias"):
            kind = GGMLQuantizationType.BF16
        layers[name] = values if kind is None else _through(values, kind)
    exact["layers"] = layers
    for top in ("embed", "lm_head"):
        exact[top] = _through(model.params[top], GGMLQuantizationType.BF16)
    rounded = dataclasses.replace(model, params=exact)
    expected = np.asarray(logits(rounded, TOKENS))
    for quant in ("f32", "mxfp4"):
        out = export_merged_gguf(
            exact, None, model.config, None, model.tokenizer, tmp_path / quant, quant=quant
        )
        reader = GGUFReader(str(out / MODEL_FILE))
        fields = {name: field.contents() for name, field in reader.fields.items()}
        for key, value in GPT_OSS_KEYS.items():
            assert fields[key] == pytest.approx(value), key
        kinds = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
        assert {
            name[len("blk.1.") :] for name in kinds if name.startswith("blk.1.")
        } == GPT_OSS_LAYER
        experts = "MXFP4" if quant == "mxfp4" else "F32"
        assert kinds["blk.1.ffn_gate_exps.weight"] == kinds["blk.1.ffn_down_exps.weight"] == experts
        assert kinds["blk.1.ffn_gate_exps.bias"] == kinds["blk.1.ffn_gate_inp.weight"] == "F32"
        assert kinds["blk.1.attn_q.weight"] == ("BF16" if quant == "mxfp4" else "F32")
        back = load_model(out / MODEL_FILE, dtype="float32")
        assert np.abs(np.asarray(logits(back, TOKENS)) - expected).max() <= 1e-5, quant
