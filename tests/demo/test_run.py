"""The README's main job: `featherweight demo` on the embedded SmolLM2-135M learns the task."""

import io
import re
import subprocess

import pytest
from rich.console import Console

from featherweight.demo.run import run_demo
from featherweight.errors import OutputExistsError
from tests.conftest import CLI, default_compiler_env


@pytest.mark.slow
def test_the_demo_learns_the_task_and_shows_plan_and_measurement(tmp_path):
    # as the README's first command runs it: its own process, XLA's default flags
    output_dir = tmp_path / "demo"
    command = [*CLI, "demo", "--output-dir", str(output_dir)]
    env = default_compiler_env(COLUMNS="200")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    report = result.stdout
    assert result.returncode == 0, report[-3000:] + result.stderr[-3000:]
    accuracy = re.search(r"task accuracy: before (\d+)% -> after (\d+)%", report)
    before, after = int(accuracy[1]), int(accuracy[2])
    assert after > before
    assert after >= 50
    assert "memory plan:" in report  # before any weight is read
    assert "measured" in report  # the compiled step's memory next to the plan
    assert (output_dir / "loss.png").exists()


@pytest.mark.parametrize("sentinel", ["notes.txt", "config.yaml"])
def test_the_demo_never_clears_a_directory_it_did_not_create(tmp_path, monkeypatch, sentinel):
    # `featherweight demo --output-dir .` in a directory of the user's: refused, nothing removed
    (tmp_path / sentinel).write_text("the user's")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputExistsError, match=re.escape(repr(sentinel))):
        run_demo(".", console=Console(file=io.StringIO()))
    assert (tmp_path / sentinel).read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [sentinel]
