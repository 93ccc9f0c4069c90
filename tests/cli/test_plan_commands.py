"""`featherweight plan` plans what `featherweight train` runs: the same settings resolve to the same
config ("auto" chunks chosen from the shapes by the one `resolve`) and compile to the same step.
Before "auto" was a value, the plan command passed every chunk option as an explicit null and
planned whole-sequence steps the trainer never ran (769.5 MiB planned beside a 632.7 MiB run).
`plan CONFIG.yaml [--set ...]` plans the config `train CONFIG.yaml` builds, and `train --dry-run`
stops after that plan."""

import io
import json
import re
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.memory.defaults import resolve
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import load_config
from featherweight.train import loop
from featherweight.train.loop import dry_run
from tests.conftest import run_settings, write_config

SETTINGS = ("--method", "lora", "--batch", "2", "--seq", "128", "--dtype", "float32")


def _plan_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_plan_and_train_of_the_same_settings_build_the_same_program(
    tiny_model_dir, demo_data, tmp_path, monkeypatch
):
    planned = _plan_json(str(tiny_model_dir), *SETTINGS)
    # the trainer, from a YAML with the same settings (every other one at its default)
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", steps=1)
    settings.update(method="lora", batch_size=2, lora={}, optimizer={})
    settings["data"]["seq_len"] = 128
    compiled = []
    measurement_of = loop.measurement_of
    monkeypatch.setattr(
        loop,
        "measurement_of",
        lambda *a, **k: compiled.append(measurement_of(*a, **k)) or compiled[-1],
    )
    result = CliRunner().invoke(app, ["train", str(write_config(tmp_path / "run.yaml", settings))])
    assert result.exit_code == 0, result.output
    trained = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    # the resolved settings: chosen once, the same in both, and recorded by the run
    assert planned["config"]["memory"] == trained["memory"]
    assert planned["settings"]["vocab_chunk"] is not None  # a choice was made (the toy's head)
    assert not load_config(tmp_path / "run" / "config.yaml").memory.unresolved
    # the compiled step: byte for byte the same memory
    assert len(compiled) == 1
    assert planned["measured"] == compiled[0].components
    assert planned["measured_total_bytes"] == compiled[0].total_bytes


@pytest.mark.parametrize("seq", [256, 2048, 8192])
def test_the_plan_command_resolves_as_the_trainer_does(seq, tmp_path):
    # SmolLM2-135M b2 float32 (the shapes): the options the trainer leaves "auto" are
    # chosen as the trainer chooses them; none is left auto; an explicit none stays whole
    args = ["SmolLM2-135M", "--method", "lora", "--batch", "2", "--seq", str(seq)]
    planned = _plan_json(*args, "--dtype", "float32", "--no-measure")
    yaml_config = write_config(
        tmp_path / "run.yaml",
        {
            "method": "lora",
            "batch_size": 2,
            "model": {"dtype": "float32"},
            "data": {"seq_len": seq},
        },
    )
    trainer = resolve(load_config(yaml_config), builtin_config("SmolLM2-135M"))
    assert planned["config"]["memory"] == trainer.model_dump(mode="json")["memory"]
    whole = _plan_json(*args, "--dtype", "float32", "--no-measure", "--loss-chunk", "none")
    assert whole["config"]["memory"]["loss_chunk"] is None


@pytest.mark.parametrize("value", ["half", "²", "١٢"])  # digits int() refuses or reads oddly
def test_a_chunk_option_names_what_it_takes(value):
    result = CliRunner().invoke(
        app, ["plan", "SmolLM2-135M", "--loss-chunk", value, "--no-measure"]
    )
    assert result.exit_code == 2
    assert "auto (chosen from the shapes), none (whole) or a whole number" in result.output


def test_the_plan_command_plans_a_preference_objective_and_its_reference():
    sft = _plan_json("Llama-3.1-8B", "--seq", "1024", "--no-measure")
    dpo = _plan_json("Llama-3.1-8B", "--seq", "1024", "--no-measure", "--objective", "dpo")
    full = _plan_json(
        "Llama-3.2-1B", "--method", "full", "--seq", "256", "--no-measure", "--objective", "dpo"
    )
    assert dpo["config"]["objective"] == "dpo" and dpo["settings"]["reference"] == "same_step"
    assert full["settings"]["reference"] == "precomputed"  # auto: full has no frozen copy
    assert "objective" not in sft["settings"]
    assert dpo["planned_device_bytes"] - sft["planned_device_bytes"] == 4 * 2 * 1024  # the ids
    assert any("one more forward pass of the frozen base" in note for note in dpo["notes"])


def test_plan_of_a_config_is_what_train_of_that_config_builds(tiny_model_dir, demo_data, tmp_path):
    # a config with a budget that changes settings, and a --set: `plan CONFIG` and
    # `train CONFIG --dry-run` (the trainer's own checks and planner) give the same config and plan
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", batch_size=4)
    settings["memory"] = {"budget": "20MiB"}
    config = write_config(tmp_path / "run.yaml", settings)
    overrides = ["--set", "data.seq_len=128"]
    planned = _plan_json(str(config), *overrides, "--no-measure")
    trained = dry_run(
        load_config(config, ["data.seq_len=128"]), console=Console(file=io.StringIO())
    )
    assert planned["config"] == trained.config.model_dump(mode="json")
    assert planned["planned_device_bytes"] == trained.plan.device_bytes
    assert planned["config"]["data"]["seq_len"] == 128
    assert planned["changes"]  # the budget changed a setting (on this CPU none to the host)
    assert planned["config"]["memory"]["embed"] == "device"
    assert not (tmp_path / "run").exists()  # the dry run wrote nothing


