"""Fused attention kernels for NVIDIA GPUs, and the exact masks they are given.

Blockwise attention (`models/attention.py`) keeps packed rows apart with segment ids. A fused
kernel that is handed less than that attends across documents -- silently (MaxText #4476: its
cuDNN path dropped the segment ids in training). So each kernel here is given a mask that says
exactly what the segment ids say, and tests compare it with blockwise on packed rows:

- cuDNN, packed rows (`cudnn_attention(..., "packed")`): each row's documents become cuDNN's
  packed ("ragged") layout, `q_seqlen`/`kv_seqlen` [B, M] and `q_offsets`/`kv_offsets` [B, M+1]
  (`packed_layout`), masked PADDING_CAUSAL: causal within each document, nothing across. Only
  jax's private `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` takes that
  layout (jax-ml/jax#25812; a public one is proposed in #29731), and cuDNN runs it on Hopper and
  later only. `cudnn_packed_refusal` checks the private signature before it is used. M is
  static and costs memory: cuDNN keeps float32 softmax statistics of B x M x H x S and its
  backward a workspace of 4 x B x M x H x S x (2h + 1) bytes (read off an H200: 4 GiB for
  Llama-3.1-8B at b2 x 2048 and M = 32). So M is small: `data.max_documents_per_row` where the
  packer holds rows to it, else `DEFAULT_PACKED_SLOTS`, and a batch with a row of more documents
  than M runs the exact fallback instead (`packed_or_fallback`: a `lax.cond` on the batch,
  blockwise in the step).
- cuDNN, one document per row (`"padded"`, `data.pack: false`): the public
  `jax.nn.dot_product_attention(..., query_seq_lengths=..., implementation="cudnn")`, each row's
  length the count of its non-padding tokens (`row_lengths`).
- cuDNN, no segment ids (`"plain"`): the public call, causal.
- Pallas (`pallas_attention`): jax's Triton flash attention
  (`jax.experimental.pallas.ops.gpu.attention.mha`), which takes segment ids itself. It needs
  as many K/V heads as query heads: grouped K/V are repeated (`jnp.repeat`: the copies, and
  their gradients before they are summed back, are B x S x H x h each). On CPU it runs only in
  interpret mode, which tests use; that is no measure of its speed.

Padding (segment 0) has no document in cuDNN's layouts: what cuDNN writes there is unspecified.
The padding positions of q, k and v are zeroed on the way in (so their gradients are zero) and
of the output on the way out; the loss never counts them and no real token attends to them, so
training sees exactly what blockwise gives it.

Layouts as in `models/attention.py`: q [B, S, H, h]; k, v [B, S, K, h]; segment_ids [B, S] int
(1, 2, ... per document, 0 padding: `data/packing.py`), each document one contiguous run.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

Rows = Literal["plain", "padded", "packed"]
# documents a row cuDNN's packed layout holds when the packer sets no limit: 4 keeps the
# backward's workspace at an eighth of 32's (0.5 GiB for Llama-3.1-8B at b2 x 2048)
DEFAULT_PACKED_SLOTS = 4
PALLAS_BLOCK = 128  # the Pallas kernel's forward tile edge (jax's default BlockSizes)
PALLAS_BACKWARD_BLOCK = 32  # its backward tiles (jax's default BlockSizes)


class PackedLayout(NamedTuple):
    """cuDNN's packed layout of a batch of rows, as jax's private API takes it: `seqlen` [B, M]
    the length of each document, `offsets` [B, M+1] where it starts in its row; both -1 past a
    row's last document."""

    seqlen: jax.Array
    offsets: jax.Array


def _boundaries(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """([B, S] bool: a document starts here, [B, S] bool: a document ends here); each contiguous
    run of one non-zero id is a document, 0 is padding."""
    real = segment_ids != 0
    before = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=0)
    after = jnp.pad(segment_ids[:, 1:], ((0, 0), (0, 1)), constant_values=0)
    return real & (segment_ids != before), real & (segment_ids != after)


def documents_per_row(segment_ids: jax.Array) -> jax.Array:
    """[B] int32: how many documents each row of `segment_ids` [B, S] holds."""
    return jnp.sum(_boundaries(segment_ids)[0], axis=1, dtype=jnp.int32)


def packed_layout(
    segment_ids: jax.Array, max_documents: int = DEFAULT_PACKED_SLOTS
) -> PackedLayout:
    """The documents of each row of `segment_ids` [B, S] as cuDNN's packed layout with
    M = `max_documents` slots: exact for rows of at most M documents (`documents_per_row`);
    the documents past the M-th are left out."""
    slots = max_documents
    starts_here, ends_here = _boundaries(segment_ids)

    def row(starts_row, ends_row):
        # the positions of the first and last token of each document, in order, -1 past the last
        first = jnp.nonzero(starts_row, size=slots + 1, fill_value=-1)[0]
        last = jnp.nonzero(ends_row, size=slots, fill_value=-1)[0]
        length = jnp.where(last >= 0, last - first[:slots] + 1, -1)
        return length, first

    seqlen, offsets = jax.vmap(row)(starts_here, ends_here)
    return PackedLayout(seqlen.astype(jnp.int32), offsets.astype(jnp.int32))


