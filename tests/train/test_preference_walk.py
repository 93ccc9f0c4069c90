"""The README's preference walk, run as written from a checkout's root: `featherweight train
examples/dpo-planet-colours.yaml` (DPO with QLoRA on the embedded demo model, 200 hand-readable
pairs) reaches a reward accuracy above 0.9, and the README's `featherweight generate
runs/dpo-planet-colours --prompt ...` then answers the held-out question with a colour, as the
pairs prefer, where the base model names none."""

import json
import shutil
import subprocess
import sys

import pytest

from featherweight.data.demo_task import first_colour
from tests.conftest import CLI, default_compiler_env
from tests.test_walks import ROOT, WALKS

# How many held-out questions (the demo's unseen phrasing) get a reply naming a colour, from the
# trained run's model and from the base model: 16 greedy generations, run in their own process
# with XLA's default flags (decoding runs long rather than compiles much: in the test's process,
# at the suite's LLVM level 0, they took most of the test's time).
COLOURS_NAMED = """
import sys
from featherweight.data.demo_task import eval_prompts, first_colour, invented_world
from featherweight.inference.generate import generate
from featherweight.io.embedded_model import require_demo_model
from featherweight.io.loader import load_model
from featherweight.train.run_model import load_run_model

def colours_named(model):
    questions = [question for question, _ in eval_prompts(invented_world())]
    replies = [generate(model, question, max_new_tokens=16) for question in questions]
    return sum(first_colour(reply) is not None for reply in replies)

trained = colours_named(load_run_model(sys.argv[1])[0])
base = colours_named(load_model(require_demo_model(), dtype="float32"))
print(trained, base)
"""


@pytest.mark.slow
def test_dpo_on_the_demo_model_learns_the_preferred_answers(demo_gguf, tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (readme_walk,) = [walk for name, walk in WALKS.items() if name.startswith("README")]
    (train_argv, generate_argv) = readme_walk
    # each command in its own process with XLA's default flags, as a user runs it
    env = default_compiler_env(COLUMNS="200")
    run_command = lambda argv: subprocess.run(
        [*CLI, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200
    )
    trained = run_command(train_argv)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    run = tmp_path / "runs" / "dpo-planet-colours"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    accuracies = [record["rewards/accuracies"] for record in records if "loss" in record]
    assert accuracies[0] == 0.0  # the policy starts as the reference: no margin yet
    assert sum(accuracies[-5:]) / 5 > 0.9
    generated = run_command(generate_argv)
    assert generated.returncode == 0, generated.stdout[-3000:] + generated.stderr[-3000:]
    assert first_colour(generated.stdout) is not None
    counted = subprocess.run(
        [sys.executable, "-c", COLOURS_NAMED, str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert counted.returncode == 0, counted.stderr[-3000:]
    trained, base = map(int, counted.stdout.split())
    assert trained >= 7  # the held-out questions are answered with a colour, as the pairs prefer
    assert base <= 1  # where the base model names none
