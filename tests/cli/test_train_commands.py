"""What `featherweight train` says at the end: the step reached of the steps asked for, losses to
four places (no `None`), or that a finished run had nothing to train. What `featherweight export`
does on SIGINT, wherever it lands (a gc callback included): it stops, the previous export is
intact, exit 130, one line saying what was kept."""

import gc
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers
import yaml
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.cli.train_commands import outcome_line
from featherweight.io import atomic, hf_writer, loader
from featherweight.recipe.schema import parse_config
from featherweight.train import export_check, loop
from featherweight.train.loop import train
from tests.conftest import run_settings
from tests.tiny_checkpoints import random_hf_model, save_byte_level_tokenizer, save_hf


def _result(step, start_step, loss, eval_loss, steps=4):
    run = SimpleNamespace(start_step=start_step, config=SimpleNamespace(steps=steps))
    return SimpleNamespace(
        step=step, loss=loss, eval_loss=eval_loss, run=run, output_dir=Path("/runs/a")
    )


def test_the_last_line_rounds_losses_and_leaves_out_what_was_not_measured():
    assert (
        outcome_line(_result(4, 0, 10.781560897827148, None)) == "done: step 4 of 4, loss 10.7816"
    )
    assert (
        outcome_line(_result(4, 2, 2.0, 1.234567))
        == "done: step 4 of 4, loss 2.0000, eval loss 1.2346"
    )


def test_a_finished_run_run_again_says_there_was_nothing_to_train():
    line = outcome_line(_result(4, 4, None, None))
    assert line == "nothing to train: /runs/a is already at step 4 of 4; raise steps to train on"


# --- SIGINT during export ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, demo_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export_interrupts") / "run"
    train(parse_config(run_settings(tiny_model_dir, demo_data, out)))  # checkpoints 2 and 4
    return out


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _signal_once(monkeypatch, owner, name, when=lambda *args, **kwargs: True, in_gc=False):
    """SIGINT to this process the first time `owner.name` is called (and `when` holds) -- or,
    with `in_gc`, from inside a garbage-collector callback, where Python's KeyboardInterrupt is
    printed as "Exception ignored" and lost (as in JAX's `_xla_gc_callback`)."""
    original, fired = getattr(owner, name), []

    def in_callback(phase, _info):
        if phase == "start" and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # bytecodes: the handler runs here, inside the callback

    def wrapper(*args, **kwargs):
        if not fired and when(*args, **kwargs):
            if in_gc:
                gc.callbacks.append(in_callback)
                try:
                    gc.collect()
                finally:
                    gc.callbacks.remove(in_callback)
            else:
                fired.append(True)
                os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


