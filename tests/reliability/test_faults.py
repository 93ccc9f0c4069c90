"""Faults injected into a run: a full disk while a checkpoint or an export is written keeps the
previous one intact and says so; a read-only output location is refused before any work; a NaN in
a batch stops training with the last good checkpoint kept."""

import errno
import itertools
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from orbax.checkpoint._src.handlers.json_checkpoint_handler import JsonCheckpointHandler

from featherweight.data.iterator import DataIterator
from featherweight.errors import (
    DiskFullError,
    OutputExistsError,
    OutputNotWritableError,
    TrainingDivergedError,
)
from featherweight.recipe.schema import parse_config
from featherweight.train import export_run as export_module
from featherweight.train import run as run_module
from featherweight.train.export_run import export_run
from featherweight.train.loop import train
from featherweight.train.metrics import read_metrics
from tests.reliability.conftest import short_run
from tests.reliability.kill_harness import equal_checkpoints, final_steps, load_checkpoint


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative name -> bytes)."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def hidden_temporaries(directory: Path) -> list[str]:
    return [path.name for path in directory.iterdir() if path.name.startswith(".fw-tmp-")]


# --- a full disk -------------------------------------------------------------------------------


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(
    tiny_model_dir, demo_data, trained_run, tmp_path, monkeypatch
):
    """The metadata writer of checkpoint 4 writes part of its file, then the disk is full."""
    writer = JsonCheckpointHandler._save_fn

    async def fill_the_disk(self, item, directory):
        if item.get("step") == 4:
            (directory / "metadata").write_text("{")
            raise disk_full()
        return await writer(self, item, directory)

    monkeypatch.setattr(JsonCheckpointHandler, "_save_fn", fill_the_disk)
    settings = short_run(tiny_model_dir, demo_data, tmp_path / "run", steps=6)
    with pytest.raises(DiskFullError) as raised:
        train(parse_config(settings))
    message = str(raised.value)
    assert f"checkpoint 4 in {tmp_path / 'run' / 'checkpoints'}" in message
    assert "the previous checkpoint (step 2) is intact" in message
    assert "Free space" in message and "run the same command again" in message
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["2"]  # the partial one is gone
    kept = load_checkpoint(tmp_path / "run", 2)
    assert equal_checkpoints(kept, load_checkpoint(trained_run, 2))

    monkeypatch.undo()  # space is back: the same command resumes from step 2, losing nothing
    result = train(parse_config(settings))
    assert result.step == 6
    assert equal_checkpoints(load_checkpoint(tmp_path / "run", 4), load_checkpoint(trained_run, 4))


def _partial_then_full(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"\x00" * 64)
    raise disk_full()


WRITERS = {
    "merged": "featherweight.io.hf_writer.save_file",
    "peft": "featherweight.io.peft_export.save_file",
}


@pytest.mark.parametrize(("export_format", "writer"), WRITERS.items())
def test_disk_full_during_an_export_keeps_the_previous_one(
    trained_run, tmp_path, monkeypatch, export_format, writer
):
    out = tmp_path / "export"
    export_run(trained_run, export_format, out)
    before = snapshot(out)
    monkeypatch.setattr(writer, _partial_then_full)
    with pytest.raises(DiskFullError) as raised:
        export_run(trained_run, export_format, out, overwrite=True)
    message = str(raised.value)
    assert f"while writing {out}" in message and f"the previous {out} is intact" in message
    assert "Free space" in message
    assert snapshot(out) == before
    assert hidden_temporaries(tmp_path) == []  # the partial staging directory was removed

    fresh = tmp_path / "fresh"
    with pytest.raises(DiskFullError, match=f"nothing was written to {fresh}"):
        export_run(trained_run, export_format, fresh)
    assert not fresh.exists() and hidden_temporaries(tmp_path) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, when this process may mount one (root in a privileged container)."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root); the injected faults cover it")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # a failed run's log is open


def test_a_really_full_disk_gives_the_same_errors(
    tiny_model_dir, demo_data, trained_run, small_disk, monkeypatch
):
    """No injection: tensorstore (orbax) and safetensors (Rust) report ENOSPC in their own ways."""
    settings = short_run(tiny_model_dir, demo_data, small_disk / "run", steps=6)
    filler = small_disk / "filler"

    def fill_after_step_3(step, trainable, opt_state, metrics):
        if step == 3:
            free = shutil.disk_usage(small_disk).free
            filler.write_bytes(b"\x00" * max(free - 16 * 1024, 0))  # room for metrics lines only

    with pytest.raises(DiskFullError, match=r"checkpoint 4 .*previous checkpoint \(step 2\)"):
        train(parse_config(settings), on_step=fill_after_step_3)
    assert final_steps(small_disk / "run") == [2]
    assert [p.name for p in (small_disk / "run" / "checkpoints").iterdir()] == ["2"]
    load_checkpoint(small_disk / "run", 2)

    filler.unlink()
    filler.write_bytes(b"\x00" * (shutil.disk_usage(small_disk).free - 1024 * 1024))
    out = small_disk / "merged"  # the merged export needs ~6 MiB
    with pytest.raises(DiskFullError, match=f"nothing was written to {out}"):
        export_run(trained_run, "merged", out)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "run"]


# --- a read-only output location ---------------------------------------------------------------


