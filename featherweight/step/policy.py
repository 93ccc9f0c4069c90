"""The memory policy of the streamed step: named, documented choices (MaxText style).

- residuals: where each layer's input (the residual stream, L x B x S x D) waits for the backward
  pass: "device", or "host" (pinned host memory, fetched back one layer ahead).
- loss_chunk: sequence chunk of the LM head + cross-entropy (None = whole sequence at once).
- vocab_chunk: vocabulary chunk of the LM head (None = all of it): logits are [B, loss_chunk,
  vocab_chunk] at a time, and an NF4 head is dequantized one chunk at a time.
- mlp_chunk: sequence chunk of the MLP inside each block (None = whole sequence): the [B, S, F]
  hidden activations become [B, mlp_chunk, F] (long context).
- save: intermediates of the block kept from the forward pass so the backward recompute skips the
  matmuls that made them. "qkv": the rotated q, k, v (skips 3 projections, costs
  B x S x (H+2K) x h per layer); "mlp_hidden": the gate and up projections (skips the two largest
  matmuls, costs 2 x B x S x F per layer); "attention": the attention's output and the attention
  residual (skips the o projection, and with "mlp_hidden" every MLP matmul's input is kept; costs
  B x S x (H h + D) per layer). All three: no projection runs forward twice (4N matmul FLOPs per
  token instead of 6N). "dequantized" (QLoRA only): the layer's NF4 linear weights, dequantized
  in the forward pass to the compute dtype and kept for the backward pass, which then reads them
  dense instead of dequantizing again (costs L x the layer's linear weights x itemsize: 4x the
  NF4 stack in bfloat16; and in time a second dequantization into the kept stack and a copy out
  of it, so it pays only against many MLP chunks: `memory/step_cost.py`). Empty = full remat of
  the block (least memory).
- attention: the attention implementation every layer calls (`featherweight.models.attention`):
  "blockwise" (tiled, no S x S array, every backend), "cudnn" / "cudnn_padded" (cuDNN on NVIDIA
  GPUs: packed rows, rows of one document), "pallas" (jax's Triton kernel) or "materialized" (XLA:
  float32 B x H x S x S scores). A config's "auto" is
  resolved before the policy is built (`recipe.build.attention_implementation`).
- packed_slots: the documents a row cuDNN's packed layout ("cudnn") holds; a batch with a row of
  more runs blockwise. `data.max_documents_per_row` where the packer holds rows to it
  (`recipe.build.packed_slots`), else `models.fused_attention.DEFAULT_PACKED_SLOTS`.
"""

from __future__ import annotations

import dataclasses

from featherweight.errors import StepConfigError
from featherweight.models.attention import IMPLEMENTATIONS
from featherweight.models.fused_attention import DEFAULT_PACKED_SLOTS

RESIDUAL_PLACEMENTS = ("device", "host")
# activations of the block, and the block's dequantized frozen weights (QLoRA)
KEPT_ACTIVATIONS = ("qkv", "attention", "mlp_hidden")
DEQUANTIZED = "dequantized"
SAVEABLE = (*KEPT_ACTIVATIONS, DEQUANTIZED)


@dataclasses.dataclass(frozen=True)
class MemoryPolicy:
    """Where activations live during a train step, and what is recomputed."""

    residuals: str = "device"
    loss_chunk: int | None = None
    vocab_chunk: int | None = None
    mlp_chunk: int | None = None
    save: tuple[str, ...] = ()
    attention: str = "blockwise"
    packed_slots: int = DEFAULT_PACKED_SLOTS

    def __post_init__(self) -> None:
        if self.attention not in IMPLEMENTATIONS:
            raise StepConfigError(
                f"attention={self.attention!r} is not an implementation; use one of "
                f"{IMPLEMENTATIONS} (a config's 'auto' is resolved for its target first)"
            )
        if self.packed_slots < 1:
            raise StepConfigError(f"packed_slots={self.packed_slots} must be at least 1")
        if self.residuals not in RESIDUAL_PLACEMENTS:
            raise StepConfigError(
                f"residuals={self.residuals!r} is not a placement; use one of {RESIDUAL_PLACEMENTS}"
            )
        unknown = [name for name in self.save if name not in SAVEABLE]
        if unknown:
            raise StepConfigError(
                f"cannot save intermediate(s) {unknown}: known names are {list(SAVEABLE)}"
            )
        if self.loss_chunk is not None and self.loss_chunk <= 0:
            raise StepConfigError(
                f"loss_chunk={self.loss_chunk} must be a positive sequence length"
            )
        object.__setattr__(self, "save", tuple(sorted(set(self.save))))
