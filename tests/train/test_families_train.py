"""Every family trains through the command line, LoRA and QLoRA: `featherweight train CONFIG`
on a tiny random checkpoint of the family (SmolLM2's tokenizer, the demo task), two steps, a
finite loss that the second step lowers on the same batch, a checkpoint, and `generate` from the
run; and a Gemma 3 DPO run whose PEFT export peft loads."""

from __future__ import annotations

import json

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.inference.generate import logits
from featherweight.io.gguf_reader import GGUFSource
from featherweight.io.hf_writer import iter_hf_tensors, save_hf_checkpoint
from featherweight.models.init import init_params
from featherweight.train.run_model import load_run_model
from tests.conftest import run_settings, tiny_config, write_config
from tests.tiny_checkpoints import hf_logits
from tests.train.test_preference_run import PAIRS

_SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
FAMILIES = {
    "qwen3": dict(model_type="qwen3", num_layers=2, head_dim=24, qk_norm=True),
    "gemma2": dict(
        model_type="gemma2", num_layers=2, head_dim=16, norm_offset=1.0, sandwich_norms=True,
        embed_scale=True, activation="gelu_pytorch_tanh", query_scale=0.2, attn_softcap=20.0,
        final_softcap=15.0, sliding_window=8, sliding_layers=(True, False),
        tie_word_embeddings=True,
    ),
    "gemma3": dict(
        model_type="gemma3_text", num_layers=2, head_dim=16, norm_offset=1.0, qk_norm=True,
        sandwich_norms=True, embed_scale=True, activation="gelu_pytorch_tanh", sliding_window=8,
        sliding_layers=(True, False), local_rope_theta=1000.0, tie_word_embeddings=True,
    ),
    "phi3": dict(model_type="phi3", num_layers=2, head_dim=16, partial_rotary_factor=0.5,
                 sliding_window=8, sliding_layers=(True, True)),
    "mistral-window": dict(model_type="mistral", num_layers=2, head_dim=16, sliding_window=8,
                           sliding_layers=(True, True)),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(demo_gguf):
    source = GGUFSource(demo_gguf)
    try:
        return source.tokenizer()
    finally:
        source.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_through_the_command_line(family, method, tokenizer, demo_data, tmp_path):
    config = tiny_config(**{**_SHAPE, **FAMILIES[family]})
    params = init_params(jax.random.PRNGKey(0), config)
    model = save_hf_checkpoint(
        tmp_path / "model", config, iter_hf_tensors(params, config), tokenizer
    )
    settings = run_settings(model, demo_data, tmp_path / "run", steps=2, method=method)
    settings["lora"]["targets"] = ["q", "k", "v", "o", "gate", "up", "down"]
    settings["data"]["eval_fraction"] = 0.0
    config_path = write_config(tmp_path / "train.yaml", settings)
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(config_path)])
    assert result.exit_code == 0, result.output
    metrics = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [row["loss"] for row in metrics if "loss" in row]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    reply = runner.invoke(
        app, ["generate", str(tmp_path / "run"), "--prompt", "Hello", "--max-new-tokens", "4"]
    )
    assert reply.exit_code == 0, reply.output


@pytest.mark.slow
def test_gemma3_dpo_through_the_command_line_exports_an_adapter_peft_loads(tokenizer, tmp_path):
    """`featherweight train` with `objective: dpo` on a tiny Gemma 3 (sliding and global layers,
    pairs longer than the window), then `featherweight export --format peft`: peft loads the
    adapter on the transformers model, whose logits are the run's (float32, 1e-4)."""
    config = tiny_config(**{**_SHAPE, **FAMILIES["gemma3"]})
    params = init_params(jax.random.PRNGKey(0), config)
    model = save_hf_checkpoint(
        tmp_path / "model", config, iter_hf_tensors(params, config), tokenizer
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[::8][:16]))
    settings = run_settings(model, pairs, tmp_path / "run", steps=3, objective="dpo")
    settings["lora"]["targets"] = ["q", "k", "v", "o", "gate", "up", "down"]
    settings["data"].update(seq_len=192, eval_fraction=0.0)
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(write_config(tmp_path / "dpo.yaml", settings))])
    assert result.exit_code == 0, result.output
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [row for row in map(json.loads, records) if "loss" in row]
    assert len(steps) == 3 and all("rewards/margins" in row for row in steps)
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)  # the policy starts at the base
    adapter = tmp_path / "adapter"
    exported = runner.invoke(
        app, ["export", str(tmp_path / "run"), "--format", "peft", "--out", str(adapter)]
    )
    assert exported.exit_code == 0, exported.output

    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, 24))  # 3 windows long
    run_model, step = load_run_model(tmp_path / "run")
    expected = np.asarray(logits(run_model, tokens))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    assert np.abs(hf_logits(base.eval(), tokens) - expected).max() > 1e-2  # the adapter moved
    loaded = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    assert step == 3 and np.abs(hf_logits(loaded, tokens) - expected).max() <= 1e-4
