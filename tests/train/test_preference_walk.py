"""The README's preference walk: `featherweight train examples/dpo-planet-colours.yaml` (DPO with
QLoRA on the embedded demo model, 200 hand-readable pairs) reaches a reward accuracy above 0.9,
and `generate RUN_DIR` then answers the held-out question with a colour, as the pairs prefer,
where the base model names none."""

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from featherweight.data.demo_task import eval_prompts, first_colour, invented_world
from featherweight.inference.generate import generate
from featherweight.io.embedded_model import require_demo_model
from featherweight.io.loader import load_model
from featherweight.recipe.schema import load_config
from featherweight.train.loop import train
from featherweight.train.run_model import load_run_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dpo-planet-colours.yaml"


def colours_named(model) -> int:
    """How many held-out questions (the demo's unseen phrasing) get a reply naming a colour."""
    replies = [
        generate(model, question, max_new_tokens=16)
        for question, _ in eval_prompts(invented_world())
    ]
    return sum(first_colour(reply) is not None for reply in replies)


@pytest.mark.slow
def test_dpo_on_the_demo_model_learns_the_preferred_answers(demo_gguf, tmp_path):
    config = load_config(EXAMPLE, [f"output_dir={tmp_path / 'run'}"])
    result = train(config, console=Console(file=io.StringIO()))
    records = [
        json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()
    ]
    accuracies = [record["rewards/accuracies"] for record in records if "loss" in record]
    assert accuracies[0] == 0.0  # the policy starts as the reference: no margin yet
    assert sum(accuracies[-5:]) / 5 > 0.9
    trained, _ = load_run_model(result.output_dir)
    assert colours_named(trained) >= 7
    assert colours_named(load_model(require_demo_model(), dtype="float32")) <= 1
