"""benchmarks/gpu_check_attention.py --tiny: the attention rows of the GPU check on CPU, so the
script cannot rot: every implementation that runs here keeps packed documents apart and equals
blockwise, the others are listed with the reason they did not run, the long-context jobs ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check_attention.py"


@pytest.mark.slow
def test_tiny_attention_check_runs_and_records_every_implementation(tmp_path):
    command = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path / "out")]
    command += ["--table-dir", str(tmp_path / "results")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "out" / "attention.jsonl").read_text().splitlines()
    records = {record["job"]: record for record in map(json.loads, lines)}

    checked = {r["implementation"]: r for r in records["packed-rows"]["implementations"]}
    for name in ("pallas (interpret mode)", "materialized"):
        assert checked[name]["passed"] and checked[name]["cross_document_gradient"] == 0.0
    for name in ("cudnn", "cudnn_padded"):
        assert "NVIDIA GPU" in checked[name]["refused"]  # named, not skipped silently

    for shape in ("b1x256", "b2x128"):
        assert records[f"fw-{shape}"]["attention"] == "blockwise"  # auto on a CPU
        assert records[f"fw-{shape}"]["median_step_s"] > 0
        assert "skipped" in records[f"torch-{shape}"]  # no CUDA torch here: the reason
    assert "longest context that ran within 80 GB: 256 tokens" in result.stdout
