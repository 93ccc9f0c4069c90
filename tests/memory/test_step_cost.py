"""The step's matmul FLOPs from the shapes (`step_flops`, what the budget search weighs) equal the
FLOPs counted in the compiled program's optimized HLO, setting by setting; host transfers follow
the placements."""

import math
import re

import jax
import pytest

from featherweight.memory import step_cost
from featherweight.memory.defaults import resolve
from featherweight.memory.measure import abstract_step_arguments
from featherweight.memory.state_bytes import host_base_bytes
from featherweight.memory.step_cost import (
    ACCELERATOR_RATES,
    CPU_RATES,
    blockwise_attention_seconds,
    dequantization_seconds,
    head_matmul_bytes,
    hlo_dot_flops,
    hlo_dot_operand_bytes,
    host_base_estimate,
    host_transfer_bytes,
    layer_weight_bytes,
    step_flops,
    step_seconds,
)
from featherweight.memory.targets import DEVICELESS_COMPILER_OPTIONS, target_mesh
from featherweight.models.registry import builtin_config
from featherweight.models.shapes import layer_shapes
from featherweight.parallel.backend import cuda_plugin_installed
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config

BATCH, SEQ = 2, 32
MODEL = tiny_config(vocab_size=512)


def _config(method: str, **memory):
    settings = {"method": method, "batch_size": BATCH, "data": {"seq_len": SEQ}, "memory": memory}
    return resolve(parse_config(settings), MODEL)  # the chunks the trainer would choose


@pytest.mark.parametrize(
    ("method", "memory"),
    [
        ("lora", {}),
        ("full", {}),
        ("qlora", {}),
        ("lora", {"loss_chunk": 8, "vocab_chunk": 128}),
        ("lora", {"mlp_chunk": 16}),
        ("full", {"vocab_chunk": 200}),
        ("lora", {"save": ["qkv", "attention", "mlp_hidden"]}),
        ("qlora", {"save": ["attention"]}),
        ("full", {"save": ["qkv", "attention", "mlp_hidden"]}),
        ("qlora", {"save": ["qkv", "attention", "mlp_hidden", "dequantized"]}),
    ],
    ids=[
        "lora",
        "full",
        "qlora",
        "lora-vocab-chunk",
        "lora-mlp-chunk",
        "full-overlapping-chunk",
        "lora-keep-all",
        "qlora-keep-attention",
        "full-keep-all",
        "qlora-keep-all-and-dequantized",
    ],
)
def test_step_flops_from_the_shapes_equal_the_compiled_programs(method, memory):
    config = _config(method, **memory)
    step, arguments = abstract_step_arguments(config, MODEL)
    assert step_flops(config, MODEL).total == hlo_dot_flops(step.lower(*arguments).compile())


@pytest.mark.skipif(
    not cuda_plugin_installed(),
    reason='XLA\'s GPU compiler is not installed (pip install "jax[cuda12-local]")',
)
@pytest.mark.parametrize("triton_gemm", [True, False], ids=["triton-gemm", "cublas"])
def test_the_counter_reads_the_gpu_compilers_matmuls(triton_gemm):
    # XLA's GPU compiler (deviceless, for an H100) turns the step's dots into Triton gemm fusions
    # (a dot inside a fused computation) or, with Triton gemms off -- as its autotuner may choose
    # on a GPU -- into cuBLAS custom calls whose dimension numbers sit in the backend config
    mesh = target_mesh("h100")
    settings = {"method": "qlora", "batch_size": BATCH, "data": {"seq_len": 64}}
    config = resolve(parse_config(settings), MODEL, mesh)
    step, arguments = abstract_step_arguments(config, MODEL, mesh)
    options = {**DEVICELESS_COMPILER_OPTIONS, "xla_gpu_enable_triton_gemm": triton_gemm}
    compiled = step.lower(*arguments).compile(options)
    text = compiled.as_text()
    assert ("__cublas$" in text) != triton_gemm and (" dot(" in text) == triton_gemm
    assert hlo_dot_flops(compiled) == step_flops(config, MODEL).total


# the head's settings, against the whole head and sequence; float32: XLA:CPU computes a bfloat16
# matmul on float32 copies of its operands, which its HLO shows
HEAD_SETTINGS = [
    {"loss_chunk": 8},
    {"vocab_chunk": 128},
    {"loss_chunk": 16, "vocab_chunk": 128},
    {"vocab_chunk": 200},  # does not divide 512: the last chunk overlaps the one before
]


