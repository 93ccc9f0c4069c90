"""What a model family's layer and loss add to the step's working set beyond Llama's.

The calibrated buffer counts (`calibration.json`) were fitted on Llama-shaped steps. A family's
differences (`models/config.py`) bring buffers of their own, measured by compiling one tiny step
with and without each difference (4 layers, D 256, F 768, H 8, K 4, h 48, V 1024; LoRA b2 with
no chunks; XLA:CPU in float32 and XLA's GPU compiler for an H100 without a GPU in bfloat16;
jax 0.10.2), and planned as:

  qk_norm         one float32 copy of the layer's q and k, B x S x (H + K) x h x 4: QK-norm
                  (Qwen3, Gemma 3) runs in float32 (compiled: +1.04 copies on XLA:CPU and +1.23
                  for the H100 at S 1024; +3.04 and +0.71 at S 128, a lone attention tile)
  sandwich_norms  XLA:CPU: five float32 D-wide buffers, 5 x B x S x D x 4, the norms after
                  attention and the MLP (Gemma) in float32 (compiled: +5.07 at S 128, +5.4 at
                  S 1024); XLA's GPU compiler fuses them away (compiled for the H100: +528 bytes
                  at S 1024)
  attention_softcap  XLA:CPU, blockwise attention in one lone tile (S <= its block): the capped
                  scores' tile beside the scores, one float32 tile B x H x S x S x 4 (compiled:
                  exactly one); with the loops it keeps 0.17 of a tile, and XLA's GPU compiler
                  fuses the tanh into the tile (compiled for the H100: +0 bytes at S 128 and 1024)
  logits_softcap  XLA:CPU: the loss chunk's capped logits beside the logits (Gemma 2's final
                  softcap), one float32 logits chunk, B x chunk x V x 4 (compiled with the loss
                  phase the peak, V 16384: exactly one, LoRA and full fine-tuning); XLA's GPU
                  compiler fuses the cap (compiled for the H100: +0 bytes)

  routed_block_weights  an MoE layer with dense (LoRA's frozen, or trained) experts
                  (`models/moe.py`): its grouped products keep no expert weight for their
                  backward (their own VJP; NF4 experts: the plan without the term is -2.0%,
                  -1.6% and -0.1% of XLA:CPU's compile for Qwen3-MoE, Mixtral and gpt-oss, b2 x
                  1024 float32 QLoRA), but with dense experts XLA:CPU still holds about
                  0.75 x 3 x (R / block) x F x D x itemsize more -- R and the block of one MLP
                  chunk's routed rows; a factor fitted on those three LoRA compiles (0.6, 1.07
                  and 0.5 of the per-block weights), not explained: the plan without it was
                  -22.8%, -27.1% and -21.2%. XLA's GPU compiler holds no such copy: with the
                  term, the same three LoRA steps compiled for the H100 (bfloat16, blockwise)
                  planned +41.5%, +64.4% and +48.7%

A sliding window adds nothing: it changes which tiles blockwise attention visits (O(S x window)
work), not their size. Nor does the `lax.cond` of a model whose layers differ (Gemma, Qwen2's
upper layers): both branches are compiled and it holds at most a fifth of an attention tile
more than one of them (compiled: -1.9 and -0.19 tiles on XLA:CPU, -1.24 and +0.21 for the H100,
at S 128 and 1024). Gemma's (1 + w) norms, scaled embeddings and GELU add nothing either (compiled: +0 bytes).
"""

from __future__ import annotations

from featherweight.models.config import ModelConfig
from featherweight.models.moe import block_rows, padded_rows

SANDWICH_NORM_BUFFERS = {"xla-cpu": 5}  # float32 D-wide buffers, by compiler (none elsewhere)
# each term: (the phase it belongs to, its formula as the plan shows it)
FAMILY_TERMS = {
    "qk_norm": ("backward", "QK-norm: B x S x (H + K) x h x 4, float32 q and k"),
    "sandwich_norms": ("backward", "XLA:CPU: 5 x B x S x D x 4, the norms after attention and MLP"),
    "attention_softcap": ("backward", "XLA:CPU, a lone tile: B x H x S x S x 4, capped scores"),
    "logits_softcap": ("loss", "XLA:CPU: B x chunk x V x 4, the loss chunk's capped logits"),
    "routed_block_weights": (
        "backward",
        "XLA:CPU, MoE, dense experts: 0.75 x 3 x (R / block) x F x D x itemsize (fitted)",
    ),
}


def family_terms(
    model_config: ModelConfig,
    compiler: str,
    tokens: int,
    logits_bytes: int,
    lone_softcap_tile_bytes: int,
    mlp_tokens: int,
    itemsize: int,
    dense_experts: bool = True,
) -> dict[str, int]:
    """The working set's family terms in bytes (see the module docstring): `tokens` B x S of a
    micro-batch, `logits_bytes` one float32 logits chunk, `lone_softcap_tile_bytes` blockwise
    attention's float32 tile when the step runs it as one lone tile (else 0), `mlp_tokens` the
    tokens of one MLP chunk, `itemsize` the compute dtype's, `dense_experts` whether an MoE's
    experts are dense (not QLoRA's NF4)."""
    model = model_config
    qk_width = (model.num_heads + model.num_kv_heads) * model.head_dim
    sandwich = SANDWICH_NORM_BUFFERS.get(compiler, 0) if model.sandwich_norms else 0
    cpu = compiler == "xla-cpu"
    capped_scores = model.attn_softcap is not None and cpu
    return {
        "qk_norm": 4 * tokens * qk_width if model.qk_norm else 0,
        "sandwich_norms": sandwich * 4 * tokens * model.hidden_size,
        "attention_softcap": lone_softcap_tile_bytes if capped_scores else 0,
        "logits_softcap": logits_bytes if model.final_softcap is not None and cpu else 0,
        "routed_block_weights": (
            _routed_block_weights(model, mlp_tokens, itemsize, dense_experts) if cpu else 0
        ),
    }


def _routed_block_weights(
    model: ModelConfig, mlp_tokens: int, itemsize: int, dense_experts: bool
) -> int:
    if not model.num_experts or not dense_experts:
        return 0
    pairs = mlp_tokens * model.experts_per_token
    block = block_rows(pairs, model.num_experts)
    blocks = padded_rows(pairs, model.num_experts, block) // block
    return int(0.75 * 3 * blocks * model.intermediate_size * model.hidden_size * itemsize)
