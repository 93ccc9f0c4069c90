"""The README's main job: `featherweight demo` on the embedded SmolLM2-135M learns the task."""

import io

import pytest
from rich.console import Console

from featherweight.demo.run import run_demo


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
