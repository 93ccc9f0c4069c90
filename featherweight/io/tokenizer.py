"""Tokenizers from `tokenizer.json` or from GGUF metadata, with the model's chat template.

The `tokenizers` library does the work; this wraps it with what a fine-tuning library needs:
special-token ids, chat-template rendering (jinja2, sandboxed, as transformers renders it) and
saving as `tokenizer.json` + `tokenizer_config.json` that transformers loads.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from featherweight.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedModelError,
    check_input_file,
    read_input_text,
)

# Pre-tokenizer split patterns for byte-level BPE vocabularies, by GGUF `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
_CONTROL_TOKEN = 3
_USER_DEFINED_TOKEN = 4


# what ends a reply in the common chat formats, in order: ChatML (Qwen, SmolLM2, Phi-4), Llama 3's
# turn and text, Llama 2 / Mistral, GPT-2's end of text, Gemma, Phi-3 / Phi-4-mini
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "</s>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
)


class Tokenizer:
    """Text <-> token ids, special tokens, and the chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        gguf_pre: str | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.gguf_pre = gguf_pre  # a GGUF file's `tokenizer.ggml.pre`, kept for writing GGUF again

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_id(self) -> int:
        """Padding id: the pad token, else EOS, else 0 (masked out of every loss anyway)."""
        for token in (self.pad_token, self.eos_token):
            token_id = self.token_id(token)
            if token_id is not None:
                return token_id
        return 0

    def stop_ids(self) -> set[int]:
        """Ids that end a generated reply: EOS and the end-of-turn tokens of common templates."""
        ids = {self.eos_id}
        for token in END_OF_TURN_TOKENS:
            ids.add(self.token_id(token))
        ids.discard(None)
        return ids  # type: ignore[return-value]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` with the model's chat template (as transformers does)."""
        if self.chat_template is None:
            raise UnsupportedModelError("this model has no chat template; pass plain text instead")
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
        )

    def save(self, directory: Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (what transformers reads)."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=8)  # compiling takes milliseconds; datasets render it per turn
def _compile_template(template: str) -> jinja2.Template:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(template)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_hf_tokenizer(directory: Path) -> Tokenizer:
    """Read `tokenizer.json` (+ `tokenizer_config.json` when present) from a model directory.

    Each file is checked as it is read -- a regular file, UTF-8, JSON of the expected shape -- so
    a truncated or damaged tokenizer is named (CorruptCheckpointError) before any weight is read.
    """
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(
            f"{directory} has no tokenizer.json; copy it from the original model repository"
        )
    redownload = "download it again from the original model repository"
    check_input_file(path, "tokenizer file", redownload, CheckpointNotFoundError)
    text = read_input_text(path, "tokenizer file")
    try:
        backend = tokenizers.Tokenizer.from_str(text)
    except Exception as error:  # the Rust library raises a plain Exception
        raise CorruptCheckpointError(
            f"{path} is not a valid tokenizer ({' '.join(str(error).split())[:160]}); it is "
            f"truncated or damaged -- {redownload}"
        ) from None
    config = _json_object(directory / "tokenizer_config.json", redownload)
    template = config.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template is None and os.path.lexists(template_file):
        check_input_file(template_file, "chat template", redownload, CheckpointNotFoundError)
        template = read_input_text(template_file, "chat template")
    if isinstance(template, list):  # named templates: use the default one
        try:
            named = {entry["name"]: entry["template"] for entry in template}
        except (KeyError, TypeError):
            named = {}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise CorruptCheckpointError(
            f"{directory / 'tokenizer_config.json'}: chat_template is a "
            f"{type(template).__name__}, not text; {redownload}"
        )
    return Tokenizer(
        backend,
        chat_template=template,
        bos_token=_token_content(config.get("bos_token")),
        eos_token=_token_content(config.get("eos_token")),
        pad_token=_token_content(config.get("pad_token")),
    )


def _json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in the optional file `path` ({} when absent), or CorruptCheckpointError."""
    if not os.path.lexists(path):
        return {}
    check_input_file(path, "tokenizer file", fix, CheckpointNotFoundError)
    try:
        value = json.loads(read_input_text(path, "tokenizer file"))
    except json.JSONDecodeError as error:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({error}); {fix}") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{path} must hold a JSON object, found {type(value).__name__}; {fix}"
        )
    return value


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> tokenizers.Tokenizer:
    """GGUF `gpt2`-type vocabularies: byte-level BPE, split as the vocabulary was trained."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merge_pairs, fuse_unk=False))
    split = _SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, merges: list[str] | None):
    """GGUF `llama`-type (SentencePiece) vocabularies: BPE with byte fallback and `▁` spaces."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges:
        merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:  # rebuild merges from the vocabulary, best-scored pieces first
        order = sorted(range(len(tokens)), key=lambda i: -(scores[i] if scores else -i))
        merge_pairs = []
        for index in order:
            piece = tokens[index]
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    merge_pairs.append((left, right))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab, merge_pairs, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend


def tokenizer_from_gguf_fields(fields: dict[str, Any]) -> Tokenizer:
    """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
    kind = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise UnsupportedModelError("this GGUF file carries no tokenizer (tokenizer.ggml.tokens)")
    merges = fields.get("tokenizer.ggml.merges")
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, merges or [], fields.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, fields.get("tokenizer.ggml.scores"), merges)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer type {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE)"
        )
    token_types = fields.get("tokenizer.ggml.token_type") or []
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _CONTROL_TOKEN
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _USER_DEFINED_TOKEN
    ]
    backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)

    def token_of(field: str) -> str | None:
        index = fields.get(f"tokenizer.ggml.{field}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    if kind == "llama" and fields.get("tokenizer.ggml.add_bos_token", True) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return Tokenizer(
        backend,
        chat_template=fields.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        pad_token=token_of("padding_token_id"),
        gguf_pre=fields.get("tokenizer.ggml.pre"),
    )
