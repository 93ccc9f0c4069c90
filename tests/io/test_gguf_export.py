"""GGUF exports of a training run: the merged model equals the merged Hugging Face export, and the
LoRA adapter GGUF is llama.cpp's layout (names, shapes, q/k permutation, alpha) whose
`W + alpha / r * B A` is the merged weight; both through the CLI too."""

import numpy as np
import pytest
from gguf import GGUFReader
from safetensors.numpy import load_file
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.inference.generate import logits
from featherweight.io.gguf_reader import unpermute_rotary_rows
from featherweight.io.loader import load_model, open_checkpoint
from featherweight.io.ollama import ADAPTER_FILE, MODEL_FILE, MODELFILE
from featherweight.train.export_run import export_run
from featherweight.train.saved_run import read_run_config
from tests.reliability.conftest import trained_run

__all__ = ["trained_run"]  # the shared 4-step LoRA run (q and v adapters, rank 4)

IDS = np.asarray([[1, 504, 3458, 282, 4933, 30, 2, 198, 28, 3]])


@pytest.fixture(scope="module")
def merged_hf(trained_run, tmp_path_factory):
    return export_run(
        trained_run, "merged", tmp_path_factory.mktemp("hf") / "merged", dtype="float32"
    )


@pytest.mark.slow
def test_merged_gguf_equals_the_merged_hf_export(trained_run, merged_hf, tmp_path):
    out = export_run(trained_run, "gguf", tmp_path / "gguf", quant="f32")
    assert (out / MODELFILE).read_text().startswith(f"FROM ./{MODEL_FILE}\n")
    ours = logits(load_model(out / MODEL_FILE), IDS)
    assert np.abs(np.asarray(ours) - np.asarray(logits(load_model(merged_hf), IDS))).max() <= 1e-4


@pytest.mark.slow
def test_adapter_gguf_is_llama_cpps_lora_layout(trained_run, merged_hf, tmp_path):
    out = export_run(trained_run, "gguf-adapter", tmp_path / "adapter")
    lora = read_run_config(trained_run).lora
    reader = GGUFReader(str(out / ADAPTER_FILE))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert (fields["general.type"], fields["adapter.type"]) == ("adapter", "lora")
    assert fields["general.architecture"] == "llama"
    alpha = fields["adapter.lora.alpha"]
    assert alpha / lora.rank == pytest.approx(lora.alpha / lora.rank)  # llama.cpp's scale
    tensors = {
        t.name: np.asarray(t.data).reshape(list(reversed(t.shape.tolist()))) for t in reader.tensors
    }
    assert set(tensors) == {
        f"blk.{layer}.attn_{target}.weight.lora_{part}"
        for layer in range(2)
        for target in ("q", "v")
        for part in ("a", "b")
    }
    base = open_checkpoint(load_model_path(trained_run))
    merged = load_file(str(merged_hf / "model.safetensors"))
    heads = base.config.num_heads
    for layer in range(2):
        for target, hf in (("q", "q_proj"), ("v", "v_proj")):
            a = tensors[f"blk.{layer}.attn_{target}.weight.lora_a"]  # [r, in]
            b = tensors[f"blk.{layer}.attn_{target}.weight.lora_b"]  # [out, r], GGUF row order
            assert a.shape == (lora.rank, base.config.hidden_size)
            if target == "q":
                b = unpermute_rotary_rows(b, heads)
            rebuilt = base.read((target, layer)) + alpha / lora.rank * (b @ a)
            expected = merged[f"model.layers.{layer}.self_attn.{hf}.weight"]
            np.testing.assert_allclose(rebuilt, expected, atol=1e-5)
    modelfile = (out / MODELFILE).read_text()
    assert f"ADAPTER ./{ADAPTER_FILE}" in modelfile and "FROM /" in modelfile


def load_model_path(run):
    return read_run_config(run).model.path


@pytest.mark.slow
def test_cli_exports_q8_0_gguf(trained_run, tmp_path):
    out = tmp_path / "q8"
    result = CliRunner().invoke(
        app, ["export", str(trained_run), "--format", "gguf", "--quant", "q8_0", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    kinds = {t.name: t.tensor_type.name for t in GGUFReader(str(out / MODEL_FILE)).tensors}
    assert kinds["blk.0.attn_q.weight"] == "Q8_0" and kinds["output_norm.weight"] == "F32"


def test_cli_refuses_a_k_quant_before_reading_the_run(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "export",
            str(tmp_path / "no-run"),
            "--format",
            "gguf",
            "--quant",
            "q4_k_m",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2
    assert "llama-quantize" in result.output
