"""Lean defaults: the MLP chunk and the head's chunks (the sequence down to 512 rows, then a frozen
head's vocabulary) chosen from the shapes where the config says "auto" (the default), so LoRA and
QLoRA steps at typical shapes plan -- and compile -- within 10% of the planner's lower bound, and
the whole-sequence settings (null, set explicitly) do not. `resolve` is the one place "auto"
becomes a value; the step builder and the planner refuse a config that still holds one."""

import dataclasses

import pytest

from featherweight.memory.defaults import (
    AUTO_VOCAB_CHUNKS,
    MIN_AUTO_LOSS_CHUNK,
    MIN_AUTO_MLP_TOKENS,
    MIN_HEAD_ROWS,
    auto_loss_chunk,
    resolve,
)
from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.memory.step_cost import head_matmul_bytes
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config

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


def _whole(method="lora", batch=2, seq=256):
    """The config `auto_loss_chunk` starts from: no chunk anywhere (what "auto" is measured from)."""
    return _config(method, batch, seq, loss_chunk=None, vocab_chunk=None, mlp_chunk=None)


def _memory_with(config, **values):
    return config.model_copy(update={"memory": config.memory.model_copy(update=values)})


def test_a_frozen_heads_chunks_keep_512_rows_and_the_vocabulary_does_the_rest():
    config = _config(mlp_chunk=None)  # b2 x 256: a 128-token chunk would have 256 rows
    chosen = resolve(config, SMOLLM2)
    assert chosen.memory.loss_chunk is None  # the whole sequence: the head streams through once
    assert chosen.memory.vocab_chunk in AUTO_VOCAB_CHUNKS
    plan = plan_for_config(chosen, SMOLLM2)
    assert plan.phases["loss"] <= plan.phases["backward"]  # the loss phase is no longer the peak
    assert plan_for_config(config, SMOLLM2) == plan  # the planner plans what the trainer runs
    # the largest chunk that is enough: twice as many rows would leave the loss phase the peak
    larger = plan_for_config(
        _memory_with(chosen, vocab_chunk=2 * chosen.memory.vocab_chunk), SMOLLM2
    )
    assert larger.phases["loss"] > larger.phases["backward"]
    # no larger than 64-token sequence chunks (the old default), with the head read 4x less
    by_sequence = _memory_with(chosen, vocab_chunk=None, loss_chunk=MIN_AUTO_LOSS_CHUNK)
    assert plan.device_bytes <= plan_for_config(by_sequence, SMOLLM2).device_bytes
    assert head_matmul_bytes(chosen, SMOLLM2) < head_matmul_bytes(by_sequence, SMOLLM2) / 3
    # longer rows: the sequence is chunked first, each chunk keeping 512 rows
    long = resolve(_config(seq=2048), SMOLLM2).memory
    assert long.loss_chunk is not None and 2 * long.loss_chunk >= MIN_HEAD_ROWS
    # a set chunk is kept (null included), and the other is chosen around it
    unchunked = resolve(_config(loss_chunk=None, vocab_chunk=None), SMOLLM2).memory
    assert unchunked.loss_chunk is None and unchunked.vocab_chunk is None
    set_sequence = resolve(_config(loss_chunk=64, mlp_chunk=None), SMOLLM2).memory
    assert set_sequence.loss_chunk == 64 and set_sequence.vocab_chunk is None  # lean already


def test_both_are_chunked_when_the_sequence_alone_is_not_enough():
    # a toy whose 32k vocabulary dwarfs its 64-wide layers: at b32 x 128 its 64-token chunks (the
    # smallest) still leave the loss phase the peak, and so does every vocabulary chunk
    model = tiny_config(vocab_size=32768)
    chosen = resolve(_config(batch=32, seq=128), model).memory
    assert chosen.vocab_chunk == AUTO_VOCAB_CHUNKS[-1] and chosen.loss_chunk is not None
    assert resolve(_config("full", batch=32, seq=128), model).memory.vocab_chunk is None


