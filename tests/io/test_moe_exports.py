"""Exports of mixture-of-experts models (Qwen3-MoE, Mixtral, gpt-oss) with LoRA on attention and
on every expert: the merged export loads in transformers, and the PEFT adapter -- the experts on
transformers' fused 3-D parameters through PEFT's `target_parameters` -- loads in peft, both with
featherweight's LoRA logits (float32). Qwen3-MoE's merged GGUF (llama.cpp's qwen3moe: experts
stacked in `ffn_*_exps`, the router `ffn_gate_inp`, the `expert_*` keys) loads back with them; a
Qwen3-MoE that llama.cpp would route otherwise is refused (gpt-oss GGUF: test_gguf_families.py)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from gguf import GGUFReader

from featherweight.errors import ExportError
from featherweight.inference.generate import logits
from featherweight.io.gguf_export import export_merged_gguf
from featherweight.io.loader import load_model
from featherweight.io.ollama import MODEL_FILE
from featherweight.io.peft_export import export_merged, export_peft
from featherweight.peft.lora import LoraConfig
from tests.peft.lora_helpers import lora_logits, random_adapters
from tests.tiny_checkpoints import hf_logits, random_hf_model, save_byte_level_tokenizer, save_hf

TOLERANCE = 1e-4
VOCAB = 256  # the byte-level tokenizer's, which GGUF files carry
TOKENS = np.random.default_rng(1).integers(0, VOCAB, size=(2, 20))
LORA = LoraConfig(rank=2, alpha=8, targets=("q", "v", "gate", "up", "down"))
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, num_experts_per_tok=2, max_position_embeddings=256,
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(num_experts=4, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True),
    ),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, intermediate_size=32)),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(num_local_experts=4, intermediate_size=32, head_dim=16, sliding_window=8),
    ),
}


def _eager(model):
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def adapted(request, tmp_path_factory):
    """(family, transformers base, featherweight model, adapters as large as the weights,
    featherweight's LoRA logits)."""
    config_class, settings = FAMILIES[request.param]
    hf_model = _eager(random_hf_model(config_class(**SIZES, **settings)))
    directory = save_hf(hf_model, tmp_path_factory.mktemp("base"))
    model = load_model(save_byte_level_tokenizer(directory), dtype="float32")
    adapters = random_adapters(jax.random.PRNGKey(0), model.config, LORA)
    expected = lora_logits(model.params, adapters, jnp.asarray(TOKENS), model.config, LORA.spec)
    return request.param, hf_model, model, adapters, np.asarray(expected)


def test_merged_export_gives_featherweights_logits(adapted, tmp_path):
    family, hf_model, model, adapters, expected = adapted
    assert np.abs(expected - hf_logits(hf_model, TOKENS)).max() > 100 * TOLERANCE  # adapted
    merged = export_merged(model.params, adapters, model.config, LORA, None, tmp_path / "m")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert np.abs(hf_logits(_eager(reloaded), TOKENS) - expected).max() <= TOLERANCE, family


def test_peft_export_targets_the_fused_expert_parameters(adapted, tmp_path):
    family, hf_model, model, adapters, expected = adapted
    out = export_peft(adapters, model.config, LORA, tmp_path / "p")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["rank_pattern"] == {"gate_up_proj": 4}  # gate and up: one block LoRA each
    loaded = peft.PeftModel.from_pretrained(hf_model, str(out)).eval()
    try:
        assert np.abs(hf_logits(loaded, TOKENS) - expected).max() <= TOLERANCE, family
    finally:
        loaded.unload()  # the module-scoped base model, as it was


@pytest.mark.parametrize("adapted", ["qwen3_moe"], indirect=True)
def test_qwen3_moe_gguf_round_trip_keeps_the_logits(adapted, tmp_path):
    _, _, model, adapters, expected = adapted
    args = (model.params, adapters, model.config, LORA, model.tokenizer)
    out = export_merged_gguf(*args, tmp_path / "g", quant="f32") / MODEL_FILE
    reader = GGUFReader(str(out))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert (fields["qwen3moe.expert_count"], fields["qwen3moe.expert_used_count"]) == (4, 2)
    assert fields["qwen3moe.expert_feed_forward_length"] == 32
    shapes = {tensor.name: tuple(tensor.shape.tolist()) for tensor in reader.tensors}
    assert shapes["blk.1.ffn_gate_exps.weight"] == (64, 32, 4)  # ggml order: in, out, experts
    assert shapes["blk.1.ffn_down_exps.weight"] == (32, 64, 4)
    assert shapes["blk.1.ffn_gate_inp.weight"] == (64, 4)
    back = load_model(out, dtype="float32")
    assert (back.config.num_experts, back.config.experts_per_token) == (4, 2)
    assert np.abs(np.asarray(logits(back, TOKENS)) - expected).max() <= TOLERANCE
    unnormalized = dataclasses.replace(model.config, norm_topk_prob=False)
    with pytest.raises(ExportError, match=r"norm_topk_prob=false.*--format merged"):
        export_merged_gguf(model.params, None, unnormalized, None, model.tokenizer, tmp_path / "n")
