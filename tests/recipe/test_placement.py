"""Host placement, for every host setting alone and together, LoRA, QLoRA and full: the step the
trainer builds keeps to XLA's GPU host-offload rules (lowered for CUDA here, no GPU), XLA's GPU
compiler compiles it as it runs (deviceless), and removing one move to the device from any host
path is caught. On today's GPUs a rule broken is a compile error (E1200) the CPU never shows."""

import itertools

import jax
import numpy as np
import pytest
from jax._src.lib.mlir import ir

from featherweight.errors import ConfigError
from featherweight.memory.measure import abstract_step_arguments, measure_for_target
from featherweight.parallel.backend import cuda_plugin_installed
from featherweight.parallel.offload_rules import (
    check_host_offload,
    lower_for_gpu,
    moves_to_device_of_host_values,
    violations_in,
)
from featherweight.recipe.build import check_method_settings
from featherweight.recipe.placement import (
    ARGUMENT_SETTINGS,
    HOST_SETTINGS,
    arguments_on_host,
    check_placements,
    place_abstract,
)
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config

UNTIED = tiny_config(vocab_size=512)
TIED = tiny_config(vocab_size=512, tie_word_embeddings=True)
NEEDS_GPU_COMPILER = pytest.mark.skipif(
    not cuda_plugin_installed(), reason="XLA's GPU compiler (jax[cuda12-local]) not installed"
)


def _config(method, settings, **extra):
    memory = dict.fromkeys(settings, "host")
    if "embed" in settings:
        memory["vocab_chunk"] = 128  # a tied head reads a host table in vocabulary chunks
    memory.update(extra.pop("memory", {}))
    values = {
        "model": {"path": "demo", "dtype": "bfloat16"},
        "method": method,
        "batch_size": 2,
        "data": {"seq_len": 64},
        "memory": memory,
        **extra,
    }
    return parse_config(values)


def _subsets(method):
    names = [n for n in HOST_SETTINGS if not (method == "full" and n == "base")]
    return [s for r in range(1, len(names) + 1) for s in itertools.combinations(names, r)]


CASES = [(m, s) for m in ("qlora", "lora", "full") for s in _subsets(m)]


def _violations(config, model_config=UNTIED):
    check_method_settings(config, model_config)
    step, arguments = abstract_step_arguments(config, model_config)
    return check_host_offload(step, *arguments)


@pytest.mark.parametrize(
    ("method", "settings"), CASES, ids=lambda v: "+".join(v) if isinstance(v, tuple) else v
)
def test_every_host_placement_keeps_the_gpu_offload_rules(method, settings):
    found = _violations(_config(method, settings))
    assert not found, "\n".join(map(str, found[:10]))


@pytest.mark.parametrize("method", ["qlora", "full"])
def test_clipping_and_accumulation_with_host_state_keep_the_rules(method):
    extra = {
        "optimizer": {"clip_norm": 1.0, "clipping": "two_pass" if method == "full" else "global"}
    }
    assert not _violations(_config(method, ("optimizer_state", "residuals"), **extra))
    accumulated = {"batch_size": 4, "memory": {"accumulation_steps": 2}}
    assert not _violations(_config(method, ("optimizer_state",), **accumulated))


def test_kept_dequantized_weights_in_host_memory_keep_the_rules():
    # QLoRA's dense weights kept from forward to backward travel with the residuals
    for settings, save in (
        (("residuals",), ["dequantized"]),
        (("residuals", "optimizer_state", "embed"), ["dequantized", "qkv", "mlp_hidden"]),
    ):
        assert not _violations(_config("qlora", settings, memory={"save": save}))


def test_a_tied_table_on_the_host_keeps_the_rules():
    assert not _violations(_config("qlora", ("embed", "optimizer_state", "base")), TIED)


def test_residuals_on_the_host_keep_the_rules_on_a_mesh():
    config = _config("qlora", ("residuals",), mesh={"data": 2, "fsdp": 2}, batch_size=4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))
    step, arguments = abstract_step_arguments(config, UNTIED, mesh)
    assert not check_host_offload(step, *arguments)


