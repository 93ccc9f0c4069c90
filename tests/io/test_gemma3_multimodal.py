"""A `Gemma3ForConditionalGeneration` checkpoint (model_type "gemma3": the text config under
`text_config`, the weights under `model.language_model.`, a vision tower beside them) loads as its
language model: the logits of `Gemma3ForCausalLM` on the same text weights."""

import numpy as np
import torch
import transformers

from featherweight.inference.generate import logits
from featherweight.io.loader import load_model
from tests.tiny_checkpoints import TOKENS, family_config, hf_logits, random_hf_model, save_hf


def test_the_text_model_of_a_multimodal_gemma3_loads(tmp_path):
    text = family_config("gemma3")
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    multimodal = random_hf_model(config)
    directory = save_hf(multimodal, tmp_path / "multimodal")
    causal = transformers.Gemma3ForCausalLM(text).eval()
    language = multimodal.model.language_model.state_dict()
    causal.model.load_state_dict(language)
    causal.lm_head.weight = causal.model.embed_tokens.weight
    model = load_model(directory, dtype="float32")
    assert model.config.model_type == "gemma3_text" and model.config.qk_norm
    with torch.no_grad():
        assert np.abs(hf_logits(causal, TOKENS) - hf_logits(multimodal, TOKENS)).max() <= 1e-4
    diff = np.abs(np.asarray(logits(model, TOKENS)) - hf_logits(causal, TOKENS)).max()
    assert diff <= 1e-4, f"max abs diff {diff:.2e}"
