"""Exports people can load at once: the PEFT adapter names a base transformers loads (the run's HF
directory, an id the user gives, or the HF directory written for a GGUF base) and peft loads it
from there; QLoRA adapters carry a README and a warning on the NF4 base; the merged export's
output check; files follow the umask."""

import json
import os
import stat

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.errors import ExportError
from featherweight.inference.generate import logits
from featherweight.io.loader import load_model
from featherweight.models.model import Model
from featherweight.recipe.schema import parse_config
from featherweight.train.export_check import merged_output_check
from featherweight.train.export_run import export_run
from featherweight.train.loop import train
from featherweight.train.run_model import _overlay, load_run_model
from tests.conftest import run_settings
from tests.hub_cache import add_to_hub_cache
from tests.tiny_checkpoints import TOKENS, hf_config, random_hf_model, write_gguf


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    train(parse_config(run_settings(tiny_model_dir, demo_data, out, steps=2)))
    return out


@pytest.fixture(scope="module")
def qlora_gguf_run(tmp_path_factory):
    """QLoRA on a tiny GGUF base (byte-level vocabulary, no chat template), text records."""
    root = tmp_path_factory.mktemp("gguf_run")
    base = write_gguf(root / "tiny.gguf", random_hf_model(hf_config("llama2")))
    data = root / "text.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"line {n} of some text"}) + "\n" for n in range(8))
    )
    settings = run_settings(base, data, root / "run", steps=2, method="qlora")
    settings["data"]["eval_fraction"] = 0.0
    train(parse_config(settings))
    return root / "run"


def peft_logits(adapter_dir) -> np.ndarray:
    """Logits of peft's model over the base the adapter records (as a user would load it)."""
    recorded = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(
        recorded["base_model_name_or_path"], dtype=torch.float32
    )
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.as_tensor(TOKENS[:, :16] % 256)).logits.numpy()


def modes(directory):
    return {
        path.name: stat.S_IMODE(path.stat().st_mode) for path in [directory, *directory.iterdir()]
    }


@pytest.mark.slow
def test_peft_loads_the_adapter_from_its_recorded_hf_base(
    lora_run, tiny_model_dir, tmp_path, monkeypatch
):
    previous = os.umask(0o002)
    try:
        adapter = export_run(lora_run, "peft", tmp_path / "adapter")
    finally:
        os.umask(previous)
    assert set(modes(adapter).values()) <= {0o664, 0o775}  # the umask's, not mkstemp's 0600
    recorded = json.loads((adapter / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == str(tiny_model_dir)
    model, _ = load_run_model(lora_run)
    ours = np.asarray(logits(model, TOKENS[:, :16] % 256))
    np.testing.assert_allclose(peft_logits(adapter), ours, atol=2e-4, rtol=1e-4)
    # --base-model is checked: a Hub name must be there (here: in the Hub cache, offline)
    add_to_hub_cache(tmp_path / "hub", "someone/tiny-base", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    named = export_run(lora_run, "peft", tmp_path / "named", base_model="someone/tiny-base")
    assert "someone/tiny-base" in (named / "README.md").read_text()
    assert json.loads((named / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "someone/tiny-base"
    )
    with pytest.raises(ExportError, match=r"--base-model SmolLM2-135M is not the model this run"):
        export_run(lora_run, "peft", tmp_path / "wrong", base_model="SmolLM2-135M")
    assert not (tmp_path / "wrong").exists()


@pytest.mark.slow
def test_a_gguf_base_is_written_as_hf_for_peft_and_qlora_says_how_to_load_it(
    qlora_gguf_run, tmp_path
):
    out = tmp_path / "adapter"
    result = CliRunner().invoke(
        app, ["export", str(qlora_gguf_run), "--format", "peft", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "NF4 (4-bit) base" in result.output and "bnb_4bit_quant_type='nf4'" in result.output
    assert "BitsAndBytesConfig" in (out / "README.md").read_text()
    recorded = json.loads((out / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == str(out / "base")
    # peft over the written base equals featherweight's adapters over the same (unquantized) base
    base = load_model(out / "base", dtype="float32")
    model, _ = load_run_model(qlora_gguf_run)
    unquantized = Model(
        base.config,
        _overlay(base.params, {"layers": {"lora": model.params["layers"]["lora"]}}),
        base.tokenizer,
        base.source,
        model.lora,
    )
    ours = np.asarray(logits(unquantized, TOKENS[:, :16] % 256))
    np.testing.assert_allclose(peft_logits(out), ours, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_the_merged_export_warns_when_its_outputs_differ_from_float32(lora_run, tmp_path):
    merged = export_run(lora_run, "merged", tmp_path / "merged", dtype="bfloat16")
    assert merged_output_check(lora_run, merged, "float32") is None  # nothing to compare
    weights = load_file(str(merged / "model.safetensors"))
    assert merged_output_check(lora_run, merged, "bfloat16", new_tokens=8) is None
    # negative control: an export whose weights changed generates differently, and is named
    noise = np.random.default_rng(0).normal(size=weights["model.norm.weight"].shape)
    weights["model.norm.weight"] = (weights["model.norm.weight"] * 50 * noise).astype(np.float32)
    save_file(weights, str(merged / "model.safetensors"), metadata={"format": "pt"})
    warning = merged_output_check(lora_run, merged, "bfloat16", new_tokens=8)
    assert warning is not None and "export again with --dtype float32" in warning
