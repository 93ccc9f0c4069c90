"""Multi-host start-up from the environment, and two real processes (gloo collectives on CPU)
training like one."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from featherweight.errors import ConfigError
from featherweight.parallel.distributed import distributed_arguments, initialize_from_env
from featherweight.train.checkpoint import Checkpointer
from featherweight.train.metrics import read_metrics
from tests.conftest import demo_data, run_settings, tiny_model_dir, write_config

__all__ = ["demo_data", "tiny_model_dir"]  # session fixtures of tests/train, used here

EXPLICIT = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4"}


def test_the_environment_names_the_processes():
    assert distributed_arguments({}) is None
    assert distributed_arguments({"SLURM_NTASKS": "1"}) is None  # one task: single-process
    assert distributed_arguments({"SLURM_NTASKS": "8"}) == {}  # srun: JAX reads SLURM's variables
    assert distributed_arguments({**EXPLICIT, "JAX_PROCESS_ID": "3"}) == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
    }
    assert initialize_from_env({}) is False  # nothing to join: single-process, nothing done


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (EXPLICIT, "JAX_PROCESS_ID missing"),
        ({**EXPLICIT, "JAX_PROCESS_ID": "4"}, r"JAX_PROCESS_ID=4 must be in \[0, "),
        ({**EXPLICIT, "JAX_PROCESS_ID": "one"}, "JAX_PROCESS_ID='one' must be an integer"),
    ],
)
def test_incomplete_or_wrong_settings_are_typed_errors(environ, message):
    with pytest.raises(ConfigError, match=message):
        distributed_arguments(environ)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _train(config_path, devices: int, extra_env: dict[str, str]) -> subprocess.Popen:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        **extra_env,
    }
    command = [sys.executable, "-m", "featherweight.cli", "train", str(config_path)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _final_arrays(run_dir, step, like=None):
    """The checkpoint's arrays by key; with `like` (arrays by key), restored onto one device in
    their shapes, as export does -- whatever mesh wrote them."""
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=10, read_only=True)
    if like is None:
        arrays = checkpointer.manager.restore(step)["arrays"]
        return {key: np.asarray(value) for key, value in arrays.items()}
    target = [jax.ShapeDtypeStruct(like[key].shape, like[key].dtype) for key in sorted(like)]
    restored, metadata = checkpointer.restore(step, target)
    assert metadata["step"] == step
    return dict(zip(sorted(like), (np.asarray(value) for value in restored), strict=True))


@pytest.mark.slow
def test_two_processes_train_like_one(tiny_model_dir, demo_data, tmp_path):
    """One process on one device with batch 4, against two processes with two CPU devices each
    (mesh auto: data=2 x fsdp=2) reading 2 rows each: the same rows, the same 3 steps."""
    steps = 3
    common = {"optimizer.name": "sgd", "checkpoint.every_steps": steps, "steps": steps}
    single = run_settings(tiny_model_dir, demo_data, tmp_path / "single", batch_size=4, **common)
    multi = run_settings(
        tiny_model_dir, demo_data, tmp_path / "multi", batch_size=2, mesh="auto", **common
    )
    port = _free_port()
    processes = [_train(write_config(tmp_path / "single.yaml", single), 1, {})]
    for index in range(2):
        processes.append(
            _train(
                write_config(tmp_path / "multi.yaml", multi),
                2,
                {
                    "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                    "JAX_NUM_PROCESSES": "2",
                    "JAX_PROCESS_ID": str(index),
                },
            )
        )
    outputs = [process.communicate(timeout=600)[0].decode() for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]
    assert "done: step 3" in outputs[1] and "done:" not in outputs[2]  # process 0 reports

    expected = read_metrics(tmp_path / "single" / "metrics.jsonl")
    actual = read_metrics(tmp_path / "multi" / "metrics.jsonl")  # written by process 0 only
    assert [r["step"] for r in actual] == [r["step"] for r in expected] == [1, 2, 3, 3]
    for key in ("loss", "eval_loss"):
        np.testing.assert_allclose(
            [r[key] for r in actual if key in r], [r[key] for r in expected if key in r], rtol=1e-5
        )
    assert (tmp_path / "multi" / "loss.png").is_file()
    # orbax's multi-host checkpoint: each process wrote its shards; they restore as one
    want = _final_arrays(tmp_path / "single", steps)
    got = _final_arrays(tmp_path / "multi", steps, like=want)
    for key in want:
        scale = np.max(np.abs(want[key])) or 1.0
        assert np.max(np.abs(want[key] - got[key])) <= 1e-5 * scale, key
