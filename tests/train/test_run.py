"""Preparing a run: resuming restores into abstract targets, one copy of the state at a time, and
host-resident leaves straight into host memory; a run directory refuses another run's config,
naming each changed setting with its old and new value."""

import gc

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from featherweight.errors import ConfigError, DataError, OutputExistsError
from featherweight.memory.budget import plan_within_budget
from featherweight.memory.components import DEVICE
from featherweight.recipe.paths import absolute_paths
from featherweight.recipe.schema import changed_settings, parse_config
from featherweight.train import run as run_module
from featherweight.train.loop import train
from featherweight.train.run import check_run_dir, prepare_run
from featherweight.train.run_dir import MARKER
from tests.conftest import run_settings

PERSISTENT = ("frozen_base", "trainable_weights", "optimizer_state")


def _on_device(array) -> bool:
    return array.sharding.memory_kind != "pinned_host"


def resume_device_peak(settings, monkeypatch):
    """(device bytes alive right after the checkpoint is read, the plan's persistent device
    bytes, the prepared run) for resuming the run `settings` describes (jax.live_arrays, CPU)."""
    gc.collect()
    before = {id(array) for array in jax.live_arrays()}
    peak = {}
    restore = ocp.CheckpointManager.restore

    def measured_restore(self, *args, **kwargs):
        restored = restore(self, *args, **kwargs)
        gc.collect()
        live = [a for a in jax.live_arrays() if id(a) not in before and not a.is_deleted()]
        peak["device"] = sum(a.nbytes for a in live if _on_device(a))
        # host-resident leaves come back from orbax as NumPy arrays (host memory, never the
        # device), then go to pinned host memory
        numpy_leaves = [x for x in restored["arrays"].values() if isinstance(x, np.ndarray)]
        peak["host"] = sum(a.nbytes for a in live if not _on_device(a)) + sum(
            x.nbytes for x in numpy_leaves
        )
        return restored

    monkeypatch.setattr(ocp.CheckpointManager, "restore", measured_restore)
    run = prepare_run(parse_config(settings), plan_fn=plan_within_budget)
    planned = sum(
        c.bytes for c in run.plan.components if c.name in PERSISTENT and c.placement == DEVICE
    )
    return peak, planned, run


def test_resume_holds_one_copy_and_reads_host_state_into_host_memory(
    tiny_model_dir, demo_data, tmp_path, monkeypatch
):
    common = {"method": "full", "memory.optimizer_state": "host", "optimizer.warmup_steps": 0}
    train(
        parse_config(run_settings(tiny_model_dir, demo_data, tmp_path / "run", steps=2, **common))
    )
    resumed = run_settings(tiny_model_dir, demo_data, tmp_path / "run", steps=3, **common)
    peak, planned, run = resume_device_peak(resumed, monkeypatch)
    assert run.start_step == 2
    trainable_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(run.trainable))
    assert peak["device"] <= planned  # not the fresh state and the checkpoint's together
    assert peak["device"] >= trainable_bytes  # (the measurement does see the restored state)
    assert peak["host"] >= sum(leaf.nbytes for leaf in jax.tree.leaves(run.opt_state))
    assert all(not _on_device(leaf) for leaf in jax.tree.leaves(run.opt_state))
    run.checkpointer.close()


