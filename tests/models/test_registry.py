"""Built-in model names: case, org prefixes, -Instruct / -chat variants and `demo` resolve to the
base model's shapes; the names are listed in `plan --help`."""

import pytest
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.errors import CheckpointNotFoundError
from featherweight.models.registry import BUILTIN_MODELS, builtin_config, is_builtin_model


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
