"""Hugging Face model directories as a checkpoint source: `config.json`, one or sharded
`*.safetensors` files (headers checked up front, then tensors read one at a time) and
`tokenizer.json`.

Pickle-based weights (`.bin`, `.pt`, `.pth`, `.ckpt`) are never opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from featherweight.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    TensorShapeError,
    UnsafeCheckpointError,
    UnsupportedModelError,
)
from featherweight.io.names import (
    HF_IGNORED,
    HF_OTHER_TOWERS,
    TensorKey,
    hf_expert_part,
    hf_fused_parts,
    hf_layer_part,
    hf_name,
    parse_hf_name,
    validate_tensors,
)
from featherweight.io.tokenizer import Tokenizer, load_hf_tokenizer
from featherweight.models.config import read_hf_config
from featherweight.models.families import family_of
from featherweight.models.shapes import layer_shapes

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
            weight_map.values()
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise CorruptCheckpointError(
                f"{index_path} is not a valid shard index ({error}); restore it from the original"
            ) from None
        names = set(weight_map.values())
        if not all(isinstance(name, str) and Path(name).name == name for name in names):
            raise CorruptCheckpointError(
                f"{index_path} names shard files outside its directory or not as text; "
                "restore it from the original"
            )
        files = sorted(directory / name for name in names)
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


class TensorEntry(NamedTuple):
    """Where one tensor's bytes lie in a safetensors file (absolute offsets) and what they hold."""

    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def _corrupt(path: Path, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is not a valid safetensors file: {problem}; it may be truncated or corrupt -- "
        "download it again"
    )


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and check a safetensors header: every tensor's dtype, shape and byte range.

    Only the header is read. Truncation (a tensor ending past the end of the file) and entries
    whose byte length disagrees with dtype x shape are caught here, before any tensor is read.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, f"only {size} bytes, shorter than the 8-byte header length")
            header_len = int.from_bytes(prefix, "little")
            if 8 + header_len > size:
                raise _corrupt(path, f"header of {header_len} bytes runs past the file's {size}")
            header = json.loads(handle.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _corrupt(path, f"header is not JSON ({error})") from None
    except OSError as error:
        raise _corrupt(path, f"cannot be read ({error})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(_count(dim) for dim in info["shape"])
            begin, end = (_count(offset) for offset in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise _corrupt(
                path, f"tensor {name!r} has a malformed header entry ({error!r})"
            ) from None
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - begin != expected:
            raise _corrupt(
                path,
                f"tensor {name!r} spans {end - begin} bytes but {info['dtype']} {list(shape)} "
                f"needs {expected}",
            )
        if data_start + end > size:
            raise _corrupt(
                path,
                f"tensor {name!r} ends at byte {data_start + end} but the file has only {size} bytes",
            )
        entries[name] = TensorEntry(np.dtype(dtype), shape, data_start + begin, data_start + end)
    return entries


class SafetensorsSource:
    """One Hugging Face model directory, read tensor by tensor.

    Tensors are read with plain file reads into freshly allocated arrays, not through a memory
    map: a map keeps every page it touched resident until it is closed, which would put a second
    copy of the checkpoint in host memory while the model is being built.
    """

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory)
        self.config = read_hf_config(self.path)
        self._where: dict[TensorKey, list[tuple[Path, TensorEntry]]] = {}
        shapes: dict[TensorKey, tuple[int, ...]] = {}
        unknown: list[str] = []
        experts: dict[TensorKey, dict[int, tuple[Path, TensorEntry]]] = {}
        sources: dict[tuple[int, str], tuple[Path, TensorEntry]] = {}
        derived_from = {n for ways in self._family.hf_derived.values() for w in ways for n in w[0]}
        for path in safetensors_files(self.path):
            for name, entry in read_safetensors_header(path).items():
                layer_part = hf_layer_part(name)
                if layer_part is not None and layer_part[1] in derived_from:
                    sources[layer_part] = (path, entry)  # read whole, then derived from
                    continue
                expert = hf_expert_part(name, self.config)
                if expert is not None:
                    _check_float(path, name, entry)
                    experts.setdefault(expert[0], {})[expert[1]] = (path, entry)
                    continue
                for key, part in self._parts(name, entry):
                    if key is None:
                        if not (HF_IGNORED.match(name) or HF_OTHER_TOWERS.match(name)):
                            unknown.append(name)
                        continue
                    if key == ("lm_head", None) and self.config.tie_word_embeddings:
                        continue  # a tied model may also save the (shared) head: the embedding
                    _check_float(path, name, entry)
                    self._where[key] = [(path, part)]
                    shapes[key] = part.shape
        for key, parts in experts.items():
            shapes[key] = self._stack_experts(key, parts)
        self._derived = self._derivations(sources, shapes)
        validate_tensors(self.config, shapes, unknown, str(self.path), spell=hf_name)
        self.shapes = shapes

    def _parts(self, name: str, entry: TensorEntry) -> list[tuple[TensorKey | None, TensorEntry]]:
        """The keys a stored tensor holds: itself, or the row ranges of a fused one (Phi-3's
        `qkv_proj`: rows are contiguous, so each part is a byte range of the tensor)."""
        parts = hf_fused_parts(name, self.config)
        if parts is None:
            return [(parse_hf_name(name, self.config), entry)]
        rows = parts[-1][2]
        if len(entry.shape) != 2 or entry.shape[0] != rows:
            raise TensorShapeError(
                f"{self.path}: tensor {name!r} has shape {entry.shape}, expected ({rows}, ...) "
                "from the config; the checkpoint and config.json do not match"
            )
        row_bytes = entry.shape[1] * entry.dtype.itemsize
        return [
            (
                key,
                TensorEntry(
                    entry.dtype,
                    (stop - first, entry.shape[1]),
                    entry.start + first * row_bytes,
                    entry.start + stop * row_bytes,
                ),
            )
            for key, first, stop in parts
        ]

    @property
    def _family(self):
        return family_of(self.config.model_type)

    def _derivations(self, sources, shapes) -> dict[TensorKey, tuple]:
        """The keys the family derives from tensors stored in another form (gpt-oss's
        interleaved or MXFP4 experts): for each layer, the first way whose tensors are all
        here -> {key: (function, stored parts)}; their shapes go into `shapes`."""
        derived = {}
        expected = layer_shapes(self.config)
        for name, ways in self._family.hf_derived.items():
            for layer in range(self.config.num_layers):
                for stored, function in ways:
                    if all((layer, part) in sources for part in stored):
                        parts = [sources[(layer, part)] for part in stored]
                        derived[(name, layer)] = (function, parts)
                        shapes[(name, layer)] = expected[name]
                        break
        return derived

    def _stack_experts(self, key: TensorKey, parts: dict[int, tuple[Path, TensorEntry]]):
        """Record an MoE layer's per-expert tensors as one [E, ...] key -> its shape."""
        count = self.config.num_experts
        shapes = {entry.shape for _, entry in parts.values()}
        if sorted(parts) != list(range(count)) or len(shapes) != 1:
            raise TensorShapeError(
                f"{self.path}: {hf_name(key, self.config)!r} holds experts {sorted(parts)[:8]} "
                f"of shapes {sorted(shapes)[:2]}, expected experts 0..{count - 1} of one shape; "
                "the checkpoint is incomplete or belongs to another config"
            )
        self._where[key] = [parts[index] for index in range(count)]
        return (count, *shapes.pop())

    def keys(self) -> list[TensorKey]:
        return list(self._where)

    def stored_dtype(self, key: TensorKey) -> np.dtype:
        if key in self._derived:
            return np.dtype(np.float32)
        return self._where[key][0][1].dtype

    def read(self, key: TensorKey) -> np.ndarray:
        """The tensor as a new array in its stored dtype."""
        return self.read_into(key, np.empty(self.shapes[key], dtype=self.stored_dtype(key)))

    def read_into(self, key: TensorKey, out: np.ndarray) -> np.ndarray:
        """Read the tensor into `out` (cast to its dtype); with the stored dtype, no other copy.
        An MoE layer's experts are read one after another into their slices of `out`."""
        if key in self._derived:  # read the stored tensors whole, then derive this one
            function, stored = self._derived[key]
            arrays = [
                self._read_part(key, part, np.empty(part[1].shape, part[1].dtype))
                for part in stored
            ]
            values = np.asarray(function(*arrays))
            if values.shape != out.shape:
                raise TensorShapeError(
                    f"{self.path}: {hf_name(key, self.config)!r} derives to shape {values.shape}, "
                    f"expected {out.shape} from the config; the checkpoint and config.json do "
                    "not match"
                )
            np.copyto(out, values, casting="unsafe")
            return out
        parts = self._where[key]
        if len(parts) > 1:
            for index, part in enumerate(parts):
                self._read_part(key, part, out[index])
            return out
        return self._read_part(key, parts[0], out)

    def _read_part(self, key: TensorKey, part: tuple[Path, TensorEntry], out: np.ndarray):
        path, entry = part
        direct = out.dtype == entry.dtype and out.flags.c_contiguous
        target = out if direct else np.empty(entry.shape, dtype=entry.dtype)
        try:
            with open(path, "rb") as handle:
                handle.seek(entry.start)
                count = handle.readinto(target.reshape(-1).view(np.uint8))
        except OSError as error:
            raise CorruptCheckpointError(
                f"{path}: tensor {hf_name(key, self.config)!r} cannot be read ({error}); download it again"
            ) from None
        if count != entry.stop - entry.start:
            raise CorruptCheckpointError(
                f"{path}: tensor {hf_name(key, self.config)!r} is cut short ({count} of "
                f"{entry.stop - entry.start} bytes); the file was truncated -- download it again"
            )
        if not direct:
            np.copyto(out, target, casting="unsafe")
        return out

    def tokenizer(self) -> Tokenizer | None:
        if not os.path.lexists(self.path / "tokenizer.json"):
            return None  # a FIFO, a link loop or an unreadable file is named by the tokenizer
        return load_hf_tokenizer(self.path)

    def close(self) -> None:
        """Nothing stays open between reads."""


def _count(value: object) -> int:
    """A size or offset from the header: a JSON integer >= 0 (not 64.0, 1e999 or true)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _check_float(path: Path, name: str, entry: TensorEntry) -> None:
    """Model weights are floating point: an integer tensor would be cast into garbage silently."""
    if entry.dtype not in _FLOAT_DTYPES:
        raise UnsupportedModelError(
            f"{path}: tensor {name!r} is stored as {entry.dtype.name}, but model weights must be "
            f"floating point ({', '.join(sorted(dtype.name for dtype in _FLOAT_DTYPES))}); a "
            "quantized checkpoint needs its original safetensors, a damaged one a new download"
        )


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
_FLOAT_DTYPES = {np.dtype(_SAFETENSORS_DTYPES[name]) for name in ("F64", "F32", "F16", "BF16")}
