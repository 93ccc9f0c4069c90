"""Exports of a trained adapter: the merged Hugging Face directory (bf16 and float32, LoRA and
QLoRA) and the PEFT adapter directory load in transformers / peft and give featherweight's LoRA
logits; bad requests fail with typed errors before anything is written."""

import copy
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from featherweight.errors import AdapterConfigError, ExportError, OutputExistsError
from featherweight.io.atomic import OUTPUT_MARKER
from featherweight.io.loader import load_model
from featherweight.io.peft_export import export_merged, export_peft
from featherweight.models.batch import batch_from_tokens
from featherweight.peft.lora import LoraConfig, init_lora, merge_lora_weight
from featherweight.step.reference import build_reference_step
from tests.peft.lora_helpers import lora_logits
from tests.tiny_checkpoints import VOCAB, hf_config, hf_logits, random_hf_model, save_hf

FLOAT32_TOLERANCE = 1e-4
TOKENS = np.random.default_rng(1).integers(0, VOCAB, size=(2, 24))
LORA = LoraConfig(rank=4, alpha=8, targets=("q", "v", "o", "gate", "down"), rslora=True)


def hf_load(directory) -> torch.nn.Module:
    """transformers' float32 reading of a saved directory."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(transformers base, its directory, featherweight model, adapters after 8 AdamW steps)."""
    hf_model = random_hf_model(hf_config("llama2"))
    directory = save_hf(hf_model, tmp_path_factory.mktemp("base"))
    model = load_model(directory, dtype="float32")
    adapters = init_lora(jax.random.PRNGKey(0), model.config, LORA)
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(adapters)
    step = build_reference_step(model.config, optimizer, lora=LORA.spec)
    batch = batch_from_tokens(jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (4, 17))))
    for _ in range(8):
        adapters, opt_state, _ = step(adapters, opt_state, model.params, batch, None)
    return hf_model, directory, model, adapters


@pytest.fixture(scope="module")
def expected_logits(trained):
    """featherweight's logits of the trained LoRA model."""
    _, _, model, adapters = trained
    return np.asarray(
        lora_logits(model.params, adapters, jnp.asarray(TOKENS), model.config, LORA.spec)
    )


def test_adapters_were_trained(trained, expected_logits):
    hf_model, _, _, adapters = trained
    assert all(jnp.any(pair["b"]) for pair in adapters["layers"]["lora"].values())
    assert np.abs(expected_logits - hf_logits(hf_model, TOKENS)).max() > 100 * FLOAT32_TOLERANCE


def test_merged_float32_export_loads_in_transformers_with_equal_logits(
    trained, expected_logits, tmp_path
):
    _, _, model, adapters = trained
    out = export_merged(
        model.params, adapters, model.config, LORA, model.tokenizer, tmp_path / "m", "float32"
    )
    diff = np.abs(hf_logits(hf_load(out), TOKENS) - expected_logits).max()
    assert diff <= FLOAT32_TOLERANCE, f"max abs diff {diff:.2e}"


