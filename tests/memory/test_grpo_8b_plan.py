"""The GRPO goal: Llama-3.1-8B QLoRA, 8 completions of 512 tokens after prompts of 256, in
12 GiB on an H100 -- both phases planned, and both compiled by XLA's GPU compiler for the H100
without a GPU (deviceless), both by `featherweight plan --target h100` on
examples/grpo-8b-12gb.yaml (the train step, and the rollout program beside it)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.memory.report import percent_difference
from featherweight.parallel.backend import cuda_plugin_installed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not cuda_plugin_installed(),
        reason='XLA\'s GPU compiler is not installed (pip install "jax[cuda12-local]")',
    ),
]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-8b-12gb.yaml"
GIB = 2**30


@pytest.fixture(scope="module")
def planned_and_compiled():
    """`plan --target h100 --json` of the example: both phases planned, the train step and the
    rollout program of the settings it chose compiled for the H100."""
    # blockwise attention named: the H100's cuDNN kernel cannot be compiled without its library
    arguments = ["plan", str(EXAMPLE), "--set", "model.path=Llama-3.1-8B", "--set",
                 "memory.attention=blockwise", "--target", "h100"]  # fmt: skip
    result = CliRunner().invoke(app, [*arguments, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["compiled_rollout"]["target"] == "h100"
    return report, report["compiled_rollout"]["total_bytes"]


def test_both_phases_are_planned_and_compiled_within_12_gib(planned_and_compiled):
    report, rollout = planned_and_compiled
    resident_state = report["planned"]["optimizer_state"]  # not an argument of the rollouts
    assert report["measured_target"] == "h100" and report["fits"]
    assert report["planned_train_device_bytes"] <= 12 * GIB
    assert report["planned_rollout_device_bytes"] <= 12 * GIB
    assert report["measured_device_bytes"] <= 12 * GIB
    assert rollout + resident_state <= 12 * GIB


def test_each_phase_is_planned_within_ten_percent_of_its_compile(planned_and_compiled):
    report, rollout = planned_and_compiled
    train_error = percent_difference(
        report["planned_train_device_bytes"], report["measured_device_bytes"]
    )
    assert abs(train_error) <= 10.0, train_error
    program = report["planned_rollout_device_bytes"] - report["planned"]["optimizer_state"]
    rollout_error = percent_difference(program, rollout)
    assert abs(rollout_error) <= 10.0, rollout_error
    # the KV cache is what the phase adds most: without it the plan misses the compile
    without_cache = program - report["planned_rollout"]["kv_cache"]
    assert percent_difference(without_cache, rollout) < -10.0