def _compiled_operand_bytes(config) -> int:
    step, arguments = abstract_step_arguments(config, MODEL)
    return hlo_dot_operand_bytes(step.lower(*arguments).compile())


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_heads_matmul_bytes_change_with_its_chunks_as_in_the_compiled_program(method):
    # the layers' matmuls are the same in every setting: the differences are the head's
    def config(**memory):
        values = {"method": method, "batch_size": BATCH, "model": {"dtype": "float32"}}
        memory = {"loss_chunk": None, "vocab_chunk": None, "mlp_chunk": None, **memory}
        return parse_config({**values, "data": {"seq_len": SEQ}, "memory": memory})

    whole = config()
    whole_compiled, whole_planned = _compiled_operand_bytes(whole), head_matmul_bytes(whole, MODEL)
    for memory in HEAD_SETTINGS:
        chunked = config(**memory)
        compiled = _compiled_operand_bytes(chunked) - whole_compiled
        assert head_matmul_bytes(chunked, MODEL) - whole_planned == compiled, memory
    # a sequence chunk streams the head once more per chunk; a frozen head's vocabulary chunks
    # only read the normed rows once more per block
    head = MODEL.vocab_size * MODEL.hidden_size * 4
    by_sequence = head_matmul_bytes(config(loss_chunk=8), MODEL) - whole_planned
    by_vocabulary = head_matmul_bytes(config(vocab_chunk=128), MODEL) - whole_planned
    assert by_sequence >= 2 * 3 * head  # 4 chunks: 3 more sweeps of logits and d_hidden
    assert by_vocabulary < head if method == "lora" else by_vocabulary > head


def test_the_hlo_counter_counts_loops_by_their_trip_counts():
    # negative control for the counter itself: XLA's cost_analysis counts a loop body once
    def looped(x, w):
        return jax.lax.scan(lambda h, _: (h @ w, None), x, None, length=5)[0]

    x = jax.ShapeDtypeStruct((8, 16), "float32")
    w = jax.ShapeDtypeStruct((16, 16), "float32")
    compiled = jax.jit(looped).lower(x, w).compile()
    assert hlo_dot_flops(compiled) == 5 * 2 * 8 * 16 * 16
    assert hlo_dot_operand_bytes(compiled) == 5 * (8 * 16 + 16 * 16) * 4


def test_host_transfers_follow_the_placements_and_cost_time_only_over_a_link():
    on_device = _config("lora")
    assert host_transfer_bytes(on_device, MODEL) == 0
    residuals = _config("lora", residuals="host")
    stream = MODEL.num_layers * BATCH * SEQ * MODEL.hidden_size * 2  # bfloat16 compute
    assert host_transfer_bytes(residuals, MODEL) == 2 * stream
    assert step_seconds(residuals, MODEL, CPU_RATES) == step_seconds(on_device, MODEL, CPU_RATES)
    assert step_seconds(residuals, MODEL, ACCELERATOR_RATES) > step_seconds(
        on_device, MODEL, ACCELERATOR_RATES
    )


def test_a_base_on_the_host_crosses_the_link_twice_and_its_estimate_adds_up():
    on_host = _config("qlora", base="host")
    stack = host_base_bytes(on_host, MODEL)
    layers = MODEL.num_layers
    assert stack and host_transfer_bytes(_config("qlora"), MODEL) == 0
    # every layer once forward and once backward, and each walk's one fetch past its end
    assert host_transfer_bytes(on_host, MODEL) == 2 * (layers + 1) * stack // layers
    estimate = host_base_estimate(on_host, MODEL, 25e9, 1e14)
    assert estimate.transfer_seconds == estimate.moved_bytes / 25e9
    assert estimate.compute_seconds == step_flops(on_host, MODEL).total / 1e14
    # at the hiding batch x sequence, compute (per token, at this length) covers the transfer
    per_token = estimate.compute_seconds / (BATCH * SEQ)
    assert (estimate.hiding_tokens - 1) * per_token < estimate.transfer_seconds
    assert estimate.hiding_tokens * per_token >= estimate.transfer_seconds


@pytest.mark.parametrize(
    "batch,seq,blockwise_s,cudnn_s",
    # Llama-3.1-8B QLoRA step on an H200 (jax 0.11.2): blockwise from an earlier run that day,
    # cuDNN from benchmarks/results/gpu_h200_2026-11-27.md
    [(2, 2048, 0.615, 0.444), (1, 16384, 7.36, 1.95)],
)
def test_blockwise_attentions_extra_time_is_the_one_measured_on_an_h200(
    monkeypatch, batch, seq, blockwise_s, cudnn_s
):
    from featherweight.models import attention_choice

    monkeypatch.setattr(attention_choice, "cudnn_library_refusal", lambda: None)
    monkeypatch.setattr(attention_choice, "cudnn_packed_refusal", lambda: None)
    model = builtin_config("Llama-3.1-8B")
    settings = {"method": "qlora", "batch_size": batch, "model": {"dtype": "bfloat16"}}
    settings |= {"data": {"seq_len": seq}, "memory": {"attention": "blockwise"}}
    config = resolve(parse_config(settings), model)
    with attention_choice.compiling_for(attention_choice.AttentionTarget("gpu", "9.0")):
        extra = blockwise_attention_seconds(config, model, ACCELERATOR_RATES)
        fused = config.model_copy(
            update={"memory": config.memory.model_copy(update={"attention": "auto"})}
        )
        assert blockwise_attention_seconds(fused, model, ACCELERATOR_RATES) == 0.0
    assert blockwise_attention_seconds(config, model, CPU_RATES) == 0.0  # no fused kernel
    assert abs(extra / (blockwise_s - cudnn_s) - 1) < 0.1


