"""The GRPO example's walk, as its header writes it, from a checkout's root: `featherweight train
examples/grpo-planet-colours.yaml` (LoRA on the embedded demo model, the reward file beside the
config) runs a few steps on a CPU and completes, each step's line carrying TRL's reward metrics.

Not asserted: that the reward rises (10 steps take minutes). Measured on this 2-core CPU on
2026-11-28 over the example's 10 steps (docs/preference.md), the prompts' scout reports stating
each planet's colour beside its moon's: the mean reward 0.55, 0.85, 1.14, then 1.20 (every answer
right) from step 4."""

import json
import shutil
import subprocess

import pytest

from tests.conftest import CLI, default_compiler_env
from tests.test_walks import ROOT, WALKS

STEPS = 2


@pytest.mark.slow
def test_the_grpo_example_runs_on_the_demo_model(demo_gguf, tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    train_argv = WALKS["grpo-planet-colours.yaml"][0]
    assert train_argv[:2] == ["train", "examples/grpo-planet-colours.yaml"]
    command = [*CLI, *train_argv, "--set", f"steps={STEPS}"]  # its own process, XLA's defaults
    trained = subprocess.run(
        command, cwd=tmp_path, env=default_compiler_env(), capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    run = tmp_path / "runs" / "grpo-planet-colours"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    assert [record["step"] for record in steps] == list(range(1, STEPS + 1))
    for record in steps:  # planet_colour (weight 1) + names_a_colour (weight 0.2)
        assert 0.0 <= record["reward"] <= 1.2
        assert 0.0 <= record["rewards/planet_colour/mean"] <= 1.0
    samples = (run / "completions.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in samples] == [2]
    assert (run / "checkpoints" / str(STEPS)).is_dir()
