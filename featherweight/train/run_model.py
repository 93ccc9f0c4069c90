"""A run's trained model, straight from its latest checkpoint: no export needed.

`featherweight generate RUN_DIR` and `featherweight chat RUN_DIR` read the run's config, load its
base model as training held it (NF4 for QLoRA, the run's dtype) and restore the checkpoint's
trainable arrays over it: LoRA adapters stay separate and are applied in the forward pass (the
same `linear` training ran), a full fine-tune's weights replace the base. The tokenizer renders
chats with the run's `data.chat_template` when it set one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import jax

from featherweight.data.chat_templates import with_chat_template
from featherweight.errors import ConfigError
from featherweight.inference.generate import generate_ids
from featherweight.models.llama import Params
from featherweight.models.model import Model
from featherweight.recipe.build import lora_config_of
from featherweight.train.run import load_weights, read_header
from featherweight.train.run_dir import CHECKPOINT_DIR
from featherweight.train.saved_run import (
    base_model_path,
    locate,
    read_run_config,
    restore_trainable,
)


def _overlay(base: Params, trained: Params) -> Params:
    """`base` with every leaf `trained` holds put in (nested dicts merged key by key)."""
    merged = dict(base)
    for key, value in trained.items():
        both_dicts = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _overlay(base[key], value) if both_dicts else value
    return merged


def load_run_model(run_or_checkpoint: str | Path, dtype: str | None = None) -> tuple[Model, int]:
    """(the model of a run's latest checkpoint, or of `RUN/checkpoints/STEP`; that step).

    `dtype` ("float32", "bfloat16") computes in another dtype than the run's: the base loads in
    it (an NF4 base stays NF4) and the trained arrays are cast to it."""
    run_dir, step = locate(run_or_checkpoint)
    config = read_run_config(run_dir)
    model_path = base_model_path(run_dir, config)
    model_config, _ = read_header(model_path)
    trainable = restore_trainable(run_dir, step, config, model_config)
    if dtype is not None:
        model_settings = config.model.model_copy(update={"dtype": dtype})
        config = config.model_copy(update={"model": model_settings})
        trainable = jax.tree.map(lambda leaf: leaf.astype(dtype), trainable)
    base = load_weights(config, model_path)
    lora = lora_config_of(config)
    model = Model(
        config=model_config,
        params=_overlay(base.params, trainable),
        tokenizer=with_chat_template(base.tokenizer, config.data.chat_template),
        source=run_dir / CHECKPOINT_DIR / str(step),
        lora=None if lora is None else lora.spec,
    )
    return model, step


def chat_replies(
    model: Model,
    messages_in: Iterable[str],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
) -> Iterator[str]:
    """An interactive conversation: each user message in, the model's reply out, the history
    rendered through the chat template every turn (KV-cached generation of each reply)."""
    tokenizer = model.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise ConfigError(
            f"{model.source} has no chat template to chat with; set data.chat_template in the "
            "run's config (a built-in name or a Jinja file), or use featherweight generate"
        )
    history: list[dict[str, str]] = []
    for turn, message in enumerate(messages_in):
        history.append({"role": "user", "content": message})
        text = tokenizer.apply_chat_template(history, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        new_ids = generate_ids(
            model, prompt_ids, max_new_tokens, temperature, seed + turn,
            stop_ids=tokenizer.stop_ids(),
        )  # fmt: skip
        reply = tokenizer.decode(new_ids).strip()
        history.append({"role": "assistant", "content": reply})
        yield reply
