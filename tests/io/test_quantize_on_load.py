"""`load_model(path, quantize="nf4")`: the linear weights of the blocks become NF4 tensor by tensor,
the rest stays dense (unless `quantize_head`), the model computes what its dequantized weights
compute, and no full-precision copy of the blocks is ever on the device -- on tiny Hugging Face
checkpoints written here and on the real SmolLM2-135M GGUF."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from featherweight.errors import QuantizationError
from featherweight.io import loader
from featherweight.io.loader import load_model, params_nbytes
from featherweight.io.names import hf_name
from featherweight.models.linear import LINEAR_NAMES
from featherweight.models.llama import forward
from featherweight.models.shapes import layer_shapes, parameter_count, top_level_shapes
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, nf4_nbytes
from tests.conftest import tiny_config

SIZES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=256,
    num_layers=4,
)


def write_checkpoint(directory, config, seed=0):
    """A float32 Hugging Face directory with random weights (norms near 1) for `config`."""
    rng = np.random.default_rng(seed)

    def tensor(name, shape):
        if name.endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)

    tensors = {
        hf_name((n, None), config): tensor(n, s) for n, s in top_level_shapes(config).items()
    }
    for layer in range(config.num_layers):
        for name, shape in layer_shapes(config).items():
            tensors[hf_name((name, layer), config)] = tensor(name, shape)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return directory


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    config = tiny_config(**SIZES, tie_word_embeddings=request.param)
    return write_checkpoint(tmp_path_factory.mktemp("nf4-load"), config), config


class QuantizeCalls:
    """Wraps the loader's `quantize_nf4`: what each call is given, and the device bytes alive
    (beyond those before the load) when it is made."""

    def __init__(self, monkeypatch):
        self.baseline = live_device_bytes()
        self.calls: list[tuple[type, tuple[int, ...], int]] = []
        quantize = loader.quantize_nf4

        def tracked(values, *args, **kwargs):
            added = live_device_bytes() - self.baseline
            self.calls.append((type(values), np.shape(values), added))
            return quantize(values, *args, **kwargs)

        monkeypatch.setattr(loader, "quantize_nf4", tracked)

    @property
    def peak_added(self) -> int:
        return max(added for *_, added in self.calls)


def live_device_bytes() -> int:
    return sum(array.nbytes for array in jax.live_arrays())


def full_precision_blocks_bytes(config) -> int:
    """The linear weights of all blocks in float32: what quantize-on-load must never hold."""
    shapes = [s for n, s in layer_shapes(config).items() if n in LINEAR_NAMES]
    return 4 * config.num_layers * sum(math.prod(s) for s in shapes)


def dequantized(params):
    return jax.tree.map(
        lambda leaf: dequantize_nf4(leaf) if isinstance(leaf, NF4Tensor) else leaf,
        params,
        is_leaf=lambda leaf: isinstance(leaf, NF4Tensor),
    )


@functools.partial(jax.jit, static_argnames="config")
def logits(params, token_ids, config):
    return forward(params, token_ids, config)


def assert_layout(params, config, quantize_head: bool):
    layers = params["layers"]
    for name in LINEAR_NAMES:
        assert isinstance(layers[name], NF4Tensor), name
        assert layers[name].stack_shape == (config.num_layers,)
        assert layers[name].shape == layer_shapes(config)[name]
    for name in ("attn_norm", "mlp_norm"):
        assert isinstance(layers[name], jax.Array) and layers[name].shape[0] == config.num_layers
    assert isinstance(params["final_norm"], jax.Array)
    head = "embed" if config.tie_word_embeddings else "lm_head"
    assert isinstance(params[head], NF4Tensor) == quantize_head
    if not config.tie_word_embeddings:
        assert isinstance(params["embed"], jax.Array)


@pytest.mark.parametrize("quantize_head", [False, True], ids=["dense-head", "nf4-head"])
def test_nf4_model_computes_what_its_dequantized_weights_compute(checkpoint, quantize_head):
    directory, config = checkpoint
    model = load_model(directory, dtype="float32", quantize="nf4", quantize_head=quantize_head)
    assert_layout(model.params, config, quantize_head)
    token_ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 12)))
    got = logits(model.params, token_ids, config)
    reference = logits(dequantized(model.params), token_ids, config)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), rtol=0, atol=1e-4)
    dense = logits(load_model(directory, dtype="float32").params, token_ids, config)
    assert not np.allclose(np.asarray(got), np.asarray(dense), atol=1e-3)  # it is quantized


def test_bfloat16_load_keeps_dense_tensors_in_the_compute_dtype(checkpoint):
    directory, _ = checkpoint
    params = load_model(directory, dtype="bfloat16", quantize="nf4").params
    assert params["embed"].dtype == jnp.bfloat16
    assert params["layers"]["attn_norm"].dtype == jnp.bfloat16
    assert params["layers"]["q"].codes.dtype == jnp.uint8


def test_load_quantizes_host_tensors_one_at_a_time(checkpoint, monkeypatch):
    """Every quantization gets one layer's tensor from host memory, and the device never holds
    more than the final (mostly NF4) parameters -- far below the blocks in full precision."""
    directory, config = checkpoint
    tracker = QuantizeCalls(monkeypatch)
    model = load_model(directory, dtype="float32", quantize="nf4")
    jax.block_until_ready(model.params)
    per_layer = layer_shapes(config)
    assert [shape for _, shape, _ in tracker.calls] == [
        per_layer[name]
        for name in per_layer
        if name in LINEAR_NAMES
        for _ in range(config.num_layers)
    ]
    assert all(kind is np.ndarray for kind, _, _ in tracker.calls)
    final = params_nbytes(model.params)
    assert tracker.peak_added <= final < full_precision_blocks_bytes(config)


def test_real_model_loads_as_nf4_without_a_full_precision_copy(demo_gguf, monkeypatch):
    tracker = QuantizeCalls(monkeypatch)
    model = load_model(demo_gguf, dtype="bfloat16", quantize="nf4")
    jax.block_until_ready(model.params)
    config = model.config
    assert_layout(model.params, config, quantize_head=False)
    assert len(tracker.calls) == config.num_layers * len(LINEAR_NAMES)
    blocks = {name: model.params["layers"][name] for name in LINEAR_NAMES}
    nf4_blocks = sum(tensor.nbytes for tensor in blocks.values())
    bf16_blocks = full_precision_blocks_bytes(config) // 2
    assert nf4_blocks == sum(
        config.num_layers * nf4_nbytes(math.prod(tensor.shape)) for tensor in blocks.values()
    )
    total, bf16_total = params_nbytes(model.params), 2 * parameter_count(config)
    print(
        f"SmolLM2-135M blocks: NF4 {nf4_blocks / 2**20:.1f} MiB vs bf16 {bf16_blocks / 2**20:.1f} "
        f"MiB ({nf4_blocks / (bf16_blocks / 2):.4f} bytes/weight); whole model {total / 2**20:.1f} "
        f"MiB vs {bf16_total / 2**20:.1f} MiB; load peak +{tracker.peak_added / 2**20:.1f} MiB"
    )
    assert nf4_blocks / (bf16_blocks / 2) <= 0.52
    assert tracker.peak_added <= total < bf16_total


def test_indivisible_linear_weight_is_refused_naming_it(tmp_path):
    config = tiny_config(hidden_size=20, num_heads=2, num_kv_heads=2, head_dim=10)  # q: 400 values
    directory = write_checkpoint(tmp_path, config)
    with pytest.raises(QuantizationError, match=r"layer 0 q of shape \(20, 20\).*block size 64"):
        load_model(directory, quantize="nf4")


def test_tied_table_with_partial_row_blocks_is_refused(tmp_path):
    config = tiny_config(
        hidden_size=96, num_heads=2, num_kv_heads=2, head_dim=48, tie_word_embeddings=True
    )
    directory = write_checkpoint(tmp_path, config)
    with pytest.raises(QuantizationError, match=r"tied embedding table \(256, 96\)"):
        load_model(directory, quantize="nf4", quantize_head=True)
    assert isinstance(load_model(directory, quantize="nf4").params["embed"], jax.Array)


def device_resident_bytes() -> int:
    """Bytes of the live arrays in device memory (pinned host arrays left out)."""
    return sum(
        array.nbytes for array in jax.live_arrays() if array.sharding.memory_kind != "pinned_host"
    )


@pytest.mark.parametrize("quantize", [None, "nf4"], ids=["dense", "nf4"])
def test_a_base_loaded_into_host_memory_never_reaches_the_device(checkpoint, monkeypatch, quantize):
    """`layers_on_host` (memory.base: host): every layer stack is in pinned host memory, equal to
    the device load value for value, and while loading the device held at most the dense top
    tensors and one layer being quantized -- never a stack (negative control: the device load
    holds them all)."""
    directory, config = checkpoint
    on_device = load_model(directory, dtype="float32", quantize=quantize).params
    baseline = device_resident_bytes()
    peaks = []
    read = loader.check_finite

    def tracked(values, *args):
        peaks.append(device_resident_bytes() - baseline)
        return read(values, *args)

    monkeypatch.setattr(loader, "check_finite", tracked)
    on_host = load_model(directory, dtype="float32", quantize=quantize, layers_on_host=True).params
    peaks.append(device_resident_bytes() - baseline)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(on_host["layers"])}
    assert kinds == {"pinned_host"}
    assert all(
        leaf.sharding.memory_kind == "device" for k, leaf in on_host.items() if k != "layers"
    )
    for expected, actual in zip(jax.tree.leaves(on_device), jax.tree.leaves(on_host), strict=True):
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))
    top = sum(leaf.nbytes for name, leaf in on_host.items() if name != "layers")
    one_layer = 4 * max(math.prod(shape) for shape in layer_shapes(config).values())
    assert max(peaks) <= top + one_layer
    stacks = sum(leaf.nbytes for leaf in jax.tree.leaves(on_device["layers"]))
    assert stacks > one_layer  # the device load holds every stack on the device
