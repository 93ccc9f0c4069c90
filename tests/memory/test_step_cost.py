"""The step's matmul FLOPs from the shapes (`step_flops`, what the budget search weighs) equal the
FLOPs counted in the compiled program's optimized HLO, setting by setting; host transfers follow
the placements."""

import math
import re

import jax
import pytest

from featherweight.dev import hlo_cost
from featherweight.dev.hlo_cost import hlo_dot_flops, hlo_dot_operand_bytes
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
from featherweight.quant.nf4 import nf4_nbytes
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config
from tests.tiny_families import tiny_family

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
    hopper = attention_choice.AttentionTarget("gpu", "9.0")
    extra = blockwise_attention_seconds(config, model, ACCELERATOR_RATES, hopper)
    fused = config.model_copy(
        update={"memory": config.memory.model_copy(update={"attention": "auto"})}
    )
    assert blockwise_attention_seconds(fused, model, ACCELERATOR_RATES, hopper) == 0.0
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
_FUSED = re.compile(r"calls=%?([\w.\-]+)")
# the final multiply of `dequantize_nf4` (codes x absmax), forward or in a VJP's remat
_DEQUANTIZED = re.compile(r'op_name="[^"]*dequantize_nf4\)+/nf4_dequantize/mul"')


def _fused_computations(text: str) -> tuple[set[str], dict[str, str]]:
    """(computations holding a dequantization's final multiply, each computation's root opcode)."""
    dequantizing, roots, current = set(), {}, None
    for line in text.splitlines():
        header = hlo_cost._COMPUTATION.match(line)
        current = header.group(1) if header else current
        if current and _DEQUANTIZED.search(line):
            dequantizing.add(current)
        if current and line.lstrip().startswith("ROOT "):
            rest = hlo_cost._INSTRUCTION.match(line).group(2)
            roots[current] = hlo_cost._shape_and_opcode(rest)[1]
    return dequantizing, roots


def _hlo_weight_traffic(compiled, shapes: set[tuple[int, ...]], layers: int) -> tuple[int, int]:
    """(values NF4 dequantizations write, dense weight values sliced or copied) in one run of a
    compiled step, loops by their trip counts: each fusion outside fused computations holding
    `dequantize_nf4`'s final multiply and writing a whole weight (or one layer's slot of a kept
    stack: a dynamic-update-slice); each copy or dynamic slice whose result is one weight."""
    text = compiled.as_text()
    dequantizing, roots = _fused_computations(text)
    sizes = {math.prod(shape) for shape in shapes}
    own, calls, entry, current = {}, {}, None, None
    for line in text.splitlines():
        header = hlo_cost._COMPUTATION.match(line)
        if header:
            current = header.group(1)
            entry = current if line.startswith("ENTRY") else entry
            own[current], calls[current] = [0, 0], []
            continue
        instruction = hlo_cost._INSTRUCTION.match(line) if current else None
        if instruction is None:
            continue
        shape, opcode = hlo_cost._shape_and_opcode(instruction.group(2))
        array = hlo_cost._array(shape) if shape.startswith(("f32", "bf16")) else None
        size = 0 if array is None else math.prod(array.dims)
        fused = _FUSED.search(line).group(1) if opcode == "fusion" else None
        root = roots.get(fused, "") if fused else opcode
        if fused in dequantizing:
            written = size // layers if root == "dynamic-update-slice" else size
            own[current][0] += written if written in sizes else 0
        elif root in ("copy", "dynamic-slice") and size:
            own[current][1] += size if tuple(d for d in array.dims if d != 1) in shapes else 0
        if opcode in ("while", "call", "conditional"):  # not fusions: counted above
            trips = hlo_cost._TRIP_COUNT.search(line)
            repeat = int(trips.group(1)) if opcode == "while" and trips else 1
            calls[current] += [(called, repeat) for called in _LOOPS.findall(line)]
            for group in hlo_cost._BRANCHES.findall(line):
                calls[current] += [(branch.strip().lstrip("%"), 1) for branch in group.split(",")]

    def total(computation: str) -> tuple[int, int]:
        counts = list(own.get(computation, (0, 0)))
        for called, repeat in calls.get(computation, ()):
            inner = total(called)
            counts = [counts[0] + repeat * inner[0], counts[1] + repeat * inner[1]]
        return counts[0], counts[1]

    return total(entry)


def test_kept_dequantized_weights_cost_what_the_compiled_step_moves():
    # QLoRA (float32) on XLA:CPU: the forward dequantizes every weight once, the backward again
    # (the MLP's once per MLP chunk, inside the chunk loop's remat). Kept, the backward
    # dequantizes nothing, but the forward dequantizes each weight once more into the kept stack
    # and the backward slices and copies each layer's weights out of it. The compiled
    # program's weight bytes, setting to setting, scale as the estimate's time does
    shapes = [shape for shape in layer_shapes(MODEL).values() if len(shape) == 2]
    layer = sum(math.prod(shape) for shape in shapes)
    nf4_per_value = sum(nf4_nbytes(math.prod(shape)) for shape in shapes) / layer

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
    counted, moved, estimated = {}, {}, {}
    for name, config in cases.items():
        step, arguments = abstract_step_arguments(config, MODEL)
        compiled = step.lower(*arguments).compile()
        counted[name] = _hlo_weight_traffic(compiled, set(shapes), MODEL.num_layers)
        dequantized, copied = counted[name]
        moved[name] = dequantized * (nf4_per_value + 4) + copied * 2 * 4
        estimated[name] = dequantization_seconds(config, MODEL, CPU_RATES)
    twice = 2 * MODEL.num_layers * layer
    assert counted["recompute"] == (twice, 0)
    assert counted["kept"] == counted["mlp-chunk-kept"] == (twice, twice)
    assert counted["mlp-chunk"][0] > twice  # the MLP's weights once per chunk in the backward
    for name in cases:
        ratio = moved[name] / moved["recompute"]
        assert estimated[name] / estimated["recompute"] == pytest.approx(ratio, rel=0.01), name


