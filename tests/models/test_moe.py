"""Mixture-of-experts layers (`models/moe.py`): Qwen3-MoE and Mixtral against transformers
(float32, eager attention; top-k 1 and 2, renormalized or not, a sliding window shorter than the
sequence), the streamed step on LoRA and QLoRA experts against the `jax.grad` reference over
AdamW steps, and the routed work: only the experts a token was routed to are computed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

from featherweight.dev.hlo_cost import hlo_dot_flops
from featherweight.inference.generate import generate_ids, logits
from featherweight.io.loader import load_model
from featherweight.models import moe
from featherweight.models.batch import Batch, batch_from_tokens
from featherweight.models.config import ModelConfig
from featherweight.models.init import init_params
from featherweight.models.llama import mlp_in, mlp_out
from featherweight.peft.lora import LoraConfig, init_lora, quantize_frozen_base
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.reference import build_reference_step, model_loss_terms
from featherweight.step.streamed import build_streamed_step
from tests.tiny_checkpoints import TOKENS, random_hf_model, reference_and_loaded, save_hf

_SMALL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, num_hidden_layers=2,
)  # fmt: skip
CASES = {
    "qwen3-moe-top2-renormalized": (
        transformers.Qwen3MoeConfig,
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=True,
        ),
    ),
    "qwen3-moe-top1": (
        transformers.Qwen3MoeConfig,
        dict(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=32, head_dim=24),
    ),
    "mixtral-top2-window": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    ),
    "gpt-oss-sinks-yarn": (  # attention sinks, alternating windows, YaRN, clamped SwiGLU, biases
        transformers.GptOssConfig,
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=8,
            intermediate_size=32,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    config_class, settings = CASES[request.param]
    config = config_class(**{**_SMALL, **settings})
    directory = tmp_path_factory.mktemp(request.param)
    return (request.param, *reference_and_loaded(config, directory))


def test_logits_and_greedy_generation_equal_transformers(case):
    name, hf_model, model = case
    with torch.no_grad():
        expected = hf_model(torch.as_tensor(TOKENS)).logits.numpy()
        prompt = [int(token) for token in TOKENS[0, :20]]
        reply = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, 20:].tolist()  # fmt: skip
    diff = np.abs(np.asarray(logits(model, TOKENS)) - expected).max()
    assert diff <= 1e-4, f"{name}: max abs diff {diff:.2e}"
    assert generate_ids(model, prompt, 10) == reply
    settings = CASES[name][1]
    assert model.config.num_experts == settings.get(
        "num_experts", settings.get("num_local_experts")
    )
    assert model.config.experts_per_token == settings["num_experts_per_tok"]
    if name.startswith("gpt-oss"):
        config = model.config
        assert config.attention_sinks and config.rope_scaling.rope_type == "yarn"
        assert config.windows == "some" and config.activation == "clamped_swiglu"
        assert config.routing == "topk_softmax" and config.expert_bias


def test_the_load_balancing_loss_equals_transformers(case):
    """transformers' `aux_loss` (`output_router_logits`) of a right-padded batch: the reference
    step's load-balancing loss over the real tokens (segment 0: padding) equals it (1e-5)."""
    _, hf_model, model = case
    mask = np.ones(TOKENS.shape, np.int64)
    mask[1, 30:] = 0
    with torch.no_grad():
        want = hf_model(
            torch.as_tensor(TOKENS), attention_mask=torch.as_tensor(mask), output_router_logits=True
        ).aux_loss
    positions = np.broadcast_to(np.arange(TOKENS.shape[1]), TOKENS.shape)
    batch = Batch(
        jnp.asarray(TOKENS), jnp.asarray(TOKENS), jnp.ones(TOKENS.shape), jnp.asarray(positions),
        jnp.asarray(mask),
    )  # fmt: skip
    _, got = model_loss_terms({}, model.params, batch, model.config)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_the_router_decides_the_output(case):
    """Routing every token to other experts changes the logits: the router's choice is used."""
    _, _, model = case
    layers = dict(model.params["layers"])
    layers["router"] = -layers["router"]
    flipped = dataclasses.replace(model, params={**model.params, "layers": layers})
    assert (
        np.abs(np.asarray(logits(flipped, TOKENS)) - np.asarray(logits(model, TOKENS))).max() > 1e-2
    )