def row_lengths(segment_ids: jax.Array) -> jax.Array:
    """[B] int32: the non-padding tokens of each row, its length when a row is one document
    followed by padding (`data.pack: false`)."""
    return jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)


def _private_cudnn():
    """jax's private cuDNN attention module, or None when this jax has none."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo
    except ImportError:
        return None
    return fused_attention_stablehlo


def cudnn_packed_refusal() -> str | None:
    """Why this jax cannot give cuDNN packed rows (None when it can): the private
    `dot_product_attention` must take q/kv seqlens and offsets and know PADDING_CAUSAL."""
    module = _private_cudnn()
    where = "jax._src.cudnn.fused_attention_stablehlo.dot_product_attention"
    if module is None or not hasattr(module, "dot_product_attention"):
        return f"this jax ({jax.__version__}) has no {where}; use blockwise or pallas"
    parameters = inspect.signature(module.dot_product_attention).parameters
    wanted = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type", "scale")
    missing = [name for name in wanted if name not in parameters]
    mask_type = getattr(module, "MaskType", None)
    if missing or mask_type is None or not hasattr(mask_type, "PADDING_CAUSAL"):
        lacks = ", ".join(missing) or "MaskType.PADDING_CAUSAL"
        return f"this jax's ({jax.__version__}) {where} lacks {lacks}; use blockwise or pallas"
    return None


def _zero_padding(x: jax.Array, real: jax.Array) -> jax.Array:
    """`x` [B, S, ...] with the positions where `real` [B, S] is False set to zero."""
    return jnp.where(real.reshape(*real.shape, *(1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    rows: Rows,
    slots: int = DEFAULT_PACKED_SLOTS,
    scale: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention by cuDNN's fused kernel, masked exactly as `segment_ids`
    say for `rows`: "plain" (no segment ids), "padded" (one document per row, then padding) or
    "packed" (several documents per row, at most `slots`: `packed_or_fallback`; Hopper and
    later, jax's private API) -> [B, S, H, h]. `scale`: the scores' factor (None:
    head_dim^-1/2); `window`: a sliding window (cuDNN's `local_window_size`; not in the packed
    layout, which `attention_choice` never picks for a windowed model)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    local = None if window is None else (window - 1, 0)
    if rows == "plain" or segment_ids is None:
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, scale=scale, local_window_size=local, implementation="cudnn"
        )
    real = segment_ids != 0
    q, k, v = (_zero_padding(x, real) for x in (q, k, v))
    if rows == "padded":
        lengths = row_lengths(segment_ids)
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            scale=scale,
            local_window_size=local,
            implementation="cudnn",
        )
        return _zero_padding(out, real)
    refusal = cudnn_packed_refusal()
    if refusal:
        raise NotImplementedError(refusal)
    module = _private_cudnn()
    layout = packed_layout(segment_ids, slots)
    out = module.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=layout.seqlen,
        kv_seqlen=layout.seqlen,
        q_offsets=layout.offsets,
        kv_offsets=layout.offsets,
        scale=scale,
        mask_type=module.MaskType.PADDING_CAUSAL,
    )
    return _zero_padding(out, real)


def packed_or_fallback(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    fused,
    fallback,
    slots: int = DEFAULT_PACKED_SLOTS,
) -> jax.Array:
    """`fused(q, k, v, segment_ids)` when no row holds more than `slots` documents, else
    `fallback(...)`: one `lax.cond` on the batch, so both are compiled and exactly one runs
    (forward and backward); the mask is exact either way."""
    fits = jnp.max(documents_per_row(segment_ids)) <= slots
    return jax.lax.cond(fits, fused, fallback, q, k, v, segment_ids)


def pallas_tile(seq_len: int) -> int:
    """The Pallas kernel's forward tile edge for `seq_len` positions: PALLAS_BLOCK, or the
    sequence rounded up to a power of two (at least the backward tile) when shorter."""
    return min(PALLAS_BLOCK, 2 ** math.ceil(math.log2(max(seq_len, PALLAS_BACKWARD_BLOCK))))


def pallas_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    interpret: bool = False,
    scale: float | None = None,
) -> jax.Array:
    """Causal (and segment-masked) grouped-query attention by jax's Pallas Triton flash kernel:
    K/V heads repeated to the query heads, positions padded to a multiple of the tile (a padded
    key lies after every real query: the causal rule keeps it out) -> [B, S, H, h].
    `interpret=True` runs the kernel's program on any backend (tests; slow)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    seq, heads, head_dim = q.shape[1:]
    groups = heads // k.shape[2]
    if groups > 1:
        k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))  # [B, S, H, h]
    tile = pallas_tile(seq)
    padded = -(-seq // tile) * tile
    if padded != seq:
        widths = ((0, 0), (0, padded - seq), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - seq)))
    backward = min(PALLAS_BACKWARD_BLOCK, tile)
    blocks = pallas_gpu.BlockSizes(
        block_q=tile,
        block_k=tile,
        block_q_dkv=backward,
        block_kv_dkv=backward,
        block_q_dq=backward,
        block_kv_dq=backward,
    )
    out = pallas_gpu.mha(
        q,
        k,
        v,
        None if segment_ids is None else segment_ids.astype(jnp.int32),
        sm_scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
        causal=True,
        block_sizes=blocks,
        interpret=interpret,
    )
    return out[:, :seq]
