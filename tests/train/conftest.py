"""A tiny trainable checkpoint with a real tokenizer (SmolLM2's, from the demo GGUF), and the
generated demo task as data: every trainer test runs the real pipeline in seconds."""

from pathlib import Path

import jax
import pytest
import yaml

from featherweight.io.gguf_reader import GGUFSource
from featherweight.io.hf_writer import iter_hf_tensors, save_hf_checkpoint
from featherweight.models.init import init_params
from featherweight.train.demo_task import invented_world, write_training_data
from tests.conftest import tiny_config


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_gguf) -> Path:
    """An HF directory: a 2-layer model over SmolLM2's 49152-token vocabulary and tokenizer."""
    source = GGUFSource(demo_gguf)
    tokenizer = source.tokenizer()
    source.close()
    config = tiny_config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)  # fmt: skip
    params = init_params(jax.random.PRNGKey(0), config)
    out = tmp_path_factory.mktemp("tiny") / "model"
    return save_hf_checkpoint(out, config, iter_hf_tensors(params, config), tokenizer)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    return write_training_data(tmp_path_factory.mktemp("data") / "train.jsonl", invented_world())


def run_settings(model_dir: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """A small, fast training config as a dict (YAML-ready)."""
    settings = {
        "method": "lora",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q", "v"]},
        "data": {"train": str(data), "seq_len": 64, "eval_fraction": 0.2},
        "optimizer": {"learning_rate": 1e-2, "schedule": "constant"},
        "batch_size": 2,
        "steps": 4,
        "checkpoint": {"every_steps": 2, "keep": 3},
        "output_dir": str(output_dir),
    }
    for key, value in overrides.items():
        node = settings
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return settings


def write_config(path: Path, settings: dict) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path
