"""Lean defaults: a loss chunk chosen from the shapes when the config leaves it unset, so a LoRA
step at typical shapes compiles within 10% of the planner's lower bound -- and the whole-sequence
loss (the old default, set explicitly) does not."""

import dataclasses

import pytest

from featherweight.memory.defaults import MIN_AUTO_LOSS_CHUNK, auto_loss_chunk, with_lean_defaults
from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config

SMOLLM2 = builtin_config("SmolLM2-135M")


def _config(method="lora", batch=2, seq=256, **memory):
    return parse_config(
        {
            "method": method,
            "batch_size": batch,
            "model": {"dtype": "float32"},
            "data": {"seq_len": seq},
            "memory": memory,
        }
    )


def test_an_unset_loss_chunk_is_chosen_and_a_set_one_is_kept():
    config = _config()
    chosen = with_lean_defaults(config, SMOLLM2)
    assert chosen.memory.loss_chunk == auto_loss_chunk(config, SMOLLM2) == MIN_AUTO_LOSS_CHUNK
    assert with_lean_defaults(_config(loss_chunk=None), SMOLLM2).memory.loss_chunk is None
    assert with_lean_defaults(_config(loss_chunk=128), SMOLLM2).memory.loss_chunk == 128
    plan = plan_for_config(chosen, SMOLLM2)
    assert plan.phases["loss"] <= plan.phases["backward"]  # the loss phase is no longer the peak
    assert plan_for_config(config, SMOLLM2) == plan  # the planner plans what the trainer runs


def test_a_short_vocabulary_needs_no_chunk():
    small_vocab = dataclasses.replace(SMOLLM2, vocab_size=1024)
    assert auto_loss_chunk(_config(), small_vocab) is None


@pytest.mark.slow  # two SmolLM2-135M steps compiled on abstract shapes: about a minute
def test_default_lora_compiles_within_10_percent_of_the_lower_bound():
    floor = plan_for_config(_config(loss_chunk=MIN_AUTO_LOSS_CHUNK), SMOLLM2).lower_bound_bytes
    default = measure_compiled(_config(), SMOLLM2)
    assert default.device_bytes <= 1.10 * floor
    whole_sequence = measure_compiled(_config(loss_chunk=None), SMOLLM2)  # negative control
    assert whole_sequence.device_bytes > 1.10 * floor
