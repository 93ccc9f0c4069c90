"""The data-loss cases of issue 17, each on the command line with a sentinel file of the user's:
the test fails if featherweight deletes or changes it, or exits with anything but a refusal (2).

- `featherweight demo --output-dir DIR` on a directory of the user's (and `--output-dir .`);
- `featherweight train CONFIG --overwrite` where CONFIG (and the user's notes) lie in output_dir;
- a second trainer with `--overwrite` on the output_dir of a live one;
- `featherweight export` of a run that recorded its base model as a relative path, run from a
  directory where another model sits at that relative path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from featherweight.cli.main import app
from tests.reliability.conftest import short_run

SENTINEL = "the user's own words\n"


def refused(args: list[str]) -> str:
    """Run the command line; it must be refused: exit code 2, one line on stderr."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    return result.stderr


def tree(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else b"<dir>"
        for path in sorted(directory.rglob("*"))
    }


@pytest.mark.parametrize("where", ["named", "current"])
def test_demo_output_dir_on_a_users_directory(tmp_path, monkeypatch, where):
    users = tmp_path / "my-project"
    users.mkdir()
    (users / "notes.txt").write_text(SENTINEL)
    monkeypatch.chdir(users if where == "current" else tmp_path)
    message = refused(["demo", "--output-dir", "." if where == "current" else str(users)])
    assert "OutputExistsError" in message and "'notes.txt'" in message
    assert (users / "notes.txt").read_text() == SENTINEL
    assert sorted(p.name for p in users.iterdir()) == ["notes.txt"]


def test_overwrite_with_the_config_inside_output_dir(trained_run, tmp_path):
    run = Path(shutil.copytree(trained_run, tmp_path / "run"))
    settings = {**yaml.safe_load((run / "config.yaml").read_text()), "output_dir": str(run)}
    settings["steps"] = 6  # another run: --overwrite would replace the old one
    (run / "train.yaml").write_text(yaml.safe_dump(settings))
    (run / "notes.txt").write_text(SENTINEL)
    before = tree(run)
    message = refused(["train", str(run / "train.yaml"), "--overwrite"])
    assert "OutputExistsError" in message and "which featherweight did not write" in message
    assert tree(run) == before  # the config, the notes and the old run's checkpoints


def test_a_second_trainer_on_a_live_run(trained_run, tmp_path):
    """A live trainer holds the run directory's lock (here a process holding it the same way)."""
    run = Path(shutil.copytree(trained_run, tmp_path / "run"))
    (run / "notes.txt").unlink(missing_ok=True)
    config = tmp_path / "second.yaml"
    settings = {**yaml.safe_load((run / "config.yaml").read_text()), "output_dir": str(run)}
    config.write_text(yaml.safe_dump({**settings, "steps": 6}))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; "
         "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)", str(run)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tree(run)
        message = refused(["train", str(config), "--overwrite"])
        assert "in use by another featherweight process" in message
        assert tree(run) == before  # the live run's checkpoints, config and metrics
    finally:
        holder.kill()
        holder.wait()


def test_export_of_a_run_with_a_relative_model_path(tiny_model_dir, demo_data, tmp_path):
    from featherweight.recipe.schema import parse_config
    from featherweight.train.loop import train

    run = tmp_path / "run"
    train(parse_config(short_run(tiny_model_dir, demo_data, run, steps=2)))
    settings = yaml.safe_load((run / "config.yaml").read_text())
    settings["model"]["path"] = "models/base"  # as a run from before absolute paths recorded it
    (run / "config.yaml").write_text(yaml.safe_dump(settings))
    elsewhere = tmp_path / "elsewhere"
    decoy = Path(shutil.copytree(tiny_model_dir, elsewhere / "models" / "base"))
    (decoy / "notes.txt").write_text(SENTINEL)
    before = tree(elsewhere)
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(elsewhere)
        message = refused(["export", str(run), "--format", "merged", "--out", "merged"])
    assert "ExportError" in message and "relative path 'models/base'" in message
    assert tree(elsewhere) == before and not (elsewhere / "merged").exists()
    assert time.monotonic() - started < 30  # refused before any weight is merged
