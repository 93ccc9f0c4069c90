"""benchmarks/gpu_check_speed.py: the GPU check's speed rows. --tiny runs them on CPU, so the script
cannot rot: featherweight at its defaults and at the fastest settings within this machine's memory
(kept activations, the same losses), the torch + peft peer beside them (skipped, with the reason,
for the mixture of experts), a speed-up per shape."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from featherweight.memory.targets import get_target
from featherweight.models.registry import builtin_config
from featherweight.models.shapes import parameter_count

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check_speed.py"


def _speed_module():
    """benchmarks/gpu_check_speed.py as a module (it imports its neighbours)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("gpu_check_speed", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check_speed"] = module  # dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_mfu_counts_4n_per_token_at_the_gpus_published_peak():
    speed = _speed_module()
    assert speed.peak_flops("NVIDIA H100 80GB HBM3") == get_target("h100").peak_flops
    assert speed.peak_flops("NVIDIA H200") == get_target("h200").peak_flops
    assert speed.peak_flops("cpu") is None
    model = builtin_config("Llama-3.1-8B")
    assert speed.model_flops_per_token(model, "qlora") == 4 * parameter_count(model)
    assert speed.model_flops_per_token(model, "full") == 6 * parameter_count(model)
    moe = builtin_config("Qwen3-30B-A3B")  # 3.3B of 30.5B a token: 8 of 128 experts
    assert 3.3e9 < speed.active_parameter_count(moe) < 3.4e9 < 30e9 < parameter_count(moe)
    assert speed.model_flops_per_token(moe, "qlora") == 4 * speed.active_parameter_count(moe)
    # issue 32's shapes in its order, issue 42's Qwen3-30B-A3B QLoRA after the first
    assert [(s.model, s.method, s.batch, s.seq) for s in speed.SHAPES] == [
        ("large", "qlora", 2, 2048), ("moe", "qlora", 1, 2048), ("large", "lora", 2, 2048),
        ("small", "lora", 8, 2048),
    ]  # fmt: skip


@pytest.mark.slow  # twelve processes: about three minutes on two cores
def test_tiny_speed_rows_run_fastest_keeps_activations_with_the_same_losses(tmp_path):
    command = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path / "out")]
    command += ["--table-dir", str(tmp_path / "results")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "out" / "speed.jsonl").read_text().splitlines()
    records = {record["job"]: record for record in map(json.loads, lines)}
    speed = _speed_module()
    assert set(records) == {name for name, _, _ in speed.jobs(tiny=True)}
    for shape in speed.TINY_SHAPES:
        defaults, fastest = records[f"fw-{shape.name}"], records[f"fw-{shape.name}-fastest"]
        assert "save" not in defaults["settings"]  # no budget: as lean as today
        assert "save qkv+attention+mlp_hidden" in fastest["settings"]  # the machine's memory
        assert fastest["planned_device_bytes"] > defaults["planned_device_bytes"]
        for mine, kept in zip(defaults["losses"], fastest["losses"], strict=True):
            assert kept == pytest.approx(mine, rel=1e-4)  # kept activations: the same training
        peer = records[f"torch-{shape.name}"]
        if shape.model == "moe":  # no QLoRA of transformers' fused experts: said in the table
            assert "fused 3-D parameters" in peer["skipped"]
            assert f"| torch-{shape.name} | torch peer skipped: " in result.stdout
        else:
            assert peer.get("tokens_per_s", 0) > 0 or "not installed" in peer["skipped"]
        assert f"- {shape.name}, fastest within the device: " in result.stdout
