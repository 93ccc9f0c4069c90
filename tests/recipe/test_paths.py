"""Where a config's paths point: an input written in the file from the config file's folder, an
output (output_dir) and anything given on the command line from the working directory; names
stay names; the run records absolute paths; a missing input is named with where it was looked for
and why."""

import pytest

from featherweight.errors import DataError
from featherweight.recipe.paths import absolute_paths
from featherweight.recipe.schema import load_config, parse_config


def _project(tmp_path):
    """configs/run.yaml beside its data, and a working directory elsewhere."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "qa.jsonl").write_text('{"text": "hi"}\n')
    (folder / "chat.jinja").write_text("{{ messages }}")
    config = folder / "run.yaml"
    config.write_text(
        "model: {path: org/some-model}\n"
        "data: {train: qa.jsonl, chat_template: chat.jinja, eval: org/some-dataset}\n"
        "output_dir: runs/a\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return folder, config, elsewhere


def test_inputs_in_a_config_file_are_read_from_its_folder_outputs_from_the_working_directory(
    tmp_path, monkeypatch
):
    folder, config, elsewhere = _project(tmp_path)
    monkeypatch.chdir(elsewhere)
    loaded = absolute_paths(load_config(config))
    assert loaded.data.train == str(folder / "qa.jsonl")
    assert loaded.data.chat_template == str(folder / "chat.jinja")
    # where `featherweight generate runs/a`, run from the same place, looks for the run
    assert loaded.output_dir == str(elsewhere / "runs" / "a")
    assert loaded.model.path == "org/some-model"  # a Hub name stays a name
    assert loaded.data.eval == "org/some-dataset"  # and a dataset name too


def test_paths_given_on_the_command_line_are_read_from_the_working_directory(tmp_path, monkeypatch):
    _, config, elsewhere = _project(tmp_path)
    (elsewhere / "other.jsonl").write_text('{"text": "hi"}\n')
    monkeypatch.chdir(elsewhere)
    loaded = absolute_paths(load_config(config, ["data.train=other.jsonl", "output_dir=out"]))
    assert loaded.data.train == str(elsewhere / "other.jsonl")
    assert loaded.output_dir == str(elsewhere / "out")


def test_an_output_dir_is_always_a_path_never_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = absolute_paths(parse_config({"output_dir": "runs/my-run"}))
    assert config.output_dir == str(tmp_path / "runs" / "my-run")


def test_a_missing_input_names_where_it_looked_and_the_rule(tmp_path, monkeypatch):
    folder, config, elsewhere = _project(tmp_path)
    (folder / "qa.jsonl").rename(elsewhere / "qa.jsonl")  # beside the working directory instead
    monkeypatch.chdir(elsewhere)
    with pytest.raises(DataError) as error:
        load_config(config)
    message = str(error.value)
    assert f"run.yaml (line 2): data.train 'qa.jsonl' is not at {folder / 'qa.jsonl'}" in message
    assert f"read from the config's folder {folder}" in message
    assert "it is in the working directory: write ../elsewhere/qa.jsonl" in message
    assert "\n" not in message