@pytest.mark.parametrize("name", ARGUMENT_SETTINGS)
def test_argument_placements_are_refused_on_a_mesh(name):
    config = _config("qlora", (name,), mesh={"data": 2, "fsdp": 2})
    with pytest.raises(ConfigError, match="one device only"):
        check_placements(config, UNTIED)


def test_place_moves_exactly_the_arguments_each_setting_names():
    config = _config("full", ("optimizer_state", "embed"))
    _, (trainable, opt_state, frozen, _, _) = abstract_step_arguments(config, UNTIED)
    kinds = {
        jax.tree_util.keystr(path): leaf.sharding.memory_kind if leaf.sharding else "device"
        for path, leaf in jax.tree_util.tree_leaves_with_path((trainable, opt_state))
    }
    assert kinds["[0]['embed']"] == "pinned_host"
    assert kinds["[0]['lm_head']"] == "device"
    assert {k for k, v in kinds.items() if k.startswith("[1]")} and all(
        v == "pinned_host" for k, v in kinds.items() if k.startswith("[1]")
    )
    assert arguments_on_host(config) == ("optimizer_state", "embed")
    again = place_abstract(config, trainable, opt_state, frozen)
    assert jax.tree.structure(again) == jax.tree.structure((trainable, opt_state, frozen))


def _module(config):
    step, arguments = abstract_step_arguments(config, UNTIED)
    return lower_for_gpu(step, *arguments).compiler_ir("stablehlo")


@pytest.mark.parametrize(
    ("method", "settings"),
    [("qlora", HOST_SETTINGS), ("full", ("residuals", "optimizer_state", "embed"))],
    ids=["qlora-all", "full-all"],
)
def test_removing_any_move_to_the_device_from_a_host_path_breaks_the_rules(method, settings):
    """The negative control: in the step with every host placement, each move of a host value
    to the device (slices of the base, of the saved residuals, of the optimizer state, chunks of
    the embedding table) is removed in turn, and the rules check must then fail."""
    text = str(_module(_config(method, settings)))
    context = _module(_config(method, ())).context
    count = len(moves_to_device_of_host_values(ir.Module.parse(text, context)))
    assert count >= 4  # base, residuals, optimizer state, embedding (at least one each)
    for index in range(count):
        broken = ir.Module.parse(text, context)
        move = moves_to_device_of_host_values(broken)[index]
        move.results[0].replace_all_uses_with(move.operands[0])
        move.erase()
        assert violations_in(broken), f"removing move {index} ({move.location}) went unnoticed"


@NEEDS_GPU_COMPILER
@pytest.mark.parametrize(
    ("method", "settings"),
    [
        ("qlora", ("residuals",)),
        ("qlora", ("embed",)),
        ("qlora", ("optimizer_state",)),
        ("qlora", ("base",)),
        ("qlora", HOST_SETTINGS),
        ("lora", HOST_SETTINGS),
        ("full", ("residuals", "optimizer_state", "embed")),
    ],
    ids=lambda v: "+".join(v) if isinstance(v, tuple) else v,
)
def test_xla_gpu_compiler_compiles_host_placements_as_they_run(method, settings):
    """XLA's GPU compiler for an H100, deviceless, with the host arguments in host memory: its
    host-offload pass accepts the program and reports the host bytes itself."""
    # blockwise attention named: the H100's cuDNN kernel cannot be compiled without its library
    config = _config(method, settings, memory={"attention": "blockwise"})
    measured = measure_for_target(config, UNTIED, "h100")
    assert measured.compiled, measured.derived
    if arguments_on_host(_config(method, settings)):
        assert measured.host_argument_bytes > 0
    assert measured.device_bytes > 0


@pytest.mark.parametrize(
    ("method", "objective"), [("qlora", "dpo"), ("qlora", "orpo"), ("lora", "dpo")]
)
def test_preference_steps_with_every_host_placement_keep_the_rules(method, objective):
    """DPO's reference forward and the per-token weights add no host compute or undeclared
    host output (lowered for CUDA, the same walk as SFT's steps)."""
    config = _config(method, tuple(HOST_SETTINGS), objective=objective)
    assert _violations(config) == []
