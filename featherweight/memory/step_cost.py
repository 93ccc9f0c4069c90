"""What a train step costs in time, from the shapes: matmul FLOPs, head bytes and host bytes.

- `step_flops(config, model_config)`: the step's matmul FLOPs phase by phase (forward, the remat
  forward, the backward's input and weight gradients, the LM head) -- what the budget search
  weighs, without compiling. tests/memory/test_step_cost.py checks it against the FLOPs read from
  compiled steps (`featherweight.dev.hlo_cost.hlo_dot_flops`, the development area's HLO reader).
- `head_matmul_bytes`: the bytes the LM head's matmuls read, which the head's chunks change while
  its FLOPs stay the same. A sequence chunk streams the whole head through its matmuls once more
  per chunk; a frozen head's vocabulary chunks read each row as often as the whole head does.

`step_seconds` turns the counts into an estimate with a device's throughput: matmul FLOPs at the
device's rate, the head's bytes at its memory's rate, and bytes that cross between host and
device memory at the link's rate, and, on a GPU, what blockwise attention costs beyond the
fused kernel (`DeviceRates.blockwise_attention_extra`, measured on an H200). Memory settings are
compared by the difference of these estimates (`budget.change_costs`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from featherweight.memory.state_bytes import (
    compute_itemsize,
    host_base_bytes,
    host_embedding_bytes,
    optimizer_state_bytes,
)
from featherweight.models.attention import block_size
from featherweight.models.attention_choice import AttentionTarget, score_form
from featherweight.models.config import ModelConfig
from featherweight.models.linear import LINEAR_NAMES
from featherweight.models.shapes import layer_shapes
from featherweight.quant.nf4 import nf4_nbytes
from featherweight.recipe.build import attention_implementation
from featherweight.recipe.schema import TrainConfig, require_resolved
from featherweight.step.loss import resolve_chunk_size
from featherweight.step.policy import DEQUANTIZED


class StepFlops(NamedTuple):
    """Matmul FLOPs of one streamed train step, by where they are spent."""

    layers: int  # the blocks: forward, remat forward, backward (input and weight gradients)
    head: int  # the LM head: forward, its input gradient, its weight gradient when trained
    head_recompute: int  # one more head forward: a trained head's vocabulary-chunked second sweep

    @property
    def total(self) -> int:
        return self.layers + self.head + self.head_recompute


def _projection_flops(config: TrainConfig, model_config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{linear: (forward FLOPs of its weight, of its LoRA adapter's two matmuls)} per layer.

    An MoE layer's expert stack [E, out, in] multiplies each token's k routed rows by one
    expert's [out, in] (and its adapter): the active-parameter count, N k rows -- the compiled
    program also multiplies the padding rows of each expert's last block (`models/moe.py`:
    at most E x (block - 1), about a sixteenth more); its router [E, D] is a linear of every
    token. Biases (gpt-oss's [E, out]) are no matmuls."""
    tokens = config.batch_size * config.data.seq_len
    rank = config.lora.rank if config.method != "full" else 0
    flops = {}
    for name, shape in layer_shapes(model_config).items():
        if len(shape) < 2 or name.endswith("_bias"):
            continue
        rows = tokens * model_config.experts_per_token if len(shape) == 3 else tokens
        out_in = shape[-2:]
        adapted = rank and name in config.lora.targets
        flops[name] = (
            2 * rows * math.prod(out_in),
            2 * rows * rank * sum(out_in) if adapted else 0,
        )
    return flops


# the projections whose outputs each class of `memory.save` keeps (the backward skips their
# forward): "attention" keeps the o projection's output inside the attention residual
SAVED_PROJECTIONS = {"qkv": ("q", "k", "v"), "attention": ("o",), "mlp_hidden": ("gate", "up")}


