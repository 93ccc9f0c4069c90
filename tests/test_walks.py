"""The walks the README and the examples' headers tell a user to type, read from those files: each
command parses as the command line reads it (every option exists and takes its value), and a
command that reads a run (`generate`, `chat`, `export`) finds the run the walk's `train` wrote,
from the repository root as written -- a config's output_dir is read from the working directory
(before, `train examples/dpo-planet-colours.yaml` wrote examples/runs/... and the README's next
command, `generate runs/dpo-planet-colours`, found no model). The slow test runs the CSV walk
for real; tests/train/test_preference_walk.py runs the DPO walk."""

import shlex
import shutil
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.recipe.paths import absolute_paths
from featherweight.recipe.schema import load_config

ROOT = Path(__file__).resolve().parent.parent
RUN_READERS = {"generate", "chat", "export"}


def _commands(lines: list[str]) -> list[list[str]]:
    """The `featherweight ...` command lines among `lines` (a `\\` continues a line), as argv."""
    commands, pending = [], ""
    for line in lines:
        text = pending + line.strip()
        pending = text[:-1] + " " if text.endswith("\\") else ""
        if not pending and text.startswith("featherweight "):
            commands.append(shlex.split(text, comments=True)[1:])
    return commands


def walks() -> dict[str, list[list[str]]]:
    """Each example's header, and each README code block that trains an example: its commands."""
    found = {}
    for config in sorted((ROOT / "examples").glob("*.yaml")):
        header = [
            line.lstrip("#") for line in config.read_text().splitlines() if line.startswith("#")
        ]
        found[config.name] = _commands(header)
    blocks = (ROOT / "README.md").read_text().split("```")[1::2]
    for number, block in enumerate(blocks):
        commands = _commands(block.splitlines())
        if any(command[:1] == ["train"] and "examples/" in command[1] for command in commands):
            found[f"README block {number}"] = commands
    return found


WALKS = walks()


def _parse(argv: list[str]) -> None:
    """Parse `argv` as `featherweight` would, without running the command."""
    group = typer.main.get_command(app)
    root = group.make_context("featherweight", list(argv))
    group.get_command(root, argv[0]).make_context(argv[0], argv[1:], parent=root)


def test_the_walks_are_found():
    assert {"lora-csv-qa.yaml", "dpo-planet-colours.yaml"} <= set(WALKS)
    assert any(name.startswith("README") for name in WALKS)
    assert all(WALKS.values())  # every example's header shows its commands


@pytest.mark.parametrize("name", sorted(WALKS))
def test_every_command_of_a_walk_parses(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    for argv in WALKS[name]:
        _parse(argv)


@pytest.mark.parametrize("name", sorted(WALKS))
def test_a_walk_reads_the_run_its_train_wrote(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    trained = set()
    for argv in WALKS[name]:
        if argv[0] == "train":
            overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
            trained.add(Path(absolute_paths(load_config(argv[1], overrides)).output_dir))
        elif argv[0] in RUN_READERS:
            assert (ROOT / argv[1]).absolute() in trained, (name, argv, trained)


@pytest.mark.slow
def test_the_csv_walk_runs_as_written(demo_gguf, tmp_path, monkeypatch):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # a checkout's root, elsewhere
    monkeypatch.chdir(tmp_path)
    for argv in WALKS["lora-csv-qa.yaml"]:
        result = CliRunner().invoke(app, argv, input="What is a planet?\n/exit\n")
        assert result.exit_code == 0, (argv, result.output)
    assert "model>" in result.output  # the chat answered from the trained run
    assert (tmp_path / "runs" / "lora-qa" / "checkpoints").is_dir()
