"""The trainer: one copy of the state, resume equal to an uninterrupted run (real SIGKILL), safe
checkpoints, divergence handling, and the errors a user meets first."""

import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

from featherweight.errors import ConfigError, DataError, OutputExistsError, TrainingDivergedError
from featherweight.memory.budget import plan_within_budget
from featherweight.recipe.schema import parse_config
from featherweight.train.checkpoint import Checkpointer
from featherweight.train.loop import train
from featherweight.train.metrics import read_metrics
from tests.conftest import run_settings, write_config


def _bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def _signature(array) -> tuple:
    return tuple(array.shape), str(array.dtype)


def test_one_copy_of_state_lives_on_the_device(tiny_model_dir, demo_data, tmp_path):
    """After a step, every live array shaped like a state leaf is that leaf: the loop keeps no
    second copy of (trainable, opt_state). Checked by shape and dtype, not bytes with slack: a
    stale `jnp.copy` of the state kept by the loop fails it (mutation-checked), however small
    the state."""
    gc.collect()
    before = {id(array) for array in jax.live_arrays()}
    seen = {}

    def observe(step, trainable, opt_state, metrics):
        if step == 3:
            gc.collect()
            new = [a for a in jax.live_arrays() if id(a) not in before]
            seen["live"] = Counter(_signature(a) for a in new if a.ndim)
            seen["live_bytes"] = sum(a.nbytes for a in new if a.ndim)
            seen["state"] = Counter(
                _signature(a) for a in jax.tree.leaves((trainable, opt_state)) if a.ndim
            )
            seen["state_bytes"] = _bytes((trainable, opt_state))

    # seq 48, batch 3: batch arrays [3, 48] share no shape with a parameter of the 64-wide model
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", steps=4, batch_size=3)
    settings["data"]["seq_len"] = 48
    result = train(parse_config(settings), on_step=observe)
    frozen = Counter(_signature(a) for a in jax.tree.leaves(result.frozen) if a.ndim)
    expected = seen["state"] + frozen
    assert {key: seen["live"][key] for key in expected} == dict(expected)
    batch = 3 * 48 * 4 * 5  # ids, targets, mask, positions, segments of one [3, 48] batch
    rotary = 2 * 48 * 16 * 4  # cos, sin [S, head_dim] float32
    assert seen["live_bytes"] <= seen["state_bytes"] + _bytes(result.frozen) + batch + rotary
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(result.trainable))


def _train_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "featherweight.cli", "train", str(config_path)]


def _restore_final(run_dir: Path, step: int):
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=10, read_only=True)
    target = checkpointer.manager.restore(step)  # raw restore: numpy leaves in a dict
    return {key: np.asarray(value) for key, value in target["arrays"].items()}


