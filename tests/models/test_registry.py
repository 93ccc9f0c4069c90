"""Built-in model names: case, org prefixes, -Instruct / -chat variants and `demo` resolve to the
base model's shapes; the names are listed in `plan --help`."""

import math

import pytest
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.errors import CheckpointNotFoundError
from featherweight.models.registry import BUILTIN_MODELS, builtin_config, is_builtin_model
from featherweight.models.shapes import layer_shapes, parameter_count


@pytest.mark.parametrize(
    "name, base",
    [
        ("SmolLM2-135M-Instruct", "SmolLM2-135M"),
        ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "SmolLM2-1.7B"),
        ("demo", "SmolLM2-135M"),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B-v0.3"),
        ("llama-3.2-1b", "Llama-3.2-1B"),
        ("google/gemma-3-27b-it", "Gemma-3-27B"),
        ("google/gemma-3-1b-pt", "Gemma-3-1B"),
        ("Qwen/Qwen3-14B-Base", "Qwen3-14B"),
        ("microsoft/Phi-3.5-mini-instruct", "Phi-3.5-mini"),
        ("microsoft/phi-4", "Phi-4"),
        ("mistralai/Mistral-Small-24B-Instruct-2501", "Mistral-Small-24B"),
    ],
)
def test_variants_resolve_to_their_base_shapes(name, base):
    assert is_builtin_model(name)
    assert builtin_config(name).to_hf_dict() == builtin_config(base).to_hf_dict()


def test_unknown_names_list_the_built_in_ones():
    assert not is_builtin_model("gpt2")
    with pytest.raises(CheckpointNotFoundError, match=r"Llama-3\.1-8B.*-Instruct variants\), demo"):
        builtin_config("gpt2")


def test_plan_help_lists_the_built_in_names():
    result = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert all(name in text for name in BUILTIN_MODELS) and "demo" in text


def test_the_families_built_in_shapes_are_their_config_jsons():
    # the fields that fix each family's shapes and attention, as published (registry comments)
    qwen = builtin_config("Qwen3-14B")
    assert (qwen.hidden_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads) == (
        5120,
        40,
        40,
        8,
    )
    assert (qwen.head_dim, qwen.intermediate_size, qwen.vocab_size) == (128, 17408, 151936)
    assert qwen.qk_norm and qwen.windows == "none"
    gemma = builtin_config("Gemma-3-27B")
    assert (gemma.hidden_size, gemma.num_layers, gemma.num_heads, gemma.num_kv_heads) == (
        5376, 62, 32, 16,
    )  # fmt: skip
    assert (gemma.head_dim, gemma.intermediate_size, gemma.sliding_window) == (128, 21504, 1024)
    assert gemma.attention_scale == pytest.approx(168**-0.5) and gemma.qk_norm
    assert gemma.vocab_size == 262208 and builtin_config("Gemma-3-1B").vocab_size == 262144
    assert gemma.layer_types()[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert gemma.rope_scaling.factor == 8.0 and gemma.local_rope_theta == 10000.0
    gemma2 = builtin_config("Gemma-2-9B")
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.sliding_window) == (50.0, 30.0, 4096)
    phi = builtin_config("Phi-3.5-mini")
    assert phi.rope_scaling.rope_type == "longrope" and len(phi.rope_scaling.long_factor) == 48
    assert builtin_config("Mistral-Small-24B").head_dim == 128  # 5120 / 32 would be 160


# (total, active) parameters on each model card; gpt-oss's card counts the active parameters
# without the embedding table (a lookup), the others with it
MOE_CARDS = {
    "Qwen3-30B-A3B": (30.5e9, 3.3e9, True),  # Qwen/Qwen3-30B-A3B: 30.5B, 3.3B activated
    "Qwen3-235B-A22B": (235e9, 22e9, True),  # Qwen/Qwen3-235B-A22B: 235B, 22B activated
    "Mixtral-8x7B-v0.1": (46.7e9, 12.9e9, True),  # mistral.ai/news/mixtral-of-experts
    "gpt-oss-20b": (20.91e9, 3.61e9, False),  # gpt-oss model card, table 1
    "gpt-oss-120b": (116.83e9, 5.13e9, False),
}


@pytest.mark.parametrize("name", MOE_CARDS)
def test_moe_built_ins_have_their_model_cards_parameter_counts(name):
    total, active, with_embedding = MOE_CARDS[name]
    config = builtin_config(name)
    count = parameter_count(config)
    experts, k = config.num_experts, config.experts_per_token
    expert_stacks = sum(
        math.prod(shape) for name, shape in layer_shapes(config).items() if len(shape) == 3
    )
    idle = config.num_layers * expert_stacks * (experts - k) // experts
    embedding = 0 if with_embedding else config.vocab_size * config.hidden_size
    assert abs(count - total) <= 0.015 * total, count
    assert abs(count - idle - embedding - active) <= 0.02 * active, count - idle - embedding


def test_moe_built_ins_read_their_config_jsons():
    qwen = builtin_config("Qwen/Qwen3-30B-A3B")
    assert (qwen.num_experts, qwen.experts_per_token, qwen.intermediate_size) == (128, 8, 768)
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.head_dim, qwen.num_layers) == (32, 4, 128, 48)
    assert qwen.norm_topk_prob and qwen.qk_norm
    mixtral = builtin_config("mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.vocab_size) == (8, 2, 32000)
    oss = builtin_config("openai/gpt-oss-20b")
    assert (oss.num_experts, oss.experts_per_token, oss.head_dim, oss.sliding_window) == (
        32, 4, 64, 128,
    )  # fmt: skip
    assert oss.layer_types()[:2] == ["sliding_attention", "full_attention"]
    assert oss.rope_scaling.rope_type == "yarn" and oss.rope_scaling.factor == 32.0
    assert oss.rope_scaling.original_max_position_embeddings == 4096
    assert oss.attention_sinks and oss.routing == "topk_softmax"
