"""Preference runs end to end on a tiny model: the data summary counts pairs, metrics.jsonl,
TensorBoard and the plot carry TRL's reward names, a precomputed reference trains exactly as
the same-step one, and a DPO run exports and generates as an SFT run does."""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from featherweight.errors import ConfigError
from featherweight.inference.generate import generate
from featherweight.recipe.schema import parse_config
from featherweight.step.preference import METRIC_NAMES
from featherweight.train.export_run import export_run
from featherweight.train.loop import train
from featherweight.train.run_model import load_run_model
from tests.conftest import run_settings

PAIRS = Path(__file__).resolve().parents[2] / "examples" / "planet-colour-pairs.jsonl"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """24 of the example's pairs."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[::8][:24]))
    return path


def preference_settings(tiny_model_dir, pairs, out, **overrides):
    settings = run_settings(
        tiny_model_dir, pairs, out, **{"steps": 3, "objective": "dpo", **overrides}
    )
    settings["data"]["seq_len"] = 192
    return settings


@pytest.fixture(scope="module")
def dpo_run(tiny_model_dir, pairs, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo") / "run"
    console = io.StringIO()
    settings = preference_settings(tiny_model_dir, pairs, out, report_to=["tensorboard"])
    result = train(parse_config(settings), console=Console(file=console, width=200))
    return result, console.getvalue()


def test_a_dpo_run_reports_pairs_and_trl_metric_names(dpo_run):
    result, text = dpo_run
    run = result.output_dir
    summary = json.loads((run / "data_summary.json").read_text())
    assert summary["objective"] == "dpo" and summary["records"] == 24
    assert summary["train"]["pairs"] + summary["eval"]["pairs"] == 24
    assert f"train: {summary['train']['pairs']} pairs -> " in text
    assert "| reward acc " in text  # the progress line shows the rewards
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record]
    assert len(steps) == 3 and all(set(METRIC_NAMES) <= set(record) for record in steps)
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)  # the policy starts at the base
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = [event.value for event in events.Scalars("train/rewards/accuracies")]
    assert logged == pytest.approx([record["rewards/accuracies"] for record in steps])
    assert (run / "loss.png").stat().st_size > 0
    assert result.eval_loss is not None and np.isfinite(result.eval_loss)


def test_a_dpo_run_exports_and_generates_as_an_sft_run(dpo_run, tmp_path):
    result, _ = dpo_run
    model, step = load_run_model(result.output_dir)
    assert step == 3
    assert isinstance(
        generate(model, "What colour is the planet Thodorlex?", max_new_tokens=4), str
    )
    adapter = export_run(result.output_dir, "peft", tmp_path / "adapter")
    assert (Path(adapter) / "adapter_model.safetensors").is_file()
    merged = export_run(result.output_dir, "merged", tmp_path / "merged")
    assert any(Path(merged).glob("*.safetensors"))


def test_a_precomputed_reference_trains_as_the_same_step_one(
    tiny_model_dir, pairs, tmp_path, dpo_run
):
    same_step, _ = dpo_run
    settings = preference_settings(tiny_model_dir, pairs, tmp_path / "run")
    settings["dpo"] = {"reference": "precomputed"}
    result = train(parse_config(settings), console=Console(file=io.StringIO()))
    read = lambda run: [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    for ours, theirs in zip(read(result.output_dir), read(same_step.output_dir), strict=True):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "eval_loss"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def test_orpo_and_full_dpo_train_and_same_step_full_dpo_is_refused(tiny_model_dir, pairs, tmp_path):
    orpo = preference_settings(tiny_model_dir, pairs, tmp_path / "orpo", steps=2)
    orpo["objective"] = "orpo"
    result = train(parse_config(orpo), console=Console(file=io.StringIO()))
    record = json.loads((result.output_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen", *METRIC_NAMES} <= set(record)
    full = preference_settings(tiny_model_dir, pairs, tmp_path / "full", steps=2, method="full")
    assert parse_config(full).dpo.reference == "precomputed"  # auto: full has no frozen copy
    train(parse_config(full), console=Console(file=io.StringIO()))
    full["dpo"] = {"reference": "same_step"}
    shutil.rmtree(tmp_path / "full")
    with pytest.raises(ConfigError, match="no frozen copy"):
        train(parse_config(full), console=Console(file=io.StringIO()))
