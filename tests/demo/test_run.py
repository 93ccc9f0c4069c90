"""The README's main job: `featherweight demo` on the embedded SmolLM2-135M learns the task."""

import io
import re

import pytest
from rich.console import Console

from featherweight.demo.run import run_demo
from featherweight.errors import OutputExistsError


@pytest.mark.slow
def test_the_demo_learns_the_task_and_shows_plan_and_measurement(tmp_path):
    output = io.StringIO()
    result = run_demo(str(tmp_path / "demo"), console=Console(file=output, width=160))
    report = output.getvalue()
    assert result.accuracy_after > result.accuracy_before
    assert result.accuracy_after >= 0.5
    assert "memory plan:" in report  # before any weight is read
    assert "measured" in report  # the compiled step's memory next to the plan
    assert (result.output_dir / "loss.png").exists()


@pytest.mark.parametrize("sentinel", ["notes.txt", "config.yaml"])
def test_the_demo_never_clears_a_directory_it_did_not_create(tmp_path, monkeypatch, sentinel):
    # `featherweight demo --output-dir .` in a directory of the user's: refused, nothing removed
    (tmp_path / sentinel).write_text("the user's")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputExistsError, match=re.escape(repr(sentinel))):
        run_demo(".", console=Console(file=io.StringIO()))
    assert (tmp_path / sentinel).read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [sentinel]
