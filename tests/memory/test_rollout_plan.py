"""GRPO's rollout phase in the plan: within 10% of the compiled rollout program on XLA:CPU
(temp + argument + output - alias; the program's arguments are the frozen base and the
adapters, so the phase less the optimizer state), a KV cache that matters (the plan without it
misses by far more), the peak the larger phase, and a budget only the rollouts exceed split
into rollout chunks."""

import pytest
from rich.console import Console

from featherweight.errors import ConfigError
from featherweight.memory.budget import fit_budget
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import percent_difference, print_report, report_json
from featherweight.memory.rollout_measure import measure_rollout
from featherweight.models.config import config_from_hf_dict
from featherweight.recipe.objectives import check_objective
from featherweight.recipe.schema import parse_config

# four layers, grouped K/V heads: the cache of 8 rows x 256 positions is a third of the program
TINY = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "tie_word_embeddings": False, "max_position_embeddings": 4096}  # fmt: skip


def grpo_config(**memory):
    return parse_config({
        "method": "lora", "objective": "grpo", "batch_size": 8, "model": {"dtype": "float32"},
        "grpo": {"rewards": ["rewards.py:f"], "num_generations": 8, "max_completion_length": 192,
                 "top_p": 0.9},
        "data": {"seq_len": 255}, "memory": memory,
    })  # fmt: skip


@pytest.fixture(scope="module")
def planned_and_compiled():
    model = config_from_hf_dict(TINY)
    config = grpo_config()
    plan = plan_for_config(config, model)
    return plan, measure_rollout(config, model, "cpu")


def test_the_rollout_phase_is_within_ten_percent_of_its_compiled_program(planned_and_compiled):
    plan, measured = planned_and_compiled
    program = plan.rollout_device_bytes - plan.bytes_of("optimizer_state")
    assert abs(percent_difference(program, measured.total_bytes)) <= 10.0
    # negative control: the same phase without its KV cache misses the compile by far more
    without_cache = program - sum(c.bytes for c in plan.rollout if c.name == "kv_cache")
    assert percent_difference(without_cache, measured.total_bytes) < -25.0


def test_the_peak_is_the_larger_phase_and_the_resident_bytes_count_once(planned_and_compiled):
    plan, _ = planned_and_compiled
    resident = sum(plan.bytes_of(name) for name in ("frozen_base", "trainable_weights"))
    resident += plan.bytes_of("optimizer_state")
    assert plan.rollout_device_bytes == resident + sum(c.bytes for c in plan.rollout)
    assert plan.device_bytes == max(plan.train_device_bytes, plan.rollout_device_bytes)
    assert any("the rollouts are the plan's second phase" in note for note in plan.warnings)


def test_rollout_chunks_plan_a_smaller_cache():
    model = config_from_hf_dict(TINY)
    whole = plan_for_config(grpo_config(), model)
    halves = plan_for_config(grpo_config(rollout_chunk=4), model)
    assert halves.bytes_of("kv_cache") == 0  # the train step's components are unchanged
    cache = {c.name: c.bytes for c in whole.rollout}["kv_cache"]
    assert {c.name: c.bytes for c in halves.rollout}["kv_cache"] == cache // 2
    assert halves.train_device_bytes == whole.train_device_bytes


def test_a_budget_only_the_rollouts_exceed_splits_them_into_chunks():
    # 16 layers of 16 K/V heads of 64 over a residual stream of 64: the cache outweighs the step
    wide_heads = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "head_dim": 64, "num_hidden_layers": 16}  # fmt: skip
    model = config_from_hf_dict({**TINY, **wide_heads})
    config = parse_config({
        "method": "lora", "objective": "grpo", "batch_size": 16, "model": {"dtype": "float32"},
        "grpo": {"rewards": ["rewards.py:f"], "num_generations": 16,
                 "max_completion_length": 1024},
        "data": {"seq_len": 1087},
    })  # fmt: skip
    plan = plan_for_config(config, model)
    assert plan.rollout_device_bytes > plan.train_device_bytes, "the rollouts must be the peak"
    budget = (plan.rollout_device_bytes + plan.train_device_bytes) // 2
    fitted, fitted_plan = fit_budget(config, model, budget, reserve=0.0)
    assert fitted.memory.rollout_chunk in (1, 2, 4, 8)
    assert fitted_plan.device_bytes <= budget
    assert fitted.batch_size == config.batch_size and fitted.data.seq_len == config.data.seq_len


def test_a_rollout_chunk_that_does_not_divide_the_group_is_one_plain_line():
    # refused by the objective's check, before the plan or any weight (recipe/objectives/grpo.py)
    config = grpo_config(rollout_chunk=3)
    with pytest.raises(ConfigError, match=r"rollout_chunk=3 must divide grpo.num_generations=8"):
        plan_for_config(config, config_from_hf_dict(TINY))
    with pytest.raises(ConfigError) as raised:
        check_objective(config)
    assert "\n" not in str(raised.value)


def test_the_report_shows_both_phases(planned_and_compiled):
    plan, _ = planned_and_compiled
    console = Console(record=True, width=240)
    print_report(plan, None, console)
    text = console.export_text()
    for row in ("train step total", "rollout phase total", "kv_cache", "peak (the larger phase)"):
        assert row in text, row
    report = report_json(plan, None)
    assert report["planned_train_device_bytes"] == plan.train_device_bytes
    assert report["planned_rollout_device_bytes"] == plan.rollout_device_bytes
    assert report["planned_device_bytes"] == plan.device_bytes
