"""benchmarks/gpu_check.sh --tiny: the GPU check's every case on CPU, so the script cannot rot.

One run of the launcher (no wheels: it skips the install) and the check it starts: every case runs
in its own process, each host placement matches its all-device run, and the table names them all.
A gradient made 2% wrong in one record must turn its row into a mismatch.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _gpu_check():
    """benchmarks/gpu_check.py as a module (it imports its neighbour results_file)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT.with_suffix(".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def _launch(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),
    }
    command = ["bash", str(SCRIPT), "--tiny", "--table-dir", str(tmp_path / "results"), *options]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_tiny_check_runs_every_case_and_host_placements_match(tmp_path):
    gpu_check = _gpu_check()
    result = _launch(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no wheels" in result.stdout  # the launcher skipped the install

    out = tmp_path / "out"
    records = gpu_check.read_records(out)
    assert set(records) == set(gpu_check.CASE_NAMES)
    for name, record in records.items():
        assert "error" not in record, (name, record.get("error"))
        assert (out / f"{name}.log").is_file()
        assert all(map(math.isfinite, record["losses"] + record["grad_norms"]))
        assert record["compiled_total_bytes"] > 0 and record["planned_device_bytes"] > 0
    by_case = {case.name: case for case in gpu_check.CASES}
    for case in gpu_check.CASES:
        if case.reference:
            cell, matches = gpu_check.comparison(
                records[case.name], records[case.reference], gpu_check.TINY.tolerance
            )
            assert matches, (case.name, cell)
    # the reference's loss moves in 6 updates, so a comparison of losses can see a wrong update
    assert records["qlora"]["losses"][0] - records["qlora"]["losses"][-1] > 0.05

    table = (tmp_path / "results" / "gpu_check_cpu_tiny.md").read_text()
    assert (out / "gpu_check_cpu_tiny.md").read_text() == table
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()}
    for name, case in by_case.items():
        assert name in rows, name
        assert ("| match |" in rows[name]) == (case.reference is not None), rows[name]
    assert "FAILED" not in table and "MISMATCH" not in table

    # negative control: one step's gradient 2% off in one host case shows as a mismatch
    wrong = json.loads(json.dumps(records))
    wrong["qlora-base-host"]["grad_norms"][0] *= 1.02
    lines = gpu_check.table_lines(wrong, list(gpu_check.CASES), gpu_check.TINY, "control")
    assert sum("MISMATCH" in line for line in lines) == 1


def test_a_deadline_that_leaves_no_time_still_writes_the_table(tmp_path):
    result = _launch(tmp_path, "--deadline", "0", "--cases", "qlora,qlora-embed-host")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").open()]
    assert [record["case"] for record in records] == ["qlora", "qlora-embed-host"]
    assert all(record["error"].startswith("not run") for record in records)
    table = (tmp_path / "out" / "gpu_check_none_tiny.md").read_text()
    assert table.count("FAILED: not run") == 2
