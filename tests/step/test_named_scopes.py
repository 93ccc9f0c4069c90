"""The step's stages carry stable `jax.named_scope` names in the program's op_name metadata, which
a profile maps back to featherweight's own work (`benchmarks/gpu_profile.py`), and the scopes are
metadata only: the compiled step's memory is the same without them."""

import contextlib
import re

import jax
import pytest

from featherweight.memory.measure import abstract_step_arguments
from featherweight.parallel.offload_rules import lower_for_gpu
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config

# what each names: NF4 -> dense; RMSNorm; RoPE; an adapter's B A x; the attention core; the MLP's
# projections; one loss chunk (final norm, head, cross-entropy); a layer's optimizer update in the
# backward pass; a layer's saved input / frozen slice brought back; a layer's input stored
SCOPES = (
    "nf4_dequantize", "rms_norm", "rotary", "lora", "attention", "mlp", "loss_chunk",
    "layer_update", "layer_fetch", "layer_store",
)  # fmt: skip


def _qlora_step(residuals: str = "device"):
    """A tiny streamed QLoRA step (abstract arguments) with loss and MLP chunks."""
    memory = {"loss_chunk": 32, "mlp_chunk": 32, "residuals": residuals}
    config = parse_config(
        {"method": "qlora", "batch_size": 2, "data": {"seq_len": 64}, "memory": memory}
    )
    return abstract_step_arguments(config, tiny_config())


def _scopes_in(text: str) -> set[str]:
    """The scope names that appear as a component of some op's name (`.../rms_norm/mul`, `"rms_norm/mul"` at the top of a function, or
    wrapped by a transformation: `transpose(jvp(rms_norm))`)."""
    return {scope for scope in SCOPES if re.search(rf"[/(\"]{scope}[/)]", text)}


def test_every_stage_scope_names_ops_of_the_streamed_qlora_step():
    # lowered for CUDA (no GPU needed): XLA:CPU has one memory, so a host-stored residual is no
    # move there and `layer_store` would name nothing
    step, arguments = _qlora_step(residuals="host")
    text = lower_for_gpu(step, *arguments).as_text(debug_info=True)
    assert _scopes_in(text) == set(SCOPES)


@contextlib.contextmanager
def _no_scope(name: str):
    """`jax.named_scope` that names nothing (usable as a decorator too, as the step uses it)."""
    yield


def _compiled(step, arguments):
    jax.clear_caches()  # a nested jit's traced body (dequantize_nf4) keeps the scopes it saw
    return step.lower(*arguments).compile()


def test_scopes_are_metadata_only_the_compiled_steps_memory_is_unchanged(monkeypatch):
    step, arguments = _qlora_step()
    scoped = _compiled(step, arguments)
    with monkeypatch.context() as patch:
        patch.setattr(jax, "named_scope", _no_scope)
        step, arguments = _qlora_step()
        plain = _compiled(step, arguments)
    assert _scopes_in(scoped.as_text()) >= set(SCOPES) - {"layer_store"}
    assert _scopes_in(plain.as_text()) == set()  # the scopes were really off
    fields = ("temp", "argument", "output", "alias", "generated_code")
    scoped_memory, plain_memory = scoped.memory_analysis(), plain.memory_analysis()
    for field in fields:
        name = f"{field}_size_in_bytes"
        assert getattr(scoped_memory, name) == pytest.approx(getattr(plain_memory, name)), field