def test_dequantization_costs_each_micro_batch_and_nothing_without_nf4_weights():
    qlora = _config("qlora", save=["dequantized"])
    seconds = dequantization_seconds(qlora, MODEL, ACCELERATOR_RATES)
    micro = qlora.model_copy(
        update={"memory": qlora.memory.model_copy(update={"accumulation_steps": 2})}
    )
    assert dequantization_seconds(micro, MODEL, ACCELERATOR_RATES) == pytest.approx(2 * seconds)
    assert dequantization_seconds(_config("lora"), MODEL, ACCELERATOR_RATES) == 0.0
    # kept in host memory with the residuals, the dense weights cross the link out and back
    on_host = _config("qlora", save=["dequantized"], residuals="host")
    dense = MODEL.num_layers * sum(
        math.prod(shape) for shape in layer_shapes(MODEL).values() if len(shape) == 2
    )
    link = 2 * dense * 2 / ACCELERATOR_RATES.link_bytes_per_second  # bfloat16
    assert dequantization_seconds(on_host, MODEL, ACCELERATOR_RATES) == pytest.approx(
        seconds + link
    )


# Not yet for models whose layers differ (Gemma, Qwen2's upper layers): the compiled program runs
# more attention matmuls in the layer's lax.cond than are counted (b2 x 32: qwen2-mixed +0.4%,
# gemma2 and gemma3 +7.4% of the step's FLOPs)
@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_each_familys_step_flops_equal_its_compiled_program(family):
    # head_dim 48 apart from hidden / heads = 32, QK-norm, a partial rotary, a window on every
    # layer: S = 32 is one lone tile of blockwise attention, the whole square
    model = tiny_family(family)
    config = resolve(
        parse_config({"method": "lora", "batch_size": BATCH, "data": {"seq_len": SEQ}}), model
    )
    step, arguments = abstract_step_arguments(config, model)
    assert step_flops(config, model).total == hlo_dot_flops(step.lower(*arguments).compile())


# gpt-oss with every layer on full attention: its alternating layers' lax.cond between sliding
# and full attention puts the step 10.4% above the count (b2 x 256, the MLP whole, XLA:CPU), as
# that cond puts Gemma's steps 7.4% above -- attention's matmuls, not the experts'
MOE_FLOP_CASES = {
    "qwen3_moe": {},
    "mixtral": {},
    "gpt_oss": {"layer_types": ["full_attention"] * 4},
}


@pytest.mark.parametrize("family", sorted(MOE_FLOP_CASES))
def test_an_moe_steps_flops_are_its_active_parameters(family):
    # router + each token's k experts' three matmuls (and their adapters): the compiled program
    # also multiplies each expert's padding rows (b2 x 256: 512 x k pairs in blocks of 8), once
    # per MLP chunk -- with Mixtral's default chunks 10.3% above the count, so the MLP runs whole
    # (gpt-oss, full attention: 8.2% above)
    model = tiny_family(family, **MOE_FLOP_CASES[family])
    settings = {"method": "lora", "batch_size": BATCH, "data": {"seq_len": 256},
                "memory": {"mlp_chunk": None}}  # fmt: skip
    config = resolve(parse_config(settings), model)
    step, arguments = abstract_step_arguments(config, model)
    compiled = hlo_dot_flops(step.lower(*arguments).compile())
    assert abs(step_flops(config, model).total - compiled) <= 0.1 * compiled


def test_a_sliding_layers_attention_grows_linearly_in_the_sequence():
    # blockwise attention with the loops visits the window's tiles only: O(S x W) on a sliding
    # layer, O(S^2) on a global one (what the budget search weighs; the loops' trip counts are
    # unknown to the compiled program's counter)
    def attention(family, seq):
        model = tiny_family(family, max_position_embeddings=16384)
        config = parse_config({"method": "lora", "data": {"seq_len": seq}, "memory": {
            "loss_chunk": None, "vocab_chunk": None, "mlp_chunk": None}})  # fmt: skip
        return step_cost.attention_flops(config, model)

    assert attention("mistral", 8192) == 2 * attention("mistral", 4096)  # every layer slides
    assert attention("qwen3", 8192) == 4 * attention("qwen3", 4096)  # none does
    # Gemma 2 (every other layer): the global layers' square dominates as S grows
    assert 2 < attention("gemma2", 8192) / attention("gemma2", 4096) < 4
