"""The plan against a GPU's memory in `featherweight train`: JAX's pool judged before any weight is
read (`memory/capacity.py`, whose own tests hold the numbers), the device's peak_bytes_in_use
printed beside the plan after the first steps. No GPU here: a fake device's `memory_stats()` (the
keys and meaning a CUDA device reports)."""

import importlib
import io

import pytest
from rich.console import Console

from featherweight.errors import BudgetError
from featherweight.memory import device_memory
from featherweight.memory.targets import LIBRARY_ALLOWANCE_BYTES
from featherweight.recipe.schema import parse_config
from featherweight.train.loop import train
from tests.conftest import run_settings

GIB = 2**30
H100_POOL = int(0.75 * 80 * GIB)  # JAX's default pool on an 80 GiB device


def test_no_statistics_no_peak_line():
    assert device_memory.peak_line(10 * GIB, None, 2) is None
    assert device_memory.peak_line(10 * GIB, {}, 2) is None


def test_the_peak_line_sets_peak_bytes_in_use_beside_the_plan():
    line = device_memory.peak_line(11 * GIB, {"peak_bytes_in_use": 10 * GIB}, 4)
    assert line == (
        "device peak after step 4: 10.00 GiB peak_bytes_in_use; plan 11.00 GiB (+10.0%)"
    )


def _fake_gpu(monkeypatch, stats):
    calls = []

    def memory_stats():
        calls.append(dict(stats))
        return dict(stats)

    monkeypatch.setattr(device_memory, "local_memory_stats", memory_stats)
    return calls


def test_train_checks_the_pool_then_prints_the_peak_after_its_first_steps(
    tiny_model_dir, demo_data, tmp_path, monkeypatch
):
    stats = {"bytes_limit": H100_POOL, "peak_bytes_in_use": 123 * 2**20, "bytes_in_use": 1}
    calls = _fake_gpu(monkeypatch, stats)
    out = io.StringIO()
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", steps=4, log_every=2)
    train(parse_config(settings), console=Console(file=out, width=300))
    lines = out.getvalue().splitlines()
    pool = [line for line in lines if line.startswith("device memory: fits: ")]
    assert pool and "on this GPU" in pool[0] and "XLA_PYTHON_CLIENT_MEM_FRACTION" in pool[0]
    peak = [line for line in lines if line.startswith("device peak after step ")]
    assert len(pool) == 1 and len(peak) == 1  # once each: before the weights, after step 2
    assert peak[0].startswith("device peak after step 2: 123.00 MiB peak_bytes_in_use; plan ")
    assert lines.index(pool[0]) < lines.index(peak[0]) and len(calls) == 2


def test_train_refuses_a_plan_beyond_the_pool_before_reading_weights(
    tiny_model_dir, demo_data, tmp_path, monkeypatch
):
    # negative control: the same run on a GPU whose pool is smaller than the plan stops
    _fake_gpu(monkeypatch, {"bytes_limit": LIBRARY_ALLOWANCE_BYTES + 2**20})
    loaded = []
    run_module = importlib.import_module("featherweight.train.run")
    monkeypatch.setattr(run_module, "load_weights", lambda *args: loaded.append(args))
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", steps=2)
    with pytest.raises(BudgetError, match="usable"):
        train(parse_config(settings))
    assert not loaded and not (tmp_path / "run").exists()
