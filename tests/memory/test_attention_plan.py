"""The planner plans the attention the step calls: the implementation resolved from the config,
its bytes against the compiled attention, and the whole step's temporaries against the compiled
step for each implementation that runs on CPU (XLA:CPU, float32)."""

import jax
import jax.numpy as jnp
import pytest

from featherweight.errors import StepConfigError
from featherweight.memory.defaults import resolve
from featherweight.memory.device_plan import plan_one_device
from featherweight.memory.measure import measure_compiled
from featherweight.memory.working_set import StepShapes, attention_of, raw_terms
from featherweight.models.attention import AttentionTarget, attend
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config

MODEL = tiny_config(max_position_embeddings=4096)
# the planner's accuracy on temporaries (tests/memory/test_calibration.py: held-out worst case)
TEMP_WORST = 0.5


def _config(attention: str, seq: int, batch: int = 1):
    settings = {
        "method": "lora",
        "batch_size": batch,
        "model": {"dtype": "float32"},
        "data": {"seq_len": seq},
        "memory": {"attention": attention},
    }
    return resolve(parse_config(settings), MODEL)  # the chunks the trainer would choose


def _planned_attention(config) -> int:
    terms = raw_terms(config, MODEL)
    return terms["attention_scores"] + terms["attention_blockwise"]


def _compiled_attention(implementation: str, seq: int, batch: int = 1) -> int:
    """XLA:CPU temp of the attention's forward and backward as the step calls it (float32, segment
    ids), less the two [B, S, H, h] buffers this harness adds around it (the output and the
    cotangent of its sum: the step's activations term owns those)."""
    q = jax.ShapeDtypeStruct((batch, seq, MODEL.num_heads, MODEL.head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, seq, MODEL.num_kv_heads, MODEL.head_dim), jnp.float32)
    segments = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def loss(q, k, v, segments):
        return jnp.sum(attend(q, k, v, segments, implementation))

    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    temp = grad.lower(q, kv, kv, segments).compile().memory_analysis().temp_size_in_bytes
    return temp - 2 * batch * seq * MODEL.num_heads * MODEL.head_dim * 4


def test_auto_is_resolved_for_the_device_and_written_into_the_plan():
    config = _config("auto", 64)
    assert attention_of(config, MODEL) == "blockwise"  # this machine is a CPU
    assert plan_one_device(config, MODEL).settings["attention"] == "blockwise"
    assert attention_of(config, MODEL, AttentionTarget("gpu", "9.0")) == "blockwise"  # packed rows
    with pytest.raises(StepConfigError, match="NVIDIA GPU"):
        plan_one_device(_config("cudnn", 64), MODEL)


@pytest.mark.parametrize("seq", [1024, 2048])
def test_planned_blockwise_bytes_match_its_compiled_attention(seq):
    planned = _planned_attention(_config("blockwise", seq))
    compiled = _compiled_attention("blockwise", seq)
    assert abs(planned / compiled - 1) < 0.05
    # negative control: the materialized path's bytes are far from the blockwise plan
    assert _compiled_attention("materialized", seq) > 3 * planned


@pytest.mark.parametrize("attention", ["blockwise", "materialized"])
def test_the_plan_of_each_implementation_matches_its_compiled_step(attention):
    config, seq = _config(attention, 2048), 2048
    other = "materialized" if attention == "blockwise" else "blockwise"
    measured = measure_compiled(config, MODEL).temp_bytes

    def planned_temp(name):
        return plan_one_device(_config(name, seq), MODEL).measured_groups()["temporaries"]

    def miss(planned):  # how far off, either way: 0.5 = 1.5 times too many or too few bytes
        return max(planned / measured, measured / planned) - 1

    assert miss(planned_temp(attention)) < TEMP_WORST
    # negative control: planning the other implementation misses the compiled step by far more
    assert miss(planned_temp(other)) > 4 * TEMP_WORST
    assert StepShapes(config, MODEL).attention == attention
