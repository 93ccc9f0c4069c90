"""The LoRA and QLoRA train steps hold the frozen base once and nothing of its size besides.

Read from XLA after compiling the jitted, donated reference step on abstract shapes: totals from
`memory_analysis()` (temp + argument + output - alias; on CPU its peak leaves temps out), and
every buffer from the buffer assignment XLA dumps. A zero (or any) gradient of a frozen weight, or
a dequantized copy of a whole NF4 stack, would be a buffer of shape [L, out, in] outside the
parameters; the check finds none in our steps and finds them in a step that differentiates the
frozen base.

Float32 bases: XLA:CPU cannot slice bf16 inside a loop and converts every bf16 stack a scan reads
to a float32 copy before the loop (a CPU-backend artifact, absent on GPU), so a bf16 LoRA total on
CPU measures the backend, not the step. In float32 the QLoRA criterion is the issue's one with a
larger margin to meet: (f32 - NF4) base bytes exceed (bf16 - NF4).
"""

import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest

from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig
from featherweight.models.linear import LINEAR_NAMES, Params
from featherweight.models.shapes import abstract_params, layer_shapes
from featherweight.peft.lora import LoraConfig, abstract_lora, quantize_frozen_base
from featherweight.step.reference import build_reference_step, model_loss
from tests.conftest import tiny_config

CONFIG = tiny_config(
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=384,  # [V, D] differs from every layer weight's shape
    num_layers=16,
)
LORA = LoraConfig(rank=4, alpha=8)
BATCH, SEQ = 1, 64
OPTIMIZER = optax.adamw(1e-3)
SLACK = 1.15


def nbytes(tree) -> int:
    return sum(
        math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
    )


def activation_bytes(config: ModelConfig, compute_bytes: int) -> int:
    """What a layer-by-layer rematerialized step holds besides weights and adapter state.

    The saved residual stream (each layer's input); one layer's working set, recomputed in the
    backward pass: its dense linear weights in the compute dtype (a slice of the stack, or
    dequantized from NF4), its projections (q, k, v, attention output, two normed inputs, gate, up
    and their product) and attention scores and probabilities, each with its cotangent; and the
    float32 logits with their gradient.
    """
    tokens = BATCH * SEQ
    residual = config.num_layers * tokens * config.hidden_size * compute_bytes
    weights = sum(math.prod(s) for n, s in layer_shapes(config).items() if n in LINEAR_NAMES)
    widths = 2 * config.q_size + 2 * config.kv_size + 2 * config.hidden_size
    projections = tokens * (widths + 3 * config.intermediate_size) * compute_bytes
    attention = 2 * BATCH * config.num_heads * SEQ * SEQ * 4
    logits = 2 * tokens * config.vocab_size * 4
    return residual + weights * compute_bytes + 2 * (projections + attention) + logits


def abstract_args(frozen: Params):
    """(trainable, opt_state, frozen, batch, key) as shapes: compile without allocating."""
    adapters = abstract_lora(CONFIG, LORA)
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    batch = Batch(ids, ids, jax.ShapeDtypeStruct((BATCH, SEQ), jnp.float32), ids, None)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    return adapters, jax.eval_shape(OPTIMIZER.init, adapters), frozen, batch, key


def dense_base(dtype) -> Params:
    return abstract_params(CONFIG, dtype)


def quantized_base(dtype) -> Params:
    return jax.eval_shape(quantize_frozen_base, abstract_params(CONFIG, dtype))


class Compiled:
    """A compiled step's memory numbers and its buffers outside the parameters."""

    def __init__(self, jitted, args, dump_dir):
        compiled = jitted.lower(*args).compile(compiler_options={"xla_dump_to": str(dump_dir)})
        self.stats = compiled.memory_analysis()
        (assignment,) = dump_dir.glob("*buffer-assignment.txt")
        self.buffers = non_parameter_buffers(assignment.read_text())

    @property
    def total(self) -> int:
        s = self.stats
        return (
            s.temp_size_in_bytes
            + s.argument_size_in_bytes
            + s.output_size_in_bytes
            - s.alias_size_in_bytes
        )

    def buffers_shaped(self, shapes) -> list[tuple[str, str, tuple[int, ...]]]:
        return [buffer for buffer in self.buffers if buffer[2] in shapes]


_VALUE = re.compile(r" value: <\d+ (\S+) @\S+> \(size=\d+,offset=\d+\): (\w+)\[([\d,]*)\]")


