"""The working set of the streamed step's peak phase: the bytes beyond what persists and what
the forward pass stores, per phase, from shapes and calibrated buffer counts.

    backward phase: one layer's VJP and update
      layer_weights        c_w x one layer's linear weights in the compute dtype (sliced, or
                           dequantized from NF4: the copy the matmuls read)
      dequantized_weights_ahead  `save: dequantized` (QLoRA) on XLA:CPU: the next layer's kept
                           dense weights, one layer's linear weights x itemsize, sliced from the
                           kept stack one layer ahead as the layer inputs are (compiled on
                           XLA:CPU the step grows by L + 1 layers' dense weights, to 0.01%; for
                           an H100, deviceless, by L layers' and 0.5%: no such copy there)
      dequantized_layer    XLA:GPU, QLoRA: the layer's NF4 weights dequantized for the MLP's
                           backward, beyond the attention's buffers: the phase peaks at the larger
                           of the two moments, max(attention, L's linear weights x itemsize)
                           (`dequantized_layer_bytes`; compiled for an H100, deviceless)
      saved_layer_from_host  XLA:GPU, `memory.save` with residuals: host: the layer's kept
                           activations brought to the device, B x S x width x itemsize
      layer_gradient       one layer's gradient of the trainable tensors
      embedding_gradient   full fine-tuning with the embedding on the device: its V x D x
                           itemsize gradient, alive from the loss to the embedding's update (tied:
                           the head's gradient of the table; untied: the zero table the input
                           cotangent is scattered into, which XLA:CPU allocates before the loss)
      optimizer_update     c_o x one layer's optimizer state (its slices and the new state)
      layer_activations    B S itemsize x (c_d D + mlp_count F + c_a (H + 2K) h): the remat forward
                           and its cotangents (c_fs for mlp_count with `save: mlp_hidden`)
      attention            the attention the step calls (`models/attention.py`):
                           materialized: c_s x B x H x S x S x 4, float32 scores and probabilities;
                           blockwise: its log-sum-exps and row terms (2 B H S x 4) and four float32
                           tiles of B x H x t x t (scores, probabilities, their cotangents; t the
                           tile edge; on XLA:CPU three for a lone tile, S <= t), counted once;
                           cudnn_padded: the log-sum-exps, B H S x 4, and cuDNN's backward
                           workspace for B sequences (`cudnn_workspace_bytes`); cudnn (packed
                           rows): cuDNN's statistics for M documents a row (`packed_slots`),
                           B H S M x 4, its backward workspace for B x M sequences, the
                           layout's int32 arrays, and the blockwise fallback's buffers (as
                           blockwise) and output (B S H h x itemsize) beside them. The
                           workspace, 4 (B M) H S (2h + 1) bytes, was read off the step
                           compiled on an H200 (benchmarks/results/gpu_h200_2026-11-27.md): at
                           B 2, M 32 it is 4.0 GiB, half the 8B QLoRA step;
                           pallas: its log-sum-exps and row terms (2 B H S' x 4, S' the
                           sequence padded to its tile) and, for grouped K/V, the repeated K
                           and V and their gradients, 4 B S' H h x itemsize (compiled for an
                           H100 without a GPU: tests/memory/test_attention_plan.py)
    loss phase: LM head + cross-entropy over one sequence chunk, with its VJP
      logits_chunk         c_l x B x chunk x V x 4 (V: vocab_chunk when the head is chunked)
      embedding_gradient   as in the backward phase (tied: it is the head's gradient)
      head_gradient        full fine-tuning of an untied head: its V x D x itemsize gradient
      dequantized_head     quantize_head: V (or vocab_chunk) x D x itemsize, the dense copy the
                           head matmul reads
      head_rows_from_host  tied embedding on the host: the vocab_chunk rows brought over
      head_rows_copy       a dense head on the device with vocab_chunk: the chunk's rows,
                           vocab_chunk x D x itemsize, copied for the matmul (XLA:CPU copies a
                           sliced operand; at small shapes this outweighs the logits it saves)
      head_optimizer_state optimizer state on the host: the largest head/embedding state, on
                           the device for its one update
    head_update phase: full fine-tuning of an untied head, updated once its gradient exists
      embedding_gradient   as in the backward phase
      head_update          c_h x V x D x itemsize (its gradient and the copies its update makes:
                           1 to 3 of them compiled on XLA:CPU, by optimizer and how the loss is
                           chunked), + c_m x the float32 moments with 8-bit AdamW (below)
    embedding phase: full fine-tuning, the embedding's one update after the backward loop
      embedding_gradient   V x D x itemsize (tied: the head's gradient plus the scattered input
                           cotangent)
      embedding_update     8-bit AdamW: c_m x its moments in float32: the new ones, 2 V D x 4,
                           and the old ones dequantized, 2 V D x 4 more -- unless a row is one
                           quantization block (D = 256), where XLA fuses the dequantization into
                           the update
    (mlp_chunk replaces S by the chunk in the F term of layer_activations; with `save:
    mlp_hidden` the F term has its own count c_fs: the backward reads the saved gate and up
    outputs instead of recomputing them)

`temporaries` (what XLA reports as temp) = the stored activations + the peak phase's working set
(the embedding phase runs after the backward pass has freed them: where it is the peak, the plan
is high by their bytes).
The buffer counts c_* are how many such buffers XLA keeps alive at once. They are data, not code:
`calibration.json` holds them per compiler and dtype together with the compiled measurements they
were fitted on and their provenance; `python -m featherweight.memory.calibrate` measures a fit grid
and a held-out grid, fits them (non-negative least squares on the relative error of temp) and
writes the file; tests/memory/test_calibration.py checks the fit and the held-out error.

Which counts a plan uses is the compiler it is for, never the machine it runs on: every function
here takes the target (`AttentionTarget`: `featherweight plan --target h100` plans with
"xla-gpu/bfloat16"; the trainer with its own device's compiler) and the config's dtype. A compiler and dtype without a fit of their own use the
XLA:CPU float32 counts, and the plan says so. The attention the plan counts is the one the step
calls: `attention_of` resolves `memory.attention` exactly as the step builder does
(`recipe.build.attention_implementation`).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import NamedTuple

from featherweight.errors import ConfigError
from featherweight.memory.family_terms import FAMILY_TERMS, family_terms
from featherweight.memory.state_bytes import (
    compute_itemsize,
    host_base_bytes,
    layer_gradient_bytes,
    layer_optimizer_bytes,
    top_optimizer_bytes,
)
from featherweight.models.attention import block_size
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig
from featherweight.models.fused_attention import pallas_tile
from featherweight.models.shapes import layer_shapes
from featherweight.optim.adamw8bit import BLOCK_SIZE
from featherweight.recipe.build import attention_implementation, packed_slots
from featherweight.recipe.schema import TrainConfig
from featherweight.step.loss import resolve_chunk_size
from featherweight.step.policy import DEQUANTIZED
from featherweight.step.streamed import gradient_mode

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
DEFAULT_CALIBRATION = "xla-cpu/float32"
# float32 tiles of blockwise attention alive at once in its backward on XLA:CPU (compiled: the
# temp of its forward and backward grows by 4.04 tiles from a 512 to a 1024 tile at S = 2048)
BLOCKWISE_TILES = 4
# ... and, by compiler, in a step whose sequence is one lone tile (S <= the block), where no loop
# is built: XLA:CPU then shares one tile with the rest of the layer's backward (compiled: the
# grid's toy steps and SmolLM2-135M LoRA b2 x 256 each held 0.75 to 1.0 tile less than with the
# loops); XLA:GPU does not (H100 bf16 compiles of SmolLM2-135M b2 x 256 and Llama-3.2-1B
# b2 x 512 LoRA: temp unchanged to the byte)
LONE_TILE_TILES = {"xla-cpu": 3}


@functools.lru_cache(maxsize=1)
def known_calibrations() -> frozenset[str]:
    """The compiler/dtype keys calibration.json holds."""
    return frozenset(json.loads(CALIBRATION_FILE.read_text())["calibrations"])


def calibration_key(config: TrainConfig, target: AttentionTarget) -> str:
    """The calibration a plan of `config` for `target` uses: the target's compiler and the
    config's dtype; `DEFAULT_CALIBRATION` when that has no fit."""
    key = f"{target.compiler}/{config.model.dtype}"
    return key if key in known_calibrations() else DEFAULT_CALIBRATION


