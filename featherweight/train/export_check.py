"""What an export changes, said at export time: a merged export's dtype against float32, and how
to load a QLoRA adapter's NF4 base.

A merged export is float32 by default (`io/peft_export.py` says why). One asked for in bfloat16
rounds every merged weight; on a small model or a long generation that can change greedy outputs
against the run itself. `merged_output_check` generates greedily from the run's checkpoint in
float32 and from the export, and names the first token where they part, with the fix
(`--dtype float32`).
"""

from __future__ import annotations

from pathlib import Path

from featherweight.inference.generate import generate_ids
from featherweight.io.loader import load_model
from featherweight.io.peft_export import BNB_CONFIG
from featherweight.models.model import Model
from featherweight.train.run_model import load_run_model

CHECK_PROMPT = "Write one sentence about why the sky is blue."
CHECK_TOKENS = 16


def _greedy(model: Model, prompt: str, new_tokens: int) -> list[int]:
    tokenizer = model.tokenizer
    if tokenizer.chat_template is not None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(prompt)
    return generate_ids(model, ids, new_tokens, stop_ids=tokenizer.stop_ids())


def merged_output_check(
    run_or_checkpoint: str | Path,
    export_dir: str | Path,
    dtype: str | None,
    prompt: str = CHECK_PROMPT,
    new_tokens: int = CHECK_TOKENS,
) -> str | None:
    """A warning when the merged export at `export_dir` (in `dtype`) generates other greedy
    tokens for `prompt` than the run's checkpoint in float32; None when they agree (or the
    export is float32 already)."""
    if dtype in (None, "float32"):
        return None
    reference, _ = load_run_model(run_or_checkpoint, dtype="float32")
    expected = _greedy(reference, prompt, new_tokens)
    del reference
    exported = _greedy(load_model(export_dir), prompt, new_tokens)
    if exported == expected:
        return None
    first = next(
        (index for index, pair in enumerate(zip(expected, exported)) if pair[0] != pair[1]),
        min(len(expected), len(exported)),
    )
    return (
        f"the {dtype} export generates differently from the run in float32 (greedy, from token "
        f"{first + 1} of {new_tokens} on a test prompt): its rounding changes the model's "
        "outputs; export again with --dtype float32 (the default) to keep them"
    )


def qlora_note(adapter_dir: str | Path) -> str:
    """How to reproduce training with a QLoRA adapter: its base loaded in NF4 (bitsandbytes)."""
    return (
        "this adapter was trained on an NF4 (4-bit) base: to reproduce training's outputs, load "
        f"the base with quantization_config={BNB_CONFIG} (bitsandbytes); see "
        f"{Path(adapter_dir) / 'README.md'}"
    )