def non_parameter_buffers(assignment: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every array XLA places in a temp or output allocation.

    Values in a parameter's allocation are the parameter itself (or a view of it, or an output
    written in place over a donated one).
    """
    buffers, in_parameter = [], False
    for line in assignment.splitlines():
        if line.startswith("allocation"):
            in_parameter = "parameter" in line
            continue
        match = _VALUE.match(line)
        if match and not in_parameter:
            shape = tuple(int(size) for size in match.group(3).split(",") if size)
            buffers.append((match.group(1), match.group(2), shape))
    return buffers


FROZEN_STACKS = {(CONFIG.num_layers, *layer_shapes(CONFIG)[name]) for name in LINEAR_NAMES}
FROZEN_TABLES = {(CONFIG.vocab_size, CONFIG.hidden_size)}  # embed and lm_head


def wrong_step(trainable, opt_state, frozen, batch, key):
    """Differentiates the frozen base too (and reports the global gradient norm, so its
    gradients are really built): what a step without the frozen/trainable split does."""
    loss, (grads, frozen_grads) = jax.value_and_grad(model_loss, argnums=(0, 1))(
        trainable, frozen, batch, CONFIG, LORA.spec, key
    )
    updates, opt_state = OPTIMIZER.update(grads, opt_state, trainable)
    norm = optax.global_norm((grads, frozen_grads))
    return optax.apply_updates(trainable, updates), opt_state, {"loss": loss, "norm": norm}


@pytest.fixture(scope="module")
def compile_step(tmp_path_factory):
    def compile_one(name: str, frozen: Params, jitted=None) -> Compiled:
        step = jitted or build_reference_step(CONFIG, OPTIMIZER, lora=LORA.spec)
        return Compiled(step, abstract_args(frozen), tmp_path_factory.mktemp(name))

    return compile_one


@pytest.fixture(scope="module")
def lora_f32(compile_step):
    return compile_step("lora", dense_base(jnp.float32))


@pytest.fixture(scope="module")
def qlora_f32(compile_step):
    return compile_step("qlora", quantized_base(jnp.float32))


def adapter_state_bytes() -> int:
    """Adapters, their gradients and their AdamW state."""
    adapters, opt_state, *_ = abstract_args(dense_base(jnp.float32))
    return 2 * nbytes(adapters) + nbytes(opt_state)


def test_tiny_model_base_is_over_20x_the_adapters():
    assert nbytes(dense_base(jnp.float32)) >= 20 * nbytes(abstract_lora(CONFIG, LORA))


def test_lora_step_holds_no_buffer_shaped_like_a_frozen_weight(lora_f32):
    assert lora_f32.buffers_shaped(FROZEN_STACKS | FROZEN_TABLES) == []


def test_the_check_catches_a_step_that_differentiates_the_frozen_base(compile_step, lora_f32):
    wrong = compile_step(
        "wrong", dense_base(jnp.float32), jax.jit(wrong_step, donate_argnums=(0, 1))
    )
    found = {buffer[2] for buffer in wrong.buffers_shaped(FROZEN_STACKS | FROZEN_TABLES)}
    assert found == FROZEN_STACKS | FROZEN_TABLES
    bound = SLACK * (
        nbytes(dense_base(jnp.float32)) + adapter_state_bytes() + activation_bytes(CONFIG, 4)
    )
    assert wrong.total > bound >= lora_f32.total


def test_lora_step_total_is_base_plus_adapter_state_plus_activations(lora_f32):
    base = nbytes(dense_base(jnp.float32))
    parts = base + adapter_state_bytes() + activation_bytes(CONFIG, 4)
    print(f"LoRA f32 step: total {lora_f32.total:,} B = {lora_f32.total / parts:.3f} x parts")
    assert lora_f32.total <= SLACK * parts
    adapters, opt_state, *_ = abstract_args(dense_base(jnp.float32))
    # donation worked: the new adapters and optimizer state overwrite the old ones
    assert lora_f32.stats.alias_size_in_bytes == nbytes(adapters) + nbytes(opt_state)


def test_qlora_step_never_dequantizes_a_whole_stack(qlora_f32):
    assert qlora_f32.buffers_shaped(FROZEN_STACKS) == []


def test_qlora_step_total_and_saving_over_lora(lora_f32, qlora_f32):
    base = nbytes(dense_base(jnp.float32))
    quantized = nbytes(quantized_base(jnp.float32))
    parts = quantized + adapter_state_bytes() + activation_bytes(CONFIG, 4)
    saving = lora_f32.total - qlora_f32.total
    print(
        f"QLoRA f32-compute step: total {qlora_f32.total:,} B = {qlora_f32.total / parts:.3f} x "
        f"parts; saves {saving:,} B vs LoRA, base bytes differ by {base - quantized:,}"
    )
    assert qlora_f32.total <= SLACK * parts
    assert saving >= 0.9 * (base - quantized)