def _saved_run(directory, config) -> None:
    """`directory` as a run of `config` that featherweight created (marker, config.yaml)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text("{}")
    (directory / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))


def test_a_refused_resume_names_the_changed_keys_with_old_and_new_values(tmp_path):
    first = parse_config({"output_dir": str(tmp_path), "optimizer": {"learning_rate": 2e-4}})
    _saved_run(tmp_path, first)
    changed = parse_config(
        {"output_dir": str(tmp_path), "optimizer": {"learning_rate": 1e-3}, "lora": {"rank": 4}}
    )
    with pytest.raises(
        OutputExistsError,
        match=r"its config differs: lora\.rank: 8 -> 4; optimizer\.learning_rate: 0\.0002 -> 0\.001\)",
    ):
        check_run_dir(changed, overwrite=False)
    more_steps = parse_config({"output_dir": str(tmp_path), "steps": 500})
    assert check_run_dir(more_steps, overwrite=False)[:2] == (tmp_path.resolve(), True)


def test_changed_settings_are_bounded():
    old = {f"key{n}": n for n in range(9)}
    new = {f"key{n}": n + 1 for n in range(9)}
    assert changed_settings(old, new).endswith("key4: 4 -> 5; and 4 more")


def test_a_run_with_a_relative_output_dir_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = {"output_dir": "runs/my-run", "steps": 4}
    first = absolute_paths(parse_config(settings))  # before the directory exists
    _saved_run(tmp_path / "runs" / "my-run", first)
    again = absolute_paths(parse_config(settings))  # now it exists
    assert check_run_dir(again, overwrite=False)[:2] == (tmp_path / "runs" / "my-run", True)


def test_a_run_saved_with_a_relative_output_dir_still_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _saved_run(tmp_path / "runs" / "old", parse_config({"output_dir": "runs/old"}))
    config = absolute_paths(parse_config({"output_dir": "runs/old"}))
    assert check_run_dir(config, overwrite=False)[1]


def test_a_directory_of_your_files_is_never_offered_to_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "config.yaml").write_text("steps: 3\n")  # your own config, not a run's
    with pytest.raises(OutputExistsError) as error:
        check_run_dir(parse_config({"output_dir": str(tmp_path)}), overwrite=False)
    message = str(error.value)
    assert "'config.yaml' and is not a featherweight run" in message
    assert "another run" not in message and "--overwrite" not in message
    assert "choose a new or empty output_dir" in message


def test_overwrite_is_offered_only_where_it_would_be_allowed(tmp_path):
    _saved_run(tmp_path, parse_config({"output_dir": str(tmp_path), "seed": 1}))
    changed = parse_config({"output_dir": str(tmp_path), "seed": 2})
    with pytest.raises(OutputExistsError, match="pass --overwrite to replace it"):
        check_run_dir(changed, overwrite=False)
    (tmp_path / "notes.txt").write_text("mine")  # now --overwrite would refuse
    with pytest.raises(OutputExistsError) as error:
        check_run_dir(changed, overwrite=False)
    assert "pass --overwrite" not in str(error.value)
    assert "'notes.txt' in it is not a run's file" in str(error.value)


def test_resuming_with_steps_below_the_checkpoint_is_refused_before_weights_are_read(
    tiny_model_dir, demo_data, tmp_path, monkeypatch
):
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run")  # 4 steps
    train(parse_config(settings))
    monkeypatch.setattr(run_module, "load_weights", lambda *_: pytest.fail("weights read"))
    with pytest.raises(ConfigError, match=r"steps: 2 is below step 4, where run \S+ already is"):
        prepare_run(parse_config({**settings, "steps": 2}))


def test_a_resumed_run_keeps_the_chunks_it_recorded(tmp_path):
    # the run's config.yaml holds what `resolve` chose then; "auto" takes it from there, whatever
    # resolve would choose today, and a chunk set to another value is a changed setting
    recorded = {"output_dir": str(tmp_path), "memory": {"loss_chunk": 128, "vocab_chunk": None,
                                                        "mlp_chunk": 64}}  # fmt: skip
    _saved_run(tmp_path, parse_config(recorded))
    directory = check_run_dir(parse_config({"output_dir": str(tmp_path)}), overwrite=False)
    assert directory.resuming and not directory.config.memory.unresolved
    assert directory.config.memory == parse_config(recorded).memory
    changed = parse_config({"output_dir": str(tmp_path), "memory": {"mlp_chunk": 32}})
    with pytest.raises(OutputExistsError, match=r"memory\.mlp_chunk: 64 -> 32"):
        check_run_dir(changed, overwrite=False)


def test_a_batch_larger_than_the_training_rows_is_refused_before_the_weights(
    tiny_model_dir, tmp_path, monkeypatch
):
    data = tmp_path / "five.jsonl"
    data.write_text("".join(f'{{"text": "record {n}"}}\n' for n in range(5)))
    loaded = []
    monkeypatch.setattr(run_module, "load_weights", lambda *args: loaded.append(args))
    settings = run_settings(tiny_model_dir, data, tmp_path / "run", batch_size=64)
    settings["data"].update(pack=False, eval_fraction=0)  # one record a row: five rows
    with pytest.raises(DataError, match="batch_size 64 is more than the 5 training rows") as error:
        prepare_run(parse_config(settings))
    assert "set batch_size to 5 or less" in str(error.value)
    assert not loaded and not (tmp_path / "run").exists()
