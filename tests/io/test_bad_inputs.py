"""Bad input gets a typed `featherweight.errors` exception whose one-line message names the file,
tensor or field and says what to do -- raised from headers and metadata, before any tensor is read
-- and on the command line, that message alone with exit code 2. Pickle is never loaded."""

import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from featherweight import errors
from featherweight.cli.main import app
from featherweight.inference.generate import generate_ids, logits
from featherweight.io.gguf_reader import GGUFSource
from featherweight.io.loader import load_model
from featherweight.io.safetensors_reader import SafetensorsSource
from tests.tiny_checkpoints import hf_config, random_hf_model, save_hf, write_gguf

LAYER0 = "model.layers.0"


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model(hf_config("llama2"))


@pytest.fixture(scope="module")
def good_dir(hf_model, tmp_path_factory) -> Path:
    return save_hf(hf_model, tmp_path_factory.mktemp("good"))


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Fail the test if any tensor is read: errors must come from headers and metadata."""

    def refuse(self, key, *args):
        pytest.fail(f"tensor {key} was read before the error was raised")

    for source in (SafetensorsSource, GGUFSource):
        monkeypatch.setattr(source, "read", refuse)
        monkeypatch.setattr(source, "read_into", refuse)


def _copy(good: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(good, tmp / "model"))


def _edit_config(good: Path, tmp: Path, **changes) -> Path:
    directory = _copy(good, tmp)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _edit_tensors(good: Path, tmp: Path, edit) -> Path:
    directory = _copy(good, tmp)
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _without_config(good: Path, tmp: Path) -> Path:
    directory = _copy(good, tmp)
    (directory / "config.json").unlink()
    return directory


def _truncated(good: Path, tmp: Path) -> Path:
    directory = _copy(good, tmp)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    return directory


def _garbage_header(good: Path, tmp: Path) -> Path:
    directory = _copy(good, tmp)
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"\x00garbage" + data[16:])
    return directory


class _TouchOnUnpickle:
    """Unpickling this creates a file: proof that a pickle was (or was not) loaded."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return Path.touch, (self.sentinel,)


def _pickle_dir(good: Path, tmp: Path) -> Path:
    directory = tmp / "model"
    directory.mkdir()
    shutil.copy(good / "config.json", directory)
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_TouchOnUnpickle(tmp / "PWNED")))
    return directory


def _pickle_file(good: Path, tmp: Path) -> Path:
    path = tmp / "model.pt"
    path.write_bytes(pickle.dumps(_TouchOnUnpickle(tmp / "PWNED")))
    return path


def _gguf(tmp: Path, model, **kwargs) -> Path:
    return write_gguf(tmp / "model.gguf", model, **kwargs)


def _truncated_gguf(tmp: Path, model) -> Path:
    path = _gguf(tmp, model)
    path.write_bytes(path.read_bytes()[:-4096])
    return path


def _gguf_missing_tensor(tmp: Path, model) -> Path:
    class WithoutOneTensor:
        config = model.config

        def state_dict(self):
            state = dict(model.state_dict())
            del state[f"{LAYER0}.mlp.down_proj.weight"]
            return state

    return _gguf(tmp, WithoutOneTensor())


