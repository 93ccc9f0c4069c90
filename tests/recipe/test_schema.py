"""Training settings: defaults, overrides, and errors that name the key, the line and the fix."""

import re
from pathlib import Path

import pytest

from featherweight.errors import ConfigError
from featherweight.recipe.schema import load_config, parse_config


def test_defaults_are_a_qlora_run_on_the_demo():
    config = parse_config({})
    assert config.method == "qlora"
    assert config.model.path == "demo"
    assert config.memory.step == "streamed"


def test_overrides_parse_yaml_values(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 10\nlora:\n  rank: 4\n")
    config = load_config(path, ["steps=25", "lora.targets=[q, v]", "memory.loss_chunk=64"])
    assert config.steps == 25
    assert config.lora.rank == 4
    assert config.lora.targets == ("q", "v")
    assert config.memory.loss_chunk == 64


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("optimzer: {}\n", "unknown key 'optimzer' (line 1) (did you mean 'optimizer'?)"),
        ("optimizer:\n  learnig_rate: 0.1\n", "did you mean 'learning_rate'"),
        ("gradient_accumulation_steps: 4\n", "did you mean 'memory.accumulation_steps'"),
        ("optimizer:\n  max_grad_norm: 1.0\n", "did you mean 'optimizer.clip_norm'"),
        ("steps: 1\nbatch_size: many\n", "batch_size (line 2)"),
        ("lora:\n  targets: [q, qkv]\n", "unknown LoRA target(s) ['qkv']"),
        ("method: prefix\n", "method"),
        ("lora:\n  rank: 0\n", "lora.rank"),
    ],
)
def test_bad_settings_name_the_key_and_line(tmp_path, yaml_text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert expected in str(error.value)
    assert str(path) in str(error.value)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listing)
    with pytest.raises(ConfigError, match=r"key\.sub=value"):
        load_config(None, ["steps"])


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(
        "steps: 10\noptimizer:\n  learning_rate: 0.1\n  learning_rate: 0.2\nsteps: 20\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"twice.yaml: key 'optimizer.learning_rate' is written twice \(lines 3 and 4\)",
    ):
        load_config(path)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"steps": True}, "steps"),
        ({"optimizer": {"learning_rate": True}}, "optimizer.learning_rate"),
        ({"memory": {"loss_chunk": False}}, "memory.loss_chunk"),
        ({"lora": {"rank": True}}, "lora.rank"),
    ],
)
def test_yes_or_no_is_not_a_number(values, key):
    with pytest.raises(ConfigError, match=rf"{key}.*yes/no value, not a number"):
        parse_config(values)
    assert parse_config({"data": {"pack": False}, "lora": {"rslora": True}}).lora.rslora


def test_a_bad_override_is_named_as_the_override_not_as_a_yaml_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method: lora\nsteps: 10\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, ["steps=ten"])
    assert "steps (--set steps=ten)" in str(error.value)
    assert "line 2" not in str(error.value)


def test_a_missing_config_points_at_an_example_that_exists(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "missing.yaml")
    repository = Path(__file__).resolve().parents[2]
    named = re.findall(r"examples/[\w.-]*", str(error.value))
    assert named and all((repository / name).exists() for name in named), named
    assert "README.md" in str(error.value)
    load_config(repository / "examples" / "lora-csv-qa.yaml")  # the one it names parses


def test_steps_and_epochs_both_set_are_refused_naming_both(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("steps: 200\nepochs: 3\n")
    with pytest.raises(ConfigError, match=r"steps \(line 1\) and epochs \(line 2\) are both set"):
        load_config(both)
    assert load_config(both, ["epochs=null"]).steps == 200  # the fix the message names
    epochs = tmp_path / "epochs.yaml"
    epochs.write_text("method: lora\nepochs: 3\n")
    with pytest.raises(ConfigError, match=r"steps \(--set steps=5\) and epochs \(line 2\)"):
        load_config(epochs, ["steps=5"])


@pytest.mark.parametrize("text", ["", "# all defaults?\n", "---\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match="holds no settings"):
        load_config(config)
