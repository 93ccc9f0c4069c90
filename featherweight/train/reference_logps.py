"""DPO's reference log-probs computed once before training (`dpo.reference: precomputed`).

One forward pass of the reference model -- the weights as loaded, with no adapter (`lora=None`)
-- over every train and eval row, in batches of the run's shape and with the run's chunks; each
target's log-prob is kept with its example (4 bytes per token, in host memory: TRL's
`precompute_ref_log_probs`), and every batch then carries them (`Batch.reference_logps`). It must
run before a resumed run's trained weights are restored: with full fine-tuning the trainable
weights are the reference until the first update.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from featherweight.data.packing import PackedRows, make_batch
from featherweight.data.preference import attach_reference
from featherweight.data.records import Dataset
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params, attention_inputs, embed, merge_params, run_layers
from featherweight.recipe.build import attention_implementation, packed_slots
from featherweight.recipe.schema import TrainConfig
from featherweight.step.common import head_param_names
from featherweight.step.loss import token_nll


def reference_fn(config: TrainConfig, model_config: ModelConfig) -> Callable:
    """Jitted `(trainable, frozen, batch) -> [B, S]` float32: the reference model's log-prob of
    each target (0 outside the loss mask)."""
    attention, slots = attention_implementation(config, model_config), packed_slots(config)
    memory = config.memory

    def logps(trainable: Params, frozen: Params, batch: Batch) -> jax.Array:
        params = merge_params(frozen, trainable)
        inputs = attention_inputs(
            model_config, batch.positions, batch.segment_ids, attention, slots
        )
        hidden = run_layers(
            params["layers"], embed(params, batch.input_ids, model_config), inputs, model_config, None,
            mlp_chunk=memory.mlp_chunk,
        )  # fmt: skip
        head = {name: params[name] for name in head_param_names(model_config) if name in params}
        nll = token_nll(
            head, hidden, batch.target_ids, model_config, memory.loss_chunk, memory.vocab_chunk
        )
        return -nll * batch.loss_mask

    return jax.jit(logps)


def _rows_logps(fn, trainable, frozen, packed: PackedRows, batch_size: int) -> list[np.ndarray]:
    """The reference log-probs of every row, in row order ([seq_len] each)."""
    out: list[np.ndarray] = []
    for first in range(0, len(packed), batch_size):
        rows = [row if row < len(packed) else None for row in range(first, first + batch_size)]
        values = np.asarray(fn(trainable, frozen, make_batch(packed, rows)))
        out.extend(values[: len(packed) - first])
    return out


def precompute_reference(
    config: TrainConfig, model_config: ModelConfig, trainable: Params, frozen: Params,
    dataset: Dataset,
) -> Dataset:  # fmt: skip
    """`dataset` with the reference log-probs of its train (and eval) examples attached."""
    fn, size = reference_fn(config, model_config), config.batch_size
    train = attach_reference(dataset.train, _rows_logps(fn, trainable, frozen, dataset.train, size))
    held_out = dataset.eval
    if held_out is not None:
        held_out = attach_reference(held_out, _rows_logps(fn, trainable, frozen, held_out, size))
    return dataset._replace(train=train, eval=held_out)