def test_a_plan_option_beside_a_config_is_refused_naming_the_set(
    tiny_model_dir, demo_data, tmp_path
):
    config = write_config(tmp_path / "run.yaml", run_settings(tiny_model_dir, demo_data, tmp_path))
    result = CliRunner().invoke(app, ["plan", str(config), "--batch", "8", "--no-measure"])
    assert result.exit_code == 2
    assert "--batch sets what" in result.output and "--set batch_size=" in result.output
    on_a_model = CliRunner().invoke(app, ["plan", "SmolLM2-135M", "--set", "steps=2"])
    assert on_a_model.exit_code == 2 and "plan a config" in on_a_model.output


def test_train_dry_run_stops_after_the_plan(tiny_model_dir, demo_data, tmp_path):
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run")
    config = write_config(tmp_path / "run.yaml", settings)
    result = CliRunner().invoke(app, ["train", str(config), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "memory plan:" in result.output and "dry run: stopped after the plan" in result.output
    assert not (tmp_path / "run").exists()


def _train_as_on(target, monkeypatch):
    """This process as if it computed on `target` (a `memory.targets.Target`): its device's
    attention, calibration and rates, and its usable memory -- what `train` sees on that GPU."""
    from featherweight.memory import capacity
    from featherweight.models.attention_choice import AttentionTarget

    monkeypatch.setattr(
        AttentionTarget, "of_device", classmethod(lambda cls, device=None: target.step_target)
    )
    monkeypatch.setattr(capacity, "of_device", lambda: capacity.of_target(target))


def test_plan_for_a_gpu_target_is_what_train_plans_on_that_gpu(
    tiny_model_dir, demo_data, tmp_path, monkeypatch
):
    # a config with a budget, planned for an H100: `plan CONFIG --target h100` and `train CONFIG
    # --dry-run` on an H100 call the one planning function (`budget.plan_within_budget`) for
    # the same target and give the same resolved config and plan
    from featherweight.memory import budget
    from featherweight.memory.targets import get_target
    from featherweight.models.attention_choice import AttentionTarget

    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", batch_size=4)
    settings["model"]["dtype"] = "bfloat16"
    settings["memory"] = {"budget": "20MiB"}
    config = write_config(tmp_path / "run.yaml", settings)
    targets = []
    plan_within_budget = budget.plan_within_budget

    def spy(config, model_config, target=None, room=None):
        targets.append(target or AttentionTarget.of_device())  # None: this process's device
        return plan_within_budget(config, model_config, target, room)

    monkeypatch.setattr(budget, "plan_within_budget", spy)
    monkeypatch.setattr(loop, "plan_within_budget", spy)
    on_cpu = _plan_json(str(config), "--target", "cpu", "--no-measure")
    planned = _plan_json(str(config), "--target", "h100", "--no-measure")
    h100 = get_target("h100")
    _train_as_on(h100, monkeypatch)
    trained = dry_run(load_config(config), console=Console(file=io.StringIO()))
    assert targets[1:] == [h100.step_target, h100.step_target]  # the plan's, then train's
    assert planned["config"] == trained.config.model_dump(mode="json")
    assert planned["planned_device_bytes"] == trained.plan.device_bytes
    assert planned["settings"] == trained.plan.settings
    # the target matters: its compiler's calibration, not this CPU's
    assert planned["settings"]["calibration"] == "xla-gpu/bfloat16"
    assert on_cpu["planned_device_bytes"] != planned["planned_device_bytes"]


def test_plan_for_a_gpu_names_every_setting_it_chose_and_assumes_its_cudnn():
    # the 8B QLoRA at 5.5 GiB on an H100: cuDNN attention, as train runs on that GPU (this
    # process need not load cuDNN), and the split of the batch in the settings line
    result = CliRunner().invoke(
        app,
        ["plan", "Llama-3.1-8B", "--budget", "5.5GiB", "--target", "h100", "--no-measure"],
        env={"COLUMNS": "300"},
    )
    assert result.exit_code == 0, result.output
    settings = next(line for line in result.output.splitlines() if line.startswith("settings:"))
    assert "attention=cudnn" in settings
    changed = re.search(r"memory\.accumulation_steps: 1 -> (\d)", result.output)
    assert changed and f"accumulation_steps={changed.group(1)}" in settings


def test_a_gpu_target_without_its_compiler_answers_with_the_plan_and_says_how_to_compile(
    monkeypatch,
):
    from featherweight.parallel import backend

    monkeypatch.setattr(backend, "cuda_plugin_installed", lambda: False)
    args = ["plan", "SmolLM2-135M", "--seq", "256", "--target", "h100"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "settings:" in result.output and "compiled" not in result.output.split("settings:")[0]
    (line,) = [line for line in result.output.splitlines() if line.startswith("not compiled")]
    assert 'pip install "featherweight[gpu-plan]"' in line
    planned = _plan_json(*args[1:])
    assert planned["measured"] is None and "gpu-plan" in planned["not_compiled"]


def test_plan_compiles_grpos_rollout_program_beside_its_step():
    # both phases planned and compiled: the rollouts' sampling program is the second program
    example = Path(__file__).resolve().parents[2] / "examples" / "grpo-planet-colours.yaml"
    result = CliRunner().invoke(app, ["plan", str(example)])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("rollout phase:"))
    planned, compiled = (float(x) for x in re.findall(r"([\d.]+) GiB (?:planned|compiled)", line))
    assert "compiled for cpu" in line and planned > 0 and compiled > 0
    report = json.loads(CliRunner().invoke(app, ["plan", str(example), "--json"]).output)
    assert report["compiled_rollout"]["total_bytes"] > report["compiled_rollout"]["temp_bytes"] > 0
    sft = _plan_json("Llama-3.2-1B", "--seq", "256", "--no-measure")
    assert sft["compiled_rollout"] is None
