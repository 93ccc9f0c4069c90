"""benchmarks/gpu_check.sh --tiny: the GPU check's every case on CPU, so the script cannot rot.

One run of the launcher (no wheels: it skips the install) and the check it starts: every case runs
in its own process, each host placement matches its all-device run, and the table names them all.
A gradient made 2% wrong in one record must turn its row into a mismatch.

The verdict itself, on small synthetic records: judged at identical weights (step 1's loss and
gradient norm) and on the loss after 6 updates, not on the later gradient norms a GPU's
nondeterminism moves (benchmarks/gpu_check.py says why); and each compared case runs with its
reference's chunks.
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


# ---------------------------------------------------------------- the verdict, on synthetic records

NUMERICS = {"model": "large", "method": "qlora", "dtype": "bfloat16"}
# the H200's all-device QLoRA reference (2026-11-27, rounded): later gradient norms swing 10x
REFERENCE = {
    "case": "qlora",
    "numerics": NUMERICS,
    "losses": [12.5984, 12.5995, 12.5336, 12.5079, 12.4202, 12.2857, 12.1153],
    "grad_norms": [0.7911, 0.0635, 0.6757, 0.4943, 0.2113, 3.5057, 3.7842],
}


def _like_reference(**changes) -> dict:
    """A copy of `REFERENCE` as a host case, with `changes` (a list given whole)."""
    return {**json.loads(json.dumps(REFERENCE)), "case": "qlora-base-host", **changes}


def test_a_wrong_gradient_at_identical_weights_is_a_mismatch():
    gpu_check = _gpu_check()
    grad_norms = [0.7911 * 1.13, *REFERENCE["grad_norms"][1:]]  # step 1's gradient 13% off
    cell, matches = gpu_check.comparison(_like_reference(grad_norms=grad_norms), REFERENCE, 1e-2)
    assert matches is False, cell
    assert "step 1: loss 0.0e+00, grad norm 1.3e-01" in cell
    losses = [12.5984 * 1.02, *REFERENCE["losses"][1:]]  # step 1's loss 2% off
    assert gpu_check.comparison(_like_reference(losses=losses), REFERENCE, 1e-2)[1] is False


def test_a_different_loss_trend_is_a_mismatch():
    gpu_check = _gpu_check()
    losses = [*REFERENCE["losses"][:-1], 12.1153 * 1.02]  # the loss after 6 updates 2% off
    cell, matches = gpu_check.comparison(_like_reference(losses=losses), REFERENCE, 1e-2)
    assert matches is False and "after 6 updates: loss 2.0e-02" in cell, cell


def test_later_gradient_norms_are_shown_not_judged():
    gpu_check = _gpu_check()
    # as the H200's embedding-on-host run: step 1 within 4e-4, the loss after 6 updates 7.7e-3
    # away, later gradient norms up to 10x the reference's
    grad_norms = [0.7908, 0.5973, 0.0891, 0.0567, 0.4577, 0.1905, 37.842]
    losses = [*REFERENCE["losses"][:-1], 12.0217]
    record = _like_reference(losses=losses, grad_norms=grad_norms)
    cell, matches = gpu_check.comparison(record, REFERENCE, 1e-2)
    assert matches is True, cell
    assert "grad norm 3.8e-04" in cell and "loss 7.7e-03" in cell
    assert "later grad norms (not judged): up to 9.0e+00" in cell
    # judged or not, a step that is not finite fails
    record["grad_norms"][3] = math.nan
    assert gpu_check.comparison(record, REFERENCE, 1e-2)[1] is False
    # other numerics: no verdict
    other = _like_reference(numerics={**NUMERICS, "quantize_head": True})
    assert gpu_check.comparison(other, REFERENCE, 1e-2) == (
        "not comparable: the settings change numerics",
        None,
    )


def test_compared_cases_run_with_their_references_chunks():
    """On the GPU's shapes (configs only, nothing compiled): the frozen base on the host frees
    device memory and would resolve other chunks than the all-device run's."""
    _gpu_check()
    cases = sys.modules["gpu_check_cases"]
    scale = cases.GPU
    chunks = {}
    for case in cases.CASES:
        if case.search is None:
            config, _ = cases.case_config(case, scale, scale.models[case.model]())
            chunks[case.name] = [getattr(config.memory, name) for name in cases.CHOSEN_FROM_SHAPES]
    compared = [case for case in cases.CASES if case.reference and case.search is None]
    assert {case.name for case in compared} >= {"qlora-base-host", "full-small-optimizer-host"}
    for case in compared:
        assert chunks[case.name] == chunks[case.reference], case.name


def test_table_only_judges_a_runs_records_again(tmp_path):
    """--table-only: no case runs; the table of OUT/results.jsonl with this code's verdicts,
    named for the device the records ran on, with the cases in the check's order."""
    gpu_check = _gpu_check()
    measured = {
        "device": "NVIDIA H200", "jax": "0.11.2", "bytes_limit": 2**37, "settings": "defaults",
        "budget_bytes": None, "compile_s": 19.0, "peak_after_setup": 2**32,
        "peak_after_compile": 2**33, "peak_after_steps": 2**34, "compiled_device_bytes": 2**34,
        "planned_device_bytes": 2**33, "median_step_s": 0.44, "tokens_per_s": 9300.0,
        "time": "2026-11-27T17:17:55",
    }  # fmt: skip
    wrong_first = [0.7911 * 1.13, *REFERENCE["grad_norms"][1:]]
    records = [
        {
            **_like_reference(case="qlora-base-host", grad_norms=wrong_first),
            **measured,
            "settings": "base: host, loss_chunk 512",  # not the reference's chunks: said so
        },
        {**REFERENCE, **measured},
        {**_like_reference(case="qlora-embed-host"), **measured},
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    options = ["--out", str(tmp_path), "--table-dir", str(tmp_path / "t"), "--table-only"]
    assert gpu_check.main(options) == 0
    table = (tmp_path / "t" / "gpu_check_h200.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| qlora")]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert names == ["qlora", "qlora-embed-host", "qlora-base-host"]
    assert rows[1].endswith("| match |")
    assert rows[2].endswith("| MISMATCH (ran with other chunks than the reference's) |")
    assert "on 2026-11-27" in table and (tmp_path / "gpu_check_h200.md").read_text() == table
