"""A tokenizer as GGUF `tokenizer.*` metadata: what llama.cpp (and featherweight's and transformers'
GGUF readers) rebuild it from.

Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen2, SmolLM2) are written as `gpt2` with their
merges and the name of their pre-tokenizer split (`tokenizer.ggml.pre`, recognised from the
`tokenizers` pre-tokenizer, or kept from the GGUF file the model came from); SentencePiece-style BPE
with byte fallback (Llama 2, Mistral) as `llama` with scores (-id: earlier pieces merge first) and
byte tokens. Added tokens are CONTROL when special, else USER_DEFINED; rows of the embedding
beyond the tokenizer (padded vocabularies) get `[PAD{id}]` tokens of type UNUSED, as llama.cpp's
converter writes them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gguf import GGUFWriter, TokenType

from featherweight.errors import ExportError
from featherweight.io.tokenizer import Tokenizer

_LLAMA3_SPLIT_START = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
_QWEN2_SPLIT_START = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


# names llama.cpp's vocabulary loader maps to a pre-tokenizer (llama-vocab.cpp), of those written here
LLAMA_CPP_PRE_NAMES = frozenset({"default", "gpt-2", "llama-bpe", "qwen2", "smollm"})


def pre_tokenizer_name(tokenizer: Tokenizer, backend_json: dict[str, Any]) -> str:
    """llama.cpp's name for the split a byte-level BPE tokenizer applies before its merges (one of
    `LLAMA_CPP_PRE_NAMES`, or the name kept from the GGUF file the model came from)."""
    if tokenizer.gguf_pre:
        return tokenizer.gguf_pre
    pre = backend_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [part.get("type") for part in parts]
    for part in parts:
        pattern = (part.get("pattern") or {}).get("Regex", "")
        if part.get("type") == "Split" and pattern.startswith(_LLAMA3_SPLIT_START):
            return "llama-bpe"
        if part.get("type") == "Split" and pattern.startswith(_QWEN2_SPLIT_START):
            return "qwen2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"  # llama.cpp's name (it refuses "gpt2": "unknown pre-tokenizer type")
    return "default"


def _merges(model: dict[str, Any]) -> list[str]:
    """Merges as GGUF stores them: "left right", a space inside a part spelled U+0120 + 256."""
    merges = []
    for merge in model.get("merges") or []:
        if isinstance(merge, str):
            merges.append(merge)
        else:
            merges.append(" ".join(part.replace(" ", chr(ord(" ") + 256)) for part in merge))
    return merges


def add_tokenizer(writer: GGUFWriter, tokenizer: Tokenizer, vocab_size: int) -> None:
    """Add `tokenizer` (padded to the model's `vocab_size` rows) to a GGUF writer's metadata."""
    backend_json = json.loads(tokenizer.backend.to_str())
    model = backend_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ExportError(
            f"GGUF export supports BPE tokenizers (byte-level or SentencePiece-style); this model's "
            f"is {model.get('type')!r} -- export it with --format merged instead"
        )
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    if len(vocab) > vocab_size or max(vocab.values()) >= vocab_size:
        raise ExportError(
            f"the tokenizer has {len(vocab)} tokens (ids up to {max(vocab.values())}) but the model "
            f"embeds only {vocab_size}; the tokenizer does not belong to this model"
        )
    byte_fallback = bool(model.get("byte_fallback"))
    tokens = [f"[PAD{index}]" for index in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    for token, index in vocab.items():
        tokens[index] = token
        types[index] = TokenType.NORMAL
        if byte_fallback and _BYTE_TOKEN.fullmatch(token):
            types[index] = TokenType.BYTE
    for index, added in tokenizer.backend.get_added_tokens_decoder().items():
        types[index] = TokenType.CONTROL if added.special else TokenType.USER_DEFINED
    unk = model.get("unk_token")
    if unk in vocab:
        types[vocab[unk]] = TokenType.UNKNOWN
        writer.add_unk_token_id(vocab[unk])

    writer.add_tokenizer_model("llama" if byte_fallback else "gpt2")
    if byte_fallback:
        writer.add_token_scores(
            [-float(index) if kind == TokenType.NORMAL else 0.0 for index, kind in enumerate(types)]
        )
        writer.add_add_space_prefix(True)
    else:
        writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer, backend_json))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_merges(model))
    probe = tokenizer.encode("a", add_special_tokens=True)
    for name, token in (("bos", tokenizer.bos_token), ("eos", tokenizer.eos_token)):
        token_id = tokenizer.token_id(token)
        if token_id is not None:
            getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(bool(probe) and probe[0] == tokenizer.bos_id)
    writer.add_add_eos_token(len(probe) > 1 and probe[-1] == tokenizer.eos_id)
    pad = tokenizer.token_id(tokenizer.pad_token)
    if pad is not None:
        writer.add_pad_token_id(pad)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
