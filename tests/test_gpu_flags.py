"""benchmarks/gpu_flags.py: XLA flag sets as ratios of interleaved runs, each set in its own
process; the ratio logic on synthetic records, the deadline, and --tiny end to end on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_flags.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_flags  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))
ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def test_sets_interleave_round_by_round():
    assert gpu_flags.schedule(["a", "b", "c"], 2) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")
    ]  # fmt: skip


def test_each_ratio_is_taken_against_the_baseline_of_its_own_round():
    records = [
        {"set": "base", "round": 0, "median_step_s": 1.0, "compile_s": 9, "first_loss": 2.0},
        {"set": "fast", "round": 0, "median_step_s": 0.8, "compile_s": 9, "first_loss": 2.0},
        {"set": "base", "round": 1, "median_step_s": 2.0, "compile_s": 9, "first_loss": 2.0},
        {"set": "fast", "round": 1, "median_step_s": 1.8, "compile_s": 9, "first_loss": 2.0},
        {"set": "fast", "round": 2, "median_step_s": 0.1, "compile_s": 9, "first_loss": 2.0},
        {"set": "base", "round": 2, "error": "timed out after 30 s"},
        {"set": "bad", "round": 0, "error": "Unknown flag in XLA_FLAGS: --xla_bogus"},
    ]
    summary = gpu_flags.summarize(records, ["base", "fast", "bad"])
    # a drifting machine (round 1 twice as slow) moves both sets of a round, not the ratio; a
    # round without its baseline gives no ratio
    assert summary["fast"]["ratios"] == pytest.approx([0.8, 0.9])
    assert summary["fast"]["ratio"] == pytest.approx(0.85)
    assert summary["fast"]["median_s"] == pytest.approx(0.8)
    assert summary["base"]["ratio"] == 1.0 and summary["base"]["errors"] == [records[5]["error"]]
    assert summary["bad"]["ratio"] is None and "Unknown flag" in summary["bad"]["errors"][0]


def test_every_listed_xla_flag_is_one_this_jaxlib_knows():
    # XLA aborts at start on a flag it does not know: one process with every flag of every set
    flags = " ".join(f for f in {**gpu_flags.GPU_SETS, **gpu_flags.CPU_SETS}.values() if f)
    env = {**ENV, "XLA_FLAGS": flags}
    command = [sys.executable, "-c", "import jax; print(float(jax.numpy.ones(3).sum()))"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "3.0", result.stderr[-2000:]


def test_an_unknown_set_is_one_plain_line_and_the_deadline_starts_nothing(tmp_path):
    command = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--sets", "fast"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 2 and "--sets 'fast': unknown ['fast']; use names from" in (
        result.stderr
    )
    command = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--deadline", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    records = json.loads((tmp_path / "flags.json").read_text())["records"]
    assert [r["error"] for r in records] == ["not run: the deadline came first"] * 4


@pytest.mark.slow  # four processes of the tiny step: about 50 s on two cores
def test_tiny_flag_sets_run_interleaved_on_cpu_with_the_same_first_loss(tmp_path):
    command = [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path), "--steps", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "flags.jsonl").read_text().splitlines()]
    assert [(r["round"], r["set"]) for r in records] == gpu_flags.schedule(
        list(gpu_flags.CPU_DEFAULT), 2
    )
    for record in records:  # each process saw its own set's flags
        assert record["xla_flags"].endswith(gpu_flags.CPU_SETS[record["set"]])
        assert len(record["step_s"]) == 2 and record["platform"] == "cpu"
    summary = json.loads((tmp_path / "flags.json").read_text())["summary"]
    assert summary["baseline"]["ratios"] == [1.0, 1.0]
    assert len(summary["no-xnnpack"]["ratios"]) == 2 and summary["no-xnnpack"]["ratio"] > 0
    losses = {loss for row in summary.values() for loss in row["first_losses"]}
    assert max(losses) - min(losses) < 1e-4  # same weights, same batch: same first loss
    table = (tmp_path / "flags.md").read_text()
    assert "measured on cpu (cpu), jax " in table and "no measure of a GPU" in table