def test_merged_bf16_export_is_sharded_and_rounds_the_float32_merge_once(
    trained, expected_logits, tmp_path
):
    hf_model, _, model, adapters = trained
    out = export_merged(
        model.params,
        adapters,
        model.config,
        LORA,
        None,
        tmp_path / "m",
        "bfloat16",
        max_shard_bytes=40_000,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3
    written = {}
    for shard in shards:
        written.update(load_file(str(out / shard)))
    pair = jax.device_get(adapters["layers"]["lora"]["gate"])
    merged = merge_lora_weight(
        model.params["layers"]["gate"][1], pair["a"][1], pair["b"][1], LORA.scale
    )
    gate = written["model.layers.1.mlp.gate_proj.weight"]
    assert gate.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(gate, merged.astype(ml_dtypes.bfloat16))
    untouched = written["model.layers.1.self_attn.k_proj.weight"]  # k is not a target
    np.testing.assert_array_equal(
        untouched, np.asarray(model.params["layers"]["k"][1]).astype(ml_dtypes.bfloat16)
    )
    # bf16 storage itself moves the logits: the export must stay within that noise floor
    rounded = copy.deepcopy(hf_model).to(torch.bfloat16).to(torch.float32)
    floor = np.abs(hf_logits(rounded, TOKENS) - hf_logits(hf_model, TOKENS)).max()
    diff = np.abs(hf_logits(hf_load(out), TOKENS) - expected_logits).max()
    print(
        f"bf16 merged export: max abs diff {diff:.2e}; bf16 rounding of the base alone {floor:.2e}"
    )
    assert diff <= 2 * floor, f"bf16 export diff {diff:.2e} vs bf16 noise floor {floor:.2e}"


def test_the_default_merged_export_is_the_model_as_trained(trained, tmp_path):
    """float32 by default: the merged sum W + scale B A exactly as featherweight computes it,
    not rounded to bfloat16's 8 significant bits."""
    _, _, model, adapters = trained
    out = export_merged(model.params, adapters, model.config, LORA, None, tmp_path / "m")
    gate = load_file(str(out / "model.safetensors"))["model.layers.1.mlp.gate_proj.weight"]
    pair = jax.device_get(adapters["layers"]["lora"]["gate"])
    base = np.asarray(model.params["layers"]["gate"][1])
    assert gate.dtype == np.float32
    np.testing.assert_array_equal(
        gate, merge_lora_weight(base, pair["a"][1], pair["b"][1], LORA.scale)
    )


def test_qlora_merged_export_dequantizes_and_merges(trained, tmp_path):
    _, directory, model, adapters = trained
    quantized = load_model(directory, dtype="float32", quantize="nf4")
    expected = lora_logits(quantized.params, adapters, jnp.asarray(TOKENS), model.config, LORA.spec)
    out = export_merged(
        quantized.params, adapters, model.config, LORA, None, tmp_path / "q", "float32"
    )
    diff = np.abs(hf_logits(hf_load(out), TOKENS) - np.asarray(expected)).max()
    assert diff <= FLOAT32_TOLERANCE, f"max abs diff {diff:.2e}"


def test_peft_export_loads_with_peft_model_from_pretrained(trained, expected_logits, tmp_path):
    hf_model, directory, model, adapters = trained
    out = export_peft(adapters, model.config, LORA, tmp_path / "p", str(directory))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["use_rslora"]
    assert config["target_modules"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    names = set(load_file(str(out / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names
    assert len(names) == 2 * 5 * model.config.num_layers
    base = random_hf_model(hf_config("llama2"))
    base.load_state_dict(hf_model.state_dict())
    loaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
    diff = np.abs(hf_logits(loaded, TOKENS) - expected_logits).max()
    assert diff <= FLOAT32_TOLERANCE, f"max abs diff {diff:.2e}"


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapters", [None, {}, {"layers": {}}, {"layers": {"lora": {}}}])
def test_export_without_adapters_is_refused(trained, tmp_path, adapters):
    _, _, model, _ = trained
    with pytest.raises(ExportError, match="no"):
        export_merged(model.params, adapters, model.config, LORA, None, tmp_path / "m")
    with pytest.raises(ExportError, match="no"):
        export_peft(adapters, model.config, LORA, tmp_path / "p")
    assert not any(tmp_path.iterdir())


def test_merged_export_refuses_an_unknown_dtype(trained, tmp_path):
    _, _, model, adapters = trained
    with pytest.raises(ExportError, match=r"'int8'.*'bfloat16'"):
        export_merged(model.params, adapters, model.config, LORA, None, tmp_path / "m", "int8")
    assert not any(tmp_path.iterdir())


def test_peft_export_of_a_full_fine_tune_is_refused(trained, tmp_path):
    _, _, model, adapters = trained
    full = {"layers": {"q": model.params["layers"]["q"]}, "embed": model.params["embed"]}
    with pytest.raises(ExportError, match=r"\['embed', 'q'\].*format 'merged'"):
        export_peft(full, model.config, LORA, tmp_path / "p")
    with pytest.raises(ExportError, match="format 'merged'"):
        export_peft({**adapters, "embed": model.params["embed"]}, model.config, LORA, tmp_path)


def test_adapters_of_other_settings_are_refused(trained, tmp_path):
    _, _, model, adapters = trained
    with pytest.raises(AdapterConfigError, match="rank 8"):
        export_peft(
            adapters, model.config, LoraConfig(rank=8, targets=LORA.targets), tmp_path / "p"
        )
    assert not (tmp_path / "p").exists()


def test_existing_output_needs_overwrite_and_overwrite_replaces_only_our_own(trained, tmp_path):
    _, _, model, adapters = trained
    out = tmp_path / "p"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    # without overwrite: named as the user's (--overwrite, which would refuse, is not offered)
    with pytest.raises(OutputExistsError, match=r"'keep\.txt', which featherweight did not write"):
        export_peft(adapters, model.config, LORA, out)
    with pytest.raises(OutputExistsError, match=r"'keep\.txt', which featherweight did not write"):
        export_merged(model.params, adapters, model.config, LORA, None, out)
    # a directory of the user's is never replaced, not even with overwrite
    for export in (
        lambda: export_peft(adapters, model.config, LORA, out, overwrite=True),
        lambda: export_merged(
            model.params, adapters, model.config, LORA, None, out, overwrite=True
        ),
    ):
        with pytest.raises(
            OutputExistsError, match=r"'keep\.txt', which featherweight did not write"
        ):
            export()
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"
    ours = tmp_path / "ours"
    export_merged(model.params, adapters, model.config, LORA, None, ours)
    export_peft(adapters, model.config, LORA, ours, overwrite=True)  # our own output: replaced
    assert sorted(p.name for p in ours.iterdir()) == [
        OUTPUT_MARKER,
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
