"""One capacity and one verdict: fits or not, against a budget, a target GPU's usable memory or
this process's device (JAX's pool on a GPU, the machine's memory on a CPU backend), with the host
bytes, the shortfall and what makes room."""

import dataclasses

import pytest

from featherweight.errors import BudgetError
from featherweight.memory import capacity, device_memory
from featherweight.memory.capacity import of_budget, of_target, refuse_unless_fits, verdict
from featherweight.memory.plan import plan_for_config
from featherweight.memory.targets import LIBRARY_ALLOWANCE_BYTES, get_target, usable_bytes
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
    judged = verdict(plan, of_target(get_target("h100")))
    assert judged.fits and judged.limit_bytes == usable_bytes(get_target("h100"))
    assert judged.line == (
        f"fits: {plan.device_bytes / GIB:.2f} of {judged.limit_bytes / GIB:.2f} GiB on the H100 "
        f"(+{plan.host_bytes / GIB:.2f} GiB host)"
    )
    assert "x 0.75" in judged.limit_note and "0.50 GiB" in judged.limit_note


def test_a_plan_over_the_budget_says_by_how_much_and_the_options():
    plan = _plan()
    budget = plan.device_bytes - GIB // 2
    judged = verdict(plan, of_budget(budget), options=["--budget 8GiB picks batch_size: 2 -> 1"])
    assert not judged.fits
    assert judged.line.startswith(f"does not fit: {plan.device_bytes / GIB:.2f} GiB planned")
    assert "short by 0.50 GiB" in judged.line and "options: --budget 8GiB" in judged.line


def test_a_budget_beyond_the_gpu_is_flagged():
    plan = _plan()
    judged = verdict(plan, of_budget(40 * GIB, get_target("rtx4090")))
    assert judged.fits and "more than the usable on the RTX 4090" in judged.limit_note


def test_the_limit_is_the_gpu_not_the_plan():
    # negative control: the same plan on a smaller GPU does not fit
    plan = _plan()
    shrunk = dataclasses.replace(get_target("l4"), facts={**get_target("l4").facts,
                                                          "memory_bytes": 8 * GIB})  # fmt: skip
    assert verdict(plan, of_target(get_target("h100"))).fits
    assert not verdict(plan, of_target(shrunk)).fits


def test_no_limit_no_verdict():
    assert of_target(get_target("cpu")) is None
    assert verdict(_plan(), None) is None


H100_POOL = int(0.75 * 80 * GIB)  # JAX's default pool on an 80 GiB device


def _gpu_pool(monkeypatch, pool=H100_POOL):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setattr(device_memory, "local_memory_stats", lambda: {"bytes_limit": pool})
    return capacity.of_device()


def _plan_of(device_bytes, host_bytes=0):
    plan = _plan()
    return dataclasses.replace(
        plan,
        components=tuple(
            dataclasses.replace(c, bytes=device_bytes if c.name == "frozen_base" else 0)
            for c in plan.components
            if c.placement == "device"
        ),
    )


def test_this_gpu_is_its_pool_less_the_same_allowance_as_a_target(monkeypatch):
    on_gpu = _gpu_pool(monkeypatch)
    assert on_gpu.limit_bytes == H100_POOL - LIBRARY_ALLOWANCE_BYTES and not on_gpu.holds_host
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION 0.75" in on_gpu.note
    judged = refuse_unless_fits(_plan_of(50 * GIB), on_gpu)
    assert judged.fits and judged.line.startswith("fits: 50.00 of 59.50 GiB on this GPU")


def test_a_plan_beyond_this_gpu_names_the_fraction_that_holds_it(monkeypatch):
    on_gpu = _gpu_pool(monkeypatch)
    with pytest.raises(BudgetError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION=0\.85") as error:
        refuse_unless_fits(_plan_of(67 * GIB), on_gpu)
    # (67 GiB + the allowance) / 80 GiB = 0.844: the next hundredth up
    assert "memory.budget: 59.50GiB" in str(error.value) and "\n" not in str(error.value)
    # more than the device can give: no fraction, only the budget
    with pytest.raises(BudgetError) as error:
        refuse_unless_fits(_plan_of(79 * GIB), on_gpu)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=" not in str(error.value)


def test_a_cpu_backend_counts_the_host_bytes_against_the_machine(monkeypatch):
    monkeypatch.setattr(device_memory, "local_memory_stats", lambda: None)
    machine = capacity.of_device()  # XLA:CPU: no pool, the physical memory
    assert machine.holds_host and machine.where == "in this machine's memory"
    plan = _plan(residuals="host")
    assert machine.needed_bytes(plan) == plan.device_bytes + plan.host_bytes
    small = dataclasses.replace(machine, limit_bytes=plan.device_bytes + plan.host_bytes // 2)
    with pytest.raises(BudgetError, match=r"the device has .* lower batch_size or data\.seq_len"):
        refuse_unless_fits(plan, small)  # the device bytes alone would fit
