"""`generate RUN_DIR` / `chat RUN_DIR`: the latest checkpoint's base + adapters generate exactly
what the merged (float32) export generates; a run without checkpoints gets a clear error."""

import shutil

import pytest
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.errors import CheckpointNotFoundError
from featherweight.inference.generate import generate_ids
from featherweight.io.convert import convert
from featherweight.io.loader import load_model
from featherweight.recipe.schema import parse_config
from featherweight.train.export_run import export_run
from featherweight.train.loop import train
from featherweight.train.run_model import chat_replies, load_run_model
from featherweight.train.saved_run import is_run_dir
from tests.conftest import run_settings

PROMPT = "What colour is the planet Thodorlex?"


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run_model") / "run"
    train(parse_config(run_settings(tiny_model_dir, demo_data, out, steps=4)))
    return out


def prompt_ids(model):
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    return model.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_generate_from_a_run_equals_generate_from_its_merged_export(lora_run, tmp_path):
    model, step = load_run_model(lora_run)
    assert step == 4 and model.lora is not None and "lora" in model.params["layers"]
    merged = load_model(export_run(lora_run, "merged", tmp_path / "merged", dtype="float32"))
    ours = generate_ids(model, prompt_ids(model), 24)
    assert ours == generate_ids(merged, prompt_ids(merged), 24)
    checkpoint, two = load_run_model(lora_run / "checkpoints" / "2")
    assert two == 2 and generate_ids(checkpoint, prompt_ids(checkpoint), 4) is not None

    result = CliRunner().invoke(
        app, ["generate", str(lora_run), "--prompt", PROMPT, "--max-new-tokens", "24"]
    )
    assert result.exit_code == 0, result.output
    reply = model.tokenizer.decode(ours)
    assert reply.strip()[:20] in result.output.replace("\n", "")


@pytest.mark.slow
def test_chat_keeps_the_history_and_replies_as_generate_does(lora_run):
    model, _ = load_run_model(lora_run)
    first, second = chat_replies(model, [PROMPT, "And the next one?"], max_new_tokens=8)
    assert first == model.tokenizer.decode(generate_ids(model, prompt_ids(model), 8)).strip()
    assert isinstance(second, str)
    result = CliRunner().invoke(
        app, ["chat", str(lora_run), "--max-new-tokens", "8"], input=f"{PROMPT}\n/exit\n"
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("model>") == 1


def test_a_run_without_checkpoints_is_refused_clearly(tmp_path, tiny_model_dir, demo_data):
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 4\n")
    assert is_run_dir(run) and not is_run_dir(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="has no checkpoint yet; train at least"):
        load_run_model(run)
    shutil.rmtree(run)


@pytest.mark.slow
def test_generate_run_dtype_float32_is_the_float32_merged_export(
    tiny_model_dir, demo_data, tmp_path
):
    base = convert(tiny_model_dir, tmp_path / "bf16-base", dtype="bfloat16")  # as Hub models are
    run = tmp_path / "run"
    settings = run_settings(base, demo_data, run, steps=2, **{"model.dtype": "bfloat16"})
    train(parse_config(settings))
    merged = export_run(run, "merged", tmp_path / "merged")  # float32, the default
    options = ["--prompt", PROMPT, "--max-new-tokens", "16"]
    from_run = CliRunner().invoke(app, ["generate", str(run), "--dtype", "float32", *options])
    from_export = CliRunner().invoke(app, ["generate", str(merged), *options])
    assert from_run.exit_code == 0 and from_export.exit_code == 0, from_run.output
    assert "2 layers, float32)" in from_run.output
    assert from_run.stdout == from_export.stdout  # the replies: stdout holds nothing else
    in_bf16 = CliRunner().invoke(app, ["generate", str(run), *options])
    assert "2 layers, bfloat16)" in in_bf16.output  # the run's own dtype by default
