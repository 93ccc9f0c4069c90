"""GGUF export directories: `model.gguf` (or `adapter.gguf`) and an Ollama `Modelfile` beside it.

Ollama's templates are Go templates, the model's chat template is Jinja; no general translation
exists. The chat template is therefore recognised by what it renders: a probe conversation is
rendered with it and compared with each known family's rendering (ChatML -- SmolLM2, Qwen2 --, Llama
3, Mistral/Llama 2 `[INST]`); the matching family's Go template goes into the Modelfile, with a
default system prompt as `SYSTEM` (ChatML templates that add one when the conversation has none)
and the end-of-turn tokens as `stop` parameters. A template of no known family is left out, and the
Modelfile says so: Ollama then falls back to the Jinja template stored in the GGUF metadata.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from featherweight.io.gguf_writer import write_model_gguf
from featherweight.io.names import TensorKey
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.config import ModelConfig

MODEL_FILE = "model.gguf"
ADAPTER_FILE = "adapter.gguf"
MODELFILE = "Modelfile"

Messages = list[dict[str, str]]


class ChatFamily(NamedTuple):
    """A chat format: how it renders messages (Python, for recognition) and in Ollama's Go."""

    name: str
    render: Callable[[Messages], str]  # with the generation prompt
    go_template: str
    stops: tuple[str, ...]


def _chatml(messages: Messages) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _llama3(messages: Messages) -> str:
    turns = "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
        for m in messages
    )
    return turns + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _inst(messages: Messages) -> str:
    out = ""
    for m in messages:
        if m["role"] == "user":
            out += f"[INST] {m['content']} [/INST]"
        elif m["role"] == "assistant":
            out += f" {m['content']}</s>"
    return out


FAMILIES = (
    ChatFamily(
        "chatml",
        _chatml,
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
        "{{ end }}<|im_start|>assistant\n",
        ("<|im_end|>", "<|im_start|>"),
    ),
    ChatFamily(
        "llama3",
        _llama3,
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
        "{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        ("<|eot_id|>", "<|start_header_id|>"),
    ),
    ChatFamily(
        "inst",
        _inst,
        '{{- range .Messages }}{{- if eq .Role "user" }}[INST] {{ .Content }} [/INST]'
        '{{- else if eq .Role "assistant" }} {{ .Content }}</s>{{- end }}{{- end }}',
        ("[INST]", "</s>"),
    ),
)
_PROBE = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Name a colour."},
]
_CHATML_SYSTEM = re.compile(r"^<\|im_start\|>system\n(.*?)<\|im_end\|>\n", re.DOTALL)


def chat_family(tokenizer: Tokenizer) -> tuple[ChatFamily | None, str | None]:
    """(the family whose rendering the chat template reproduces, its default system prompt)."""
    if tokenizer.chat_template is None:
        return None, None
    try:
        rendered = tokenizer.apply_chat_template(_PROBE)
    except Exception:  # a template that needs more than plain messages (tools, dates, ...)
        return None, None
    # with and without a leading BOS (which llama.cpp adds itself when the file says so)
    for text in dict.fromkeys([rendered, rendered.removeprefix(tokenizer.bos_token or "\0")]):
        for family in FAMILIES:
            if text == family.render(_PROBE):
                return family, None
            match = _CHATML_SYSTEM.match(text) if family.name == "chatml" else None
            if match and text[match.end() :] == family.render(_PROBE):
                return family, match.group(1)
    return None, None


def _quoted(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile_text(tokenizer: Tokenizer | None, from_path: str, adapter: str | None = None) -> str:
    """An Ollama Modelfile: FROM (and ADAPTER), TEMPLATE, SYSTEM and stop parameters."""
    lines = [f"FROM {from_path}"]
    if adapter is not None:
        lines.append(f"ADAPTER {adapter}")
    family, system = chat_family(tokenizer) if tokenizer is not None else (None, None)
    if family is not None:
        lines.append(f"TEMPLATE {_quoted(family.go_template)}")
        if system:
            lines.append(f"SYSTEM {_quoted(system)}")
    elif tokenizer is not None and tokenizer.chat_template is not None:
        lines.append(
            "# The chat template is of no family featherweight translates to a Go template; "
            "Ollama uses the one stored in the GGUF metadata (tokenizer.chat_template)."
        )
    stops = list(family.stops) if family is not None else []
    if tokenizer is not None:
        for token_id in sorted(tokenizer.stop_ids()):
            token = tokenizer.backend.id_to_token(token_id)
            if token is not None and token not in stops:
                stops.append(token)
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"


def write_gguf_directory(
    directory: Path,
    config: ModelConfig,
    tensors: Iterable[tuple[TensorKey, np.ndarray]],
    tokenizer: Tokenizer | None,
    quant: str,
    name: str | None = None,
) -> Path:
    """Write `model.gguf` and its Modelfile into `directory` (a staging directory)."""
    write_model_gguf(Path(directory) / MODEL_FILE, config, tensors, tokenizer, quant, name)
    (Path(directory) / MODELFILE).write_text(modelfile_text(tokenizer, f"./{MODEL_FILE}"))
    return Path(directory)