def _no_checkpoint_reads(monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("the model was opened before the output location was checked")

    monkeypatch.setattr(run_module, "read_header", refuse)
    monkeypatch.setattr(export_module, "read_header", refuse)


def test_a_read_only_output_dir_is_refused_before_any_work(
    tiny_model_dir, demo_data, trained_run, read_only_dir, monkeypatch
):
    _no_checkpoint_reads(monkeypatch)
    settings = short_run(tiny_model_dir, demo_data, read_only_dir / "run")
    with pytest.raises(OutputNotWritableError) as raised:
        train(parse_config(settings))
    assert f"cannot write under {read_only_dir}" in str(raised.value)
    assert "choose a writable output_dir" in str(raised.value)
    with pytest.raises(OutputNotWritableError, match=f"cannot write under {read_only_dir}"):
        export_run(trained_run, "merged", read_only_dir / "merged")
    assert list(read_only_dir.iterdir()) == []


# --- a NaN in a batch --------------------------------------------------------------------------


def test_a_nan_in_a_batch_stops_training_and_keeps_the_last_good_checkpoint(
    tiny_model_dir, demo_data, trained_run, tmp_path, monkeypatch
):
    batches = DataIterator.__next__
    calls = itertools.count(1)

    def poisoned(self):
        batch = batches(self)
        if next(calls) == 5:
            batch = batch._replace(loss_mask=batch.loss_mask * np.float32("nan"))
        return batch

    monkeypatch.setattr(DataIterator, "__next__", poisoned)
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingDivergedError) as raised:
        train(parse_config(short_run(tiny_model_dir, demo_data, run_dir)))
    message = str(raised.value)
    assert "loss became nan at step 5" in message
    assert f"last good checkpoint (step 4) in {run_dir / 'checkpoints'}" in message
    assert "learning_rate" in message and "check the data" in message
    assert final_steps(run_dir) == [2, 4]
    # the kept state is exactly the uninterrupted run's step 4: nothing of the NaN step leaked in
    assert equal_checkpoints(load_checkpoint(run_dir, 4), load_checkpoint(trained_run, 4))
    assert [record["step"] for record in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


# --- a replacement killed between its two renames -----------------------------------------------


def test_an_export_replacement_killed_between_its_renames_is_undone(trained_run, tmp_path):
    """`--overwrite` moves the previous export aside, then renames the new one into place; a kill
    between the two leaves both hidden. The next export puts the previous one back first."""
    out = tmp_path / "adapter"
    export_run(trained_run, "peft", out)
    before = snapshot(out)
    aside = tmp_path / ".fw-tmp-adapter-old-x1"
    aside.mkdir()
    out.rename(aside / "old")
    (tmp_path / ".fw-tmp-adapter-x2").mkdir()  # the new export, complete but not renamed
    with pytest.raises(OutputExistsError, match="already exists"):
        export_run(trained_run, "peft", out)  # without --overwrite: the previous one is back
    assert snapshot(out) == before
    export_run(trained_run, "peft", out, overwrite=True)
    assert snapshot(out) == before and hidden_temporaries(tmp_path) == []


# --- a full disk while the run writes its metrics or its loss plot -----------------------------


def test_disk_full_while_plotting_the_loss_ends_with_the_last_checkpoint_intact(
    tiny_model_dir, demo_data, trained_run, tmp_path, monkeypatch
):
    """The last file a run writes is loss.png: a full disk there is a DiskFullError that says the
    run itself is saved, and the final checkpoint equals an undisturbed run's."""
    import matplotlib.figure

    def partial_then_full(self, path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG partial")
        raise disk_full()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", partial_then_full)
    run_dir = tmp_path / "run"
    with pytest.raises(DiskFullError) as raised:
        train(parse_config(short_run(tiny_model_dir, demo_data, run_dir, steps=4)))
    message = str(raised.value)
    assert f"while writing the loss plot {run_dir / 'loss.png'}" in message
    assert "checkpoints and metrics.jsonl are intact, only the plot is missing" in message
    assert final_steps(run_dir) == [2, 4]
    assert equal_checkpoints(load_checkpoint(run_dir, 4), load_checkpoint(trained_run, 4))
    assert [record["step"] for record in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert sorted(p.name for p in run_dir.iterdir() if "png" in p.name) == []  # no partial plot


class FillingFile:
    """A text file whose disk is full after `lines` writes (each later write raises ENOSPC)."""

    def __init__(self, handle, lines: int) -> None:
        self.handle, self.lines = handle, lines

    def write(self, text: str) -> int:
        if self.lines == 0:
            raise disk_full()
        self.lines -= 1
        return self.handle.write(text)

    def __getattr__(self, name):
        return getattr(self.handle, name)


def test_disk_full_while_logging_metrics_keeps_the_previous_checkpoint(
    tiny_model_dir, demo_data, trained_run, tmp_path, monkeypatch
):
    from featherweight.train.metrics import MetricsLog

    opened = MetricsLog.__init__

    def open_on_a_filling_disk(self, path, resume_step):
        opened(self, path, resume_step)
        self._handle = FillingFile(self._handle, lines=2)  # steps 1 and 2 fit

    monkeypatch.setattr(MetricsLog, "__init__", open_on_a_filling_disk)
    run_dir = tmp_path / "run"
    with pytest.raises(DiskFullError) as raised:
        train(parse_config(short_run(tiny_model_dir, demo_data, run_dir)))
    message = str(raised.value)
    assert f"while writing {run_dir / 'metrics.jsonl'}" in message
    assert "the checkpoints are intact and the run resumes from the latest one" in message
    assert final_steps(run_dir) == [2]
    assert equal_checkpoints(load_checkpoint(run_dir, 2), load_checkpoint(trained_run, 2))

    monkeypatch.undo()  # space is back: the same command resumes from step 2
    assert train(parse_config(short_run(tiny_model_dir, demo_data, run_dir))).step == 8
