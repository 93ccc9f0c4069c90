"""`convert` and the HF writer: what they write is what transformers loads, logit for logit --
from HF directories (every family), from a loaded model, from GGUF files (tiny and the real
SmolLM2), sharded when asked, cast to bfloat16 when asked, and atomically (complete or absent)."""

import json

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.errors import OutputExistsError
from featherweight.inference.generate import logits
from featherweight.io.atomic import OUTPUT_MARKER, TEMP_PREFIX
from featherweight.io.convert import convert
from featherweight.io.hf_writer import iter_hf_tensors, save_hf_checkpoint
from featherweight.io.loader import load_model
from featherweight.io.safetensors_reader import SafetensorsSource, read_safetensors_header
from tests.tiny_checkpoints import (
    TOKENS,
    hf_config,
    hf_from_gguf,
    hf_logits,
    llama3_rope_factors,
    random_hf_model,
    save_hf,
    write_gguf,
)

TOLERANCE = 1e-4
REAL_TOLERANCE = 1e-3
TEXTS = ["Hello, world!", "naïve café — 日本語 🤗", "for i in range(3):\n    print(i)"]


def transformers_load(directory, dtype=torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2", "smollm2"])
def hf_checkpoint(request, tmp_path_factory):
    """(transformers model, its saved directory) for one family."""
    model = random_hf_model(hf_config(request.param))
    return model, save_hf(model, tmp_path_factory.mktemp(request.param))


def test_hf_dir_convert_round_trip(hf_checkpoint, tmp_path):
    """HF dir -> convert -> transformers: the same model, logit for logit."""
    model, directory = hf_checkpoint
    written = convert(directory, tmp_path / "out")
    assert sorted(path.name for path in written.iterdir()) == [
        OUTPUT_MARKER,
        "config.json",
        "model.safetensors",
    ]
    diff = np.abs(hf_logits(transformers_load(written), TOKENS) - hf_logits(model, TOKENS)).max()
    assert diff <= TOLERANCE


def test_loaded_model_written_back_round_trip(hf_checkpoint, tmp_path):
    """HF dir -> load_model -> save_hf_checkpoint -> transformers: logits equal featherweight's."""
    _model, directory = hf_checkpoint
    loaded = load_model(directory, dtype="float32")
    out = save_hf_checkpoint(
        tmp_path / "out", loaded.config, iter_hf_tensors(loaded.params, loaded.config), None
    )
    diff = np.abs(hf_logits(transformers_load(out), TOKENS) - np.asarray(logits(loaded, TOKENS)))
    assert diff.max() <= TOLERANCE


def test_sharded_output_with_small_shard_size(hf_checkpoint, tmp_path):
    model, directory = hf_checkpoint
    written = convert(directory, tmp_path / "out", max_shard_bytes=64 * 1024)
    index = json.loads((written / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert shards == sorted(path.name for path in written.glob("model-*.safetensors"))
    assert index["metadata"]["total_size"] == sum((written / n).stat().st_size for n in shards)
    diff = np.abs(hf_logits(transformers_load(written), TOKENS) - hf_logits(model, TOKENS)).max()
    assert diff <= TOLERANCE


def test_bfloat16_output(tmp_path):
    model = random_hf_model(hf_config("llama2"))
    written = convert(save_hf(model, tmp_path / "src"), tmp_path / "out", dtype="bfloat16")
    assert json.loads((written / "config.json").read_text())["torch_dtype"] == "bfloat16"
    header = read_safetensors_header(written / "model.safetensors")
    assert {entry.dtype.name for entry in header.values()} == {"bfloat16"}
    reloaded = transformers_load(written, dtype=torch.bfloat16).state_dict()
    for name, weight in model.state_dict().items():
        assert torch.equal(reloaded[name], weight.to(torch.bfloat16)), name


def test_tiny_gguf_convert_round_trip(tmp_path):
    """GGUF -> convert -> transformers: equals transformers reading the GGUF itself, and the
    written tokenizer loads in transformers with featherweight's token ids."""
    model = random_hf_model(hf_config("llama2"))
    gguf_path = write_gguf(tmp_path / "tiny.gguf", model, GGMLQuantizationType.Q8_0)
    written = convert(gguf_path, tmp_path / "out")
    assert (written / "tokenizer.json").is_file() and (written / "tokenizer_config.json").is_file()
    expected = hf_logits(hf_from_gguf(gguf_path), TOKENS)
    assert np.abs(hf_logits(transformers_load(written), TOKENS) - expected).max() <= TOLERANCE
    tokenizer = transformers.AutoTokenizer.from_pretrained(written)
    ours = load_model(gguf_path).tokenizer
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == ours.encode(text)


def test_llama3_gguf_converts_to_a_config_with_its_rope_scaling(tmp_path):
    """The rope factors a Llama 3.1-style GGUF stores become `rope_scaling` in config.json, so
    transformers runs the converted model as the original (its own GGUF reader does not)."""
    model = random_hf_model(hf_config("llama3"))
    factors = {"rope_freqs.weight": llama3_rope_factors(model.config)}
    gguf_path = write_gguf(tmp_path / "llama3.gguf", model, extra_tensors=factors)
    written = convert(gguf_path, tmp_path / "out")
    rope = json.loads((written / "config.json").read_text())["rope_scaling"]
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    diff = np.abs(hf_logits(transformers_load(written), TOKENS) - hf_logits(model, TOKENS)).max()
    assert diff <= TOLERANCE


@pytest.mark.slow
def test_smollm2_gguf_convert_round_trip(demo_gguf, tmp_path):
    """The real GGUF, converted: transformers loads the directory, its logits equal
    featherweight's on the GGUF, and its tokenizer and chat template are featherweight's."""
    written = convert(demo_gguf, tmp_path / "smollm2")
    ours = load_model(demo_gguf)
    prompt = ours.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    ids = np.asarray([ours.tokenizer.encode(prompt, add_special_tokens=False)])
    diff = np.abs(hf_logits(transformers_load(written), ids) - np.asarray(logits(ours, ids)))
    assert diff.max() <= REAL_TOLERANCE  # 30 layers, logits ~30: float32 summation-order noise
    tokenizer = transformers.AutoTokenizer.from_pretrained(written)
    for text in [*TEXTS, prompt]:
        assert tokenizer(text)["input_ids"] == ours.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Name a colour."}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        prompt
    )


def _leftovers(parent) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if path.name.startswith(TEMP_PREFIX))


def _fail_after(monkeypatch, reads: int, seen_partial: list):
    """Make the source fail on read number `reads`, noting the partial output present then."""
    original = SafetensorsSource.read
    count = {"reads": 0}

    def failing_read(self, key):
        count["reads"] += 1
        if count["reads"] == reads:
            seen_partial.extend(p.name for p in self.path.parent.glob(f"{TEMP_PREFIX}*/*"))
            raise RuntimeError("disk unplugged")
        return original(self, key)

    monkeypatch.setattr(SafetensorsSource, "read", failing_read)


def test_failure_mid_write_leaves_no_output(monkeypatch, tmp_path):
    source = save_hf(random_hf_model(hf_config("llama2")), tmp_path / "src")
    partial: list[str] = []
    _fail_after(monkeypatch, reads=15, seen_partial=partial)
    with pytest.raises(RuntimeError, match="disk unplugged"):
        convert(source, tmp_path / "out", max_shard_bytes=16 * 1024)
    assert any(name.endswith(".safetensors") for name in partial)  # it failed mid-write
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_failed_overwrite_keeps_the_previous_output(monkeypatch, tmp_path):
    source = save_hf(random_hf_model(hf_config("llama2")), tmp_path / "src")
    out = convert(source, tmp_path / "out")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    _fail_after(monkeypatch, reads=10, seen_partial=[])
    with pytest.raises(RuntimeError):
        convert(source, out, overwrite=True)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert _leftovers(tmp_path) == []


def test_existing_output_is_refused_before_reading(monkeypatch, tmp_path):
    source = save_hf(random_hf_model(hf_config("llama2")), tmp_path / "src")
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(SafetensorsSource, "__init__", lambda *args: pytest.fail("opened"))
    with pytest.raises(OutputExistsError, match=r"out already exists.*--overwrite"):
        convert(source, tmp_path / "out")


def test_cli_convert(tmp_path):
    source = save_hf(random_hf_model(hf_config("smollm2")), tmp_path / "src")
    result = CliRunner().invoke(app, ["convert", str(source), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    rerun = CliRunner().invoke(app, ["convert", str(source), "--out", str(tmp_path / "out")])
    assert rerun.exit_code == 2
    assert "OutputExistsError" in rerun.output
