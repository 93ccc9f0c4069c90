"""Every bad input of the catalogue (tests/reliability/errors_catalogue.py, docs/errors.md) is fed to
featherweight: it raises exactly the catalogued error, whose one-line message names the offending
value and the fix, and nothing is written. The catalogue, these tests and docs/errors.md agree."""

import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from featherweight import errors
from featherweight.cli.main import app
from tests.reliability.catalogue_cases import CASES, Env
from tests.reliability.catalogue_command_line import Cli
from tests.reliability.errors_catalogue import (
    CATALOGUE,
    DOCS_PAGE,
    RUNTIME_ERRORS,
    error_classes,
    generated_part,
    render,
)

ENTRIES = {entry.name: entry for entry in CATALOGUE}


def snapshot(*directories: Path) -> dict[str, bytes]:
    """Every entry under `directories` with its content (a link: its target; a FIFO or a file
    that cannot be read: its kind and mode)."""
    entries = {}
    for directory in directories:
        for path in sorted(directory.rglob("*")):
            if path.is_symlink():
                entries[str(path)] = os.readlink(path).encode()
            elif path.is_dir():
                entries[str(path)] = b"<directory>"
            elif not path.is_file():
                entries[str(path)] = f"<special {path.stat().st_mode:o}>".encode()
            else:
                try:
                    entries[str(path)] = path.read_bytes()
                except PermissionError:
                    entries[str(path)] = f"<unreadable {path.stat().st_mode:o}>".encode()
    return entries


def run_command_line(call: Cli) -> tuple[str, str]:
    """(error type, message) of a refused command line: exit code 2 and one line on stderr."""
    result = CliRunner().invoke(app, call.args, env=call.env or None)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    match = re.fullmatch(r"error: (\w+): (.+)", lines[0])
    assert match, lines[0]
    return match.group(1), match.group(2)


@pytest.fixture
def env(tmp_path, small_model_dir, demo_data, trained_run, tiny_gguf, read_only_dir, monkeypatch):
    return Env(
        tmp_path, small_model_dir, demo_data, trained_run, tiny_gguf, read_only_dir, monkeypatch
    )


@pytest.mark.parametrize("name", list(ENTRIES))
def test_bad_input(name, env):
    build, patterns = CASES[name]
    action = build(env)
    before = snapshot(env.tmp, env.run)
    if isinstance(action, Cli):
        error_type, message = run_command_line(action)
    else:
        with pytest.raises(errors.FeatherweightError) as raised:
            action()
        error_type, message = type(raised.value).__name__, str(raised.value)
    assert error_type == ENTRIES[name].error, message
    assert "\n" not in message
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in: {message}"
    assert snapshot(env.tmp, env.run) == before  # nothing written, nothing changed


def test_the_catalogue_and_its_tests_agree():
    assert set(CASES) == set(ENTRIES)
    assert len(CATALOGUE) == len(ENTRIES) >= 25  # names are unique
    assert {entry.area for entry in CATALOGUE} >= {
        "config", "paths", "checkpoints", "data", "budgets", "meshes", "exports"
    }  # fmt: skip


def test_every_error_class_has_a_catalogued_bad_input():
    abstract = {"FeatherweightError", "TensorMismatchError"}
    caught = {entry.error for entry in CATALOGUE}
    classes = {error_class.__name__ for error_class in error_classes()}
    assert caught <= classes
    assert classes - caught - abstract - set(RUNTIME_ERRORS) == set()


def test_docs_page_matches_the_catalogue():
    assert generated_part(DOCS_PAGE.read_text()) == render(), (
        "docs/errors.md is out of date: run python -m tests.reliability.errors_catalogue"
    )