BEFORE_COMPLETE = {
    "reading the base": (loader, "check_finite", {}),
    "writing a tensor": (hf_writer, "_cast", {}),
    "in a gc callback while writing": (hf_writer, "_cast", {"in_gc": True}),
    "before the final renames": (atomic, "_fsync_tree", {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("point", BEFORE_COMPLETE)
def test_sigint_during_an_export_stops_it_and_keeps_the_previous_export(
    lora_run, tmp_path, monkeypatch, point
):
    out = tmp_path / "merged"
    previous = ["export", str(lora_run / "checkpoints" / "2"), "--format", "merged"]
    assert CliRunner().invoke(app, [*previous, "--out", str(out)]).exit_code == 0
    kept = _snapshot(out)
    owner, name, options = BEFORE_COMPLETE[point]
    _signal_once(monkeypatch, owner, name, **options)
    args = ["export", str(lora_run), "--format", "merged", "--out", str(out), "--overwrite"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [
        f"stopped by SIGINT: the export stopped before it was complete; the previous {out} is "
        "intact"
    ]
    assert _snapshot(out) == kept
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # no temporaries left


@pytest.mark.slow
def test_sigint_during_the_final_renames_completes_them_and_says_so(
    lora_run, tmp_path, monkeypatch
):
    out = tmp_path / "merged"
    previous = ["export", str(lora_run / "checkpoints" / "2"), "--format", "merged"]
    assert CliRunner().invoke(app, [*previous, "--out", str(out)]).exit_code == 0
    kept = _snapshot(out)
    aside = lambda *args, prefix="", **kwargs: "-old-" in prefix  # the previous export moved aside
    _signal_once(monkeypatch, atomic.tempfile, "mkdtemp", when=aside)
    args = ["export", str(lora_run), "--format", "merged", "--out", str(out), "--overwrite"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130, result.output
    assert (
        result.output.strip()
        == f"stopped by SIGINT: the export had just finished: {out} is complete"
    )
    assert _snapshot(out) != kept and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


@pytest.mark.slow
def test_sigint_during_the_check_keeps_the_finished_export(lora_run, tmp_path, monkeypatch):
    out = tmp_path / "merged"
    _signal_once(monkeypatch, export_check, "_greedy")
    args = ["export", str(lora_run), "--format", "merged", "--out", str(out), "--dtype", "bfloat16"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130, result.output
    assert result.output.splitlines()[-1] == (
        f"stopped by SIGINT: the check of the export stopped; {out} itself is complete"
    )
    assert (out / "model.safetensors").is_file()


# --- the README's config, relative output_dir: interrupted and resumed through the CLI ----------


def readme_config() -> str:
    """The training config README.md shows, as it stands."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return text.split("A training config", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_config_trains_is_interrupted_and_resumes(demo_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(readme_config())  # output_dir: runs/my-run (relative)
    (tmp_path / "data.jsonl").write_bytes(demo_data.read_bytes())
    small = ["steps=3", "data.seq_len=64", "batch_size=1", "checkpoint.every_steps=1"]
    args = ["train", "config.yaml", *(f"--set={value}" for value in small)]
    args += ["--set=memory.loss_chunk=64", "--set=log_every=1"]  # (512 does not divide 64)
    save = loop.save

    def save_then_interrupt(run, step, *rest):
        save(run, step, *rest)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while step 1's checkpoint is written

    monkeypatch.setattr(loop, "save", save_then_interrupt)
    interrupted = CliRunner().invoke(app, args)
    assert interrupted.exit_code == 130, interrupted.output
    assert "stopped by signal 2 after step 2; checkpoint saved" in interrupted.output
    monkeypatch.setattr(loop, "save", save)
    resumed = CliRunner().invoke(app, args)  # the same command again
    assert resumed.exit_code == 0, resumed.output
    run = tmp_path / "runs" / "my-run"
    assert f"resuming {run} at step 2" in resumed.output
    assert "done: step 3 of 3, loss " in resumed.output


# --- mixture-of-experts models -----------------------------------------------------------------

MOE_SIZES = dict(
    vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, num_experts_per_tok=2, max_position_embeddings=256,
)  # fmt: skip
MOE_FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=4, moe_intermediate_size=32)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, intermediate_size=32)),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(num_local_experts=4, intermediate_size=32, head_dim=16, sliding_window=8),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_each_moe_family_trains_lora_and_qlora_on_its_experts(family, method, tmp_path):
    """`featherweight train` on a tiny checkpoint of each MoE family, adapters on attention and
    every expert (the router is no LoRA target: frozen), two steps: it finishes with a loss."""
    config_class, settings = MOE_FAMILIES[family]
    model_dir = save_hf(random_hf_model(config_class(**MOE_SIZES, **settings)), tmp_path / "m")
    save_byte_level_tokenizer(model_dir)
    data = tmp_path / "train.jsonl"  # plain text: the byte-level tokenizer has no chat template
    data.write_text(
        "".join(f'{{"text": "record {i}: the experts route tokens"}}\n' for i in range(20))
    )
    values = run_settings(model_dir, data, tmp_path / "run", method=method, steps=2)
    values["lora"]["targets"] = ["q", "v", "gate", "up", "down"]
    values.pop("checkpoint")
    if method == "qlora":  # with the router's load-balancing loss
        values["moe"] = {"router_aux_loss_coef": 0.01}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(values))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    assert "done: step 2 of 2, loss " in result.output
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [record for record in records if "loss" in record]  # not the evaluations
    assert ("aux_loss" in steps[-1]) == (method == "qlora")