def step_flops(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> StepFlops:
    """The streamed step's matmul FLOPs from the shapes (what `hlo_dot_flops` counts), compiled
    for `target` (default: this process's device: which attention runs).

    Each block runs forward, again in the backward pass (remat), then its input gradient (as
    many FLOPs as the forward) and -- for trained weights -- their gradient (as many again).
    The remat stops short of the down projection (its output is not needed backward; XLA drops
    it), and of the second matmul of the down projection's adapter. Attention's two batched
    matmuls (q k^T, p v) run forward, remat, and twice backward. LoRA adapters are trained, so
    they have both gradients. `save` skips recomputing the projections whose outputs it keeps
    (`SAVED_PROJECTIONS`; their adapters' first matmuls still run): with every class kept no
    projection runs forward twice -- LoRA's layers cost 4N matmul FLOPs per token (forward and
    input gradient) instead of 6N, full fine-tuning's 6N instead of 8N.
    """
    require_resolved(config, "the step's FLOPs")
    m, tokens = model_config, config.batch_size * config.data.seq_len
    projections = _projection_flops(config, model_config)
    linear = sum(base for base, _ in projections.values())
    adapters = sum(adapter for _, adapter in projections.values())
    saved = _not_recomputed(config)
    shapes = layer_shapes(m)
    remat = sum(
        base + adapter
        if name not in saved
        # the adapter's first matmul (rank-wide) is needed for the second's gradient
        else adapter * shapes[name][-1] // sum(shapes[name][-2:])
        for name, (base, adapter) in projections.items()
    )
    trained_linear = linear if config.method == "full" else 0
    per_layer = (
        linear + adapters + remat  # forward, remat
        + linear + adapters + trained_linear + adapters  # d_input, d_weight
    )  # fmt: skip
    head_forward = 2 * tokens * _head_rows_per_sweep(config, m) * m.hidden_size
    head_trained = config.method == "full"
    head = head_forward * (3 if head_trained else 2)
    vocab_chunk = config.memory.vocab_chunk
    chunked_vocab = vocab_chunk is not None and vocab_chunk < m.vocab_size
    recompute = head_forward if chunked_vocab and head_trained else 0  # a frozen head: one sweep
    # attention: forward, remat, and the two operands' gradients of both matmuls
    layers = m.num_layers * per_layer + attention_flops(config, model_config, target)
    return StepFlops(layers, head, recompute)


def _not_recomputed(config: TrainConfig) -> set[str]:
    """The projections the backward's recompute skips: the down projection (its output is not
    needed backward) and those whose outputs `save` keeps."""
    kept = config.memory.save
    return {"down"} | {
        name for cls, names in SAVED_PROJECTIONS.items() if cls in kept for name in names
    }


def _attention_forward_flops(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None
) -> int:
    """Every layer's attention matmuls in the forward: the scores and the weighted sum, 2 x 2 B H
    S x keys x h, the keys a query is scored against: the whole sequence (the whole square) on
    a global layer, the window's min(S, W) on a sliding one (blockwise attention visits only
    the tiles in reach: O(S x W)) -- unless blockwise attention runs as one lone tile (S <= its
    block), which computes the whole square and masks it."""
    m, seq = model_config, config.data.seq_len
    window = score_form(m).window
    lone_tile = (
        seq <= block_size(seq) and attention_implementation(config, m, target) == "blockwise"
    )
    sliding = sum(m.sliding_layers) if window is not None and not lone_tile else 0
    keys = (m.num_layers - sliding) * seq + sliding * min(seq, window or seq)
    return 2 * 2 * config.batch_size * m.num_heads * seq * keys * m.head_dim


def attention_flops(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> int:
    """The attention's matmul FLOPs in a step on `target` (default: this process's device),
    every layer: the forward's, the remat forward's and the backward's two operand gradients of
    each (4 x `_attention_forward_flops`)."""
    return 4 * _attention_forward_flops(config, model_config, target)


def blockwise_attention_seconds(
    config: TrainConfig,
    model_config: ModelConfig,
    rates: DeviceRates,
    target: AttentionTarget | None = None,
) -> float:
    """What blockwise attention adds to a step on `target` (default: this process's device)
    where a fused kernel could run instead (0 where the rates know no fused kernel, or the step
    calls another implementation)."""
    if not rates.blockwise_attention_extra or config.memory.attention not in ("auto", "blockwise"):
        return 0.0
    if attention_implementation(config, model_config, target) != "blockwise":
        return 0.0
    auto = config.model_copy(
        update={"memory": config.memory.model_copy(update={"attention": "auto"})}
    )
    if attention_implementation(auto, model_config, target) == "blockwise":
        return 0.0  # no fused kernel runs on this target (float32, a CPU, ...)
    extra = rates.blockwise_attention_extra * attention_flops(config, model_config, target)
    return extra / rates.flops_per_second


def _head_rows_per_sweep(config: TrainConfig, model_config: ModelConfig) -> int:
    """Rows of the LM head one sweep over the vocabulary reads: V, or with vocabulary chunks that
    do not divide it, every chunk whole (the last overlaps the one before, `step.loss`)."""
    vocab = model_config.vocab_size
    block = min(config.memory.vocab_chunk or vocab, vocab)
    return -(-vocab // block) * block


def head_matmul_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """Bytes the LM head's matmuls read in one step (what `hlo_dot_operand_bytes` counts of them).

    Per sequence chunk of R = B x chunk rows and vocabulary block of Vc rows (Vc = V unchunked;
    with a chunk that does not divide V the last block overlaps the one before), in the compute
    dtype: the logits read the normed rows [R, D] and the block [Vc, D]; d_hidden reads the
    logits' gradient [R, Vc] and the block again; a trained head's gradient reads [R, D] and
    [R, Vc]; a trained head's vocabulary blocks are read once more by the first sweep (the
    log-sum-exp). So the head itself, V x D, streams through twice per sequence chunk (three
    times trained and vocabulary-chunked): a sequence chunk costs bytes, a frozen head's
    vocabulary chunk only the normed rows once more per block. Each micro-batch
    (`memory.accumulation_steps`) has its own sequence chunks.
    """
    require_resolved(config, "the LM head's bytes")
    m, memory = model_config, config.memory
    itemsize = compute_itemsize(config)
    tokens = config.batch_size * config.data.seq_len
    seq_chunks = config.data.seq_len // resolve_chunk_size(config.data.seq_len, memory.loss_chunk)
    seq_chunks *= memory.accumulation_steps  # each micro-batch streams the head again
    rows = _head_rows_per_sweep(config, model_config)
    blocks = rows // min(memory.vocab_chunk or m.vocab_size, m.vocab_size)
    trained = config.method == "full"
    second_sweep = trained and blocks > 1
    sweeps = 2 if second_sweep else 1  # sweeps making logits
    moved = sweeps * (blocks * tokens * m.hidden_size + seq_chunks * rows * m.hidden_size)
    moved += tokens * rows + seq_chunks * rows * m.hidden_size  # d_hidden
    if trained:
        moved += blocks * tokens * m.hidden_size + tokens * rows  # d_head
    return moved * itemsize


def layer_weight_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """Bytes the layers' matmuls read of their weights in one step (what `hlo_dot_operand_bytes`
    counts of them): each projection's dense weight (an NF4 weight dequantized, in the compute
    dtype) in the forward, the backward's input gradient and the recompute -- which skips the
    down projection and the projections `save` keeps -- and a LoRA adapter's two rank-wide
    matrices three times, once per micro-batch (`memory.accumulation_steps`). A trained
    weight's gradient reads activations, not the weight. What a larger micro-batch saves: the
    same weights read fewer times for the same tokens."""
    require_resolved(config, "the layers' weight bytes")
    saved = _not_recomputed(config)
    rank = config.lora.rank if config.method != "full" else 0
    per_layer = 0
    for name, shape in layer_shapes(model_config).items():
        if len(shape) == 2:
            per_layer += math.prod(shape) * (2 if name in saved else 3)
            per_layer += 3 * rank * sum(shape) if rank and name in config.lora.targets else 0
    micro_batches = config.memory.accumulation_steps
    return micro_batches * model_config.num_layers * per_layer * compute_itemsize(config)


class DeviceRates(NamedTuple):
    """How fast a device turns the counts into time: matmul FLOP/s, the bytes/s its memory feeds
    a matmul that streams its operand (the LM head), and bytes/s over the host link (None where
    host and device memory are one, as on a CPU: placement moves nothing). Round figures: only
    the ratio of a setting's cost to the step's time is used."""

    flops_per_second: float
    memory_bytes_per_second: float
    link_bytes_per_second: float | None
    # blockwise attention's time beyond the fused kernel's, in units of the attention's matmul
    # FLOPs at `flops_per_second` (0 where no fused kernel runs: what "auto" picks costs nothing)
    blockwise_attention_extra: float = 0.0


# 2-16 cores with AVX2/AVX-512 FMA; ~20 GB/s of DRAM per core streaming a matmul operand, a round
# figure; host memory is the device's. It under-weighs sequence chunks on a CPU: SmolLM2-135M
# LoRA at b2 x 256 in 64-token chunks measured 1.053x the step with vocabulary chunks
# (benchmarks/results/memory_settings_lora_cpu.md, its A/A row 1.024) where this rate estimates
# +0.7% (the per-call packing of the head's operand is not counted)
CPU_RATES = DeviceRates(1e11, 2e10, None)
# an H100-class GPU: ~40% of its 989 dense bf16 TFLOP/s sustained, ~2.5 TB/s of its 3.35 TB/s HBM;
# PCIe 5 x16 at ~25 GB/s per way. Blockwise attention: measured on an H200 (jax 0.11.2), the
# Llama-3.1-8B QLoRA step with blockwise attention took 3.9 x the attention's FLOPs at this rate
# longer than with cuDNN's kernel, alike at b2 x 2048 (0.615 s against 0.444 s) and at
# b1 x 16384 (7.36 s against 1.95 s); the blockwise steps ran in an earlier session that day
# (benchmarks/results/gpu_h200_2026-11-27.md)
ACCELERATOR_RATES = DeviceRates(4e14, 2.5e12, 2.5e10, 3.9)


def rates_for(platform: str) -> DeviceRates:
    """The rates of a JAX platform name ("cpu", "gpu", "cuda", "tpu", ...)."""
    return CPU_RATES if platform == "cpu" else ACCELERATOR_RATES


def host_transfer_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """Bytes a train step moves between host and device memory, from the placements.

    residuals on host: the residual stream (L x B x S x D) out in the forward pass and back in
    the backward pass; optimizer state on host: all of it in and out, one layer at a time;
    base on host: every layer of the frozen stack in, twice (`host_base_transfer_bytes`);
    embedding on host: the batch's rows in (a frozen table), or -- trained -- the table and its
    gradient's rows in and out; a tied head on host also streams the table through the loss
    once per sequence chunk (a frozen head's vocabulary chunks take one sweep, `step.loss`).
    """
    m, memory = model_config, config.memory
    tokens, itemsize = config.batch_size * config.data.seq_len, compute_itemsize(config)
    moved = 0
    if memory.residuals == "host":
        moved += 2 * m.num_layers * tokens * m.hidden_size * itemsize
    if memory.optimizer_state == "host":
        moved += 2 * optimizer_state_bytes(config, model_config)
    moved += host_base_transfer_bytes(config, model_config)
    table = host_embedding_bytes(config, model_config)
    if table:
        trained = config.method == "full"
        moved += 2 * table if trained else tokens * m.hidden_size * itemsize
        if m.tie_word_embeddings and not trained:
            sweeps = config.data.seq_len // resolve_chunk_size(
                config.data.seq_len, memory.loss_chunk
            )
            moved += sweeps * table
    return moved


def host_base_transfer_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """Bytes of the frozen base brought from the host per step with `memory.base: host`: each
    layer once in the forward scan and once in the backward loop (its recompute), plus the one
    fetch ahead each walk makes past its last layer: 2 (L + 1) layers (0 otherwise)."""
    stack = host_base_bytes(config, model_config)
    layers = model_config.num_layers
    return 2 * (layers + 1) * stack // layers


class HostBaseEstimate(NamedTuple):
    """What streaming the base from the host costs a step on a target: estimates from the
    target's published peaks (`targets.json`), not measurements.

    moved_bytes: the base brought over per step (`host_base_transfer_bytes`).
    transfer_seconds: those bytes at the host link's one-way rate (PCIe x16, theoretical).
    compute_seconds: the step's matmul FLOPs (`step_flops`) at the dense bf16 peak.
    hiding_tokens: batch x sequence from which the compute at peak takes as long as the
      transfer, so that overlapped transfers hide behind it (the FLOPs per token of this step's
      sequence length).
    """

    moved_bytes: int
    transfer_seconds: float
    flops: int
    compute_seconds: float
    hiding_tokens: int

    def lines(self, device: str) -> list[str]:
        """The estimate as the plan prints it."""
        return [
            f"estimate ({device}, published peaks): the base crosses the host link twice a "
            f"step: {self.moved_bytes / 2**30:.2f} GiB, {self.transfer_seconds:.2f} s at the "
            f"link's rate; compute {self.flops / 1e12:.1f} TFLOP, {self.compute_seconds:.2f} s "
            f"at peak; compute hides the transfer from ~{self.hiding_tokens:,} tokens per step "
            "(batch x sequence), if overlapped",
        ]


def host_base_estimate(
    config: TrainConfig,
    model_config: ModelConfig,
    link_bytes_per_second: float,
    peak_flops: float,
    target: AttentionTarget | None = None,
) -> HostBaseEstimate:
    """The transfer and compute estimates of `memory.base: host` at a target's rates (`target`:
    the step's, default this process's device)."""
    moved = host_base_transfer_bytes(config, model_config)
    flops = step_flops(config, model_config, target).total
    transfer = moved / link_bytes_per_second
    tokens = config.batch_size * config.data.seq_len
    per_token_seconds = flops / tokens / peak_flops
    return HostBaseEstimate(
        moved, transfer, flops, flops / peak_flops, math.ceil(transfer / per_token_seconds)
    )


def dequantization_seconds(
    config: TrainConfig, model_config: ModelConfig, rates: DeviceRates
) -> float:
    """What dequantizing QLoRA's NF4 layer weights costs a step (0 for LoRA and full), in bytes
    at the device's memory rate.

    A dequantization reads a weight's NF4 bytes (codes, absmax and their scales) and writes it
    dense in the compute dtype. The forward pass dequantizes every weight of every layer once;
    the backward pass again (its matmuls need the weights for the input gradient whatever
    activations are kept), the MLP's once per MLP chunk when the MLP runs in sequence chunks
    (the chunk loop's remat dequantizes inside the loop; the forward's is hoisted out of it).
    `save: dequantized` keeps them instead, which is not free: the forward writes them into the
    kept stack by dequantizing each weight a second time inside that write (so compiled by
    XLA:CPU, and by XLA:GPU for an H100, deviceless), and the backward moves each layer's slice
    out of the stack twice, a slice and a copy into the loop's carry (a dense read and write
    each; so compiled by XLA:CPU). So keeping pays only where the backward would dequantize the
    MLP many times (MLP chunks: about five or more in bfloat16). Each micro-batch of
    `memory.accumulation_steps` does all of it anew; kept weights placed in host memory
    (`residuals: host`) also cross the link out and back."""
    if config.method != "qlora":
        return 0.0
    memory, itemsize = config.memory, compute_itemsize(config)
    shapes = layer_shapes(model_config)  # an MoE layer's expert stacks count whole: each expert
    sizes = {name: math.prod(shapes[name]) for name in LINEAR_NAMES}  # is dequantized once a pass
    moved = {name: nf4_nbytes(size) + size * itemsize for name, size in sizes.items()}
    layer = sum(moved.values())  # one layer's weights dequantized once
    dense = sum(sizes.values()) * itemsize
    mlp = sum(moved[name] for name in ("gate", "up", "down"))
    chunked = memory.mlp_chunk is not None and "mlp_hidden" not in memory.save
    mlp_passes = config.data.seq_len // min(memory.mlp_chunk, config.data.seq_len) if chunked else 1
    kept = DEQUANTIZED in memory.save
    per_layer = 2 * layer + 4 * dense if kept else 2 * layer - mlp + mlp_passes * mlp
    layers = model_config.num_layers * memory.accumulation_steps
    seconds = layers * per_layer / rates.memory_bytes_per_second
    if kept and memory.residuals == "host" and rates.link_bytes_per_second is not None:
        seconds += 2 * layers * dense / rates.link_bytes_per_second
    return seconds


def step_seconds(
    config: TrainConfig,
    model_config: ModelConfig,
    rates: DeviceRates,
    target: AttentionTarget | None = None,
) -> float:
    """Estimated seconds of one train step on `target` (default: this process's device, whose
    attention runs): its matmul FLOPs at the device's rate, the bytes the
    LM head's and the layers' matmuls read of their weights at its memory's rate, blockwise
    attention's extra time where a fused kernel could run, QLoRA's dequantizations, plus its host
    transfers at the link's rate (not overlapped: an upper bound on what they add)."""
    seconds = step_flops(config, model_config, target).total / rates.flops_per_second
    weights = head_matmul_bytes(config, model_config) + layer_weight_bytes(config, model_config)
    seconds += weights / rates.memory_bytes_per_second
    seconds += blockwise_attention_seconds(config, model_config, rates, target)
    seconds += dequantization_seconds(config, model_config, rates)
    if rates.link_bytes_per_second is not None:
        seconds += host_transfer_bytes(config, model_config) / rates.link_bytes_per_second
    return seconds


def seconds_per_token(
    config: TrainConfig,
    model_config: ModelConfig,
    rates: DeviceRates,
    target: AttentionTarget | None = None,
) -> float:
    """`step_seconds` per trained token on `target`: what compares steps of different
    micro-batches."""
    tokens = config.batch_size * config.data.seq_len
    return step_seconds(config, model_config, rates, target) / tokens
