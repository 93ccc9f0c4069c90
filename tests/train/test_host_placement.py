"""The trainer with optimizer state, embedding and frozen layer stack in host memory: the same
training as with everything on the device, resumable from a checkpoint (host arrays saved and
restored to the host), and the plan it prints lists them in host memory."""

import io

import jax
import numpy as np
import pytest
from rich.console import Console

from featherweight.recipe.schema import parse_config
from featherweight.train.loop import train
from tests.conftest import run_settings

COMMON = {
    "memory.vocab_chunk": 8192,  # tied embeddings: the head reads the host table in chunks
    "optimizer.warmup_steps": 0,  # the same schedule for a 2-step and a 4-step run
}
HOST = {**COMMON, "memory.optimizer_state": "host", "memory.embed": "host", "memory.base": "host"}


def _final(result):
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(result.trainable)
    }


@pytest.mark.default_emitters  # two programs compared at float32 noise (tests/emitters.py)
def test_host_placements_train_resume_and_print_the_plan(tiny_model_dir, demo_data, tmp_path):
    straight = train(
        parse_config(
            run_settings(tiny_model_dir, demo_data, tmp_path / "device", steps=4, **COMMON)
        )
    )
    output = io.StringIO()
    first = run_settings(tiny_model_dir, demo_data, tmp_path / "host", steps=2, **HOST)
    train(parse_config(first), console=Console(file=output, width=200))
    report = output.getvalue()
    assert "in host memory" in report and "optimizer_state" in report
    assert "embedding_table" in report and "base_layers" in report
    # a second run with more steps resumes from the host run's checkpoint at step 2
    resumed = train(
        parse_config(run_settings(tiny_model_dir, demo_data, tmp_path / "host", steps=4, **HOST))
    )
    assert resumed.run.start_step == 2
    assert resumed.run.frozen["embed"].sharding.memory_kind == "pinned_host"
    frozen_layers = jax.tree.leaves(resumed.run.frozen["layers"])
    assert {leaf.sharding.memory_kind for leaf in frozen_layers} == {"pinned_host"}
    expected, actual = _final(straight), _final(resumed)
    assert expected.keys() == actual.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-7)
