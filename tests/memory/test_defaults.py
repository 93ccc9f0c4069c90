"""Lean defaults: the loss, MLP and (frozen NF4 head) vocabulary chunks chosen from the shapes when
the config leaves them unset, so LoRA and QLoRA steps at typical shapes plan -- and compile --
within 10% of the planner's lower bound, and the whole-sequence settings (the old defaults, set
explicitly) do not."""

import dataclasses

import pytest

from featherweight.memory.defaults import (
    MIN_AUTO_LOSS_CHUNK,
    MIN_AUTO_MLP_TOKENS,
    MIN_TRAINED_HEAD_ROWS,
    auto_loss_chunk,
    with_lean_defaults,
)
from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config

SMOLLM2 = builtin_config("SmolLM2-135M")


def _config(method="lora", batch=2, seq=256, quantize_head=False, mesh=None, **memory):
    return parse_config(
        {
            **({} if mesh is None else {"mesh": mesh}),
            "method": method,
            "batch_size": batch,
            "model": {"dtype": "float32", "quantize_head": quantize_head},
            "data": {"seq_len": seq},
            "memory": memory,
        }
    )


def test_an_unset_loss_chunk_is_chosen_and_a_set_one_is_kept():
    config = _config(mlp_chunk=None)
    chosen = with_lean_defaults(config, SMOLLM2)
    assert chosen.memory.loss_chunk == auto_loss_chunk(config, SMOLLM2) == MIN_AUTO_LOSS_CHUNK
    assert with_lean_defaults(_config(loss_chunk=None), SMOLLM2).memory.loss_chunk is None
    assert with_lean_defaults(_config(loss_chunk=128), SMOLLM2).memory.loss_chunk == 128
    plan = plan_for_config(chosen, SMOLLM2)
    assert plan.phases["loss"] <= plan.phases["backward"]  # the loss phase is no longer the peak
    assert plan_for_config(config, SMOLLM2) == plan  # the planner plans what the trainer runs


@pytest.mark.parametrize(("batch", "seq"), [(2, 256), (2, 2048), (8, 1024), (1, 4096)])
def test_a_trained_heads_loss_chunk_keeps_enough_rows(batch, seq):
    """Full fine-tuning sums the head's gradient over the loss chunks: a chunk keeps at least
    `MIN_TRAINED_HEAD_ROWS` rows (none at b2 x 256, where LoRA takes 64-token chunks), while
    a frozen head's chunks cost nothing and only `MIN_AUTO_LOSS_CHUNK` bounds them."""
    full = auto_loss_chunk(_config("full", batch, seq), SMOLLM2)
    lora = auto_loss_chunk(_config("lora", batch, seq), SMOLLM2)
    assert full is None or batch * full >= MIN_TRAINED_HEAD_ROWS
    assert lora is not None and (full is None or lora <= full)
    if full is not None:  # chosen because the loss phase was the peak at the whole sequence
        whole = plan_for_config(_config("full", batch, seq, loss_chunk=None), SMOLLM2)
        assert whole.phases["loss"] > whole.phases["backward"]
    assert (full is None) == (batch * seq <= MIN_TRAINED_HEAD_ROWS)


def test_a_short_vocabulary_needs_no_chunk():
    small_vocab = dataclasses.replace(SMOLLM2, vocab_size=1024)
    assert auto_loss_chunk(_config(), small_vocab) is None


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize(("batch", "seq"), [(2, 256), (2, 2048), (8, 1024), (1, 4096)])
def test_defaults_plan_within_10_percent_of_the_lower_bound(method, batch, seq):
    config = with_lean_defaults(_config(method, batch, seq), SMOLLM2)
    plan = plan_for_config(config, SMOLLM2)
    assert plan.device_bytes <= 1.10 * plan.lower_bound_bytes
    mlp_chunk = config.memory.mlp_chunk  # None: no chunk lowers the plan at these shapes
    assert mlp_chunk is None or batch * mlp_chunk >= MIN_AUTO_MLP_TOKENS  # large matmuls
    if batch * seq >= 4096:  # the old defaults (whole sequence) are not lean at these shapes
        old = _config(method, batch, seq, loss_chunk=None, mlp_chunk=None)
        assert plan_for_config(old, SMOLLM2).device_bytes > 1.10 * plan.lower_bound_bytes


def test_an_unset_mlp_chunk_is_chosen_only_where_it_lowers_the_plan():
    assert with_lean_defaults(_config(mlp_chunk=512, seq=2048), SMOLLM2).memory.mlp_chunk == 512
    assert with_lean_defaults(_config(mlp_chunk=None, seq=2048), SMOLLM2).memory.mlp_chunk is None
    short = with_lean_defaults(_config(batch=1, seq=256), SMOLLM2)  # 128 rows: too small
    assert short.memory.mlp_chunk is None
    mesh = _config(seq=2048, mesh={"data": 1, "fsdp": 1})
    assert with_lean_defaults(mesh, SMOLLM2).memory.mlp_chunk is None  # the batch is split
    config = with_lean_defaults(_config(seq=2048), SMOLLM2)
    memory = config.memory.model_copy(update={"mlp_chunk": config.memory.mlp_chunk // 2})
    halved = config.model_copy(update={"memory": memory})
    assert (
        plan_for_config(halved, SMOLLM2).device_bytes
        > 0.98 * plan_for_config(config, SMOLLM2).device_bytes
    )  # one more halving would not have paid


def test_a_frozen_nf4_head_gets_a_vocabulary_chunk_and_a_trained_head_does_not():
    qlora = with_lean_defaults(_config("qlora", quantize_head=True), SMOLLM2)
    assert qlora.memory.vocab_chunk is not None  # its dense copy was the peak
    unchunked = plan_for_config(_config("qlora", quantize_head=True, vocab_chunk=None), SMOLLM2)
    assert plan_for_config(qlora, SMOLLM2).device_bytes < unchunked.device_bytes
    assert with_lean_defaults(_config(), SMOLLM2).memory.vocab_chunk is None  # nothing to save
    assert with_lean_defaults(_config("full"), SMOLLM2).memory.vocab_chunk is None


@pytest.mark.slow  # four SmolLM2-135M steps compiled on abstract shapes: about two minutes
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_defaults_compile_within_10_percent_of_the_lower_bound(method):
    floor = plan_for_config(_config(method), SMOLLM2).lower_bound_bytes
    default = measure_compiled(_config(method), SMOLLM2)
    assert default.device_bytes <= 1.10 * floor
    whole = measure_compiled(_config(method, loss_chunk=None, mlp_chunk=None), SMOLLM2)
    assert whole.device_bytes > default.device_bytes  # the old defaults hold more (the 10%
    # negative control is the plan test's, at the longer shapes where it applies)
