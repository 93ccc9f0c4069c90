"""The working set's buffer counts: data with provenance, reproducible, and right on held-out steps.

`featherweight/memory/calibration.json` holds the counts with the compiled measurements they were
fitted on and a held-out grid. These tests refit from the stored measurements (deterministic, no
compiling), check the plan against the held-out measurements, and re-measure held-out steps with
today's compiler so stale data cannot hide (a few in the default suite, all of them under slow).
"""

import json

import pytest

from featherweight.dev import calibrate
from featherweight.memory import working_set
from featherweight.memory.device_plan import plan_one_device
from featherweight.memory.measure import measure_compiled, measure_for_target
from featherweight.memory.report import percent_difference
from featherweight.parallel.backend import cuda_plugin_installed

ENTRY = json.loads(calibrate.calibration_path().read_text())["calibrations"][calibrate.KEY]
# percent, planned vs compiled on the held-out grid (XLA:CPU, float32): the goal is 10 (issue 14),
# reached: worst total 8.5 (a full fine-tune of a toy whose 4096-token head dwarfs its 5 layers:
# how many copies of the head XLA makes for its update varies with how the loss is chunked),
# median 1.5; temporaries alone: worst 22.0 (a 3-layer toy of the kind), median 3.4
TOTAL_MEDIAN, TOTAL_WORST = 5.0, 10.0
TEMP_MEDIAN, TEMP_WORST = 8.0, 25.0


def test_the_calibration_says_where_it_comes_from():
    for field in ("compiler", "dtype", "jax_version", "machine", "date", "fit"):
        assert ENTRY[field], field
    assert len(ENTRY["fit_measurements"]) >= 30 and len(ENTRY["held_out_measurements"]) >= 20
    assert working_set.calibration_counts() == ENTRY["counts"]


def test_the_counts_are_the_fit_of_the_stored_measurements():
    assert calibrate.fit(ENTRY["fit_measurements"]) == ENTRY["counts"]


