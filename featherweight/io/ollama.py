"""GGUF export directories: `model.gguf` (or `adapter.gguf`) and an Ollama `Modelfile` beside it.

Ollama's templates are Go templates, the model's chat template is Jinja; no general translation
exists. The chat template is therefore recognised by what it renders: a probe conversation is
rendered with it and compared with each known family's rendering, and so is the probe after a
system message wherever the template accepts one, so that a family is matched with the place it
gives the system prompt. The families: ChatML (SmolLM2, Qwen2, Qwen3), Llama 3, Mistral/Llama 2
`[INST]` (its Go template leaves a system prompt out, so its system rendering is not compared),
Gemma 2 / 3 (the system prompt folded into the first user turn, as Gemma 3's template does;
Gemma 2's refuses a system message), Phi-3 / 3.5 (`<|user|>` turns on lines of their own), Phi-4
(ChatML's tokens with `<|im_sep|>` after the role) and Phi-4-mini (Phi-3's tokens without the
newlines). The matching family's Go template goes into the Modelfile, with a default system prompt
as `SYSTEM` (ChatML templates that add one when the conversation has none) and the end-of-turn
tokens as `stop` parameters. The Go templates use `.Messages` (`.Role`, `.Content`) and template
variables only, and pass each message's content as it is: Gemma's template trims it.

Qwen3's template is ChatML for a conversation of plain messages with its default, thinking, mode:
the generation prompt is `<|im_start|>assistant\n` and the model writes its own `<think>` block.
Two differences the probe cannot see: with `enable_thinking=False` the template writes an empty
`<think></think>` block after the generation prompt, which the ChatML Go template does not, and it
drops the `<think>` block of earlier assistant turns, which the Go template passes on as Ollama
stores them.

A template of no known family is left out, and the Modelfile says so: Ollama then derives a
template from the Jinja one stored in the GGUF metadata (`tokenizer.chat_template`). gpt-oss's
harmony format is left to that: its template writes the current date and a fixed system preamble
into every prompt, and its replies run in channels (analysis, final) that need Ollama's own
harmony handling rather than a template translated here.
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
    places_system: bool = True  # whether `render` and the Go template carry a system prompt


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


def _gemma(messages: Messages) -> str:
    out, system = "", ""
    for m in messages:
        if m["role"] == "system":
            system = m["content"]
            continue
        role = "model" if m["role"] == "assistant" else m["role"]
        prefix, system = (f"{system}\n\n" if system else ""), ""
        out += f"<start_of_turn>{role}\n{prefix}{m['content']}<end_of_turn>\n"
    return out + "<start_of_turn>model\n"


def _phi3(messages: Messages) -> str:
    turns = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
    return turns + "<|assistant|>\n"


def _phi4(messages: Messages) -> str:
    turns = "".join(f"<|im_start|>{m['role']}<|im_sep|>{m['content']}<|im_end|>" for m in messages)
    return turns + "<|im_start|>assistant<|im_sep|>"


def _phi4_mini(messages: Messages) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"


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
        places_system=False,
    ),
    ChatFamily(
        "gemma",
        _gemma,
        # a system message is held in $system and written at the start of the next turn
        '{{- $system := "" }}{{ range .Messages }}{{ if eq .Role "system" }}'
        "{{ $system = .Content }}{{ else }}<start_of_turn>"
        '{{ if eq .Role "assistant" }}model{{ else }}{{ .Role }}{{ end }}\n'
        '{{ if $system }}{{ $system }}\n\n{{ $system = "" }}{{ end }}'
        "{{ .Content }}<end_of_turn>\n{{ end }}{{ end }}<start_of_turn>model\n",
        ("<end_of_turn>", "<start_of_turn>"),
    ),
    ChatFamily(
        "phi3",
        _phi3,
        "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
        ("<|end|>", "<|user|>", "<|assistant|>"),
    ),
    ChatFamily(
        "phi4",
        _phi4,
        "{{- range .Messages }}<|im_start|>{{ .Role }}<|im_sep|>{{ .Content }}<|im_end|>"
        "{{ end }}<|im_start|>assistant<|im_sep|>",
        ("<|im_end|>", "<|im_start|>"),
    ),
    ChatFamily(
        "phi4-mini",
        _phi4_mini,
        "{{- range .Messages }}<|{{ .Role }}|>{{ .Content }}<|end|>{{ end }}<|assistant|>",
        ("<|end|>", "<|user|>", "<|assistant|>"),
    ),
)
_PROBE = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Name a colour."},
]
_PROBE_SYSTEM = {"role": "system", "content": "Answer in one word."}
_CHATML_SYSTEM = re.compile(r"^<\|im_start\|>system\n(.*?)<\|im_end\|>\n", re.DOTALL)


def _rendered(tokenizer: Tokenizer, messages: Messages) -> str | None:
    """The chat template's rendering of `messages`, None where it refuses them."""
    try:
        return tokenizer.apply_chat_template(messages)
    except Exception:  # a template that needs more than plain messages (tools, dates, ...)
        return None


def _default_system(family: ChatFamily, text: str) -> tuple[bool, str | None]:
    """(whether `text` is the family's rendering of the probe, the system prompt it added)."""
    if text == family.render(_PROBE):
        return True, None
    match = _CHATML_SYSTEM.match(text) if family.name == "chatml" else None
    if match and text[match.end() :] == family.render(_PROBE):
        return True, match.group(1)
    return False, None


def chat_family(tokenizer: Tokenizer) -> tuple[ChatFamily | None, str | None]:
    """(the family whose rendering the chat template reproduces, its default system prompt)."""
    if tokenizer.chat_template is None:
        return None, None
    rendered = _rendered(tokenizer, _PROBE)
    if rendered is None:
        return None, None
    with_system = _rendered(tokenizer, [_PROBE_SYSTEM, *_PROBE])
    # with and without a leading BOS (which llama.cpp adds itself when the file says so)
    for bos in dict.fromkeys(["", tokenizer.bos_token or ""]):
        if not rendered.startswith(bos):
            continue
        for family in FAMILIES:
            matched, system = _default_system(family, rendered.removeprefix(bos))
            if not matched:
                continue
            if with_system is None or not family.places_system:
                return family, system
            if with_system.removeprefix(bos) == family.render([_PROBE_SYSTEM, *_PROBE]):
                return family, system
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