@pytest.mark.slow
def test_sigkill_and_resume_equals_an_uninterrupted_run(tiny_model_dir, demo_data, tmp_path):
    steps = 12
    straight = run_settings(
        tiny_model_dir,
        demo_data,
        tmp_path / "straight",
        steps=steps,
        **{"checkpoint.every_steps": 5},
    )
    subprocess.run(
        _train_command(write_config(tmp_path / "straight.yaml", straight)),
        check=True,
        capture_output=True,
    )

    killed = run_settings(
        tiny_model_dir, demo_data, tmp_path / "killed", steps=steps, **{"checkpoint.every_steps": 5}
    )
    config_path = write_config(tmp_path / "killed.yaml", killed)
    process = subprocess.Popen(
        _train_command(config_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    checkpoint_5 = tmp_path / "killed" / "checkpoints" / "5"
    try:
        deadline = time.time() + 300
        while not checkpoint_5.exists() and time.time() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert checkpoint_5.exists(), "the run never wrote checkpoint 5"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not (tmp_path / "killed" / "checkpoints" / str(steps)).exists()
    subprocess.run(_train_command(config_path), check=True, capture_output=True)

    straight_losses = [
        r["loss"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "loss" in r
    ]
    resumed_losses = [
        r["loss"] for r in read_metrics(tmp_path / "killed" / "metrics.jsonl") if "loss" in r
    ]
    assert len(straight_losses) == steps
    assert resumed_losses == straight_losses  # bit for bit, every step
    final_straight = _restore_final(tmp_path / "straight", steps)
    final_resumed = _restore_final(tmp_path / "killed", steps)
    for key in final_straight:
        np.testing.assert_array_equal(final_straight[key], final_resumed[key])


KILL_DURING_SAVE = textwrap.dedent(
    """
    import os, sys, time, pathlib
    from featherweight.train import checkpoint
    original = checkpoint.Checkpointer.save
    marker = pathlib.Path(sys.argv[2])  # read now: sys.argv is replaced below
    def slow_save(self, step, arrays, metadata):
        if step == 4:
            real_rename = os.rename
            def stalled_rename(src, dst, *a, **k):
                marker.write_text(str(src))
                time.sleep(600)  # killed here: the checkpoint is written but not renamed
            os.rename = stalled_rename
            pathlib.Path.rename = lambda self, target: stalled_rename(self, target)
        return original(self, step, arrays, metadata)
    checkpoint.Checkpointer.save = slow_save
    from featherweight.cli.main import main
    sys.argv = ["featherweight", "train", sys.argv[1]]
    main()
    """
)


@pytest.mark.slow
def test_kill_during_a_checkpoint_write_keeps_the_previous_one(tiny_model_dir, demo_data, tmp_path):
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", steps=6)
    config_path = write_config(tmp_path / "run.yaml", settings)
    script = tmp_path / "kill_during_save.py"
    script.write_text(KILL_DURING_SAVE)
    marker = tmp_path / "renaming"
    process = subprocess.Popen([sys.executable, str(script), str(config_path), str(marker)])
    try:
        deadline = time.time() + 300
        while not marker.exists() and time.time() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "the save of step 4 never reached its final rename"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not (checkpoints / "4").exists()  # nothing partial under a final name
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2"]
    restored = _restore_final(tmp_path / "run", 2)
    assert restored and all(np.all(np.isfinite(value)) for value in restored.values())
    subprocess.run(_train_command(config_path), check=True, capture_output=True)  # resumes from 2
    assert {p.name for p in checkpoints.iterdir() if p.name.isdigit()} >= {"4", "6"}


def test_sigterm_saves_and_exits_with_143(tiny_model_dir, demo_data, tmp_path):
    settings = run_settings(
        tiny_model_dir,
        demo_data,
        tmp_path / "run",
        steps=100_000,
        **{"checkpoint.every_steps": 1000},
    )
    config_path = write_config(tmp_path / "run.yaml", settings)
    process = subprocess.Popen(
        _train_command(config_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.time() + 300
        while (not metrics.exists() or not metrics.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 143
    finally:
        process.kill()
    saved = Checkpointer(tmp_path / "run" / "checkpoints", keep=10, read_only=True).latest_step()
    assert saved is not None and saved >= 1  # a clean save at the step where it stopped
    assert saved == max(r["step"] for r in read_metrics(metrics))


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tiny_model_dir, demo_data, tmp_path):
    settings = run_settings(
        tiny_model_dir,
        demo_data,
        tmp_path / "run",
        steps=40,
        # full fine-tuning with plain SGD at an absurd rate: the head's logits overflow float32
        # (LoRA under RMSNorm can saturate at a finite loss instead)
        **{"method": "full", "optimizer.name": "sgd", "optimizer.b1": 0.0},
        **{"optimizer.learning_rate": 1e30},
    )
    with pytest.raises(TrainingDivergedError, match="learning_rate"):
        train(parse_config(settings))
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", keep=10, read_only=True)
    last = checkpointer.latest_step()
    if last is not None:
        restored = checkpointer.manager.restore(last)
        assert all(np.all(np.isfinite(np.asarray(v))) for v in restored["arrays"].values())


def test_errors_before_any_work(tiny_model_dir, demo_data, tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        parse_config({"optimizer": {"learnig_rate": 1e-3}})
    with pytest.raises(DataError, match=r"does not exist|missing|not found"):
        train(parse_config(run_settings(tiny_model_dir, tmp_path / "none.jsonl", tmp_path / "a")))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        train(parse_config(run_settings(tiny_model_dir, empty, tmp_path / "b")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(demo_data.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        train(parse_config(run_settings(tiny_model_dir, bad, tmp_path / "c")))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=r"'notes\.txt' and is not a featherweight run"):
        train(parse_config(run_settings(tiny_model_dir, demo_data, other)))
    assert (other / "notes.txt").read_text() == "mine"
    for name in ("a", "b", "c"):
        assert not (tmp_path / name).exists()  # nothing written before the checks passed


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path):
    config = write_config(tmp_path / "c.yaml", {"optimzer": {}})
    result = subprocess.run(_train_command(config), capture_output=True, text=True)
    assert result.returncode == 2
    assert "did you mean 'optimizer'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_a_signal_during_setup_stops_before_the_first_step(tiny_model_dir, demo_data, tmp_path):
    """SIGTERM while the run plans, loads and compiles: no step runs, nothing new is written, the
    metrics a killed run logged past its checkpoint are dropped, and the run says it was stopped."""
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", steps=4)
    train(parse_config(settings))  # checkpoints 2 and 4
    metrics = tmp_path / "run" / "metrics.jsonl"
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "4")  # as if killed after logging step 4, before saving it
    longer = parse_config({**settings, "steps": 6})

    def plan_then_signal(config, model_config):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives during setup
        return plan_within_budget(config, model_config)

    result = train(longer, plan_fn=plan_then_signal)
    assert result.stopped_by_signal == signal.SIGTERM and result.step == 2
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2"]
    assert max(record["step"] for record in read_metrics(metrics)) == 2
