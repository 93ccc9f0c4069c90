"""examples/: each config parses, resolves and is planned for the device its comment names, and
fits it; the CSV example's data is read as the trainer reads it. A new example needs its row in
`EXAMPLES` (the model its Hub name is planned as, and the device), or this test fails."""

import json
from pathlib import Path

import pytest

from featherweight.memory import capacity
from featherweight.memory.budget import parse_budget, plan_within_budget
from featherweight.memory.targets import get_target
from featherweight.models.registry import builtin_config
from featherweight.recipe.build import check_method_settings
from featherweight.recipe.schema import load_config

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
# example -> (the built-in config its model is planned as, the target GPU it is written for)
EXAMPLES = {
    "qlora-8b-24gb.yaml": ("Llama-3.1-8B", "rtx4090"),
    "lora-csv-qa.yaml": ("SmolLM2-135M", None),  # the demo model, on this machine
    "full-1b.yaml": ("Llama-3.2-1B", "rtx4090"),
    "long-context.yaml": ("Llama-3.1-8B", "rtx4090"),
    "mesh.yaml": ("Llama-3.1-8B", "h100"),  # per device of the mesh
    "dpo-planet-colours.yaml": ("SmolLM2-135M", None),  # the demo model, on this machine
    "dpo-8b-24gb.yaml": ("Llama-3.1-8B", "rtx4090"),
    "grpo-planet-colours.yaml": ("SmolLM2-135M", None),  # the demo model, on this machine
    "grpo-8b-12gb.yaml": ("Llama-3.1-8B", "h100"),  # both phases within its 12 GiB budget
    "qwen3-14b-qlora.yaml": ("Qwen3-14B", "rtx4090"),
    "gemma3-27b-qlora-24gb.yaml": ("Gemma-3-27B", "rtx4090"),
}


def test_every_example_is_listed():
    assert sorted(path.name for path in EXAMPLES_DIR.glob("*.yaml")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_example_is_planned_and_fits_the_device_it_is_written_for(name):
    model_name, target_name = EXAMPLES[name]
    config = load_config(EXAMPLES_DIR / name)
    model = builtin_config(model_name)
    check_method_settings(config, model)
    target = None if target_name is None else get_target(target_name)
    step_target = get_target(target_name or "cpu").step_target  # as `plan --target` plans it
    planned, plan = plan_within_budget(config, model, step_target, capacity.of_machine(target))
    assert not planned.memory.unresolved
    if target is not None:
        judged = capacity.verdict(plan, capacity.of_target(target))
        assert judged.fits, (name, judged.line)
    if config.memory.budget is not None:
        assert plan.device_bytes <= parse_budget(config.memory.budget)


def test_the_csv_example_reads_its_question_answer_pairs(demo_gguf):
    from featherweight.io.gguf_reader import GGUFSource
    from featherweight.train.dataset import build_dataset

    config = load_config(EXAMPLES_DIR / "lora-csv-qa.yaml")
    assert Path(config.data.train) == EXAMPLES_DIR / "qa.csv"
    source = GGUFSource(demo_gguf)
    tokenizer = source.tokenizer()
    source.close()
    dataset = build_dataset(config, tokenizer, Path(config.data.train))
    assert dataset.records == 12 and not dataset.skipped  # every row an instruction record
    assert dataset.train_stats.examples + dataset.eval_stats.examples == 12


def test_the_dpo_example_reads_its_200_pairs(demo_gguf):
    from featherweight.io.gguf_reader import GGUFSource
    from featherweight.train.dataset import build_dataset

    config = load_config(EXAMPLES_DIR / "dpo-planet-colours.yaml")
    source = GGUFSource(demo_gguf)
    tokenizer = source.tokenizer()
    source.close()
    dataset = build_dataset(config, tokenizer, Path(config.data.train))
    assert dataset.records == 200 and not dataset.skipped
    assert dataset.train_stats.pairs + dataset.eval_stats.pairs == 200
    assert not dataset.train_stats.truncated_pairs and not dataset.train_stats.dropped_pairs


def test_the_grpo_prompts_are_the_demo_worlds_reports():
    """examples/planet-colour-prompts.jsonl is `report_prompts` of the demo's world, as written:
    each report states the planet's colour and its moon's (another colour), and `colour` is the
    planet's, the column the walk's reward checks."""
    from featherweight.data.demo_task import first_colour, invented_world, report_prompts

    world = invented_world()
    lines = (EXAMPLES_DIR / "planet-colour-prompts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records == report_prompts(world)
    assert len(records) == 32 and {r["colour"] for r in records} == set(world.values())
    for record in records:
        text = record["prompt"][0]["content"]
        name = next(name for name in world if f"planet {name} " in text or f", {name}," in text)
        assert record["colour"] == world[name] != record["moon_colour"]
        assert f"is {record['colour']}" in text and f"is {record['moon_colour']}" in text
    firsts = [first_colour(r["prompt"][0]["content"]) for r in records]
    assert 0 < sum(f == r["colour"] for f, r in zip(firsts, records, strict=True)) < len(records)