@pytest.mark.parametrize(("batch", "seq"), [(2, 256), (2, 2048), (8, 1024), (1, 4096)])
def test_a_heads_loss_chunk_keeps_enough_rows(batch, seq):
    """Each loss chunk streams the head through its matmuls again (and a trained head's adds its
    gradient): a chunk keeps at least `MIN_HEAD_ROWS` rows, trained or frozen (none at b2 x 256,
    where a frozen head takes vocabulary chunks instead); on a mesh, where no vocabulary chunk
    follows, a frozen head's chunk keeps only `MIN_AUTO_LOSS_CHUNK` tokens."""
    for method in ("full", "lora"):
        chunk = auto_loss_chunk(_whole(method, batch, seq), SMOLLM2)
        assert chunk is None or batch * chunk >= MIN_HEAD_ROWS
        if chunk is not None:  # chosen because the loss phase was the peak at the whole sequence
            whole = _config(method, batch, seq, loss_chunk=None, vocab_chunk=None)
            whole = plan_for_config(whole, SMOLLM2)
            assert whole.phases["loss"] > whole.phases["backward"]
        assert (chunk is None) == (batch * seq <= MIN_HEAD_ROWS)
    on_mesh = auto_loss_chunk(_whole("lora", batch, seq), SMOLLM2, sharded=True)
    assert on_mesh is not None and on_mesh >= MIN_AUTO_LOSS_CHUNK


def test_a_short_vocabulary_needs_no_chunk():
    small_vocab = dataclasses.replace(SMOLLM2, vocab_size=1024)
    assert auto_loss_chunk(_whole(), small_vocab) is None


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize(("batch", "seq"), [(2, 256), (2, 2048), (8, 1024), (1, 4096)])
def test_defaults_plan_within_10_percent_of_the_lower_bound(method, batch, seq):
    config = resolve(_config(method, batch, seq), SMOLLM2)
    plan = plan_for_config(config, SMOLLM2)
    assert plan.device_bytes <= 1.10 * plan.lower_bound_bytes
    mlp_chunk = config.memory.mlp_chunk  # None: no chunk lowers the plan at these shapes
    assert mlp_chunk is None or batch * mlp_chunk >= MIN_AUTO_MLP_TOKENS  # large matmuls
    if batch * seq >= 4096:  # the old defaults (whole sequence) are not lean at these shapes
        old = _config(method, batch, seq, loss_chunk=None, mlp_chunk=None)
        assert plan_for_config(old, SMOLLM2).device_bytes > 1.10 * plan.lower_bound_bytes


