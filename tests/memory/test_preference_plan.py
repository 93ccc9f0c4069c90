"""Preference objectives in the memory plan: DPO and ORPO cost what SFT of the same rows costs,
plus their batch arrays -- no second copy of the base, the reference mode's cost shown."""

import pytest

from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import percent_difference
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config


def llama_8b_qlora(dtype="bfloat16", **values):
    """Llama-3.1-8B QLoRA at 2 rows x 1024 tokens, padded: SFT of b2 x 1024, or one preference
    pair (chosen and rejected, 1024 tokens each) with `objective`."""
    return parse_config({
        "method": "qlora", "batch_size": 2, "model": {"dtype": dtype},
        "data": {"seq_len": 1024, "pack": False}, **values,
    })  # fmt: skip


@pytest.mark.parametrize(
    "values",
    [
        {"objective": "dpo"},
        {"objective": "dpo", "dpo": {"loss": "ipo", "reference": "precomputed"}},
        {"objective": "orpo"},
    ],
    ids=["dpo-same-step", "ipo-precomputed", "orpo"],
)
def test_llama_8b_qlora_one_pair_plans_within_5_percent_of_sft(values):
    model = builtin_config("Llama-3.1-8B")
    sft = plan_for_config(llama_8b_qlora(), model)
    pair = plan_for_config(llama_8b_qlora(**values), model)
    assert pair.device_bytes <= 1.05 * sft.device_bytes
    # one copy of the base: the reference is the same frozen weights with the adapters off
    assert pair.bytes_of("frozen_base") == sft.bytes_of("frozen_base")
    extra_arrays = 2 if values.get("dpo", {}).get("reference") == "precomputed" else 1
    assert pair.bytes_of("batch") - sft.bytes_of("batch") == extra_arrays * 4 * 2 * 1024
    assert pair.settings["objective"] == values["objective"]
    assert any(f"objective {values['objective']}" in note for note in pair.warnings)


def test_reference_mode_costs_are_shown_in_the_plan():
    model = builtin_config("Llama-3.1-8B")
    same_step = plan_for_config(llama_8b_qlora(objective="dpo"), model)
    precomputed = plan_for_config(
        llama_8b_qlora(objective="dpo", dpo={"reference": "precomputed"}), model
    )
    assert same_step.settings["reference"] == "same_step"
    assert "one more forward pass of the frozen base" in " ".join(same_step.warnings)
    assert "8,192 B of reference log-probs in each batch" in " ".join(precomputed.warnings)


def test_compiled_dpo_step_keeps_one_base_and_the_memory_of_sft():
    """Measured on this CPU (XLA:CPU memory_analysis): the DPO step's arguments are SFT's plus
    its one batch array, and its temporaries (the reference forward included) stay within 5%."""
    model = tiny_config(vocab_size=512, num_layers=4)
    base = {"method": "qlora", "batch_size": 2, "model": {"dtype": "float32"}}
    data = {"seq_len": 128, "pack": False}
    sft = measure_compiled(parse_config({**base, "data": data}), model)
    dpo_config = parse_config({**base, "data": data, "objective": "dpo"})
    dpo = measure_compiled(dpo_config, model)
    assert dpo.components["frozen_base"] == sft.components["frozen_base"]
    assert dpo.components["batch"] - sft.components["batch"] == 4 * 2 * 128
    assert dpo.total_bytes <= 1.05 * sft.total_bytes
    planned = plan_for_config(dpo_config, model)
    assert planned.measured_groups()["batch"] == dpo.components["batch"]


@pytest.mark.slow
def test_llama_8b_qlora_dpo_compiles_within_5_percent_of_sft_and_of_its_plan():
    """Llama-3.1-8B QLoRA, one pair of 2 x 1024 tokens vs SFT b2 x 1024, float32 on this CPU's
    compiler (abstract shapes): a minute or two each."""
    model = builtin_config("Llama-3.1-8B")
    sft = measure_compiled(llama_8b_qlora("float32"), model)
    config = llama_8b_qlora("float32", objective="dpo")
    dpo = measure_compiled(config, model)
    assert dpo.total_bytes <= 1.05 * sft.total_bytes
    assert dpo.components["frozen_base"] == sft.components["frozen_base"]
    planned = plan_for_config(config, model)
    assert abs(percent_difference(planned.device_bytes, dpo.total_bytes)) <= 5.0
