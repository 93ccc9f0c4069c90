"""The verdict line a person reads first: fits or not, against the budget or the GPU's usable
memory, with the host bytes and the shortfall."""

import dataclasses

from featherweight.memory.plan import plan_for_config
from featherweight.memory.targets import get_target, usable_bytes
from featherweight.memory.verdict import verdict
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config

GIB = 2**30


def _plan(**memory):
    config = parse_config(
        {"method": "qlora", "batch_size": 2, "data": {"seq_len": 2048}, "memory": memory}
    )
    return plan_for_config(config, builtin_config("Llama-3.1-8B"))


def test_a_plan_that_fits_the_h100_says_so_with_its_host_bytes(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    plan = _plan(residuals="host")
    judged = verdict(plan, get_target("h100"))
    assert judged.fits and judged.limit_bytes == usable_bytes(get_target("h100"))
    assert judged.line == (
        f"fits: {plan.device_bytes / GIB:.2f} of {judged.limit_bytes / GIB:.2f} GiB on the H100 "
        f"(+{plan.host_bytes / GIB:.2f} GiB host)"
    )
    assert "x 0.75" in judged.limit_note and "0.50 GiB" in judged.limit_note


def test_a_plan_over_the_budget_says_by_how_much_and_the_options():
    plan = _plan()
    budget = plan.device_bytes - GIB // 2
    judged = verdict(plan, None, budget, options=["--budget 8GiB picks batch_size: 2 -> 1"])
    assert not judged.fits
    assert judged.line.startswith(f"does not fit: {plan.device_bytes / GIB:.2f} GiB planned")
    assert "short by 0.50 GiB" in judged.line and "options: --budget 8GiB" in judged.line


def test_a_budget_beyond_the_gpu_is_flagged():
    plan = _plan()
    judged = verdict(plan, get_target("rtx4090"), budget_bytes=40 * GIB)
    assert judged.fits and "more than the usable on the RTX 4090" in judged.limit_note


def test_the_limit_is_the_gpu_not_the_plan():
    # negative control: the same plan on a smaller GPU does not fit
    plan = _plan()
    shrunk = dataclasses.replace(get_target("l4"), facts={**get_target("l4").facts,
                                                          "memory_bytes": 8 * GIB})  # fmt: skip
    assert verdict(plan, get_target("h100")).fits
    assert not verdict(plan, shrunk).fits


def test_no_limit_no_verdict():
    assert verdict(_plan(), get_target("cpu")) is None
