"""benchmarks/gpu_check_families.py: the GPU check's family and GRPO rows. --tiny runs them on CPU,
so the script cannot rot: a family trained with auto attention agrees at step 1 with another
implementation from the same weights and batch, and GRPO's rollouts and update run at the 8B
goal's settings with both phases planned."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check_families.py"


def _families_module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check_families
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu_check_families


def test_the_documents_batch_keeps_padding_and_document_ends_out_of_the_loss():
    families = _families_module()
    model = families.model_of("Qwen3-0.6B", tiny=True)
    for pack, documents in ((True, (3, 2)), (False, (1, 1))):
        batch = families.documents_batch(model, families.TINY, pack)
        segments, mask = np.asarray(batch.segment_ids), np.asarray(batch.loss_mask)
        assert tuple(int(row.max()) for row in segments) == documents
        assert not mask[segments == 0].any()  # padding carries no loss
        ends = np.diff(segments, axis=1, append=0) != 0  # a document's last token: no target
        assert not mask[ends].any()
    assert (np.asarray(batch.segment_ids)[1] == 0).any()  # unpacked: row 1 ends in padding


def test_tiny_models_keep_a_sliding_and_a_global_layer():
    families = _families_module()
    gemma = families.model_of("Gemma-3-1B", tiny=True)
    assert gemma.num_layers == 2 and set(gemma.sliding_layers) == {True, False}
    gpt_oss = families.model_of("gpt-oss-20b", tiny=True)
    assert gpt_oss.num_experts == 4 and gpt_oss.attention_sinks


@pytest.mark.slow  # two processes, about a minute on two cores
def test_tiny_family_and_grpo_rows_run_and_agree(tmp_path):
    jobs = "gemma3-1b-qlora-padded,grpo-8b-qlora"
    command = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path / "out")]
    command += ["--table-dir", str(tmp_path / "results"), "--jobs", jobs]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (tmp_path / "out" / "families.jsonl").read_text().splitlines()
    records = {record["job"]: record for record in map(json.loads, lines)}
    gemma = records["gemma3-1b-qlora-padded"]
    assert (gemma["attention"], gemma["compared_with"]) == ("blockwise", "materialized")
    assert gemma["matches"], gemma["step1_relative_differences"]
    assert gemma["losses"][-1] < gemma["losses"][0]  # it trains
    grpo = records["grpo-8b-qlora"]
    assert grpo["completion_tokens"] == 4 * 32  # no stop token: every row to the limit
    assert 0 < grpo["planned_rollout_device_bytes"] <= grpo["planned_device_bytes"]
    assert all(np.isfinite(grpo["losses"]))
    assert "| grpo-8b-qlora | rollouts: " in result.stdout


def test_the_window_check_compares_each_head_dim_with_and_without_a_window(capsys):
    # benchmarks/gpu_check_window.py --tiny: materialized for cuDNN on CPU, float32
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check_window
    finally:
        sys.path.remove(str(SCRIPT.parent))
    sys_argv, sys.argv = sys.argv, ["gpu_check_window.py", "--tiny"]
    try:
        assert gpu_check_window.main() == 0
    finally:
        sys.argv = sys_argv
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["head_dim"], r["window"]) for r in records] == [
        (128, None), (128, 32), (256, None), (256, 32)
    ]  # fmt: skip
    for record in records:
        assert max(record["relative_errors"].values()) < 1e-5, record
