"""Run-directory ownership: only featherweight's own files are ever removed; one trainer at a time."""

import fcntl
import os

import pytest

from featherweight.errors import OutputExistsError
from featherweight.train import run_dir


def _fake_run(directory):
    run_dir.claim(directory)
    (directory / "config.yaml").write_text("steps: 1\n")
    (directory / "checkpoints" / "2").mkdir(parents=True)
    (directory / ".fw-tmp-config.yaml-x").write_text("half")
    run_dir.release(directory)
    return directory


def test_clearing_removes_exactly_what_a_run_wrote(tmp_path):
    run = _fake_run(tmp_path / "run")
    run_dir.clear_run(run)
    assert sorted(p.name for p in run.iterdir()) == [run_dir.MARKER]


def test_a_foreign_file_stops_the_clearing_before_anything_is_removed(tmp_path):
    run = _fake_run(tmp_path / "run")
    (run / "notes.md").write_text("mine")
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(OutputExistsError, match=r"'notes\.md'"):
        run_dir.clear_run(run)
    assert sorted(p.name for p in run.iterdir()) == before


def test_an_unmarked_directory_is_never_cleared(tmp_path):
    (tmp_path / "config.yaml").write_text("a config that looks like a run's")
    with pytest.raises(OutputExistsError, match="not created by featherweight"):
        run_dir.clear_run(tmp_path)
    assert (tmp_path / "config.yaml").exists()


def test_a_second_holder_of_the_lock_is_refused(tmp_path):
    other = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # another process's trainer
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(OutputExistsError, match="in use by another featherweight process"):
            run_dir.acquire(tmp_path)
    finally:
        os.close(other)
    run_dir.acquire(tmp_path)  # free again once the other holder is gone
    run_dir.release(tmp_path)
