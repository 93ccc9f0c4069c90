"""The working set of the streamed step's peak phase: the bytes beyond what persists and what
the forward pass stores, per phase, from shapes and calibrated buffer counts.

    backward phase: one layer's VJP and update
      layer_weights        c_w x one layer's linear weights in the compute dtype (sliced, or
                           dequantized from NF4: the copy the matmuls read)
      layer_gradient       one layer's gradient of the trainable tensors (plus, for tied
                           embeddings in full fine-tuning, the V x D embedding gradient, alive
                           through the whole backward loop)
      optimizer_update     c_o x one layer's optimizer state (its slices and the new state)
      layer_activations    B S itemsize x (c_d D + c_f F + c_a (H + 2K) h): the remat forward
                           and its cotangents
      attention            the attention the step calls (`models/attention.py`):
                           materialized: c_s x B x H x S x S x 4, float32 scores and probabilities;
                           blockwise: its log-sum-exps and row terms (2 B H S x 4) and four float32
                           tiles of B x H x t x t (scores, probabilities, their cotangents; t the
                           tile edge), counted once; cudnn: the log-sum-exps and cuDNN's float32 dQ
                           accumulator, B H S (h + 1) x 4
    loss phase: LM head + cross-entropy over one sequence chunk, with its VJP
      logits_chunk         c_l x B x chunk x V x 4 (V: vocab_chunk when the head is chunked)
      head_gradient        full fine-tuning: c_h x V x D x itemsize (gradient + update), + c_m x
                           2 V D x 4 with 8-bit AdamW (its moments dequantized to float32)
      dequantized_head     quantize_head: V (or vocab_chunk) x D x itemsize, the dense copy the
                           head matmul reads
      head_rows_from_host  tied embedding on the host: the vocab_chunk rows brought over
      head_optimizer_state optimizer state on the host: the largest head/embedding state, on
                           the device for its one update
    (mlp_chunk replaces S by the chunk in the F term of layer_activations)

`temporaries` (what XLA reports as temp) = the stored activations + the peak phase's working set.
The buffer counts c_* are how many such buffers XLA keeps alive at once. They are data, not code:
`calibration.json` holds them per compiler and dtype together with the compiled measurements they
were fitted on and their provenance; `python -m featherweight.memory.calibrate` measures a fit grid
and a held-out grid, fits them (non-negative least squares on the relative error of temp) and
writes the file; tests/memory/test_calibration.py checks the fit and the held-out error.

Which counts a plan uses is the compiler it is for, never the machine it runs on: the target
(`featherweight plan --target h100` plans within `calibration_for("xla-gpu/bfloat16")`), else the
local backend and the config's dtype. A compiler and dtype without a fit of their own use the
XLA:CPU float32 counts, and the plan says so. The attention the plan counts is the one the step
calls: `attention_of` resolves `memory.attention` exactly as the step builder does
(`recipe.build.attention_implementation`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import NamedTuple

from featherweight.errors import ConfigError
from featherweight.memory.state_bytes import (
    compute_itemsize,
    host_base_bytes,
    layer_gradient_bytes,
    layer_optimizer_bytes,
    top_optimizer_bytes,
)
from featherweight.models.attention import AttentionTarget, block_size
from featherweight.models.config import ModelConfig
from featherweight.models.shapes import layer_shapes
from featherweight.recipe.build import attention_implementation
from featherweight.recipe.schema import TrainConfig
from featherweight.step.loss import resolve_chunk_size

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
DEFAULT_CALIBRATION = "xla-cpu/float32"
# float32 tiles of blockwise attention alive at once in its backward on XLA:CPU (compiled: the
# temp of its forward and backward grows by 4.04 tiles from a 512 to a 1024 tile at S = 2048)
BLOCKWISE_TILES = 4
_TARGET_CALIBRATION: ContextVar[str | None] = ContextVar("target_calibration", default=None)


@functools.lru_cache(maxsize=1)
def known_calibrations() -> frozenset[str]:
    """The compiler/dtype keys calibration.json holds."""
    return frozenset(json.loads(CALIBRATION_FILE.read_text())["calibrations"])


@contextlib.contextmanager
def calibration_for(compiler: str) -> Iterator[None]:
    """Plans made inside use the counts of `compiler` ("xla-gpu" or "xla-cpu") and each config's
    dtype: how `--target` picks the calibration for every plan of a command (the budget search's
    candidates included)."""
    token = _TARGET_CALIBRATION.set(compiler)
    try:
        yield
    finally:
        _TARGET_CALIBRATION.reset(token)


def calibration_key(config: TrainConfig) -> str:
    """The calibration a plan of `config` uses: the target's compiler (`calibration_for`, else
    the local backend's) and the config's dtype; `DEFAULT_CALIBRATION` when that has no fit."""
    compiler = _TARGET_CALIBRATION.get()
    if compiler is None:
        import jax

        compiler = f"xla-{jax.default_backend()}"
    key = f"{compiler}/{config.model.dtype}"
    return key if key in known_calibrations() else DEFAULT_CALIBRATION


@functools.lru_cache(maxsize=8)
def calibration_counts(key: str = DEFAULT_CALIBRATION) -> dict[str, float]:
    """The buffer counts fitted for a compiler and dtype (`calibration.json`, written by
    `python -m featherweight.memory.calibrate` together with the measurements it fitted)."""
    calibrations = json.loads(CALIBRATION_FILE.read_text())["calibrations"]
    if key not in calibrations:
        raise ConfigError(
            f"no working-set calibration {key!r} in {CALIBRATION_FILE.name}; known: "
            f"{', '.join(sorted(calibrations))} (fit one with python -m featherweight.memory.calibrate)"
        )
    return dict(calibrations[key]["counts"])


def attention_of(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> str:
    """The attention implementation the configured step calls on `target` (default: this
    process's device): "blockwise", "cudnn" or "materialized"."""
    return attention_implementation(config, model_config, target)


def attention_bytes(s: StepShapes) -> tuple[int, int]:
    """(materialized scores B x H x S x S x 4 before their calibrated count, the other
    implementations' buffers counted once); one of the two is zero."""
    if s.attention == "materialized":
        return 4 * s.B * s.H * s.S * s.S, 0
    if s.attention == "cudnn":
        return 0, 4 * s.B * s.H * s.S * (s.h + 1)
    tile = block_size(s.S)
    padded = -(-s.S // tile) * tile
    return 0, 4 * s.B * s.H * (2 * padded + BLOCKWISE_TILES * tile * tile)


class WorkingBuffer(NamedTuple):
    """A group of buffers of one phase: name, planned bytes, formula with this run's numbers."""

    name: str
    bytes: int
    formula: str


class StepShapes:
    """The numbers the formulas use, read once from the configs."""

    def __init__(self, config: TrainConfig, model_config: ModelConfig) -> None:
        m = model_config
        self.L, self.D, self.F = m.num_layers, m.hidden_size, m.intermediate_size
        self.V, self.H, self.K, self.h = m.vocab_size, m.num_heads, m.num_kv_heads, m.head_dim
        self.B, self.S = config.batch_size, config.data.seq_len
        self.T = self.B * self.S
        self.a = compute_itemsize(config)
        self.chunk = resolve_chunk_size(self.S, config.memory.loss_chunk)
        # vocabulary rows of the head at a time, and the MLP's sequence chunk
        vocab_chunk, mlp_chunk = config.memory.vocab_chunk, config.memory.mlp_chunk
        self.Vc = self.V if vocab_chunk is None else min(self.V, vocab_chunk)
        self.Sm = self.S if mlp_chunk is None else min(self.S, mlp_chunk)
        # the linear weights of one layer: its 2-D tensors (norms and biases are 1-D)
        self.linear = sum(math.prod(shape) for shape in layer_shapes(m).values() if len(shape) == 2)
        self.full = config.method == "full"
        self.attention = attention_of(config, model_config)
        self.tied = m.tie_word_embeddings


def raw_terms(config: TrainConfig, model_config: ModelConfig) -> dict[str, int]:
    """The working set's terms in bytes, each counted once (before the calibrated counts)."""
    s = StepShapes(config, model_config)
    head_like = s.V * s.D * s.a
    eight_bit = config.optimizer.name == "adamw_8bit"
    return {
        "layer_weights": s.linear * s.a,
        "layer_gradient": layer_gradient_bytes(config, model_config),
        "optimizer_state": layer_optimizer_bytes(config, model_config),
        "activations_d": s.T * s.a * s.D,
        "activations_f": s.B * s.Sm * s.a * s.F,
        "activations_attention": s.T * s.a * (s.H + 2 * s.K) * s.h,
        "attention_scores": attention_bytes(s)[0],
        "attention_blockwise": attention_bytes(s)[1],
        "tied_embedding_gradient": head_like if s.full and s.tied else 0,
        "logits": 4 * s.B * s.chunk * s.Vc,
        "head_gradient": head_like if s.full else 0,
        "head_dequantized_moments": 8 * s.V * s.D if s.full and eight_bit else 0,
        "dequantized_head": s.Vc * s.D * s.a if config.model.quantize_head else 0,
        "head_rows_from_host": (
            s.Vc * s.D * s.a if config.memory.embed == "host" and s.tied and not s.full else 0
        ),
        "base_layer": host_base_bytes(config, model_config) // s.L,
        "top_state_on_device": (
            top_optimizer_bytes(config, model_config)
            if config.memory.optimizer_state == "host"
            else 0
        ),
    }


def phase_working_sets(
    config: TrainConfig, model_config: ModelConfig, calibration: dict[str, float] | None = None
) -> dict[str, list[WorkingBuffer]]:
    """Each phase's working set, buffer group by buffer group, with its formula; the buffer counts
    are `calibration` (default: the fit `calibration_key` names in calibration.json)."""
    s, t = StepShapes(config, model_config), raw_terms(config, model_config)
    c = calibration or calibration_counts(calibration_key(config))
    attention_width = (s.H + 2 * s.K) * s.h
    backward = [
        WorkingBuffer(
            "layer_weights",
            round(c["layer_weights"] * t["layer_weights"]),
            f"{c['layer_weights']} x one layer's linear weights x {s.a} B = "
            f"{c['layer_weights']} x {s.linear} x {s.a}",
        ),
        WorkingBuffer(
            "layer_gradient",
            t["layer_gradient"] + t["tied_embedding_gradient"],
            "one layer's trainable tensors"
            + (" + tied embedding gradient V x D" if t["tied_embedding_gradient"] else ""),
        ),
        WorkingBuffer(
            "optimizer_update",
            round(c["optimizer_state"] * t["optimizer_state"]),
            f"{c['optimizer_state']} x one layer's optimizer state ({t['optimizer_state']} B)",
        ),
        WorkingBuffer(
            "layer_activations",
            round(
                c["activations_d"] * t["activations_d"]
                + c["activations_f"] * t["activations_f"]
                + c["activations_attention"] * t["activations_attention"]
            ),
            f"B x S x {s.a} x ({c['activations_d']} D + {c['activations_f']} F + "
            f"{c['activations_attention']} (H+2K)h) = {s.B} x {s.S} x {s.a} x "
            f"({c['activations_d']} x {s.D} + {c['activations_f']} x {s.F} + "
            f"{c['activations_attention']} x {attention_width})",
        ),
        _attention_buffer(s, t, c),
    ]
    if t["base_layer"]:
        backward.append(_base_in_flight(config, t["base_layer"]))
    loss = [
        WorkingBuffer(
            "logits_chunk",
            round(c["logits"] * t["logits"]),
            f"{c['logits']} x B x chunk x V x 4 = {c['logits']} x {s.B} x {s.chunk} x {s.Vc} x 4"
            + ("" if s.Vc == s.V else " (vocab_chunk)"),
        ),
    ]
    if t["head_gradient"]:
        moments = t["head_dequantized_moments"]
        loss.append(
            WorkingBuffer(
                "head_gradient",
                round(
                    c["head_gradient"] * t["head_gradient"]
                    + c["head_dequantized_moments"] * moments
                ),
                f"{c['head_gradient']} x V x D x {s.a} (gradient and update of the head)"
                + (
                    f" + {c['head_dequantized_moments']} x 2 x V x D x 4 (float32 moments)"
                    if moments
                    else ""
                ),
            )
        )
    if t["dequantized_head"]:
        rows = "V" if s.Vc == s.V else f"vocab_chunk {s.Vc}"
        loss.append(WorkingBuffer("dequantized_head", t["dequantized_head"], f"{rows} x D x {s.a}"))
    if t["head_rows_from_host"]:
        loss.append(
            WorkingBuffer(
                "head_rows_from_host",
                t["head_rows_from_host"],
                f"vocab_chunk x D x {s.a}: the tied table's rows brought from the host",
            )
        )
    if t["top_state_on_device"]:
        loss.append(
            WorkingBuffer(
                "head_optimizer_state",
                t["top_state_on_device"],
                "the head's/embedding's optimizer state (a row chunk of it for elementwise "
                "optimizers), brought from the host for its update",
            )
        )
    return {"backward": backward, "loss": loss}


def _base_in_flight(config: TrainConfig, layer_bytes: int) -> WorkingBuffer:
    """memory.base: host -- the layers of the frozen base on the device: two on an accelerator
    (the one computing and the next coming over, each a buffer of its own: the copy's
    destination). XLA:CPU has one memory for both, so its host-to-device copies are no-ops and
    the two are the layer slices the loop takes with the base on the device too (compiled: the
    same temp bytes either way), already in `layer_weights`: none more."""
    if calibration_key(config).startswith("xla-cpu"):
        return WorkingBuffer(
            "base_layers_in_flight", 0, "XLA:CPU: one memory, the copies are the layer slices"
        )
    return WorkingBuffer(
        "base_layers_in_flight",
        2 * layer_bytes,
        f"2 x one layer of the frozen base from the host (computing, coming over) = 2 x "
        f"{layer_bytes}",
    )


def _attention_buffer(s: StepShapes, t: dict[str, int], c: dict[str, float]) -> WorkingBuffer:
    if s.attention == "materialized":
        return WorkingBuffer(
            "attention_scores",
            round(c["attention_scores"] * t["attention_scores"]),
            f"materialized: {c['attention_scores']} x B x H x S x S x 4 = "
            f"{c['attention_scores']} x {s.B} x {s.H} x {s.S}^2 x 4",
        )
    if s.attention == "cudnn":
        formula = f"cudnn: B x H x S x (h + 1) x 4 = {s.B} x {s.H} x {s.S} x {s.h + 1} x 4"
    else:
        tile = block_size(s.S)
        formula = (
            f"blockwise: B x H x (2 S + {BLOCKWISE_TILES} t^2) x 4 = {s.B} x {s.H} x (2 x {s.S} + "
            f"{BLOCKWISE_TILES} x {tile}^2) x 4"
        )
    return WorkingBuffer(f"attention_{s.attention}", t["attention_blockwise"], formula)


def working_set_floor(config: TrainConfig, model_config: ModelConfig) -> int:
    """The larger phase with every tensor counted once: (one layer's weights in the compute dtype
    unless trainable, its gradient, its intermediates x, q, k, v, attended, gate, up, their
    product and the attention's buffers: float32 scores B x H x S x S when materialized) or (one logits chunk and the head's gradient).
    The implementation's floor, not XLA's: every tensor it needs, each once."""
    s, t = StepShapes(config, model_config), raw_terms(config, model_config)
    intermediates = s.T * s.a * (2 * s.D + (2 * s.H + 2 * s.K) * s.h) + s.B * s.Sm * s.a * 3 * s.F
    backward = (
        (0 if s.full else t["layer_weights"])
        + t["layer_gradient"]
        + intermediates
        + t["attention_scores"]
        + t["attention_blockwise"]
    )
    loss = t["logits"] + t["head_gradient"]
    return max(backward, loss)
