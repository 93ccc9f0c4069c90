"""LoRA exports of Qwen3, Gemma 2, Gemma 3 and Phi-3: the merged export loads in transformers and
the PEFT adapter in peft, both with featherweight's LoRA logits. Phi-3's fused `qkv_proj` and
`gate_up_proj` take its q/k/v and gate/up adapters as one block LoRA (rank k r, PEFT's
`rank_pattern` / `alpha_pattern`); the targets leave k and up out, so B has zero rows there; the
llama.cpp adapter GGUF holds the same blocks with llama.cpp's scale."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from gguf import GGUFReader
from safetensors.numpy import load_file

from featherweight.io.gguf_export import write_adapter_gguf
from featherweight.io.loader import load_model
from featherweight.io.peft_export import export_merged, export_peft
from featherweight.models.batch import batch_from_tokens
from featherweight.peft.lora import LoraConfig, init_lora
from featherweight.step.reference import build_reference_step
from tests.peft.lora_helpers import lora_logits
from tests.tiny_checkpoints import (
    LLAMA_CPP_FAMILIES,
    VOCAB,
    family_config,
    hf_logits,
    random_hf_model,
    save_hf,
)

TOLERANCE = 1e-4
TOKENS = np.random.default_rng(1).integers(0, VOCAB, size=(2, 24))
LORA = LoraConfig(rank=4, alpha=8, targets=("q", "v", "o", "gate", "down"), rslora=True)


@pytest.fixture(scope="module", params=list(LLAMA_CPP_FAMILIES))
def trained(request, tmp_path_factory):
    """(family, transformers base, featherweight model, adapters after 4 AdamW steps, logits)."""
    hf_model = random_hf_model(family_config(request.param))
    model = load_model(save_hf(hf_model, tmp_path_factory.mktemp("base")), dtype="float32")
    adapters = init_lora(jax.random.PRNGKey(0), model.config, LORA)
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(adapters)
    step = build_reference_step(model.config, optimizer, lora=LORA.spec)
    batch = batch_from_tokens(jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 17))))
    for _ in range(4):
        adapters, opt_state, _ = step(adapters, opt_state, model.params, batch, None)
    expected = lora_logits(model.params, adapters, jnp.asarray(TOKENS), model.config, LORA.spec)
    return request.param, hf_model, model, adapters, np.asarray(expected)


def test_merged_and_peft_exports_give_featherweights_logits(trained, tmp_path):
    family, hf_model, model, adapters, expected = trained
    assert np.abs(expected - hf_logits(hf_model, TOKENS)).max() > 100 * TOLERANCE  # trained
    merged = export_merged(model.params, adapters, model.config, LORA, None, tmp_path / "m")
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(merged), dtype=torch.float32
    )
    assert np.abs(hf_logits(merged_model.eval(), TOKENS) - expected).max() <= TOLERANCE, family
    out = export_peft(adapters, model.config, LORA, tmp_path / "p")
    loaded = peft.PeftModel.from_pretrained(hf_model, str(out)).eval()
    try:
        assert np.abs(hf_logits(loaded, TOKENS) - expected).max() <= TOLERANCE, family
    finally:
        loaded.unload()  # the module-scoped base model, as it was


@pytest.mark.parametrize("trained", ["phi3"], indirect=True)
def test_phi3_adapters_are_block_loras_on_the_fused_modules(trained, tmp_path):
    _, _, model, adapters, _ = trained
    out = export_peft(adapters, model.config, LORA, tmp_path / "p")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert config["rank_pattern"] == {"qkv_proj": 8}  # q and v; gate alone keeps rank 4
    assert config["alpha_pattern"] == {"qkv_proj": pytest.approx(8 * 2**0.5)}  # rsLoRA
    tensors = load_file(str(out / "adapter_model.safetensors"))
    b = tensors["base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"]
    q, kv = model.config.q_size, model.config.kv_size
    assert b.shape == (q + 2 * kv, 8) and not b[q : q + kv].any()  # k is not a target
    # llama.cpp's adapter: alpha / rank of each tensor, so the 2-part block's B is doubled
    stacks = jax.device_get(adapters["layers"]["lora"])
    write_adapter_gguf(tmp_path / "adapter.gguf", stacks, model.config, LORA.scale)
    reader = GGUFReader(str(tmp_path / "adapter.gguf"))
    alpha = reader.fields["adapter.lora.alpha"].contents()
    found = {
        t.name: np.asarray(t.data).reshape(list(reversed(t.shape.tolist()))) for t in reader.tensors
    }
    a, b = found["blk.1.attn_qkv.weight.lora_a"], found["blk.1.attn_qkv.weight.lora_b"]
    update = alpha / a.shape[0] * (b @ a)
    expected_q = LORA.scale * stacks["q"]["b"][1] @ stacks["q"]["a"][1]
    np.testing.assert_allclose(update[:q], expected_q, atol=1e-6)
    assert set(found) == {
        f"blk.{layer}.{name}.weight.lora_{part}"
        for layer in range(2)
        for name in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
        for part in "ab"
    }
