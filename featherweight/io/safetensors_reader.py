"""Hugging Face model directories as a checkpoint source: `config.json`, one or sharded
`*.safetensors` files (lazily opened: tensors are read one at a time) and `tokenizer.json`.

Pickle-based weights (`.bin`, `.pt`, `.pth`, `.ckpt`) are never opened.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from featherweight.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from featherweight.io.names import HF_IGNORED, TensorKey, hf_name, parse_hf_name, validate_tensors
from featherweight.io.tokenizer import Tokenizer, load_hf_tokenizer
from featherweight.models.config import read_hf_config

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def refuse_pickle(path: Path) -> None:
    """Raise for a pickle checkpoint file, with the conversion that makes it loadable."""
    raise UnsafeCheckpointError(
        f"{path} is a pickle-based checkpoint; featherweight never unpickles (it can run code). "
        "Convert it to safetensors first, e.g. in Python: "
        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)"
    )


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a model directory: from the shard index, or the single file."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CorruptCheckpointError(
                f"{index_path} is not a valid shard index ({error}); restore it from the original"
            ) from None
        files = sorted({directory / name for name in weight_map.values()})
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise CheckpointNotFoundError(
                f"{directory} lacks shard file(s) {', '.join(missing)} listed in {index_path.name}; "
                "download the complete checkpoint"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickles = [path for path in directory.iterdir() if path.suffix in PICKLE_SUFFIXES]
    if pickles:
        refuse_pickle(pickles[0])
    raise CheckpointNotFoundError(
        f"{directory} has no *.safetensors weights; a Hugging Face model directory needs "
        "model.safetensors (or model-*.safetensors with model.safetensors.index.json)"
    )


class SafetensorsSource:
    """One Hugging Face model directory opened lazily."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory)
        self.config = read_hf_config(self.path)
        self._files = {}
        self._where: dict[TensorKey, tuple[Path, str]] = {}
        shapes: dict[TensorKey, tuple[int, ...]] = {}
        unknown: list[str] = []
        for path in safetensors_files(self.path):
            handle = self._open(path)
            for name in handle:
                key = parse_hf_name(name)
                if key is None:
                    if HF_IGNORED.match(name):
                        continue
                    unknown.append(name)
                    continue
                if key == ("lm_head", None) and self.config.tie_word_embeddings:
                    continue  # a tied model may also save the (shared) head; the embedding rules
                self._where[key] = (path, name)
                shapes[key] = tuple(handle.get_slice(name).get_shape())
        validate_tensors(self.config, shapes, unknown, str(self.path), spell=hf_name)
        self.shapes = shapes

    def _open(self, path: Path):
        if path not in self._files:
            try:
                self._files[path] = safe_open(str(path), framework="numpy")
            except (SafetensorError, OSError, ValueError) as error:
                raise CorruptCheckpointError(
                    f"{path} is not a valid safetensors file ({error}); it may be truncated or "
                    "corrupt -- download it again"
                ) from None
        return self._files[path]

    def keys(self) -> list[TensorKey]:
        return list(self._where)

    def stored_dtype(self, key: TensorKey) -> np.dtype:
        path, name = self._where[key]
        return np.dtype(_SAFETENSORS_DTYPES[self._open(path).get_slice(name).get_dtype()])

    def read(self, key: TensorKey) -> np.ndarray:
        path, name = self._where[key]
        try:
            return self._open(path).get_tensor(name)
        except (SafetensorError, OSError, ValueError) as error:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} cannot be read ({error}); the file may be truncated"
            ) from None

    def tokenizer(self) -> Tokenizer | None:
        if not (self.path / "tokenizer.json").is_file():
            return None
        return load_hf_tokenizer(self.path)

    def close(self) -> None:
        self._files.clear()


def _dtype_table() -> dict[str, np.dtype]:
    import ml_dtypes

    return {
        "F64": np.float64,
        "F32": np.float32,
        "F16": np.float16,
        "BF16": ml_dtypes.bfloat16,
        "I64": np.int64,
        "I32": np.int32,
        "I16": np.int16,
        "I8": np.int8,
        "U8": np.uint8,
        "BOOL": np.bool_,
    }


_SAFETENSORS_DTYPES = _dtype_table()