@functools.lru_cache(maxsize=8)
def calibration_counts(key: str = DEFAULT_CALIBRATION) -> dict[str, float]:
    """The buffer counts fitted for a compiler and dtype (`calibration.json`, written by
    `python -m featherweight.memory.calibrate` together with the measurements it fitted)."""
    calibrations = json.loads(CALIBRATION_FILE.read_text())["calibrations"]
    if key not in calibrations:
        raise ConfigError(
            f"no working-set calibration {key!r} in {CALIBRATION_FILE.name}; known: "
            f"{', '.join(sorted(calibrations))} (fit one with python -m "
            "featherweight.memory.calibrate)"
        )
    return dict(calibrations[key]["counts"])


def plan_reserve(config: TrainConfig, target: AttentionTarget) -> float:
    """The fraction of a budget the budget search keeps in reserve for the plan's own error on
    `target`: how far below its compiled step a plan fell at worst on the calibration's held-out
    grid (`plan_reserve_percent` in calibration.json; 0 for a calibration without it)."""
    calibrations = json.loads(CALIBRATION_FILE.read_text())["calibrations"]
    entry = calibrations.get(calibration_key(config, target), {})
    return entry.get("plan_reserve_percent", 0.0) / 100


def attention_of(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> str:
    """The attention implementation the configured step calls on `target` (default: this
    process's device), one of `models.attention.IMPLEMENTATIONS`."""
    return attention_implementation(config, model_config, target)


def attention_bytes(shapes: StepShapes) -> tuple[int, int]:
    """(materialized scores B x H x S x S x 4 before their calibrated count, the other
    implementations' buffers counted once); one of the two is zero."""
    if shapes.attention == "materialized":
        return 4 * shapes.batch * shapes.heads * shapes.seq * shapes.seq, 0
    batch, heads, seq = shapes.batch, shapes.heads, shapes.seq
    if shapes.attention == "cudnn_padded":
        workspace = cudnn_workspace_bytes(batch, heads, seq, shapes.head_dim)
        return 0, 4 * batch * heads * seq + workspace
    if shapes.attention == "cudnn":
        # statistics for M documents a row, the backward's workspace, the layout, and the
        # blockwise fallback's buffers and output beside cuDNN's (`packed_or_fallback`)
        slots = shapes.packed_slots
        stats = 4 * batch * heads * seq * slots
        workspace = cudnn_workspace_bytes(batch * slots, heads, seq, shapes.head_dim)
        layout = 4 * 4 * batch * (slots + 1)
        fallback = batch * seq * heads * shapes.head_dim * shapes.itemsize
        return 0, stats + workspace + layout + fallback + _blockwise_bytes(shapes)
    if shapes.attention == "pallas":
        padded = pallas_padded(seq)
        repeated = 4 * padded * heads * shapes.head_dim * shapes.itemsize
        grouped = heads > shapes.kv_heads
        return 0, batch * (8 * heads * padded + (repeated if grouped else 0))
    return 0, _blockwise_bytes(shapes)


def cudnn_workspace_bytes(sequences: int, heads: int, seq: int, head_dim: int) -> int:
    """The workspace cuDNN's fused attention backward (`__cudnn$fmhaSoftmaxBackward`) takes for
    `sequences` sequences of `seq` positions: 4 x sequences x H x S x (2h + 1) bytes, two float32
    accumulators of the query's shape and a float32 row term per sequence. In the packed layout
    every row is M sequences of up to S positions (`recipe.build.packed_slots`), so it is M
    times the padded layout's. Read off the step compiled on an H200 (jax 0.11.2):
    u8[4311761664] for 2 x 32 sequences, 32 heads, 2048 positions, head dim 128, which is this
    plus the forward's 17152 bytes (benchmarks/results/gpu_h200_2026-11-27.md). The padded layout's (one sequence a row)
    is the same formula at M = 1, not yet read off a GPU."""
    return 4 * sequences * heads * seq * (2 * head_dim + 1)


def _blockwise_bytes(shapes: StepShapes) -> int:
    """Blockwise attention's log-sum-exps and row terms and its float32 tiles."""
    tile = block_size(shapes.seq)
    padded = -(-shapes.seq // tile) * tile
    tiles = blockwise_tiles(shapes.seq, shapes.target.compiler)
    return 4 * shapes.batch * shapes.heads * (2 * padded + tiles * tile * tile)


def pallas_padded(seq_len: int) -> int:
    """The positions the Pallas kernel computes for `seq_len`: padded to its tile (at most
    `models.fused_attention.pallas_tile`)."""
    tile = pallas_tile(seq_len)
    return -(-seq_len // tile) * tile


def blockwise_tiles(seq_len: int, compiler: str) -> int:
    """Float32 tiles of blockwise attention alive at once at `seq_len` in a step compiled by
    `compiler` ("xla-cpu", "xla-gpu"); see BLOCKWISE_TILES and LONE_TILE_TILES."""
    if seq_len > block_size(seq_len):
        return BLOCKWISE_TILES
    return LONE_TILE_TILES.get(compiler, BLOCKWISE_TILES)


def _lone_tile_bytes(shapes: StepShapes) -> int:
    """Blockwise attention's float32 tile, B x H x S x S x 4, when the step runs it as one lone
    tile (S <= its block); 0 otherwise."""
    if shapes.attention != "blockwise" or shapes.seq > block_size(shapes.seq):
        return 0
    return 4 * shapes.batch * shapes.heads * shapes.seq * shapes.seq


def dequantized_layer_bytes(config: TrainConfig, shapes: StepShapes) -> int:
    """XLA:GPU, QLoRA: the bytes by which the backward's MLP moment exceeds its attention moment.

    The backward of one layer peaks at one of two moments: the attention's backward (its tiles,
    the buffers `attention_bytes` counts) or the MLP's, where the layer's NF4 weights are
    dequantized dense into the compute dtype for the matmuls -- q, k, v, o kept dense from the
    recompute for the attention's backward, gate and up dense, down being dequantized -- and the
    attention's tiles are no longer alive. So the phase holds its calibrated buffers plus
    max(attention, dense layer), counted as the attention plus this difference. Compiled for an
    H100 (deviceless, jax 0.10.2), Llama-3.1-8B QLoRA b1 x 2048 (loss / MLP chunks 256, the
    base and optimizer state on the host): the peak is the MLP's dequantization, holding 363.5
    of the layer's 416 MiB dense, no attention tile alive. The calibrated counts come from toy
    models whose dense layer is far below their attention's tiles, where this is 0; without it
    the 8B plans at one row per micro-batch fell 19-20% below the compile. XLA:CPU's count of
    the layer's weights (`layer_weights`, c_w) already holds the copy; with `save: dequantized`
    the backward reads the kept dense stack and dequantizes nothing."""
    quantized = config.method == "qlora" and DEQUANTIZED not in config.memory.save
    if not quantized or not shapes.calibration.startswith("xla-gpu"):
        return 0
    return max(0, shapes.layer_linear * shapes.itemsize - sum(attention_bytes(shapes)))


def saved_width(config: TrainConfig, shapes: StepShapes) -> int:
    """Values per token and layer the forward keeps for the backward (`memory.save`): q, k, v
    (qkv), the attention's output and its residual (attention), the MLP's gate and up
    (mlp_hidden)."""
    widths = {
        "qkv": (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim,
        "attention": shapes.heads * shapes.head_dim + shapes.hidden,
        "mlp_hidden": 2 * shapes.intermediate,
    }
    return sum(widths.get(name, 0) for name in config.memory.save)


def saved_layer_from_host_bytes(config: TrainConfig, shapes: StepShapes) -> int:
    """XLA:GPU, kept activations in host memory (`memory.save` with residuals: host): the layer's
    saved intermediates the backward brings to the device, B x S x width x itemsize. Compiled
    for an H100 (deviceless, jax 0.10.2), Llama-3.1-8B QLoRA b4 x 2048 as two micro-batches at
    its smallest settings with every activation class kept on the host: 358 MiB on the device
    beyond the plan without it, one layer's 336 MiB. XLA:CPU has one memory: the stored
    component holds them there."""
    if config.memory.residuals != "host" or not shapes.calibration.startswith("xla-gpu"):
        return 0
    return shapes.tokens * saved_width(config, shapes) * shapes.itemsize


class WorkingBuffer(NamedTuple):
    """A group of buffers of one phase: name, planned bytes, formula with this run's numbers."""

    name: str
    bytes: int
    formula: str


class StepShapes:
    """The numbers the formulas use, read once from the configs, for the step compiled for
    `target` (its attention and its compiler's calibration)."""

    def __init__(
        self, config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
    ) -> None:
        model = model_config
        self.target = target
        self.calibration = calibration_key(config, target)
        self.layers, self.hidden, self.intermediate = (
            model.num_layers,
            model.hidden_size,
            model.intermediate_size,
        )
        self.vocab, self.heads, self.kv_heads, self.head_dim = (
            model.vocab_size,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
        )
        self.batch, self.seq = config.batch_size, config.data.seq_len
        self.tokens = self.batch * self.seq
        self.itemsize = compute_itemsize(config)
        self.loss_chunk = resolve_chunk_size(self.seq, config.memory.loss_chunk)
        # vocabulary rows of the head at a time, and the MLP's sequence chunk
        vocab_chunk, mlp_chunk = config.memory.vocab_chunk, config.memory.mlp_chunk
        self.vocab_rows = self.vocab if vocab_chunk is None else min(self.vocab, vocab_chunk)
        self.mlp_seq = self.seq if mlp_chunk is None else min(self.seq, mlp_chunk)
        # the linear weights of one layer: its 2-D tensors (norms and biases are 1-D)
        self.layer_linear = sum(
            math.prod(shape) for shape in layer_shapes(model).values() if len(shape) == 2
        )
        self.full = config.method == "full"
        self.attention = attention_of(config, model_config, target)
        self.packed_slots = packed_slots(config)  # cuDNN's packed layout: documents a row
        self.tied = model.tie_word_embeddings
        # the gate and up outputs kept from the forward pass (`memory.save`): the backward reads
        # them instead of recomputing them, which changes its F-wide buffers
        self.saved_mlp = "mlp_hidden" in config.memory.save


def raw_terms(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> dict[str, int]:
    """The working set's terms in bytes for `target`, each counted once (before the calibrated
    counts)."""
    shapes = StepShapes(config, model_config, target)
    head_like = shapes.vocab * shapes.hidden * shapes.itemsize
    eight_bit = config.optimizer.name == "adamw_8bit"
    # full fine-tuning updates the embedding after the backward loop; on the host (untied) it
    # is updated in row chunks, so no V x D gradient exists on the device
    trained_table = shapes.full and config.memory.embed == "device"
    # 8-bit AdamW's two moments of a V x D tensor in float32: the new ones, and the old ones
    # dequantized -- unless a row is one quantization block, where the blocks' reshapes are
    # identities and XLA fuses the dequantization into the update (compiled on XLA:CPU)
    moments = 2 * shapes.vocab * shapes.hidden * 4 * (1 if shapes.hidden == BLOCK_SIZE else 2)
    rows_from_host = config.memory.embed == "host" and shapes.tied and not shapes.full
    return {
        "layer_weights": shapes.layer_linear * shapes.itemsize,
        "layer_gradient": layer_gradient_bytes(config, model_config),
        "optimizer_state": layer_optimizer_bytes(config, model_config),
        "activations_d": shapes.tokens * shapes.itemsize * shapes.hidden,
        "activations_f": 0
        if shapes.saved_mlp
        else shapes.batch * shapes.mlp_seq * shapes.itemsize * shapes.intermediate,
        "activations_f_saved": shapes.batch * shapes.mlp_seq * shapes.itemsize * shapes.intermediate
        if shapes.saved_mlp
        else 0,
        "activations_attention": shapes.tokens
        * shapes.itemsize
        * (shapes.heads + 2 * shapes.kv_heads)
        * shapes.head_dim,
        "attention_scores": attention_bytes(shapes)[0],
        "attention_blockwise": attention_bytes(shapes)[1],
        **family_terms(
            model_config,
            target.compiler,
            shapes.tokens,
            logits_bytes=4 * shapes.batch * shapes.loss_chunk * shapes.vocab_rows,
            lone_softcap_tile_bytes=_lone_tile_bytes(shapes),
            mlp_tokens=shapes.batch * shapes.mlp_seq,
            itemsize=shapes.itemsize,
            dense_experts=config.method != "qlora",
        ),
        "embedding_gradient": head_like if trained_table else 0,
        "logits": 4 * shapes.batch * shapes.loss_chunk * shapes.vocab_rows,
        "head_gradient": head_like if shapes.full and not shapes.tied else 0,
        "head_dequantized_moments": moments if shapes.full and not shapes.tied and eight_bit else 0,
        "embedding_dequantized_moments": moments if trained_table and eight_bit else 0,
        "dequantized_head": shapes.vocab_rows * shapes.hidden * shapes.itemsize
        if config.model.quantize_head
        else 0,
        "head_rows_from_host": shapes.vocab_rows * shapes.hidden * shapes.itemsize
        if rows_from_host
        else 0,
        "head_rows_copy": (
            shapes.vocab_rows * shapes.hidden * shapes.itemsize
            if shapes.vocab_rows < shapes.vocab
            and not config.model.quantize_head
            and not rows_from_host
            else 0
        ),
        "base_layer": host_base_bytes(config, model_config) // shapes.layers,
        "dequantized_layer": dequantized_layer_bytes(config, shapes),
        "saved_layer_from_host": saved_layer_from_host_bytes(config, shapes),
        "top_state_on_device": (
            top_optimizer_bytes(config, model_config)
            if config.memory.optimizer_state == "host"
            else 0
        ),
    }


def phase_working_sets(
    config: TrainConfig,
    model_config: ModelConfig,
    target: AttentionTarget,
    calibration: dict[str, float] | None = None,
) -> dict[str, list[WorkingBuffer]]:
    """Each phase's working set on `target`, buffer group by buffer group, with its formula; the
    buffer counts are `calibration` (default: the fit `calibration_key` names in
    calibration.json)."""
    shapes = StepShapes(config, model_config, target)
    terms = raw_terms(config, model_config, target)
    counts = calibration or calibration_counts(shapes.calibration)
    table = _embedding_gradient(shapes, terms)
    backward = [*_layer_backward(shapes, terms, counts), *table]
    if terms["dequantized_layer"]:
        backward.append(
            WorkingBuffer(
                "dequantized_layer",
                terms["dequantized_layer"],
                f"XLA:GPU: the layer's NF4 weights dequantized for the MLP's backward, beyond the "
                f"attention's buffers = max(0, {shapes.layer_linear} x {shapes.itemsize} - "
                f"{sum(attention_bytes(shapes))})",
            )
        )
    if terms["saved_layer_from_host"]:
        backward.append(
            WorkingBuffer(
                "saved_layer_from_host",
                terms["saved_layer_from_host"],
                f"the layer's kept activations brought from the host = B x S x "
                f"{saved_width(config, shapes)} x {shapes.itemsize}",
            )
        )
    if terms["base_layer"]:
        backward.append(_base_in_flight(config, shapes, terms["base_layer"]))
    if DEQUANTIZED in config.memory.save and shapes.calibration.startswith("xla-cpu"):
        backward.append(
            WorkingBuffer(
                "dequantized_weights_ahead",
                shapes.layer_linear * shapes.itemsize,
                f"the next layer's kept dense weights, fetched one layer ahead = "
                f"{shapes.layer_linear} x {shapes.itemsize}",
            )
        )
    phases = {"backward": backward, "loss": _loss_phase(shapes, terms, counts, table)}
    if terms["head_gradient"]:
        phases["head_update"] = [*table, _update_buffer(shapes, terms, counts)]
    if table:
        phases["embedding"] = list(table)
        if terms["embedding_dequantized_moments"]:
            moments = counts["head_dequantized_moments"] * terms["embedding_dequantized_moments"]
            phases["embedding"].append(
                WorkingBuffer(
                    "embedding_update",
                    round(moments),
                    f"{counts['head_dequantized_moments']} x 2 x V x D x 4 (8-bit AdamW's moments "
                    "in float32)",
                )
            )
    return phases


def _layer_backward(
    shapes: StepShapes, terms: dict[str, int], counts: dict[str, float]
) -> list[WorkingBuffer]:
    """One layer's VJP and update: its weights, gradient, optimizer update, activations and the
    attention's buffers."""
    attention_width = (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim
    mlp_count = counts["activations_f_saved"] if shapes.saved_mlp else counts["activations_f"]
    activations = (
        counts["activations_d"] * terms["activations_d"]
        + mlp_count * (terms["activations_f"] + terms["activations_f_saved"])
        + counts["activations_attention"] * terms["activations_attention"]
    )
    return [
        WorkingBuffer(
            "layer_weights",
            round(counts["layer_weights"] * terms["layer_weights"]),
            f"{counts['layer_weights']} x one layer's linear weights x {shapes.itemsize} B = "
            f"{counts['layer_weights']} x {shapes.layer_linear} x {shapes.itemsize}",
        ),
        WorkingBuffer("layer_gradient", terms["layer_gradient"], "one layer's trainable tensors"),
        WorkingBuffer(
            "optimizer_update",
            round(counts["optimizer_state"] * terms["optimizer_state"]),
            f"{counts['optimizer_state']} x one layer's optimizer state "
            f"({terms['optimizer_state']} B)",
        ),
        WorkingBuffer(
            "layer_activations",
            round(activations),
            f"B x S x {shapes.itemsize} x ({counts['activations_d']} D + {mlp_count} F + "
            f"{counts['activations_attention']} (H+2K)h) = {shapes.batch} x {shapes.seq} x "
            f"{shapes.itemsize} x ({counts['activations_d']} x {shapes.hidden} + {mlp_count} x "
            f"{shapes.intermediate} + {counts['activations_attention']} x {attention_width})",
        ),
        _attention_buffer(shapes, terms, counts),
        *_family_buffers(terms, "backward"),
    ]


def _loss_phase(
    shapes: StepShapes,
    terms: dict[str, int],
    counts: dict[str, float],
    table: list[WorkingBuffer],
) -> list[WorkingBuffer]:
    """The LM head and cross-entropy over one sequence chunk, with its VJP: the logits chunk and
    whichever head-sized buffers the settings add (each present only where its term is)."""
    itemsize, rows = shapes.itemsize, shapes.vocab_rows
    whole = rows == shapes.vocab
    loss = [
        WorkingBuffer(
            "logits_chunk",
            round(counts["logits"] * terms["logits"]),
            f"{counts['logits']} x B x chunk x V x 4 = {counts['logits']} x {shapes.batch} x "
            f"{shapes.loss_chunk} x {rows} x 4" + ("" if whole else " (vocab_chunk)"),
        ),
        *table,
    ]
    head_rows = "V" if whole else f"vocab_chunk {rows}"
    optional = (
        ("head_gradient", "head_gradient", f"V x D x {itemsize}: the untied head's gradient"),
        ("dequantized_head", "dequantized_head", f"{head_rows} x D x {itemsize}"),
        (
            "head_rows_from_host",
            "head_rows_from_host",
            f"vocab_chunk x D x {itemsize}: the tied table's rows brought from the host",
        ),
        (
            "head_rows_copy",
            "head_rows_copy",
            f"vocab_chunk x D x {itemsize}: the chunk's head rows, copied for the matmul",
        ),
        (
            "head_optimizer_state",
            "top_state_on_device",
            "the head's/embedding's optimizer state (a row chunk of it for elementwise "
            "optimizers), brought from the host for its update",
        ),
    )
    loss += [WorkingBuffer(name, terms[term], text) for name, term, text in optional if terms[term]]
    return loss + _family_buffers(terms, "loss")


def _family_buffers(terms: dict[str, int], phase: str) -> list[WorkingBuffer]:
    """The buffers a model family adds to `phase` (`memory/family_terms.py`), those it has."""
    return [
        WorkingBuffer(name, terms[name], formula)
        for name, (where, formula) in FAMILY_TERMS.items()
        if where == phase and terms[name]
    ]


def _update_buffer(
    shapes: StepShapes, terms: dict[str, int], counts: dict[str, float]
) -> WorkingBuffer:
    """The untied head's update: its gradient and the copies its update makes, and 8-bit
    AdamW's moments in float32."""
    moments = terms["head_dequantized_moments"]
    return WorkingBuffer(
        "head_update",
        round(
            counts["head_gradient"] * terms["head_gradient"]
            + counts["head_dequantized_moments"] * moments
        ),
        f"{counts['head_gradient']} x V x D x {shapes.itemsize} (the head's gradient and its "
        "update's copies)"
        + (
            f" + {counts['head_dequantized_moments']} x 2 x V x D x 4 (float32 moments)"
            if moments
            else ""
        ),
    )


def _embedding_gradient(shapes: StepShapes, terms: dict[str, int]) -> list[WorkingBuffer]:
    if not terms["embedding_gradient"]:
        return []
    what = (
        "the head's gradient of the tied table, kept for its one update"
        if shapes.tied
        else "the zero table the input cotangent is scattered into (allocated before the loss)"
    )
    return [
        WorkingBuffer(
            "embedding_gradient", terms["embedding_gradient"], f"V x D x {shapes.itemsize}: {what}"
        )
    ]


def _base_in_flight(config: TrainConfig, shapes: StepShapes, layer_bytes: int) -> WorkingBuffer:
    """memory.base: host -- the layers of the frozen base on the device: two on an accelerator
    (the one computing and the next coming over, each a buffer of its own: the copy's
    destination). XLA:CPU has one memory for both, so the layer computing is the slice the loop
    takes with the base on the device too (already in `layer_weights`); the next one's move to
    the device is a copy of its own there (compiled: one layer more than with the base on the
    device).

    One exception, read off XLA's GPU compiler: the fused step (each layer updated in the
    backward pass) with its optimizer state on the host holds one layer at its peak -- the next
    layer is fetched after the MLP's backward, behind the state's slices -- where the kept
    gradient (micro-batches, global clipping) or a state on the device holds two (compiled for
    an H100, deviceless: Llama-3.1-8B QLoRA b1 and b2 x 2048 fused, one 107 MiB NF4 layer fewer
    than b2 x 2048 as two micro-batches; Llama-3.2-1B likewise)."""
    if shapes.calibration.startswith("xla-cpu"):
        return WorkingBuffer(
            "base_layers_in_flight",
            layer_bytes,
            f"XLA:CPU: one memory, the next layer's copy from the host = {layer_bytes}",
        )
    if _fused_with_host_state(config):
        return WorkingBuffer(
            "base_layers_in_flight",
            layer_bytes,
            f"one layer of the frozen base from the host (fused step, optimizer state on the "
            f"host: the next one comes over after the peak) = {layer_bytes}",
        )
    return WorkingBuffer(
        "base_layers_in_flight",
        2 * layer_bytes,
        f"2 x one layer of the frozen base from the host (computing, coming over) = 2 x "
        f"{layer_bytes}",
    )


def _fused_with_host_state(config: TrainConfig) -> bool:
    """Whether the streamed step updates each layer in its backward pass (no kept gradient:
    `step.streamed.gradient_mode`) with the optimizer state in host memory."""
    settings = config.optimizer
    mode = gradient_mode(
        settings.clip_norm, settings.clipping == "two_pass", config.memory.accumulation_steps
    )
    return mode != "kept" and config.memory.optimizer_state == "host"


def _attention_buffer(
    shapes: StepShapes, terms: dict[str, int], counts: dict[str, float]
) -> WorkingBuffer:
    if shapes.attention == "materialized":
        return WorkingBuffer(
            "attention_scores",
            round(counts["attention_scores"] * terms["attention_scores"]),
            f"materialized: {counts['attention_scores']} x B x H x S x S x 4 = "
            f"{counts['attention_scores']} x {shapes.batch} x {shapes.heads} x {shapes.seq}^2 x 4",
        )
    if shapes.attention == "cudnn_padded":
        formula = (
            f"cudnn_padded: B x H x S x (4 + 4 (2h + 1)), the log-sum-exps and cuDNN's backward "
            f"workspace = {shapes.batch} x {shapes.heads} x {shapes.seq} x "
            f"(4 + 4 x {2 * shapes.head_dim + 1})"
        )
    elif shapes.attention == "cudnn":
        formula = (
            f"cudnn: B x H x S x M x (4 + 4 (2h + 1)), cuDNN's statistics and backward workspace "
            f"for M = {shapes.packed_slots} packed slots a row = {shapes.batch} x {shapes.heads} "
            f"x {shapes.seq} x {shapes.packed_slots} x (4 + 4 x {2 * shapes.head_dim + 1}), "
            "with the packed layout and the blockwise fallback's buffers and output"
        )
    elif shapes.attention == "pallas":
        padded, heads = pallas_padded(shapes.seq), shapes.heads
        repeated = f" + 4 x {heads} x {shapes.head_dim} x {shapes.itemsize}"
        grouped = heads > shapes.kv_heads  # the repeated K/V and their gradients
        formula = (
            f"pallas: B x S' x (8 H{' + 4 H h x itemsize' if grouped else ''}) = "
            f"{shapes.batch} x {padded} x (8 x {heads}{repeated if grouped else ''})"
        )
    else:
        tile, tiles = block_size(shapes.seq), blockwise_tiles(shapes.seq, shapes.target.compiler)
        formula = (
            f"blockwise: B x H x (2 S + {tiles} t^2) x 4 = {shapes.batch} x {shapes.heads} x "
            f"(2 x {shapes.seq} + {tiles} x {tile}^2) x 4"
        )
    return WorkingBuffer(f"attention_{shapes.attention}", terms["attention_blockwise"], formula)


def working_set_floor(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> int:
    """The largest phase with every tensor counted once: (one layer's weights in the compute
    dtype unless trainable, its gradient, its intermediates x, q, k, v, attended, gate, up, their
    product and the attention's buffers: float32 scores B x H x S x S when materialized) or (one
    logits chunk and the head's gradient: the tied table's, or the untied head's) or (the
    embedding's gradient). The implementation's floor, not XLA's: every tensor it needs, each
    once."""
    shapes = StepShapes(config, model_config, target)
    terms = raw_terms(config, model_config, target)
    intermediates = (
        shapes.tokens
        * shapes.itemsize
        * (2 * shapes.hidden + (2 * shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim)
        + shapes.batch * shapes.mlp_seq * shapes.itemsize * 3 * shapes.intermediate
    )
    backward = (
        (0 if shapes.full else terms["layer_weights"])
        + terms["layer_gradient"]
        + intermediates
        + terms["attention_scores"]
        + terms["attention_blockwise"]
    )
    head = terms["embedding_gradient"] if shapes.tied else terms["head_gradient"]
    return max(backward, terms["logits"] + head, terms["embedding_gradient"])
