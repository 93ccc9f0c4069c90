"""Data parallel and FSDP over 8 virtual CPU devices: the streamed step on a mesh gives the
one-device result, holds an eighth of the arguments per device, and keeps NF4 blocks whole; an
MoE model's experts shard whole over fsdp."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from featherweight.errors import ShardingError
from featherweight.models.batch import batch_from_tokens
from featherweight.models.init import init_params
from featherweight.parallel.sharding import (
    check_batch_size,
    make_mesh,
    mesh_shape,
    optimizer_state_spec,
    parameter_spec,
    per_device_bytes,
    place_batch,
    shard_tree,
    step_shardings,
    tree_shardings,
    tree_specs,
)
from featherweight.quant.nf4 import abstract_nf4
from featherweight.recipe.schema import MeshSettings, parse_config
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.streamed import build_streamed_step
from tests.conftest import tiny_config, training_case

CONFIG = tiny_config()
# Qwen3-MoE: 8 experts, each [F=32, D=64] -- D is the largest axis, E the one the rule picks
MOE = tiny_config(
    model_type="qwen3_moe", intermediate_size=32, qk_norm=True, num_experts=8,
    experts_per_token=2, norm_topk_prob=True,
)  # fmt: skip
STEPS = 3
FSDP8 = MeshSettings(data=1, fsdp=8)


def _case(method, config=CONFIG):
    """(trainable, frozen, lora spec) of a tiny float32 model: full, LoRA, QLoRA."""
    return training_case(config, method, rank=8)


BATCH = batch_from_tokens(jax.random.randint(jax.random.PRNGKey(3), (8, 17), 0, CONFIG.vocab_size))


def _train(method, mesh_settings, optimizer, steps=STEPS, config=CONFIG):
    """Losses, final trainable (numpy) and the compiled step's memory analysis of `steps` donated
    steps, on one device (mesh_settings None) or on a mesh of the 8 devices."""
    trainable, frozen, lora = _case(method, config)
    state = init_streamed_opt_state(optimizer, trainable)
    batch, shardings = BATCH, None
    if mesh_settings is not None:
        mesh = make_mesh(mesh_settings)
        shardings = step_shardings(mesh, trainable, state, frozen)
        trainable, frozen = (shard_tree(t, mesh, parameter_spec) for t in (trainable, frozen))
        state = shard_tree(state, mesh, optimizer_state_spec)
        batch = place_batch(BATCH, mesh)
    step = build_streamed_step(config, optimizer, trainable, frozen, lora, shardings=shardings)
    compiled = step.lower(trainable, state, frozen, batch, jax.random.PRNGKey(0)).compile()
    losses, layouts = [], jax.tree.map(lambda x: x.sharding, (trainable, state))
    for index in range(steps):
        trainable, state, metrics = compiled(
            trainable, state, frozen, batch, jax.random.PRNGKey(index)
        )
        losses.append(float(metrics["loss"]))
    assert jax.tree.map(lambda x: x.sharding, (trainable, state)) == layouts  # layout kept
    return np.array(losses), jax.tree.map(np.asarray, trainable), compiled.memory_analysis()


def _max_relative(expected, actual) -> float:
    """Largest over tensors of max |difference| / max |expected|."""
    return max(
        float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
        for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True)
    )


SGD = optax.sgd(0.1, momentum=0.9)  # state that follows its parameter; the update is linear


@pytest.fixture(scope="module")
def one_device():
    return {method: _train(method, None, SGD) for method in ("full", "lora", "qlora")}


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_fsdp_over_8_devices_equals_one_device(one_device, method):
    losses, params, single = one_device[method]
    fsdp_losses, fsdp_params, sharded = _train(method, FSDP8, SGD)
    np.testing.assert_allclose(fsdp_losses, losses, rtol=1e-5)
    assert _max_relative(params, fsdp_params) <= 1e-5
    assert _max_relative(_case(method)[0], fsdp_params) > 1e-3  # the steps did train
    # each device holds an eighth of the arguments (NF4 absmax groups and scalars replicated)
    assert sharded.argument_size_in_bytes <= single.argument_size_in_bytes / 8 * 1.1
    # the state keeps its layout, so donation still aliases all of it, shard by shard
    assert sharded.alias_size_in_bytes >= 0.99 * single.alias_size_in_bytes / 8


@pytest.mark.parametrize(
    "method",
    [
        pytest.param("full", marks=pytest.mark.slow),
        pytest.param("lora", marks=pytest.mark.slow),
        "qlora",
    ],
)
def test_moe_experts_shard_whole_and_fsdp_equals_one_device(method):
    """Qwen3-MoE with 8 experts on fsdp=8: every expert stack, its NF4 fields and its adapters
    shard on E (one whole expert per device); the router trains only in full fine-tuning; the
    sharded step gives the one-device losses and parameters from an eighth of the arguments."""
    trainable, frozen, _ = _case(method, MOE)
    specs = tree_specs({"t": trainable, "f": frozen}, make_mesh(FSDP8), parameter_spec)
    if method == "full":
        assert specs["t"]["layers"]["gate"] == P(None, "fsdp")  # [L, E, F, D]: E, not D
        assert "router" in trainable["layers"]
    else:
        assert "router" not in trainable["layers"]["lora"]
        assert specs["t"]["layers"]["lora"]["down"] == {"a": P(None, "fsdp"), "b": P(None, "fsdp")}
    if method == "qlora":
        nf4 = specs["f"]["layers"]["up"]
        assert (nf4.codes, nf4.absmax, nf4.absmax_scale, nf4.absmax_offset) == (
            P(None, "fsdp"),
        ) * 4
    losses, params, single = _train(method, None, SGD, config=MOE)
    fsdp_losses, fsdp_params, sharded = _train(method, FSDP8, SGD, config=MOE)
    np.testing.assert_allclose(fsdp_losses, losses, rtol=1e-5)
    assert _max_relative(params, fsdp_params) <= 1e-5
    assert _max_relative(_case(method, MOE)[0], fsdp_params) > 1e-3  # the steps did train
    assert sharded.argument_size_in_bytes <= single.argument_size_in_bytes / 8 * 1.1


@pytest.mark.parametrize(
    ("method", "mesh"),
    [("lora", MeshSettings(data=8, fsdp=1)), ("qlora", MeshSettings(data=2, fsdp=4))],
    ids=["data8", "data2-fsdp4"],
)
def test_data_parallel_splits_the_batch_and_equals_one_device(one_device, method, mesh):
    losses, params, single = one_device[method]
    split_losses, split_params, sharded = _train(method, mesh, SGD)
    np.testing.assert_allclose(split_losses, losses, rtol=1e-5)
    assert _max_relative(params, split_params) <= 1e-5
    # each device: 1/fsdp of the model and its state (NF4 absmax groups replicated), 1/8 of rows
    batch_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(BATCH))
    model_bytes = single.argument_size_in_bytes - batch_bytes
    expected = model_bytes / mesh.fsdp + batch_bytes / 8
    assert expected <= sharded.argument_size_in_bytes <= 1.1 * expected


def test_adamw_under_fsdp_gives_the_one_device_loss_and_parameters():
    """AdamW divides each gradient element by its own running RMS, so where a gradient element
    nearly cancels, float32 summation order (which the mesh changes) moves that element's update
    by up to lr x its relative rounding error; the parameters agree as a whole (norm-wise)."""
    adamw = optax.adamw(1e-2, weight_decay=0.1)
    losses, params, _ = _train("full", None, adamw, steps=2)
    fsdp_losses, fsdp_params, _ = _train("full", FSDP8, adamw, steps=2)
    np.testing.assert_allclose(fsdp_losses, losses, rtol=1e-5)
    difference = sum(
        float(np.sum((a - b) ** 2))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(fsdp_params), strict=True)
    )
    norm = sum(float(np.sum(a**2)) for a in jax.tree.leaves(params))
    assert math.sqrt(difference / norm) <= 1e-5


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_planned_per_device_arguments_equal_the_compiled_ones(devices):
    """`per_device_bytes` of the rules (no compile) is what XLA gives each device, for QLoRA."""
    trainable, frozen, lora = _case("qlora")
    state = jax.eval_shape(lambda t: init_streamed_opt_state(SGD, t), trainable)
    mesh = make_mesh(MeshSettings(data=1, fsdp=devices), jax.devices()[:devices])
    shardings = step_shardings(mesh, trainable, state, frozen)
    arguments = (trainable, state, frozen, BATCH, jax.random.PRNGKey(0))
    step = build_streamed_step(CONFIG, SGD, trainable, frozen, lora, shardings=shardings)
    analysis = step.lower(*arguments).compile().memory_analysis()
    # the dropout key is unused without dropout, and jit drops unused arguments
    planned = per_device_bytes(arguments[:4], shardings.inputs[:4])
    assert planned == analysis.argument_size_in_bytes


# --- rules ---------------------------------------------------------------------------------------


def test_stacked_layers_are_never_sharded_on_the_layer_axis():
    mesh = make_mesh(FSDP8)
    params = init_params(jax.random.PRNGKey(0), CONFIG)
    specs = tree_specs(params, mesh, parameter_spec)
    for spec in jax.tree.leaves(specs["layers"]):
        assert spec[0] is None and "fsdp" in spec
    assert specs["layers"]["gate"] == P(None, "fsdp")  # [L, F=128, D=64]: the larger axis
    assert specs["layers"]["down"] == P(None, None, "fsdp")  # [L, D=64, F=128]
    assert specs["embed"] == P("fsdp")


def _nf4_specs(shape, fsdp):
    weight = {"layers": {"q": abstract_nf4(shape, (2,))}}
    mesh = make_mesh(MeshSettings(data=8 // fsdp, fsdp=fsdp))
    return tree_specs(weight, mesh, parameter_spec)["layers"]["q"], mesh


def test_nf4_fields_shard_only_on_whole_blocks():
    # 4096 x 4096: 262144 blocks, 1024 absmax groups -- everything divides over 8
    specs, mesh = _nf4_specs((4096, 4096), 8)
    assert (specs.codes, specs.absmax, specs.absmax_scale) == (P(None, "fsdp"),) * 3
    assert specs.absmax_offset == P()
    nf4 = abstract_nf4((4096, 4096), (2,))
    codes_shard = NamedSharding(mesh, specs.codes).shard_shape(nf4.codes.shape)
    absmax_shard = NamedSharding(mesh, specs.absmax).shard_shape(nf4.absmax.shape)
    assert codes_shard[-1] % 32 == 0 and absmax_shard[-1] % 256 == 0  # whole blocks and groups
    assert codes_shard[-1] * 2 // 64 == absmax_shard[-1]  # shard k's codes use shard k's absmax
    # 64 x 64: the 64 absmax values are less than one group per device -> replicated
    specs, _ = _nf4_specs((64, 64), 8)
    assert (specs.codes, specs.absmax, specs.absmax_scale) == (P(None, "fsdp"), P(), P())
    # 64 x 100: 100 blocks do not split into 8 whole parts -> codes replicated too
    specs, _ = _nf4_specs((64, 100), 8)
    assert specs.codes == P() and specs.absmax == P()
    specs, _ = _nf4_specs((64, 100), 4)
    assert specs.codes == P(None, "fsdp")


def test_optimizer_state_follows_its_parameter():
    mesh = make_mesh(FSDP8)
    params = init_params(jax.random.PRNGKey(0), CONFIG)
    state = jax.eval_shape(
        lambda p: init_streamed_opt_state(optax.adamw(1e-3), p), params
    )  # mu, nu [L, ...] per layer tensor; count [L]
    param_specs = jax.tree.leaves(tree_specs(params["layers"], mesh, parameter_spec))
    for param_spec, tensor_state in zip(param_specs, state.layers, strict=True):
        specs = tree_specs(tensor_state, mesh, optimizer_state_spec)
        assert specs[0].mu == specs[0].nu == param_spec
        assert specs[0].count == P()
    top = tree_specs(state.top, mesh, optimizer_state_spec)
    assert top["embed"][0].mu == P("fsdp")


# --- bad input ---------------------------------------------------------------------------------


def test_mesh_sizes_must_fill_the_devices():
    assert mesh_shape(MeshSettings(), 8) == {"data": 1, "fsdp": 8}
    assert mesh_shape(MeshSettings(), 8, process_count=2) == {"data": 2, "fsdp": 4}
    assert mesh_shape(MeshSettings(fsdp=2), 8) == {"data": 4, "fsdp": 2}
    assert mesh_shape(parse_config({"mesh": "auto"}).mesh, 4) == {"data": 1, "fsdp": 4}
    with pytest.raises(ShardingError, match=r"data=2, fsdp=2 does not fill the 8 devices"):
        mesh_shape(MeshSettings(data=2, fsdp=2), 8)
    with pytest.raises(ShardingError, match="fsdp=3"):
        make_mesh(MeshSettings(fsdp=3))


def test_indivisible_parameter_is_named_with_a_mesh_that_works():
    mesh = make_mesh(FSDP8)
    odd = {"layers": {"q": jax.ShapeDtypeStruct((2, 12, 20), jnp.float32)}}
    with pytest.raises(ShardingError, match=r"layers\.q of shape \(2, 12, 20\).*data=2, fsdp=4"):
        tree_specs(odd, mesh, parameter_spec)
    adapter = {"layers": {"lora": {"q": {"a": jax.ShapeDtypeStruct((2, 3, 20), jnp.float32)}}}}
    assert tree_specs(adapter, mesh, parameter_spec)["layers"]["lora"]["q"]["a"] == P()


def test_batch_must_split_over_the_data_and_fsdp_axes():
    mesh = make_mesh(MeshSettings(data=2, fsdp=4))
    with pytest.raises(ShardingError, match=r"global batch of 6 rows .* 2 x 4 = 8 devices.*24"):
        check_batch_size(6, mesh)
    with pytest.raises(ShardingError, match="global batch of 4 rows"):
        place_batch(batch_from_tokens(jnp.zeros((4, 9), jnp.int32)), mesh)


def test_abstract_shapes_carry_per_device_bytes():
    mesh = make_mesh(FSDP8)
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), CONFIG))
    shardings = tree_shardings(params, mesh, parameter_spec)
    total = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
    assert per_device_bytes(params, shardings) == total // 8