def test_an_auto_mlp_chunk_is_chosen_only_where_it_lowers_the_plan():
    assert resolve(_config(mlp_chunk=512, seq=2048), SMOLLM2).memory.mlp_chunk == 512
    assert resolve(_config(mlp_chunk=None, seq=2048), SMOLLM2).memory.mlp_chunk is None
    short = resolve(_config(batch=1, seq=256), SMOLLM2)  # 128 rows: too small
    assert short.memory.mlp_chunk is None
    mesh = _config(seq=2048, mesh={"data": 2, "fsdp": 4})
    assert resolve(mesh, SMOLLM2).memory.mlp_chunk is None  # the batch is split
    config = resolve(_config(seq=2048), SMOLLM2)
    memory = config.memory.model_copy(update={"mlp_chunk": config.memory.mlp_chunk // 2})
    halved = config.model_copy(update={"memory": memory})
    assert (
        plan_for_config(halved, SMOLLM2).device_bytes
        > 0.98 * plan_for_config(config, SMOLLM2).device_bytes
    )  # one more halving would not have paid


def test_a_frozen_nf4_head_gets_a_vocabulary_chunk_and_a_trained_head_does_not():
    qlora = resolve(_config("qlora", quantize_head=True), SMOLLM2)
    assert qlora.memory.vocab_chunk is not None  # its dense copy was the peak
    unchunked = plan_for_config(_config("qlora", quantize_head=True, vocab_chunk=None), SMOLLM2)
    assert plan_for_config(qlora, SMOLLM2).device_bytes < unchunked.device_bytes
    assert resolve(_config("full"), SMOLLM2).memory.vocab_chunk is None
    mesh = _config(seq=2048, mesh={"data": 2, "fsdp": 4})  # a chunk may gather the head there
    assert resolve(mesh, SMOLLM2).memory.vocab_chunk is None


@pytest.mark.slow  # four SmolLM2-135M steps compiled on abstract shapes: about two minutes
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_defaults_compile_within_10_percent_of_the_lower_bound(method):
    floor = plan_for_config(_config(method), SMOLLM2).lower_bound_bytes
    default = measure_compiled(_config(method), SMOLLM2)
    assert default.device_bytes <= 1.10 * floor
    whole = measure_compiled(_config(method, loss_chunk=None, mlp_chunk=None), SMOLLM2)
    assert whole.device_bytes > default.device_bytes  # the old defaults hold more (the 10%
    # negative control is the plan test's, at the longer shapes where it applies)


def test_auto_is_the_default_and_resolve_leaves_none():
    config = _config(seq=2048)
    assert config == _config(seq=2048, loss_chunk="auto", vocab_chunk="auto", mlp_chunk="auto")
    resolved = resolve(config, SMOLLM2)
    assert not resolved.memory.unresolved and config.memory.unresolved
    assert resolve(resolved, SMOLLM2) is resolved  # a resolved config is kept as it is
    # what the "auto" settings became is a plain config: written and read back, it plans the same
    again = parse_config(resolved.model_dump(mode="json"))
    assert again == resolved and plan_for_config(again, SMOLLM2) == plan_for_config(config, SMOLLM2)


def test_a_mesh_of_one_device_resolves_as_one_device():
    # the one-device mesh `plan --target` compiles on chooses what the one-GPU trainer chooses
    from featherweight.memory.targets import target_mesh
    from featherweight.parallel.sharding import abstract_mesh

    config = _config(seq=2048)
    one_device = resolve(config, SMOLLM2)
    assert one_device.memory.mlp_chunk is not None  # a chunk only one device takes
    assert resolve(config, SMOLLM2, abstract_mesh({"data": 1, "fsdp": 1})) == one_device
    assert resolve(config, SMOLLM2, target_mesh("cpu")) == one_device
    # negative control: a mesh of eight devices splits the batch, and leaves the MLP whole
    sharded = resolve(config, SMOLLM2, abstract_mesh({"data": 2, "fsdp": 4}))
    assert sharded.memory.mlp_chunk is None


def test_the_builder_and_the_planner_refuse_auto():
    from featherweight.errors import ConfigError
    from featherweight.memory.device_plan import plan_one_device
    from featherweight.recipe.build import abstract_split, build_train_step
    from featherweight.recipe.optimizer import make_optimizer

    model = tiny_config()
    config = _config(seq=64)
    with pytest.raises(ConfigError, match=r"memory\.mlp_chunk, memory\.loss_chunk.* still auto"):
        plan_one_device(config, model)
    trainable, frozen = abstract_split(config, model)
    optimizer = make_optimizer(config.optimizer, config.steps)
    with pytest.raises(ConfigError, match=r"featherweight\.resolve"):
        build_train_step(config, model, trainable, frozen, optimizer)
    resolved = resolve(config, model)
    plan_one_device(resolved, model)
    build_train_step(resolved, model, trainable, frozen, optimizer)  # resolved: built


def test_a_resumed_run_keeps_what_it_recorded():
    from featherweight.recipe.schema import take_saved_choices

    recorded = _memory_with(resolve(_config(seq=2048), SMOLLM2), mlp_chunk=128)
    resumed = take_saved_choices(_config(seq=2048), recorded)
    assert resumed == recorded  # whatever resolve would choose today, the run's own choice
    explicit = take_saved_choices(_config(seq=2048, mlp_chunk=512), recorded)
    assert explicit.memory.mlp_chunk == 512  # a setting the config names is its own


def test_a_tied_table_on_the_host_gets_the_vocabulary_chunk_it_needs():
    # the head reads a tied table on the host chunk by chunk (recipe/placement.py): "auto" is a
    # chunk there even where the whole vocabulary would be lean, and null is refused
    from featherweight.errors import ConfigError
    from featherweight.recipe.build import check_method_settings

    # wide MLPs, narrow rows: the whole vocabulary is lean even with its rows read from the host
    model = tiny_config(vocab_size=20000, hidden_size=256, intermediate_size=32768, num_heads=4,
                        num_kv_heads=2, head_dim=64, tie_word_embeddings=True)  # fmt: skip
    on_device = resolve(_config(seq=64), model)
    assert on_device.memory.vocab_chunk is None  # lean at this toy's shapes
    on_host = resolve(_config(seq=64, embed="host"), model)
    assert on_host.memory.vocab_chunk == AUTO_VOCAB_CHUNKS[0]
    check_method_settings(on_host, model)
    with pytest.raises(ConfigError, match=r"set memory\.vocab_chunk"):
        check_method_settings(_config(seq=64, embed="host", vocab_chunk=None), model)