def _errors(counts):
    rows = calibrate.errors_of(ENTRY["held_out_measurements"], counts)
    total = sorted(abs(row["total_error"]) for row in rows)
    temp = sorted(abs(row["temp_error"]) for row in rows)
    return total[len(total) // 2], total[-1], temp[len(temp) // 2], temp[-1]


def test_held_out_plans_are_within_bounds():
    total_median, total_worst, temp_median, temp_worst = _errors(ENTRY["counts"])
    assert total_median <= TOTAL_MEDIAN and total_worst <= TOTAL_WORST
    assert temp_median <= TEMP_MEDIAN and temp_worst <= TEMP_WORST


def test_wrong_counts_fail_the_held_out_check():
    # negative control: counts off by a third would be caught
    scaled = {name: value * 0.67 for name, value in ENTRY["counts"].items()}
    total_median, _, temp_median, _ = _errors(scaled)
    assert temp_median > TEMP_MEDIAN or total_median > TOTAL_MEDIAN


def _remeasure(records):
    for record in records:
        model, config = calibrate.case_of(record)
        measured = measure_compiled(config, model)
        drift = percent_difference(measured.temp_bytes, record["temp_bytes"])
        assert abs(drift) <= 2.0, f"the compiler changed ({drift:+.1f}%): re-run the calibration"
        plan = plan_one_device(config, model)
        error = percent_difference(plan.cpu_comparable_bytes, measured.total_bytes)
        assert abs(error) <= TOTAL_WORST, (config.method, error)


QUICK_HELD_OUT = 3  # remeasured by every run; the slow test remeasures the rest


@pytest.mark.default_emitters  # the stored measurements' compiler (tests/emitters.py)
def test_stored_held_out_measurements_are_todays_compiler():
    _remeasure(ENTRY["held_out_measurements"][:QUICK_HELD_OUT])


@pytest.mark.default_emitters  # the stored measurements' compiler (tests/emitters.py)
@pytest.mark.slow
def test_every_other_held_out_measurement_is_todays_compiler():
    _remeasure(ENTRY["held_out_measurements"][QUICK_HELD_OUT:])


# --- XLA:GPU bfloat16: the step compiled for an H100 without one (memory.measure_for_target) -----

GPU_KEY = "xla-gpu/bfloat16"
GPU_ENTRY = json.loads(calibrate.calibration_path().read_text())["calibrations"].get(GPU_KEY)
needs_gpu_entry = pytest.mark.skipif(GPU_ENTRY is None, reason=f"no {GPU_KEY} calibration yet")
# percent, planned device bytes vs the H100 compile's device bytes on the held-out grid (1B-8B,
# LoRA/QLoRA/full, b1-4 x S 512-4096, and batch 1 at 32K-131K tokens): the goal is 10 (issue 14),
# reached with blockwise attention in the step (worst 8.5, median 5.2)
GPU_DEVICE_GOAL = 10.0


@needs_gpu_entry
def test_the_gpu_calibration_says_where_it_comes_from_and_refits():
    assert GPU_ENTRY["target"] == "h100" and "XLA:GPU" in GPU_ENTRY["compiler"]
    assert GPU_ENTRY["fit_measurements"] and GPU_ENTRY["held_out_measurements"]
    assert calibrate.fit(GPU_ENTRY["fit_measurements"], compiler="xla-gpu") == GPU_ENTRY["counts"]
    config = calibrate.case_of(GPU_ENTRY["held_out_measurements"][0])[1]
    assert working_set.calibration_key(config, calibrate.compiler_target("xla-gpu")) == GPU_KEY


def _gpu_device_errors(counts):
    rows = calibrate.errors_of(GPU_ENTRY["held_out_measurements"], counts, "xla-gpu")
    return [abs(row["device_error"]) for row in rows]


@needs_gpu_entry
def test_held_out_gpu_plans_are_within_ten_percent_of_the_h100_compile():
    errors = _gpu_device_errors(GPU_ENTRY["counts"])
    assert max(errors) <= GPU_DEVICE_GOAL, errors
    assert sorted(errors)[len(errors) // 2] <= GPU_DEVICE_GOAL * 0.6, errors  # the median


@needs_gpu_entry
def test_the_gpu_grid_reaches_long_context():
    seqs = [record["config"]["data"]["seq_len"] for record in GPU_ENTRY["held_out_measurements"]]
    assert max(seqs) >= 131072 and min(seqs) <= 512, seqs


@needs_gpu_entry
def test_the_cpu_counts_would_miss_the_h100_compile():
    # negative control: XLA:CPU's counts (float32 copies of bf16 operands) miss the GPU compile
    errors = _gpu_device_errors(ENTRY["counts"])
    assert max(errors) > GPU_DEVICE_GOAL, errors


@pytest.mark.slow
@needs_gpu_entry
@pytest.mark.skipif(
    not cuda_plugin_installed(),
    reason="XLA's GPU compiler is not installed (the test extra installs it)",
)
def test_a_held_out_gpu_measurement_is_todays_compiler():
    record = min(GPU_ENTRY["held_out_measurements"], key=lambda r: r["total_bytes"])
    model, config = calibrate.case_of(record)
    # compiled as the fit measured it (its "auto" attention blockwise: no cuDNN library here)
    measured = measure_for_target(calibrate.as_fitted(config, "h100"), model, "h100")
    drift = percent_difference(measured.device_bytes, record["device_bytes"])
    assert abs(drift) <= 2.0, f"the compiler changed ({drift:+.1f}%): re-run the calibration"


GPU_F32_KEY = "xla-gpu/float32"
GPU_F32 = json.loads(calibrate.calibration_path().read_text())["calibrations"].get(GPU_F32_KEY)
# percent, held-out device error of the float32 step compiled for the H100: worst 22.1 (Llama-3.1-8B
# QLoRA b1 x 131072 with every host placement planned low), median 1.1
GPU_F32_WORST, GPU_F32_MEDIAN = 23.0, 5.0


@pytest.mark.skipif(GPU_F32 is None, reason=f"no {GPU_F32_KEY} calibration yet")
def test_the_gpu_float32_calibration_refits_and_holds_on_its_held_out_grid():
    assert GPU_F32["target"] == "h100" and GPU_F32["dtype"] == "float32"
    assert calibrate.fit(GPU_F32["fit_measurements"], compiler="xla-gpu") == GPU_F32["counts"]

    def errors(counts):
        rows = calibrate.errors_of(GPU_F32["held_out_measurements"], counts, "xla-gpu")
        return sorted(abs(row["device_error"]) for row in rows)

    fitted = errors(GPU_F32["counts"])
    assert fitted[-1] <= GPU_F32_WORST and fitted[len(fitted) // 2] <= GPU_F32_MEDIAN, fitted
    # negative control: XLA:CPU's counts, the fallback without this fit, miss the median
    assert errors(ENTRY["counts"])[len(fitted) // 2] > GPU_F32_MEDIAN