# name -> (build(good_dir, tmp_path, hf_model) -> path, error type, patterns the message must match)
CASES = {
    "missing path": (
        lambda good, tmp, model: tmp / "no-such-model",
        errors.CheckpointNotFoundError,
        [r"no-such-model does not exist", r"give a Hugging Face model directory or a \.gguf"],
    ),
    "no config.json": (
        lambda good, tmp, model: _without_config(good, tmp),
        errors.CheckpointNotFoundError,
        [r"model has no config\.json", r"point at a Hugging Face model directory"],
    ),
    "unsupported model_type": (
        lambda good, tmp, model: _edit_config(good, tmp, model_type="gpt_neox"),
        errors.UnsupportedModelError,
        [
            r"config\.json: model_type 'gpt_neox'",
            r"supported model types: llama, mistral, .*qwen3, gemma2",
        ],
    ),
    "unsupported architecture": (
        lambda good, tmp, model: _edit_config(
            good, tmp, architectures=["LlamaForSequenceClassification"]
        ),
        errors.UnsupportedModelError,
        [r"LlamaForSequenceClassification", r"supported for llama: LlamaForCausalLM"],
    ),
    "unsupported activation": (
        lambda good, tmp, model: _edit_config(good, tmp, hidden_act="relu"),
        errors.UnsupportedModelError,
        [r"hidden activation 'relu' is not supported", r"silu, gelu_pytorch_tanh"],
    ),
    "missing tensor": (
        lambda good, tmp, model: _edit_tensors(
            good, tmp, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")
        ),
        errors.MissingTensorError,
        [r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'", r"incomplete"],
    ),
    "unexpected tensor": (
        lambda good, tmp, model: _edit_tensors(
            good,
            tmp,
            lambda t: t.update({f"{LAYER0}.self_attn.q_norm.weight": np.ones(16, np.float32)}),
        ),
        errors.UnexpectedTensorError,
        [rf"'{LAYER0}\.self_attn\.q_norm\.weight'", r"is config\.json for this checkpoint\?"],
    ),
    "tensor of an extra layer": (
        lambda good, tmp, model: _edit_config(good, tmp, num_hidden_layers=1),
        errors.UnexpectedTensorError,
        [r"'model\.layers\.1\.", r"check num_hidden_layers"],
    ),
    "wrong shape": (
        lambda good, tmp, model: _edit_tensors(
            good,
            tmp,
            lambda t: t.update(
                {f"{LAYER0}.self_attn.k_proj.weight": np.ones((64, 64), np.float32)}
            ),
        ),
        errors.TensorShapeError,
        [rf"'{LAYER0}\.self_attn\.k_proj\.weight' has shape \(64, 64\), expected \(32, 64\)"],
    ),
    "truncated safetensors": (
        lambda good, tmp, model: _truncated(good, tmp),
        errors.CorruptCheckpointError,
        [
            r"model\.safetensors .*tensor '[\w.]+' ends at byte \d+ but the file has only",
            r"truncated or corrupt -- download it again",
        ],
    ),
    "corrupt safetensors header": (
        lambda good, tmp, model: _garbage_header(good, tmp),
        errors.CorruptCheckpointError,
        [r"model\.safetensors .*header is not JSON", r"download it again"],
    ),
    "pickle checkpoint directory": (
        lambda good, tmp, model: _pickle_dir(good, tmp),
        errors.UnsafeCheckpointError,
        [r"pytorch_model\.bin is a pickle-based checkpoint", r"safe_serialization=True"],
    ),
    "pickle checkpoint file": (
        lambda good, tmp, model: _pickle_file(good, tmp),
        errors.UnsafeCheckpointError,
        [r"model\.pt is a pickle-based checkpoint", r"Convert it to safetensors"],
    ),
    "GGUF of another architecture": (
        lambda good, tmp, model: _gguf(tmp, model, architecture="gpt2"),
        errors.UnsupportedModelError,
        [r"model\.gguf: GGUF architecture 'gpt2'", r"supported: llama, qwen2"],
    ),
    "GGUF unsupported quantization": (
        lambda good, tmp, model: _gguf(tmp, model, tensor_type=GGMLQuantizationType.I32),
        errors.UnsupportedModelError,
        [
            r"tensor 'token_embd\.weight' is stored as I32",
            r"supported: .*Q4_1",
            r"use a file quantized",
        ],
    ),
    "truncated GGUF": (
        lambda good, tmp, model: _truncated_gguf(tmp, model),
        errors.CorruptCheckpointError,
        [r"model\.gguf is not a readable GGUF file", r"download it again"],
    ),
    "GGUF missing tensor": (
        lambda good, tmp, model: _gguf_missing_tensor(tmp, model),
        errors.MissingTensorError,
        [r"lacks tensor 'blk\.0\.ffn_down\.weight'"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_load_model_raises_a_typed_error_naming_the_problem(
    case, good_dir, hf_model, tmp_path, no_tensor_reads
):
    build, error_type, patterns = CASES[case]
    path = build(good_dir, tmp_path, hf_model)
    with pytest.raises(error_type) as raised:
        load_model(path)
    message = str(raised.value)
    assert "\n" not in message
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"
    assert not (tmp_path / "PWNED").exists()  # no pickle was ever loaded


@pytest.mark.parametrize("case", list(CASES))
def test_cli_prints_one_line_and_exits_2(case, good_dir, hf_model, tmp_path, no_tensor_reads):
    build, error_type, _patterns = CASES[case]
    path = build(good_dir, tmp_path, hf_model)
    result = CliRunner().invoke(app, ["convert", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {error_type.__name__}: ")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "PWNED").exists()


def test_cli_generate_reports_the_same_way(tmp_path):
    result = CliRunner().invoke(app, ["generate", str(tmp_path / "nothing-here")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: CheckpointNotFoundError: model path {tmp_path / 'nothing-here'} does not "
        "exist; give a Hugging Face model directory or a .gguf file (or a Hub name, org/name)"
    ]


@pytest.fixture(scope="module")
def loaded(good_dir):
    return load_model(good_dir)


@pytest.mark.parametrize(
    ("token_ids", "pattern"),
    [
        (np.array([[1.0, 2.0]]), r"must be integers, got dtype float64.*tokenizer\.encode"),
        ([[1, 2], [3]], r"rectangular \[batch, seq\]"),
        ([[1, 256, 3]], r"token id 256 is outside the vocabulary \[0, 256\)"),
        ([[-1, 2]], r"token id -1 is outside the vocabulary"),
        (np.zeros((1, 0), np.int32), r"seq >= 1, got \(1, 0\)"),
    ],
)
def test_bad_token_ids_to_logits(loaded, token_ids, pattern):
    with pytest.raises(errors.TokenIdError, match=pattern):
        logits(loaded, token_ids)


def test_bad_token_ids_to_generate(loaded):
    with pytest.raises(errors.TokenIdError, match="token id 300"):
        generate_ids(loaded, [5, 300], max_new_tokens=2)
