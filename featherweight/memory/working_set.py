"""The working set of the streamed step's peak phase: the bytes beyond what persists and what
the forward pass stores, per phase, from shapes and calibrated buffer counts.

    backward phase: one layer's VJP and update
      layer_weights        c_w x one layer's linear weights in the compute dtype (sliced, or
                           dequantized from NF4: the copy the matmuls read)
      dequantized_weights_ahead  `save: dequantized` (QLoRA) on XLA:CPU: the next layer's kept
                           dense weights, one layer's linear weights x itemsize, sliced from the
                           kept stack one layer ahead as the layer inputs are (XLA:GPU makes
                           no such copy)
      dequantized_layer    XLA:GPU, QLoRA: the layer's NF4 weights dequantized for the MLP's
                           backward, beyond the attention's buffers: the phase peaks at the larger
                           of the two moments, max(attention, L's linear weights x itemsize)
                           (`dequantized_layer_bytes`)
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
                           blockwise) and output (B S H h x itemsize) beside them; the
                           workspace is 4 (B M) H S (2h + 1) bytes;
                           pallas: its log-sum-exps and row terms (2 B H S' x 4, S' the
                           sequence padded to its tile) and, for grouped K/V, the repeated K
                           and V and their gradients, 4 B S' H h x itemsize
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
      head_update          c_h x V x D x itemsize (its gradient and the copies its update
                           makes), + c_m x the float32 moments with 8-bit AdamW (below)
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

Each term is written once, as a product of named factors (`memory/terms.py`): the bytes and the
formula the plan prints both come from it. The compiles each term was read off are in
benchmarks/results/working_set_notes.md.

`temporaries` (what XLA reports as temp) = the stored activations + the peak phase's working set
(the embedding phase runs after the backward pass has freed them: where it is the peak, the plan
is high by their bytes).
The buffer counts c_* are how many such buffers XLA keeps alive at once. They are data, not code:
`calibration.json` holds them per compiler and dtype together with the compiled measurements they
were fitted on and their provenance; `python -m featherweight.dev.calibrate` measures a fit grid
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
from featherweight.memory.terms import Factor, Term, number
from featherweight.models.attention import block_size
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig
from featherweight.models.fused_attention import pallas_tile
from featherweight.models.moe import block_rows, padded_rows
from featherweight.models.shapes import layer_shapes
from featherweight.optim.adamw8bit import BLOCK_SIZE
from featherweight.recipe.build import attention_implementation, packed_slots
from featherweight.recipe.schema import TrainConfig
from featherweight.step.loss import resolve_chunk_size
from featherweight.step.policy import DEQUANTIZED
from featherweight.step.streamed import gradient_mode

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
DEFAULT_CALIBRATION = "xla-cpu/float32"
# float32 tiles of blockwise attention alive at once in its backward (scores, probabilities,
# their cotangents), and by compiler in a step whose sequence is one lone tile (S <= the block),
# where XLA:CPU shares one with the rest of the layer's backward; the compiles they were read
# off: benchmarks/results/working_set_notes.md
BLOCKWISE_TILES = 4
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
    `python -m featherweight.dev.calibrate` together with the measurements it fitted)."""
    calibrations = json.loads(CALIBRATION_FILE.read_text())["calibrations"]
    if key not in calibrations:
        raise ConfigError(
            f"no working-set calibration {key!r} in {CALIBRATION_FILE.name}; known: "
            f"{', '.join(sorted(calibrations))} (fit one with python -m "
            "featherweight.dev.calibrate)"
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
    scores, other = attention_terms(shapes)
    return scores.bytes, other.bytes


def attention_terms(shapes: StepShapes) -> tuple[Term, Term]:
    """The attention the step calls, as terms: (materialized scores, before their calibrated
    count; every other implementation's buffers, counted once); one of the two is empty.
    blockwise: its log-sum-exps and row terms and its float32 tiles; cudnn_padded: the
    log-sum-exps and cuDNN's backward workspace; cudnn (packed rows): cuDNN's statistics and
    workspace for M documents a row, the layout's int32 arrays, and the blockwise fallback's
    buffers and output beside them (`packed_or_fallback`); pallas: its log-sum-exps and row terms
    over the padded sequence and, for grouped K/V, the repeated K and V and their gradients."""
    b, h, s = Factor("B", shapes.batch), Factor("H", shapes.heads), Factor("S", shapes.seq)
    four = number(4)
    if shapes.attention == "materialized":
        return Term.of(b, h, s, s, four), Term()
    if shapes.attention == "cudnn_padded":
        return Term(), Term.sum(Term.of(four, b, h, s), _cudnn_workspace(shapes, slots=None))
    if shapes.attention == "cudnn":
        m = Factor("M", shapes.packed_slots)
        fallback = Term.of(
            b, s, h, Factor("h", shapes.head_dim), Factor("itemsize", shapes.itemsize)
        )
        layout = Term.of(number(16), b, Factor("(M + 1)", shapes.packed_slots + 1))
        parts = (Term.of(four, b, h, s, m), _cudnn_workspace(shapes, m), layout, fallback)
        return Term(), Term.sum(*parts, _blockwise_term(shapes))
    if shapes.attention == "pallas":
        padded = Factor("S'", pallas_padded(shapes.seq))
        repeated = Term.of(
            number(4),
            b,
            padded,
            h,
            Factor("h", shapes.head_dim),
            Factor("itemsize", shapes.itemsize),
        ).when(shapes.heads > shapes.kv_heads)
        return Term(), Term.sum(Term.of(number(8), b, h, padded), repeated)
    return Term(), _blockwise_term(shapes)


def _cudnn_workspace(shapes: StepShapes, slots: Factor | None) -> Term:
    """cuDNN's backward workspace for B (x M packed slots) sequences (`cudnn_workspace_bytes`)."""
    sequences = (Factor("B", shapes.batch),) + (() if slots is None else (slots,))
    return Term.of(
        number(4),
        *sequences,
        Factor("H", shapes.heads),
        Factor("S", shapes.seq),
        Factor("(2h + 1)", 2 * shapes.head_dim + 1),
    )


def cudnn_workspace_bytes(sequences: int, heads: int, seq: int, head_dim: int) -> int:
    """The workspace cuDNN's fused attention backward (`__cudnn$fmhaSoftmaxBackward`) takes for
    `sequences` sequences of `seq` positions: 4 x sequences x H x S x (2h + 1) bytes, two float32
    accumulators of the query's shape and a float32 row term per sequence. In the packed layout
    every row is M sequences of up to S positions (`recipe.build.packed_slots`), so it is M
    times the padded layout's. Read off a step compiled on an H200
    (benchmarks/results/working_set_notes.md); the padded layout's (one sequence a row) is the
    same formula at M = 1, not yet read off a GPU."""
    return 4 * sequences * heads * seq * (2 * head_dim + 1)


def _blockwise_term(shapes: StepShapes) -> Term:
    """Blockwise attention's log-sum-exps and row terms and its float32 tiles."""
    tile = block_size(shapes.seq)
    padded = -(-shapes.seq // tile) * tile
    tiles = blockwise_tiles(shapes.seq, shapes.target.compiler)
    b, h, t = Factor("B", shapes.batch), Factor("H", shapes.heads), Factor("t", tile)
    return Term.sum(
        Term.of(number(4), b, h, number(2), Factor("padded S", padded)),
        Term.of(number(4), b, h, Factor("tiles", tiles), t, t),
    )


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
    dequantized dense into the compute dtype for the matmuls and the attention's tiles are no
    longer alive. So the phase holds its calibrated buffers plus max(attention, dense layer),
    counted as the attention plus this difference. The calibrated counts come from toy models
    whose dense layer is far below their attention's tiles, where this is 0; the 8B step read
    off XLA's GPU compiler is not (benchmarks/results/working_set_notes.md). XLA:CPU's count of
    the layer's weights (`layer_weights`, c_w) already holds the copy; with `save: dequantized`
    the backward reads the kept dense stack and dequantizes nothing."""
    quantized = config.method == "qlora" and DEQUANTIZED not in config.memory.save
    if not quantized or not shapes.calibration.startswith("xla-gpu"):
        return 0
    return max(0, _dense_layer(shapes).bytes - sum(attention_bytes(shapes)))


def _dense_layer(shapes: StepShapes) -> Term:
    """One layer's linear weights in the compute dtype."""
    return Term.of(
        Factor("one layer's linear weights", shapes.layer_linear),
        Factor("itemsize", shapes.itemsize),
    )


def saved_width(config: TrainConfig, shapes: StepShapes) -> int:
    """Values per token and layer the forward keeps for the backward (`memory.save`): q, k, v
    (qkv), the attention's output and its residual (attention), the MLP's gate and up
    (mlp_hidden): of an MoE layer, the gate and up of every routed row -- each token's top k, sorted
    by expert and each expert's group padded to whole blocks (`models/moe.padded_rows`), k times
    and more a dense MLP's; compiled for the H100, Qwen3-30B-A3B's 6 GiB settings kept 2.5 GiB
    more than a plan counting one row a token."""
    widths = {
        "qkv": (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim,
        "attention": shapes.heads * shapes.head_dim + shapes.hidden,
        "mlp_hidden": 2 * shapes.intermediate * shapes.routed_rows // max(1, shapes.tokens),
    }
    return sum(widths.get(name, 0) for name in config.memory.save)


def _saved_layer_from_host(config: TrainConfig, shapes: StepShapes) -> Term:
    """XLA:GPU, kept activations in host memory (`memory.save` with residuals: host): the layer's
    saved intermediates the backward brings to the device, B x S x width x itemsize (read off
    XLA's GPU compiler: benchmarks/results/working_set_notes.md). XLA:CPU has one memory: the
    stored component holds them there."""
    on_gpu = shapes.calibration.startswith("xla-gpu")
    return Term.of(
        Factor("B", shapes.batch),
        Factor("S", shapes.seq),
        Factor("saved width", saved_width(config, shapes)),
        Factor("itemsize", shapes.itemsize),
    ).when(config.memory.residuals == "host" and on_gpu)


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
        model = self.model_config = model_config
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
        # the MLP's rows: a token each, or an MoE's routed rows (each token's top k, padded)
        self.routed_rows = (
            padded_rows(
                self.tokens * model.experts_per_token,
                model.num_experts,
                block_rows(self.tokens * model.experts_per_token, model.num_experts),
            )
            if model.num_experts
            else self.tokens
        )
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


def step_terms(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> dict[str, Term]:
    """The working set's terms for `target`, each counted once (before the calibrated counts),
    as products of named factors: the plan's bytes and its printed formulas both come from
    these (`raw_terms` is their bytes)."""
    shapes = StepShapes(config, model_config, target)
    layer, head = _layer_terms(config, model_config, shapes), _head_terms(config, shapes)
    family = family_terms(
        model_config,
        target.compiler,
        shapes.tokens,
        logits_bytes=head["logits"].bytes,
        lone_softcap_tile_bytes=_lone_tile_bytes(shapes),
        mlp_tokens=shapes.batch * shapes.mlp_seq,
        itemsize=shapes.itemsize,
        dense_experts=config.method != "qlora",
    )
    families = {
        name: Term.of(Factor(name, value)).when(value > 0) for name, value in family.items()
    }
    return {**layer, **families, **head}


def _layer_terms(
    config: TrainConfig, model_config: ModelConfig, shapes: StepShapes
) -> dict[str, Term]:
    """One layer's backward: its weights, gradient and optimizer state, the remat forward's
    activations and their cotangents, the attention, and what host placements bring over."""
    b, s = Factor("B", shapes.batch), Factor("S", shapes.seq)
    itemsize = Factor("itemsize", shapes.itemsize)
    mlp = Term.of(
        b, Factor("MLP chunk", shapes.mlp_seq), itemsize, Factor("F", shapes.intermediate)
    )
    scores, attention = attention_terms(shapes)
    width = (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim
    dequantized_layer = dequantized_layer_bytes(config, shapes)
    base_layer = host_base_bytes(config, model_config) // shapes.layers
    return {
        "layer_weights": _dense_layer(shapes),
        "layer_gradient": Term.of(
            Factor("one layer's trainable tensors", layer_gradient_bytes(config, model_config))
        ),
        "optimizer_state": Term.of(
            Factor("one layer's optimizer state", layer_optimizer_bytes(config, model_config))
        ),
        "activations_d": Term.of(b, s, itemsize, Factor("D", shapes.hidden)),
        "activations_f": mlp.when(not shapes.saved_mlp),
        "activations_f_saved": mlp.when(shapes.saved_mlp),
        "activations_attention": Term.of(b, s, itemsize, Factor("(H + 2K) h", width)),
        "attention_scores": scores,
        "attention_blockwise": attention,
        "base_layer": Term.of(Factor("one layer of the frozen base", base_layer)).when(
            config.memory.base == "host"
        ),
        "dequantized_layer": Term.of(
            Factor(f"max(0, {_dense_layer(shapes).symbols} - attention)", dequantized_layer)
        ).when(dequantized_layer > 0),
        "saved_layer_from_host": _saved_layer_from_host(config, shapes),
    }


def _head_terms(config: TrainConfig, shapes: StepShapes) -> dict[str, Term]:
    """The LM head's and the embedding's: the logits chunk, the head's and the table's
    gradients, 8-bit AdamW's moments of them, and the head's rows each setting copies."""
    v, d = Factor("V", shapes.vocab), Factor("D", shapes.hidden)
    itemsize = Factor("itemsize", shapes.itemsize)
    rows = Factor("V" if shapes.vocab_rows == shapes.vocab else "vocab_chunk", shapes.vocab_rows)
    head_like, head_rows = Term.of(v, d, itemsize), Term.of(rows, d, itemsize)
    eight_bit = config.optimizer.name == "adamw_8bit"
    # full fine-tuning updates the embedding after the backward loop; on the host (untied) it
    # is updated in row chunks, so no V x D gradient exists on the device
    trained_table = shapes.full and config.memory.embed == "device"
    # 8-bit AdamW's two moments of a V x D tensor in float32: the new ones, and the old ones
    # dequantized -- unless a row is one quantization block, where the blocks' reshapes are
    # identities and XLA fuses the dequantization into the update (compiled on XLA:CPU)
    copies = Factor("(new and old)", 1 if shapes.hidden == BLOCK_SIZE else 2)
    moments = Term.of(number(2), v, d, number(4), copies)
    rows_from_host = config.memory.embed == "host" and shapes.tied and not shapes.full
    top_state = top_optimizer_bytes(config, shapes.model_config)
    return {
        "embedding_gradient": head_like.when(trained_table),
        "logits": Term.of(
            number(4), Factor("B", shapes.batch), Factor("chunk", shapes.loss_chunk), rows
        ),
        "head_gradient": head_like.when(shapes.full and not shapes.tied),
        "head_dequantized_moments": moments.when(shapes.full and not shapes.tied and eight_bit),
        "embedding_dequantized_moments": moments.when(trained_table and eight_bit),
        "dequantized_head": head_rows.when(config.model.quantize_head),
        "head_rows_from_host": head_rows.when(rows_from_host),
        "head_rows_copy": head_rows.when(
            shapes.vocab_rows < shapes.vocab
            and not config.model.quantize_head
            and not rows_from_host
        ),
        "top_state_on_device": Term.of(
            Factor("the head's/embedding's optimizer state", top_state)
        ).when(config.memory.optimizer_state == "host"),
    }


def raw_terms(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> dict[str, int]:
    """The working set's terms in bytes for `target`, each counted once (before the calibrated
    counts): what the calibration fits its counts to."""
    return {name: term.bytes for name, term in step_terms(config, model_config, target).items()}


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
    terms = step_terms(config, model_config, target)
    counts = calibration or calibration_counts(shapes.calibration)
    table = _buffers(terms, [("embedding_gradient", "embedding_gradient", _table_note(shapes))])
    backward = [*_layer_backward(shapes, terms, counts), *table]
    backward += _buffers(
        terms,
        [
            (
                "dequantized_layer",
                "dequantized_layer",
                "XLA:GPU: the layer's NF4 weights dequantized for the MLP's backward, beyond the "
                "attention's buffers",
            ),
            (
                "saved_layer_from_host",
                "saved_layer_from_host",
                "the layer's kept activations brought from the host",
            ),
        ],
    )
    if terms["base_layer"].bytes:
        backward.append(_base_in_flight(config, shapes, terms["base_layer"]))
    if DEQUANTIZED in config.memory.save and shapes.calibration.startswith("xla-cpu"):
        ahead = "the next layer's kept dense weights, fetched one layer ahead"
        backward.append(_buffer("dequantized_weights_ahead", _dense_layer(shapes), ahead))
    phases = {"backward": backward, "loss": _loss_phase(shapes, terms, counts, table)}
    if terms["head_gradient"].bytes:
        phases["head_update"] = [*table, _update_buffer(terms, counts)]
    if table:
        phases["embedding"] = list(table)
        moments = terms["embedding_dequantized_moments"]
        if moments.bytes:
            scaled = moments.times(counts["head_dequantized_moments"])
            what = "8-bit AdamW's moments in float32"
            phases["embedding"].append(_buffer("embedding_update", scaled, what))
    return phases


def _buffer(name: str, term: Term, what: str = "") -> WorkingBuffer:
    """A buffer group whose bytes and formula both come from `term`; `what` says what it holds."""
    return WorkingBuffer(name, term.bytes, f"{what}: {term.formula}" if what else term.formula)


def _buffers(terms: dict[str, Term], named: list[tuple[str, str, str]]) -> list[WorkingBuffer]:
    """(buffer name, term name, what it holds) for each term that has bytes."""
    return [_buffer(name, terms[term], what) for name, term, what in named if terms[term].bytes]


def _layer_backward(
    shapes: StepShapes, terms: dict[str, Term], counts: dict[str, float]
) -> list[WorkingBuffer]:
    """One layer's VJP and update: its weights, gradient, optimizer update, activations and the
    attention's buffers."""
    mlp_count = counts["activations_f_saved"] if shapes.saved_mlp else counts["activations_f"]
    activations = Term.sum(
        terms["activations_d"].times(counts["activations_d"]),
        Term.sum(terms["activations_f"], terms["activations_f_saved"]).times(mlp_count),
        terms["activations_attention"].times(counts["activations_attention"]),
    )
    if shapes.attention == "materialized":
        attention = terms["attention_scores"].times(counts["attention_scores"])
        attention_name = "attention_scores"
    else:
        attention, attention_name = terms["attention_blockwise"], f"attention_{shapes.attention}"
    return [
        _buffer("layer_weights", terms["layer_weights"].times(counts["layer_weights"])),
        _buffer("layer_gradient", terms["layer_gradient"]),
        _buffer("optimizer_update", terms["optimizer_state"].times(counts["optimizer_state"])),
        _buffer("layer_activations", activations),
        _buffer(attention_name, attention, _attention_note(shapes)),
        *_family_buffers(terms, "backward"),
    ]


def _attention_note(shapes: StepShapes) -> str:
    """The attention the step calls, with cuDNN's packed slots where they count."""
    if shapes.attention == "cudnn":
        return f"cudnn, M = {shapes.packed_slots} packed slots a row"
    return shapes.attention


def _loss_phase(
    shapes: StepShapes,
    terms: dict[str, Term],
    counts: dict[str, float],
    table: list[WorkingBuffer],
) -> list[WorkingBuffer]:
    """The LM head and cross-entropy over one sequence chunk, with its VJP: the logits chunk and
    whichever head-sized buffers the settings add (each present only where its term is)."""
    optional = [
        ("head_gradient", "head_gradient", "the untied head's gradient"),
        ("dequantized_head", "dequantized_head", "the dense copy the head matmul reads"),
        (
            "head_rows_from_host",
            "head_rows_from_host",
            "the tied table's rows brought from the host",
        ),
        ("head_rows_copy", "head_rows_copy", "the chunk's head rows, copied for the matmul"),
        (
            "head_optimizer_state",
            "top_state_on_device",
            "a row chunk of it for elementwise optimizers, brought from the host for its update",
        ),
    ]
    logits = _buffer("logits_chunk", terms["logits"].times(counts["logits"]))
    return [logits, *table, *_buffers(terms, optional), *_family_buffers(terms, "loss")]


def _family_buffers(terms: dict[str, Term], phase: str) -> list[WorkingBuffer]:
    """The buffers a model family adds to `phase` (`memory/family_terms.py`), those it has."""
    return [
        WorkingBuffer(name, terms[name].bytes, formula)
        for name, (where, formula) in FAMILY_TERMS.items()
        if where == phase and terms[name].bytes
    ]


def _update_buffer(terms: dict[str, Term], counts: dict[str, float]) -> WorkingBuffer:
    """The untied head's update: its gradient and the copies its update makes, and 8-bit
    AdamW's moments in float32."""
    update = Term.sum(
        terms["head_gradient"].times(counts["head_gradient"]),
        terms["head_dequantized_moments"].times(counts["head_dequantized_moments"]),
    )
    return _buffer("head_update", update, "the head's gradient, its update's copies and moments")


def _table_note(shapes: StepShapes) -> str:
    """What the embedding's gradient is: the tied table's, or the untied one's scatter target."""
    if shapes.tied:
        return "the head's gradient of the tied table, kept for its one update"
    return "the zero table the input cotangent is scattered into (allocated before the loss)"


def _base_in_flight(config: TrainConfig, shapes: StepShapes, layer: Term) -> WorkingBuffer:
    """memory.base: host -- the layers of the frozen base on the device: two on an accelerator
    (the one computing and the next coming over, each a buffer of its own: the copy's
    destination). XLA:CPU has one memory for both, so the layer computing is the slice the loop
    takes with the base on the device too (already in `layer_weights`); the next one's move to
    the device is a copy of its own there. The fused step (each layer updated in the backward
    pass) with its optimizer state on the host holds one layer at its peak on XLA's GPU
    compiler: the next layer is fetched after the MLP's backward, behind the state's slices
    (read off the compiler: benchmarks/results/working_set_notes.md)."""
    if shapes.calibration.startswith("xla-cpu"):
        what = "XLA:CPU: one memory, the next layer's copy from the host"
        return _buffer("base_layers_in_flight", layer, what)
    if _fused_with_host_state(config):
        what = "the fused step with its optimizer state on the host: one layer; the next comes after the peak"
        return _buffer("base_layers_in_flight", layer, what)
    what = "the layers of the frozen base from the host, computing and coming over"
    return _buffer("base_layers_in_flight", layer.times(2), what)


def _fused_with_host_state(config: TrainConfig) -> bool:
    """Whether the streamed step updates each layer in its backward pass (no kept gradient:
    `step.streamed.gradient_mode`) with the optimizer state in host memory."""
    settings = config.optimizer
    mode = gradient_mode(
        settings.clip_norm, settings.clipping == "two_pass", config.memory.accumulation_steps
    )
    return mode != "kept" and config.memory.optimizer_state == "host"


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
