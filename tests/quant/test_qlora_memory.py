"""QLoRA dequantizes one layer at a time: XLA does not hoist the dequantization of the NF4 stack
out of the scanned blocks into a dense copy of the whole base.

The jitted forward + backward of a QLoRA model (NF4 base of 12 stacked layers, bf16 compute, one
trainable LoRA adapter on q, the project's loss with rematerialized blocks) is compiled on abstract
shapes and read from XLA: `memory_analysis()` for temp bytes, the optimized HLO for array shapes.
The same gradient written to dequantize the whole stack up front is compiled beside it, so the
bound is shown to fail on the build it rules out. The batch is tiny so that weights dominate.
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest

from featherweight.models.batch import Batch
from featherweight.models.linear import LINEAR_NAMES, LoraSpec, Params
from featherweight.models.shapes import abstract_params, layer_shapes
from featherweight.quant.nf4 import dequantize_nf4, quantize_nf4
from featherweight.step.reference import model_loss
from tests.conftest import tiny_config

CONFIG = tiny_config(
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=128,
    num_layers=12,
)
COMPUTE = jnp.bfloat16
BATCH, SEQ, RANK = 1, 8, 4
LORA = LoraSpec(scale=2.0)
DEQUANTIZED_LAYERS_ALLOWED = 3


def nbytes(tree) -> int:
    return sum(
        math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
    )


def nf4_base(params: Params) -> Params:
    layers = dict(params["layers"])
    for name in LINEAR_NAMES:
        layers[name] = quantize_nf4(layers[name], stack_axes=1, name=name)
    return {**params, "layers": layers}


FROZEN = jax.eval_shape(nf4_base, abstract_params(CONFIG, COMPUTE))
TRAINABLE = {
    "layers": {
        "lora": {
            "q": {
                "a": jax.ShapeDtypeStruct((CONFIG.num_layers, RANK, CONFIG.hidden_size), COMPUTE),
                "b": jax.ShapeDtypeStruct((CONFIG.num_layers, CONFIG.q_size, RANK), COMPUTE),
            }
        }
    }
}
IDS = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
BATCH_SHAPES = Batch(IDS, IDS, jax.ShapeDtypeStruct((BATCH, SEQ), jnp.float32), IDS, None)

LINEAR_SHAPES = [shape for name, shape in layer_shapes(CONFIG).items() if name in LINEAR_NAMES]
LAYER_DEQUANTIZED_BYTES = sum(math.prod(s) for s in LINEAR_SHAPES) * jnp.dtype(COMPUTE).itemsize
LARGEST_LINEAR = max(math.prod(s) for s in LINEAR_SHAPES)


def activation_bytes() -> int:
    """Saved residual stream, one layer's activations with cotangents, logits and their gradient:
    generous for B=1, S=8, and still under one layer's dequantized weights."""
    tokens = BATCH * SEQ
    residual = (CONFIG.num_layers + 1) * tokens * CONFIG.hidden_size * 4
    layer = 2 * tokens * (4 * CONFIG.hidden_size + 3 * CONFIG.intermediate_size) * 4
    logits = 2 * tokens * CONFIG.vocab_size * 4
    return residual + layer + logits


def qlora_grad(trainable, frozen, batch, remat=True):
    return jax.value_and_grad(model_loss)(trainable, frozen, batch, CONFIG, LORA, remat=remat)


def hoisted_grad(trainable, frozen, batch):
    """The same gradient with every stack dequantized before the layers run: what a hoisting XLA
    (or a careless model) would build."""
    layers = dict(frozen["layers"])
    for name in LINEAR_NAMES:
        layers[name] = dequantize_nf4(layers[name], COMPUTE)
    return qlora_grad(trainable, {**frozen, "layers": layers}, batch)


class Compiled:
    def __init__(self, fn):
        compiled = jax.jit(fn).lower(TRAINABLE, FROZEN, BATCH_SHAPES).compile()
        self.stats = compiled.memory_analysis()
        self.hlo = compiled.as_text()

    @property
    def temp(self) -> int:
        return self.stats.temp_size_in_bytes

    def largest_float_array(self) -> int:
        """Elements of the largest float array the optimized program names."""
        shapes = re.findall(r"\b(?:f32|bf16)\[([\d,]+)\]", self.hlo)
        return max(math.prod(int(d) for d in shape.split(",")) for shape in shapes)


@pytest.fixture(scope="module")
def scanned():
    return Compiled(qlora_grad)


@pytest.fixture(scope="module")
def hoisted():
    return Compiled(hoisted_grad)


def bound() -> int:
    return DEQUANTIZED_LAYERS_ALLOWED * LAYER_DEQUANTIZED_BYTES + activation_bytes()


def test_base_is_mostly_weights():
    """The setting where hoisting would show: the NF4 base is over 10x the activations allowance,
    and the whole stack dequantized is over 3x the bound."""
    assert nbytes(FROZEN["layers"]) > 10 * activation_bytes()
    assert CONFIG.num_layers * LAYER_DEQUANTIZED_BYTES > 3 * bound()


def test_qlora_step_holds_at_most_three_layers_dequantized(scanned):
    print(
        f"QLoRA grad: temp {scanned.temp:,} B = {scanned.temp / LAYER_DEQUANTIZED_BYTES:.2f} "
        f"dequantized layers; arguments {scanned.stats.argument_size_in_bytes:,} B "
        f"(NF4 base {nbytes(FROZEN['layers']):,} B)"
    )
    assert scanned.temp <= bound()
    peak = scanned.stats.argument_size_in_bytes + scanned.temp
    assert peak <= nbytes(FROZEN) + nbytes(TRAINABLE) + bound()


def test_hoisted_dequantization_breaks_the_bound(hoisted):
    print(f"hoisted: temp {hoisted.temp:,} B = {hoisted.temp / LAYER_DEQUANTIZED_BYTES:.2f} layers")
    assert hoisted.temp > CONFIG.num_layers * LAYER_DEQUANTIZED_BYTES > bound()


def test_no_dense_stack_in_the_program(scanned, hoisted):
    """The compiled program never names a float array larger than one linear weight; the hoisted
    one names the dense stacks."""
    assert scanned.largest_float_array() <= LARGEST_LINEAR
    assert hoisted.largest_float_array() >= CONFIG.num_layers * LARGEST_LINEAR


def test_without_remat_the_backward_pass_keeps_every_layer_dequantized():
    """Why the blocks must be rematerialized under QLoRA: otherwise the scan saves each layer's
    dequantized weights for the backward pass, a dense copy of the whole base."""
    unrematerialized = Compiled(lambda *args: qlora_grad(*args, remat=False))
    print(f"no remat: temp {unrematerialized.temp / LAYER_DEQUANTIZED_BYTES:.2f} layers")
    assert unrematerialized.temp > CONFIG.num_layers * LAYER_DEQUANTIZED_BYTES
