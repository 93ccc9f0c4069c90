"""Chat templates a run can name instead of the model's own (`data.chat_template`).

A model without a chat template (a base model) cannot train on chat records, and a model's own
template may not be the format a dataset was written for. `data.chat_template` names one of the
templates below, or a Jinja file, in the form transformers' `apply_chat_template` renders.

The end-of-turn marker of a named template (`<|im_end|>`, `<|eot_id|>`, `</s>`) is learned as the
end of each reply only when the tokenizer holds it as a special token (the instruct models these
formats come from do); with a base model's tokenizer the marker is plain text, still trained on,
and generation stops at EOS.
"""

from __future__ import annotations

from pathlib import Path

from featherweight.errors import ConfigError
from featherweight.io.tokenizer import Tokenizer

CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    ),
    "zephyr": (
        "{% for message in messages %}<|{{ message['role'] }}|>\n"
        "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
}


def resolve_chat_template(value: str) -> str:
    """The template text `value` names: a built-in name, or the path of a Jinja file."""
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value]
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ConfigError(
        f"data.chat_template {value!r} is neither a built-in template "
        f"({', '.join(CHAT_TEMPLATES)}) nor a file; name one, or give the path of a Jinja template"
    )


def with_chat_template(tokenizer: Tokenizer, value: str | None) -> Tokenizer:
    """`tokenizer` rendering chats with the template `value` names (unchanged for None)."""
    if value is None:
        return tokenizer
    return Tokenizer(
        tokenizer.backend,
        resolve_chat_template(value),
        tokenizer.bos_token,
        tokenizer.eos_token,
        tokenizer.pad_token,
    )
