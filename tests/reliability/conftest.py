"""The reliability suite's fixtures: the trainer tests' tiny model (SmolLM2's tokenizer, 2 layers)
and data, short runs, and one finished run shared by the in-process tests."""

import errno
import os
from pathlib import Path

import jax
import pytest

from featherweight.io.hf_writer import iter_hf_tensors, save_hf_checkpoint
from featherweight.io.output_paths import inside, resolved
from featherweight.models.init import init_params
from featherweight.recipe.schema import parse_config
from featherweight.train.loop import train
from tests.conftest import demo_data, run_settings, tiny_config, tiny_model_dir

__all__ = [
    "demo_data",
    "read_only_dir",
    "short_run",
    "small_model_dir",
    "tiny_gguf",
    "tiny_model_dir",
    "trained_run",
]  # the fixtures (tests/train's are shared)

STEPS = 8


def short_run(model_dir: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """A run of 8 steps with a checkpoint every 2 (the last 3 kept), no evaluation."""
    settings = {"steps": STEPS, "data.eval_fraction": 0.0, "checkpoint.every_steps": 2}
    return run_settings(model_dir, data, output_dir, **{**settings, **overrides})


@pytest.fixture(scope="session")
def trained_run(tiny_model_dir, demo_data, tmp_path_factory) -> Path:
    """A finished 4-step LoRA run (checkpoints 2 and 4), trained in this process."""
    output_dir = tmp_path_factory.mktemp("trained") / "run"
    train(parse_config(short_run(tiny_model_dir, demo_data, output_dir, steps=4)))
    return output_dir


@pytest.fixture(scope="session")
def small_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A small HF directory (a few MB: cheap to copy and damage) with SmolLM2's tokenizer files
    and an embedding of as many rows as that tokenizer has tokens."""
    config = tiny_config(vocab_size=49152)
    directory = tmp_path_factory.mktemp("small") / "model"
    save_hf_checkpoint(
        directory, config, iter_hf_tensors(init_params(jax.random.PRNGKey(1), config), config), None
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((tiny_model_dir / name).read_bytes())
    return directory


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A 2-layer llama GGUF written the way llama.cpp's converter writes one."""
    from tests.tiny_checkpoints import hf_config, random_hf_model, write_gguf

    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    return write_gguf(path, random_hf_model(hf_config("llama2")))


@pytest.fixture
def read_only_dir(tmp_path, monkeypatch):
    """A directory nothing can be created in. Root ignores permission bits, so for root the OS's
    answer for a read-only mount (EROFS) is injected into every file creation under it."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    if os.access(directory, os.W_OK):
        real_open = os.open

        def read_only_open(path, flags, *args, **kwargs):
            writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if writing and inside(resolved(path), directory):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only_open)
    yield directory
    directory.chmod(0o755)