CONFIG = ModelConfig(
    model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=32, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=4, experts_per_token=2,
    norm_topk_prob=True,
)  # fmt: skip


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_streamed_step_on_expert_adapters_equals_the_reference(method):
    """LoRA on attention and on every expert (per-expert adapters), the router frozen: five
    AdamW steps of the streamed step (each layer updated in the backward pass; kept MLP rows)
    equal the `jax.grad` reference step."""
    params = init_params(jax.random.PRNGKey(0), CONFIG)
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "gate", "up", "down"))
    adapters = init_lora(jax.random.PRNGKey(1), CONFIG, lora)
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 16))
    adapters = jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape), adapters)
    assert adapters["layers"]["lora"]["gate"]["a"].shape == (2, 4, 4, 64)  # [L, E, r, in]
    frozen = params if method == "lora" else quantize_frozen_base(params)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 33), 0, CONFIG.vocab_size)
    batch = batch_from_tokens(tokens)
    reference = build_reference_step(CONFIG, optimizer, lora=lora.spec, donate=False)
    streamed = build_streamed_step(
        CONFIG, optimizer, adapters, frozen, lora=lora.spec, donate=False,
        policy=MemoryPolicy(save=("mlp_hidden",)),
    )  # fmt: skip
    ref, ref_state = adapters, optimizer.init(adapters)
    ours, our_state = adapters, init_streamed_opt_state(optimizer, adapters)
    for step in range(5):
        key = jax.random.PRNGKey(step)
        ref, ref_state, ref_metrics = reference(ref, ref_state, frozen, batch, key)
        ours, our_state, our_metrics = streamed(ours, our_state, frozen, batch, key)
        np.testing.assert_allclose(our_metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    for want, got in zip(jax.tree.leaves(ref), jax.tree.leaves(ours), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), ours, adapters)
    assert moved["layers"]["lora"]["gate"]["b"] > 1e-3  # the experts' adapters trained


def _mlp_flops(config: ModelConfig, tokens: int) -> int:
    params = init_params(jax.random.PRNGKey(0), config)
    layer = jax.tree.map(lambda leaf: leaf[0], params["layers"])
    a = jax.random.normal(jax.random.PRNGKey(1), (1, tokens, config.hidden_size))

    def mlp(layer, a):
        return mlp_out(layer, a, mlp_in(layer, a, config), config)

    return hlo_dot_flops(jax.jit(mlp).lower(layer, a).compile())


def test_only_the_routed_experts_are_computed():
    """The compiled MoE MLP's matmul FLOPs (XLA:CPU, loops by their trip counts) are the
    active-parameter formula -- each token through its k experts' three matrices, plus the
    router -- within 10%, at 64 experts where a dense pass would be 32x that."""
    config = ModelConfig(
        model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=64,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=64,
        experts_per_token=2,
    )  # fmt: skip
    tokens = 8192
    active = (
        2 * tokens * config.experts_per_token * 3 * config.hidden_size * config.intermediate_size
    )
    router = 2 * tokens * config.hidden_size * config.num_experts
    flops = _mlp_flops(config, tokens)
    assert abs(flops - (active + router)) <= 0.1 * (active + router), (flops, active + router)
    block = moe.block_rows(tokens * 2, config.num_experts)
    assert moe.padded_rows(tokens * 2, config.num_experts, block) <= 1.07 * tokens * 2