@pytest.mark.parametrize(
    ("method", "save"),
    [("lora", ()), ("qlora", ()), ("lora", ("qkv", "attention", "mlp_hidden")), ("full", ())],
)
def test_a_micro_batch_more_reads_the_weights_again_as_in_the_compiled_program(method, save):
    """Accumulating 2 micro-batches instead of 1 runs the same FLOPs but reads every layer's
    weights and the LM head once more: the compiled programs' dot operand bytes differ by what
    `layer_weight_bytes` + `head_matmul_bytes` say (the adapters' rank-wide matrices aside)."""

    def config(steps):
        memory = {"loss_chunk": None, "vocab_chunk": None, "mlp_chunk": None, "save": list(save)}
        values = {"method": method, "batch_size": 4, "model": {"dtype": "float32"}}
        memory["accumulation_steps"] = steps
        return parse_config({**values, "data": {"seq_len": SEQ}, "memory": memory})

    def planned(c):
        return layer_weight_bytes(c, MODEL) + head_matmul_bytes(c, MODEL)

    compiled = _compiled_operand_bytes(config(2)) - _compiled_operand_bytes(config(1))
    estimate = planned(config(2)) - planned(config(1))
    assert step_flops(config(2), MODEL).total == step_flops(config(1), MODEL).total
    assert abs(estimate / compiled - 1) < 0.05, (estimate, compiled)


_LOOPS = re.compile(r"(?:body|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
# the final multiply of `dequantize_nf4` (codes x absmax), forward or in a VJP's remat
_DEQUANTIZED = re.compile(r'op_name="[^"]*dequantize_nf4\)+/mul"')


def _hlo_dequantized_values(compiled, weight_sizes: set[int]) -> int:
    """Dense values NF4 dequantizations write in one run of a compiled step: each instruction
    outside fused computations whose root is `dequantize_nf4`'s final multiply and whose result
    is a whole weight, loops counted by their trip counts."""
    own, calls, entry, current = {}, {}, None, None
    for line in compiled.as_text().splitlines():
        header = step_cost._COMPUTATION.match(line)
        if header:
            current = header.group(1)
            entry = current if line.startswith("ENTRY") else entry
            own[current], calls[current] = 0, []
            continue
        instruction = step_cost._INSTRUCTION.match(line) if current else None
        if instruction is None:
            continue
        shape, opcode = step_cost._shape_and_opcode(instruction.group(2))
        array = step_cost._array(shape)
        size = 0 if array is None else math.prod(array.dims)
        if _DEQUANTIZED.search(line) and size in weight_sizes and opcode != "parameter":
            own[current] += size
        if opcode in ("while", "call", "conditional"):  # not fusions: their root is counted
            trips = step_cost._TRIP_COUNT.search(line)
            repeat = int(trips.group(1)) if opcode == "while" and trips else 1
            calls[current] += [(called, repeat) for called in _LOOPS.findall(line)]
            for group in step_cost._BRANCHES.findall(line):
                calls[current] += [(branch.strip().lstrip("%"), 1) for branch in group.split(",")]

    def total(computation: str) -> int:
        return own.get(computation, 0) + sum(n * total(c) for c, n in calls.get(computation, ()))

    return total(entry)


def test_kept_dequantized_weights_halve_the_dequantizations_as_the_estimate_counts():
    # QLoRA (float32) on XLA:CPU: the forward dequantizes every weight once, the backward again (the MLP's
    # once per MLP chunk, inside the chunk loop's remat) -- unless `save: dequantized` keeps them.
    # The compiled program's dequantized values, setting to setting, scale as the estimate's time
    sizes = [math.prod(shape) for shape in layer_shapes(MODEL).values() if len(shape) == 2]

    def qlora(mlp_chunk=None, save=()):
        memory = {"loss_chunk": None, "vocab_chunk": None, "mlp_chunk": mlp_chunk, "save": save}
        settings = {"method": "qlora", "batch_size": BATCH, "data": {"seq_len": SEQ}}
        return parse_config({**settings, "model": {"dtype": "float32"}, "memory": memory})

    cases = {
        "recompute": qlora(),
        "kept": qlora(save=["dequantized"]),
        "mlp-chunk": qlora(mlp_chunk=8),
        "mlp-chunk-kept": qlora(mlp_chunk=8, save=["dequantized"]),
    }
    counted, estimated = {}, {}
    for name, config in cases.items():
        step, arguments = abstract_step_arguments(config, MODEL)
        counted[name] = _hlo_dequantized_values(step.lower(*arguments).compile(), set(sizes))
        estimated[name] = dequantization_seconds(config, MODEL, CPU_RATES)
    assert counted["recompute"] == 2 * counted["kept"] == 2 * MODEL.num_layers * sum(sizes)
    assert counted["mlp-chunk-kept"] == counted["kept"]
    for name in cases:
        ratio = counted[name] / counted["recompute"]
        assert estimated[name] / estimated["recompute"] == pytest.approx(ratio, rel=0.01), name