def _mxfp4_encode(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Random-free test encoder: each block of 32 values of [..., in] -> (blocks [..., G, 16]
    uint8, scales [..., G] uint8), the nearest e2m1 code under a power-of-two scale."""
    from featherweight.models.families.gpt_oss import FP4_VALUES

    grouped = values.reshape(*values.shape[:-1], -1, 32)
    exponents = np.ceil(np.log2(np.abs(grouped).max(-1) / 6.0 + 1e-30)).astype(np.int32)
    scaled = grouped / np.ldexp(1.0, exponents)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # contiguous: safetensors writes an array's memory as it lies
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponents + 127, np.uint8)


def test_gpt_oss_mxfp4_experts_load_as_transformers_decodes_them(tmp_path):
    """OpenAI's checkpoints store the experts in MXFP4: decoded on load, they give the logits of
    the transformers model holding transformers' own decoding of the same blocks
    (`convert_moe_packed_tensors`), and a merged export written back in the dense layout loads in
    transformers with those logits too."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from featherweight.io.convert import convert

    config_class, settings = CASES["gpt-oss-sinks-yarn"]
    config = config_class(**{**_SMALL, **settings})
    config._attn_implementation = "eager"
    hf_model = random_hf_model(config)
    dense = save_hf(hf_model, tmp_path / "dense")
    tensors = load_file(str(dense / "model.safetensors"))
    with torch.no_grad():
        for name in [
            n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        ]:
            out_in = np.swapaxes(tensors.pop(name), -1, -2)  # [E, out, in]
            blocks, scales = _mxfp4_encode(out_in)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            decoded = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
            )  # transformers' [E, in, out]
            hf_model.get_parameter(name).copy_(decoded)
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    (packed / "config.json").write_text((dense / "config.json").read_text())
    save_file(tensors, str(packed / "model.safetensors"), metadata={"format": "pt"})
    expected = hf_logits_of(hf_model)
    model = load_model(packed, dtype="float32")
    assert np.abs(np.asarray(logits(model, TOKENS)) - expected).max() <= 1e-4
    written = convert(packed, tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32)
    reloaded.config._attn_implementation = "eager"
    assert np.abs(hf_logits_of(reloaded.eval()) - expected).max() <= 1e-4


def hf_logits_of(hf_model) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.as_tensor(TOKENS)).logits.numpy()


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "nf4"])
def test_grouped_products_and_their_gradients_equal_a_gather_per_row(quantized):
    """The blocked product's own backward (no expert weight kept per block) against every row
    times its expert's weight gathered whole: outputs, the rows' gradient and, for trained dense
    experts, the weights' gradient."""
    from featherweight.quant.nf4 import dequantize_nf4, quantize_nf4

    experts, rows_per_expert, width_in, width_out, block = 4, (3, 0, 9, 5), 64, 32, 8
    weight = jax.random.normal(jax.random.PRNGKey(0), (experts, width_out, width_in))
    if quantized:
        weight = quantize_nf4(weight, stack_axes=1)
    dense = dequantize_nf4(weight, jnp.float32) if quantized else weight
    ids = jnp.asarray(np.repeat(np.arange(experts), rows_per_expert), jnp.int32)
    pair_row, row_token, block_expert = moe.layout(ids[:, None], experts, block)
    x = jax.random.normal(jax.random.PRNGKey(1), (ids.shape[0], width_in))
    rows = jnp.where((row_token >= 0)[:, None], x[jnp.maximum(row_token, 0)], 0.0)

    def ours(rows, weight):
        return moe._grouped(rows, weight, block_expert)[pair_row[:, 0]]

    def gathered(rows, weight):
        return jnp.einsum("ni,noi->no", rows[pair_row[:, 0]], weight[ids])

    cotangent = jax.random.normal(jax.random.PRNGKey(2), (ids.shape[0], width_out))
    want, pull_want = jax.vjp(gathered, rows, dense)
    if quantized:
        got, pull_got = jax.vjp(lambda r: ours(r, weight), rows)
        np.testing.assert_allclose(pull_got(cotangent)[0], pull_want(cotangent)[0], atol=1e-4)
    else:
        got, pull_got = jax.vjp(ours, rows, weight)
        for mine, theirs in zip(pull_got(cotangent), pull_want(cotangent), strict=True):
            np.testing.assert_allclose(mine, theirs, atol=1e-4)
    np.testing.assert_allclose(got, want, atol=1e-4)
