"""One builder per bad input of the catalogue (tests/reliability/errors_catalogue.py).

A builder makes the bad input under `env.tmp` and returns the action that must fail; `CASES` maps
the catalogue's name to (builder, patterns the one-line message must match: the offending value,
and the fix).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import jax
import numpy as np
import pytest
import yaml
from gguf import GGUFReader
from huggingface_hub import errors as hub_errors
from safetensors.numpy import load_file, save_file

from featherweight.inference.generate import generate_ids, logits
from featherweight.io.convert import convert
from featherweight.io.hf_writer import iter_hf_tensors, save_hf_checkpoint
from featherweight.io.loader import load_model
from featherweight.memory.budget import plan_within_budget
from featherweight.models.config import read_hf_config
from featherweight.models.init import init_params
from featherweight.models.model import Model
from featherweight.quant.nf4 import quantize_nf4
from featherweight.recipe.schema import apply_overrides, load_config, parse_config
from featherweight.train import run as run_module
from featherweight.train.export_run import export_run
from featherweight.train.loop import train
from tests.conftest import tiny_config
from tests.hub_cache import hub_refusal
from tests.reliability.conftest import short_run

Action = Callable[[], object]
CASES: dict[str, tuple[Callable[[Env], Action], tuple[str, ...]]] = {}
LAYER0 = "model.layers.0"


def case(name: str, *patterns: str):
    """Register the decorated builder as the test of catalogue entry `name`."""

    def register(build: Callable[[Env], Action]) -> Callable[[Env], Action]:
        CASES[name] = (build, patterns)
        return build

    return register


class TouchOnUnpickle:
    """Unpickling this creates a file, which the test's snapshot would show."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return Path.touch, (self.sentinel,)


@dataclass
class Env:
    """What builders start from; everything they create lies under `tmp`."""

    tmp: Path
    model: Path  # a 256-token HF directory with SmolLM2's tokenizer files
    data: Path
    run: Path  # a finished LoRA run (checkpoints 2 and 4), shared: never written to
    gguf: Path
    read_only: Path
    monkeypatch: pytest.MonkeyPatch

    def settings(self, **overrides) -> dict:
        return short_run(self.model, self.data, self.tmp / "run", **overrides)

    def train(self, overwrite: bool = False, **overrides) -> Action:
        config = parse_config(self.settings(**overrides))
        return lambda: train(config, overwrite=overwrite)

    def train_model(self, model: Path) -> Action:
        return self.train(**{"model.path": str(model)})

    def train_data(self, content: str | bytes, **overrides) -> Action:
        path = self.tmp / "bad.jsonl"
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return self.train(**{"data.train": str(path), **overrides})

    def config_file(self, text: str) -> Path:
        path = self.tmp / "config.yaml"
        path.write_text(text)
        return path

    def model_copy(self) -> Path:
        return Path(shutil.copytree(self.model, self.tmp / "models" / "model"))

    def edited_config(self, **changes) -> Path:
        directory = self.model_copy()
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **changes}))
        return directory

    def edited_tensors(self, edit: Callable[[dict], object]) -> Path:
        directory = self.model_copy()
        tensors = load_file(str(directory / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory

    def edited_bytes(self, edit: Callable[[bytes], bytes]) -> Path:
        directory = self.model_copy()
        path = directory / "model.safetensors"
        path.write_bytes(edit(path.read_bytes()))
        return directory

    def edited_gguf(self, edit: Callable[[bytearray], object]) -> Path:
        data = bytearray(self.gguf.read_bytes())
        edit(data)
        path = self.tmp / "damaged.gguf"
        path.write_bytes(bytes(data))
        return path

    def run_copy(self, config_text: str | None = None) -> Path:
        """The finished run copied to tmp/run, its config.yaml moved along (or replaced)."""
        copy = Path(shutil.copytree(self.run, self.tmp / "run"))
        if config_text is None:
            config = {**yaml.safe_load((copy / "config.yaml").read_text()), "output_dir": str(copy)}
            config_text = yaml.safe_dump(config, sort_keys=False)
        (copy / "config.yaml").write_text(config_text)
        return copy

    def export(self, run: Path | None = None, **kwargs) -> Action:
        kwargs.setdefault("export_format", "merged")
        kwargs.setdefault("out", self.tmp / "export")
        return lambda: export_run(run or self.run, **kwargs)


# --- config ------------------------------------------------------------------------------------


@case(
    "unknown key",
    r"unknown key 'optimizer\.learnig_rate' \(line 2\)",
    r"did you mean 'learning_rate'\?",
)
def unknown_key(env: Env) -> Action:
    path = env.config_file("optimizer:\n  learnig_rate: 0.001\n")
    return lambda: load_config(path)


@case("value out of range", r"lora\.rank \(line 2\)", r"greater than 0", r"got 0")
def value_out_of_range(env: Env) -> Action:
    path = env.config_file("lora:\n  rank: 0\n")
    return lambda: load_config(path)


@case("value of the wrong type", r"steps \(line 1\)", r"valid integer", r"got 'many'")
def wrong_type(env: Env) -> Action:
    path = env.config_file("steps: many\n")
    return lambda: load_config(path)


@case("config file missing", r"missing\.yaml does not exist", r"pass a YAML file")
def missing_config(env: Env) -> Action:
    return lambda: load_config(env.tmp / "missing.yaml")


@case("config that is not a mapping", r"config\.yaml must hold a mapping of settings, found list")
def not_a_mapping(env: Env) -> Action:
    path = env.config_file("- steps\n- 10\n")
    return lambda: load_config(path)


@case(
    "YAML of nested aliases",
    r"lora\.targets\.0 \(line 26\): Input should be a valid string \(got \[\[",
    r"and \d+ more",
)
def alias_bomb(env: Env) -> Action:
    # 25 levels of 9 aliases each ("billion laughs"): 1 KB of text that expands to 9^25 values
    lines, previous = ["a: &a [x, x, x, x, x, x, x, x, x]"], "a"
    for level in range(1, 25):
        name = f"n{level}"
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
        previous = name
    lines.append(f"lora: {{targets: *{previous}}}")
    path = env.config_file("\n".join(lines) + "\n")
    return lambda: load_config(path)


@case(
    "infinite learning rate",
    r"optimizer\.learning_rate \(line 2\): Input should be a finite number",
)
def infinite_learning_rate(env: Env) -> Action:
    path = env.config_file("optimizer:\n  learning_rate: .inf\n")
    return lambda: load_config(path)


@case(
    "malformed override", r"--set 'steps'", r"must look like key\.sub=value, e\.g\. --set steps=200"
)
def malformed_override(env: Env) -> Action:
    return lambda: apply_overrides({}, ["steps"])


@case(
    "key written twice",
    r"config\.yaml: key 'steps' is written twice \(lines 1 and 3\)",
    r"keep one of them",
)
def key_twice(env: Env) -> Action:
    path = env.config_file("steps: 10\nmethod: lora\nsteps: 20\n")
    return lambda: load_config(path)


@case(
    "yes/no where a number is meant", r"steps \(line 1\)", r"true is a yes/no value, not a number"
)
def yes_no_number(env: Env) -> Action:
    path = env.config_file("steps: true\n")
    return lambda: load_config(path)


@case(
    "relative path not beside the config",
    r"run\.yaml \(line 1\): data\.train 'qa\.jsonl' is not at \S+/configs/qa\.jsonl",
    r"read from the config's folder \S+/configs, not the working directory \(it is in the "
    r"working directory: write \.\./qa\.jsonl\)",
)
def path_not_beside_the_config(env: Env) -> Action:
    (env.tmp / "configs").mkdir()
    (env.tmp / "configs" / "run.yaml").write_text("data: {train: qa.jsonl}\n")
    (env.tmp / "qa.jsonl").write_text('{"text": "hi"}\n')
    env.monkeypatch.chdir(env.tmp)
    return lambda: load_config(env.tmp / "configs" / "run.yaml")


@case("unknown LoRA target", r"\['qq'\]", r"valid: \['q', 'k', 'v', 'o', 'gate', 'up', 'down'\]")
def unknown_target(env: Env) -> Action:
    return lambda: parse_config({"lora": {"targets": ["q", "qq"]}})


@case(
    "LoRA rank larger than a target weight",
    r"LoRA rank=128 exceeds the smaller dimension of target 'q' \(weight \[out, in\] = \[64, 64\]\)",
    r"use rank <= 64 or drop 'q' from the targets",
)
def rank_too_large(env: Env) -> Action:
    return env.train(**{"lora.rank": 128})


@case("quantized head without QLoRA", r"model\.quantize_head=true", r"needs method: qlora")
def quantized_head(env: Env) -> Action:
    return env.train(**{"model.quantize_head": True})


@case(
    "kept dequantized weights without QLoRA",
    r"memory\.save: dequantized keeps NF4 weights dense .* method: lora has no NF4 weights",
    r"drop it from memory\.save, or use method: qlora",
)
def dequantized_without_qlora(env: Env) -> Action:
    return env.train(**{"memory.save": ["dequantized"]})


@case(
    "kept dequantized weights with the base on the host",
    r"memory\.save: dequantized keeps every layer's weights dense",
    r"which memory\.base: host exists to avoid; drop one of them",
)
def dequantized_with_base_on_host(env: Env) -> Action:
    return env.train(**{"method": "qlora", "memory.save": ["dequantized"], "memory.base": "host"})


@case(
    "global clipping the step cannot do in one pass",
    r"optimizer\.clipping: global with method: full and the streamed step",
    r"choose optimizer\.clipping: two_pass .*, per_tensor .*memory\.step: reference",
)
def global_clipping(env: Env) -> Action:
    return env.train(**{"method": "full", "optimizer.clip_norm": 1.0})


@case(
    "loss chunk that does not divide the sequence",
    r"loss chunk size 48 does not divide the sequence length 64",
    r"use a divisor such as 64",
)
def loss_chunk(env: Env) -> Action:
    return env.train(**{"memory.loss_chunk": 48})


@case(
    "MLP chunk that does not divide the sequence",
    r"memory\.mlp_chunk=48 must divide data\.seq_len=64",
    r"use a divisor, e\.g\. 32",
)
def mlp_chunk(env: Env) -> Action:
    return env.train(**{"memory.mlp_chunk": 48})


@case(
    "host placement on a mesh",
    r"memory\.optimizer_state: host is supported on one device only",
    r"drop the host placement, or set mesh: null",
)
def host_placement_on_a_mesh(env: Env) -> Action:
    return env.train(**{"memory.optimizer_state": "host", "mesh.data": 1, "mesh.fsdp": 8})


@case(
    "frozen base on the host without a frozen base",
    r"memory\.base: host keeps the frozen base in host memory, and method: full has none",
    r"use method lora or qlora, or memory\.base: device",
)
def base_on_host_with_full(env: Env) -> Action:
    return env.train(**{"memory.base": "host", "method": "full"})


@case(
    "unknown saved intermediate",
    r"\['attn'\]",
    r"known names are \['qkv', 'attention', 'mlp_hidden', 'dequantized'\]",
)
def unknown_saved(env: Env) -> Action:
    return lambda: parse_config({"memory": {"save": ["attn"]}})  # refused by the schema


# --- paths -------------------------------------------------------------------------------------


@case(
    "missing model path",
    r"no-such-model does not exist",
    r"give a Hugging Face model directory or a \.gguf file",
)
def missing_model(env: Env) -> Action:
    return env.train_model(env.tmp / "no-such-model")


@case(
    "output_dir holding other files",
    r"run holds 'notes\.txt' and is not a featherweight run",
    r"never writes over files it did not write -- choose a new or empty output_dir$",
)
def output_dir_taken(env: Env) -> Action:
    (env.tmp / "run").mkdir()
    (env.tmp / "run" / "notes.txt").write_text("mine")
    return env.train()


@case(
    "overwrite of a directory featherweight did not create",
    r"run was not created by featherweight \(it holds 'notes\.txt'",
    r"choose a new or empty output_dir",
)
def overwrite_foreign_dir(env: Env) -> Action:
    (env.tmp / "run").mkdir()
    (env.tmp / "run" / "notes.txt").write_text("mine")
    return env.train(overwrite=True)


@case(
    "overwrite of a run holding other files",
    r"run holds 'train\.yaml', which featherweight did not write",
    r"move it out, or choose a new output_dir",
)
def overwrite_run_with_config(env: Env) -> Action:
    copy = env.run_copy()
    (copy / "train.yaml").write_text(yaml.safe_dump(env.settings()))
    return env.train(overwrite=True)


@case(
    "output_dir in use",
    r"output_dir \S+/run is in use by another featherweight process",
    r"or choose another output_dir",
)
def output_dir_in_use(env: Env) -> Action:
    copy = env.run_copy()
    holder = os.open(copy, os.O_RDONLY | os.O_DIRECTORY)  # as another trainer's lock would
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    env.monkeypatch.setattr(env, "lock_holder", holder, raising=False)
    return env.train(overwrite=True)


@case(
    "output_dir that is a file",
    r"output_dir \S+/run is a file",
    r"choose a directory for output_dir",
)
def output_dir_file(env: Env) -> Action:
    (env.tmp / "run").write_text("notes")
    return env.train()


@case(
    "read-only output_dir", r"cannot write under \S+/read-only \(", r"choose a writable output_dir"
)
def read_only_output(env: Env) -> Action:
    config = parse_config(short_run(env.model, env.data, env.read_only / "run"))
    return lambda: train(config)


@case(
    "output_dir holding the model",
    r"output_dir \S+/models contains the model \S+/models/model",
    r"put the output_dir somewhere that does not hold the model",
)
def output_dir_with_model(env: Env) -> Action:
    model = env.model_copy()
    config = parse_config(short_run(model, env.data, model.parent))
    return lambda: train(config, overwrite=True)


@case(
    "output_dir holding the dataset",
    r"output_dir \S+/data contains the dataset \S+/data/train\.jsonl",
    r"put the output_dir somewhere that does not hold the dataset",
)
def output_dir_with_data(env: Env) -> Action:
    data = env.tmp / "data" / "train.jsonl"
    data.parent.mkdir()
    shutil.copy(env.data, data)
    config = parse_config(short_run(env.model, data, data.parent))
    return lambda: train(config, overwrite=True)


@case(
    "run file linked outside output_dir",
    r"run/metrics\.jsonl is a link to \S+/elsewhere\.jsonl",
    r"remove the link",
)
def linked_run_file(env: Env) -> Action:
    (env.tmp / "run").mkdir()
    (env.tmp / "elsewhere.jsonl").write_text("")
    (env.tmp / "run" / "metrics.jsonl").symlink_to(env.tmp / "elsewhere.jsonl")
    return env.train()


@case(
    "damaged run config in output_dir",
    r"run whose config\.yaml cannot be read \(",
    r"pass --overwrite to replace that run",
)
def damaged_run_config(env: Env) -> Action:
    env.run_copy(config_text="steps: [4\n")
    return env.train()


@case(
    "export into the run's checkpoints",
    r"export --out \S+/checkpoints/merged lies inside \S+/checkpoints",
    r"put the export --out outside it",
)
def export_into_checkpoints(env: Env) -> Action:
    return env.export(out=env.run / "checkpoints" / "merged")


@case(
    "export over the run itself",
    r"export --out (\S+) is the run \1",
    r"put the export --out somewhere that does not hold the run",
)
def export_over_run(env: Env) -> Action:
    return env.export(out=env.run, overwrite=True)


@case(
    "export output that exists",
    r"output directory \S+/export already exists",
    r"choose another path or pass --overwrite",
)
def export_exists(env: Env) -> Action:
    (env.tmp / "export").mkdir()
    return env.export()


@case(
    "export --overwrite over a directory of the user's",
    r"export holds 'notes\.txt', which featherweight did not write",
    r"choose a new or empty directory, or remove it yourself",
)
def export_overwrite_foreign(env: Env) -> Action:
    (env.tmp / "export").mkdir()
    (env.tmp / "export" / "notes.txt").write_text("mine")
    return env.export(overwrite=True)


@case(
    "convert to an integer dtype",
    r"convert --dtype 'int8'",
    r"use one of float32, float16, bfloat16",
)
def convert_int8(env: Env) -> Action:
    return lambda: convert(env.model, env.tmp / "converted", dtype="int8")


@case(
    "run with a relative model path",
    r"records its base model as the relative path 'models/llama/base'",
    r"edit model\.path in \S+config\.yaml to the model's absolute path",
)
def export_relative_model(env: Env) -> Action:
    config = yaml.safe_load((env.run / "config.yaml").read_text())
    config["model"]["path"] = "models/llama/base"  # (org/name would be a Hub name)
    copy = env.run_copy(config_text=yaml.safe_dump(config, sort_keys=False))
    return env.export(run=copy)


@case(
    "resume with fewer steps than the checkpoint",
    r"steps: 2 is below step 4, where run \S+/run already is",
    r"set steps to 4 or more to resume it, or choose a new output_dir",
)
def fewer_steps(env: Env) -> Action:
    copy = env.run_copy()
    config = yaml.safe_load((copy / "config.yaml").read_text())
    env.monkeypatch.setattr(run_module, "load_weights", lambda *_: pytest.fail("weights read"))
    return lambda: train(parse_config({**config, "steps": 2}))


@case(
    "Hub model not in the cache while offline",
    r"model org/missing is neither a path on this machine nor in the local Hub cache \S+, and "
    r"HF_HUB_OFFLINE is set",
    r"unset HF_HUB_OFFLINE to download it",
    r"or give a local directory",
)
def hub_offline(env: Env) -> Action:
    env.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env.monkeypatch.setenv("HF_HUB_CACHE", str(env.tmp / "hub"))
    return env.train(**{"model.path": "org/missing"})


@case(
    "gated Hub model",
    r"model meta-llama/Llama-3\.1-8B is gated on the Hugging Face Hub",
    r"accept its license at https://huggingface\.co/meta-llama/Llama-3\.1-8B, log in",
)
def hub_gated(env: Env) -> Action:
    def refuse(*_args, **_kwargs):
        raise hub_refusal(hub_errors.GatedRepoError, 403, "meta-llama/Llama-3.1-8B")

    env.monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    env.monkeypatch.setenv("HF_HUB_CACHE", str(env.tmp / "hub"))
    return env.train(**{"model.path": "meta-llama/Llama-3.1-8B"})


@case(
    "base model changed since the run",
    r"base model at \S+ is not the one run \S+/run was trained on",
    r"its checkpoints are intact -- put the original model back",
)
def model_changed(env: Env) -> Action:
    copy = env.run_copy()
    run_file = copy / "run.json"
    run = json.loads(run_file.read_text())
    run["model_fingerprint"] = {"sha256": "0" * 64, "bytes": 1}  # recorded from another model
    run_file.write_text(json.dumps(run))
    config = parse_config(yaml.safe_load((copy / "config.yaml").read_text()))
    return lambda: train(config)


@case(
    "convert over its source",
    r"convert --out \S+/models contains the source checkpoint \S+/models/model",
    r"put the convert --out somewhere that does not hold",
)
def convert_over_source(env: Env) -> Action:
    model = env.model_copy()
    return lambda: convert(model, model.parent, overwrite=True)


# --- checkpoints -------------------------------------------------------------------------------


@case(
    "NaN in a weight",
    r"tensor layer 0 up of \S+ holds NaN or infinite values",
    r"download it again or use another one",
)
def nan_weight(env: Env) -> Action:
    def poison(tensors):
        tensors[f"{LAYER0}.mlp.up_proj.weight"][0, 0] = np.nan

    return env.train_model(env.edited_tensors(poison))


@case(
    "tokenizer larger than the embedding",
    r"has 49152 tokens but the model's embedding has 256 rows",
    r"use the tokenizer\.json that came with these weights",
)
def tokenizer_too_large(env: Env) -> Action:
    directory = env.tmp / "models" / "small-vocab"
    save_hf_checkpoint(
        directory,
        tiny_config(),
        iter_hf_tensors(init_params(jax.random.PRNGKey(1), tiny_config()), tiny_config()),
        None,
    )
    shutil.copy(env.model / "tokenizer.json", directory / "tokenizer.json")
    return env.train_model(directory)


@case(
    "truncated safetensors",
    r"tensor '[\w.]+' ends at byte \d+ but the file has only \d+ bytes",
    r"truncated or corrupt -- download it again",
)
def truncated_safetensors(env: Env) -> Action:
    return env.train_model(env.edited_bytes(lambda data: data[:-1000]))


@case(
    "safetensors header that is not JSON",
    r"model\.safetensors is not a valid safetensors file: header is not JSON",
    r"download it again",
)
def garbage_header(env: Env) -> Action:
    return env.train_model(env.edited_bytes(lambda data: data[:8] + b"\x00garbage" + data[16:]))


@case(
    "integer tensor in safetensors",
    r"tensor 'model\.norm\.weight' is stored as int32",
    r"must be floating point",
    r"a new download",
)
def integer_tensor(env: Env) -> Action:
    def to_int(tensors: dict) -> None:
        tensors["model.norm.weight"] = tensors["model.norm.weight"].view(np.int32)

    return env.train_model(env.edited_tensors(to_int))


@case(
    "missing tensor",
    r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'",
    r"incomplete or belongs to another config",
)
def missing_tensor(env: Env) -> Action:
    return env.train_model(env.edited_tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))


@case(
    "tensor of the wrong shape",
    rf"'{LAYER0}\.self_attn\.k_proj\.weight' has shape \(64, 64\), expected \(32, 64\)",
    r"the checkpoint and config\.json do not match",
)
def wrong_shape(env: Env) -> Action:
    wrong = {f"{LAYER0}.self_attn.k_proj.weight": np.ones((64, 64), np.float32)}
    return env.train_model(env.edited_tensors(lambda tensors: tensors.update(wrong)))


@case(
    "tensor the config does not explain",
    rf"'{LAYER0}\.self_attn\.q_norm\.weight'",
    r"is config\.json for this checkpoint\?",
)
def unexpected_tensor(env: Env) -> Action:
    extra = {f"{LAYER0}.self_attn.q_norm.weight": np.ones(16, np.float32)}
    return env.train_model(env.edited_tensors(lambda tensors: tensors.update(extra)))


@case(
    "unsupported model type",
    r"model_type 'gpt_neox'",
    r"supported model types: llama, mistral, .*qwen3, gemma2",
)
def unsupported_type(env: Env) -> Action:
    return env.train_model(env.edited_config(model_type="gpt_neox"))


@case(
    "impossible model config",
    r"num_attention_heads=4 must be a positive multiple of num_key_value_heads=3",
)
def impossible_config(env: Env) -> Action:
    return env.train_model(env.edited_config(num_key_value_heads=3))


@case("truncated GGUF", r"damaged\.gguf", r"truncated", r"download it again")
def truncated_gguf(env: Env) -> Action:
    return env.train_model(env.edited_gguf(lambda data: data.__delitem__(slice(-4096, None))))


@case(
    "GGUF with a damaged tensor table",
    r"tensor 'blk\.0\.attn_\w+\.weight' lies at bytes \d+-\d+, expected from \d+",
    r"the tensor table is damaged or the file truncated -- download it again",
)
def damaged_tensor_table(env: Env) -> Action:
    tensor = next(t for t in GGUFReader(str(env.gguf)).tensors if t.name == "blk.0.attn_q.weight")
    position = tensor.field.offset + sum(part.nbytes for part in tensor.field.parts[:-1])
    shifted = (int(tensor.field.parts[-1][0]) + 64).to_bytes(8, "little")

    def shift(data: bytearray) -> None:
        data[position : position + 8] = shifted

    return env.train_model(env.edited_gguf(shift))


@case(
    "GGUF with a damaged metadata key",
    r"metadata key 'llama\.context_lengtx' is one byte away from GGUF's 'llama\.context_length'",
    r"download it again",
)
def damaged_key(env: Env) -> Action:
    def rename(data: bytearray) -> None:
        at = bytes(data).index(b"llama.context_length")
        data[at : at + 20] = b"llama.context_lengtx"

    return env.train_model(env.edited_gguf(rename))


@case("model without a tokenizer", r"models/model has no tokenizer", r"the trainer needs one")
def no_tokenizer(env: Env) -> Action:
    model = env.model_copy()
    (model / "tokenizer.json").unlink()
    return env.train_model(model)


@case(
    "damaged checkpoint when resuming",
    r"checkpoint \S+/run/checkpoints/4 cannot be restored",
    r"delete it to resume from an earlier one",
)
def damaged_checkpoint(env: Env) -> Action:
    run = env.run_copy()
    (run / "checkpoints" / "4" / "arrays" / "manifest.ocdbt").unlink()
    config = parse_config(yaml.safe_load((run / "config.yaml").read_text()))
    return lambda: train(config)


@case(
    "damaged run config at export",
    r"run/config\.yaml cannot be read \(",
    r"restore it from the YAML config",
)
def damaged_config_at_export(env: Env) -> Action:
    return env.export(run=env.run_copy(config_text="method: ["))


@case(
    "export of a directory that is not a run",
    r"is not a featherweight run \(no config\.yaml\)",
    r"pass train's output_dir",
)
def export_not_a_run(env: Env) -> Action:
    return env.export(run=env.tmp)


@case(
    "export of a run without checkpoints",
    r"run \S+/fresh has no checkpoint yet",
    r"train at least until the first save",
)
def export_no_checkpoints(env: Env) -> Action:
    (env.tmp / "fresh").mkdir()
    shutil.copy(env.run / "config.yaml", env.tmp / "fresh")
    return env.export(run=env.tmp / "fresh")


@case(
    "export of a checkpoint that does not exist",
    r"checkpoints/99 does not exist",
    r"pass a run directory",
)
def export_missing_step(env: Env) -> Action:
    return env.export(run=env.run / "checkpoints" / "99")


# --- safety ------------------------------------------------------------------------------------


@case(
    "pickle weights in a model directory",
    r"pytorch_model\.bin is a pickle-based checkpoint",
    r"never unpickles",
    r"safe_serialization=True",
)
def pickle_directory(env: Env) -> Action:
    directory = env.tmp / "models" / "pickled"
    directory.mkdir(parents=True)
    shutil.copy(env.model / "config.json", directory)
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(TouchOnUnpickle(env.tmp / "PWNED")))
    return env.train_model(directory)


@case(
    "pickle file as the model",
    r"model\.pt is a pickle-based checkpoint",
    r"Convert it to safetensors",
)
def pickle_file(env: Env) -> Action:
    path = env.tmp / "model.pt"
    path.write_bytes(pickle.dumps(TouchOnUnpickle(env.tmp / "PWNED")))
    return env.train_model(path)


# --- data --------------------------------------------------------------------------------------


@case("missing dataset", r"dataset \S+none\.jsonl does not exist", r"pass a JSONL file")
def missing_dataset(env: Env) -> Action:
    return env.train(**{"data.train": str(env.tmp / "none.jsonl")})


@case("dataset that is a directory", r"is a directory", r"pass a JSONL file")
def dataset_directory(env: Env) -> Action:
    return env.train(**{"data.train": str(env.tmp)})


@case("empty dataset", r"bad\.jsonl is empty", r"one JSON object per line")
def empty_dataset(env: Env) -> Action:
    return env.train_data("")


@case("line that is not JSON", r"bad\.jsonl:2: not valid JSON", r"pass --skip-bad")
def not_json(env: Env) -> Action:
    return env.train_data('{"text": "fine"}\n{not json\n')


@case(
    "line nested too deeply",
    r"bad\.jsonl:2: nests deeper than Python's recursion limit allows",
    r"pass --skip-bad",
)
def nested_too_deeply(env: Env) -> Action:
    depth = 200_000
    return env.train_data('{"text": "fine"}\n{"text": ' + "[" * depth + "]" * depth + "}\n")


@case(
    "record of no known shape",
    r"bad\.jsonl:1: record has keys \['completion', 'prompt'\]",
    r'expected \{"text": \.\.\.\}',
)
def unknown_shape(env: Env) -> Action:
    return env.train_data('{"prompt": "a", "completion": "b"}\n')


@case(
    "conversation without an assistant turn",
    r"bad\.jsonl:1: the conversation has no assistant message",
    r"nothing to learn",
)
def no_assistant(env: Env) -> Action:
    return env.train_data('{"messages": [{"role": "user", "content": "hi"}]}\n')


@case(
    "invalid UTF-8",
    r"bad\.jsonl:1: not valid UTF-8 \(invalid start byte at byte \d+\)",
    r"--skip-bad",
)
def invalid_utf8(env: Env) -> Action:
    return env.train_data(b'{"text": "caf\xff"}\n')


@case(
    "half a surrogate pair",
    r'bad\.jsonl:1: holds "\\ud800", half of a UTF-16 surrogate pair',
    r"--skip-bad",
)
def lone_surrogate(env: Env) -> Action:
    return env.train_data('{"text": "\\ud800"}\n')


@case("every line bad with --skip-bad", r"bad\.jsonl: all 2 lines are bad and were skipped")
def all_skipped(env: Env) -> Action:
    return env.train_data("{oops\n[1]\n", **{"data.skip_bad": True})


@case(
    "eval split larger than the data",
    r"1 examples cannot give both a train and an eval set \(eval_fraction=0\.5\)",
    r"add examples or set eval_fraction to 0",
)
def eval_too_large(env: Env) -> Action:
    return env.train_data('{"text": "one example"}\n', **{"data.eval_fraction": 0.5})


@case(
    "example longer than a row",
    r"bad\.jsonl:1: example has \d+ tokens, more than a row holds \(seq_len \+ 1 = 9\)",
    r"raise seq_len, shorten the example, or set overflow='truncate'",
)
def example_too_long(env: Env) -> Action:
    text = json.dumps({"text": "word " * 40})
    return env.train_data(text + "\n", **{"data.overflow": "error", "data.seq_len": 8})


# --- budgets -----------------------------------------------------------------------------------


def _plan(env: Env, budget: str) -> Action:
    config = parse_config(env.settings(**{"memory.budget": budget}))
    model_config = read_hf_config(env.model)
    return lambda: plan_within_budget(config, model_config)


@case("budget that is not a size", r"budget '8 gigs' is not a memory size", r"e\.g\. 8GiB")
def budget_not_a_size(env: Env) -> Action:
    return _plan(env, "8 gigs")


@case(
    "budget nothing fits",
    r"nothing fits 0\.00 GiB",
    r"GiB short; largest component: ",
    r"Options that fit|use a larger device",
)
def budget_too_small(env: Env) -> Action:
    return _plan(env, "1MiB")


# --- meshes ------------------------------------------------------------------------------------


@case(
    "mesh that does not fill the devices",
    r"mesh data=3, fsdp=3 does not fill the 8 devices",
    r"use e\.g\. fsdp=8",
)
def mesh_too_big(env: Env) -> Action:
    return env.train(mesh={"data": 3, "fsdp": 3})


@case(
    "batch that does not split over the mesh",
    r"global batch of 3 rows cannot be split",
    r"a multiple of 8, e\.g\. 24",
)
def batch_not_divisible(env: Env) -> Action:
    return env.train(batch_size=3, mesh={"data": 2, "fsdp": 4})


@case("mesh axis of size 0", r"mesh\.data", r"positive integer or 'auto', got 0")
def mesh_axis_zero(env: Env) -> Action:
    return lambda: parse_config({"mesh": {"data": 0}})


# --- exports -----------------------------------------------------------------------------------


@case(
    "unknown export format",
    r"export format 'onnx' is unknown",
    r"use one of merged, peft, gguf, gguf-adapter",
)
def unknown_format(env: Env) -> Action:
    return env.export(export_format="onnx")


@case(
    "GGUF type featherweight does not write",
    r"--quant 'q4_k_m' is not a GGUF type featherweight writes",
    r"use one of f32, f16, bf16, q8_0.*llama-quantize",
)
def gguf_k_quant_export(env: Env) -> Action:
    return env.export(export_format="gguf", quant="q4_k_m")


@case(
    "GGUF tensor type that cannot be dequantized",
    r"tensor 'blk\.0\.attn_q\.weight' is stored as I32, which the installed gguf package",
    r"Upgrade gguf, or use a file quantized with one of these",
)
def gguf_integer_tensor(env: Env) -> Action:
    from gguf import GGMLQuantizationType

    from tests.tiny_checkpoints import hf_config, random_hf_model, write_gguf

    def type_of(name: str) -> GGMLQuantizationType:
        integer = name == "blk.0.attn_q.weight"
        return GGMLQuantizationType.I32 if integer else GGMLQuantizationType.F32

    path = write_gguf(env.tmp / "int.gguf", random_hf_model(hf_config("llama2")), type_of=type_of)
    return lambda: load_model(path)


@case("GRPO reward without a function name", r"reward 'rewards\.py' names no function")
def reward_without_function(env: Env) -> Action:
    from featherweight.train.rewards import load_reward

    return lambda: load_reward("rewards.py", env.tmp)


@case(
    "GGUF of an unsupported architecture",
    r"GGUF architecture 'mamba' is not supported",
    r"supported: llama, qwen2, qwen3",
)
def gguf_architecture(env: Env) -> Action:
    from tests.tiny_checkpoints import hf_config, random_hf_model, write_gguf

    model = random_hf_model(hf_config("llama2"))
    path = write_gguf(env.tmp / "mamba.gguf", model, architecture="mamba")
    return lambda: load_model(path)


@case("PEFT export of a full fine-tune", r"full-run is a full fine-tune", r"use --format merged")
def peft_of_full(env: Env) -> Action:
    copy = Path(shutil.copytree(env.run, env.tmp / "full-run"))
    config = yaml.safe_load((copy / "config.yaml").read_text())
    (copy / "config.yaml").write_text(yaml.safe_dump({**config, "method": "full"}))
    return env.export(run=copy, export_format="peft")


@case(
    "merged export to an integer dtype",
    r"merged export dtype 'int8' is not supported",
    r"use 'float32' \(default\)",
)
def integer_dtype(env: Env) -> Action:
    return env.export(dtype="int8")


@case(
    "disk full while exporting",
    r"no space left on the device while writing \S+/export \(No space left on device\)",
    r"the partial copy was removed; nothing was written to \S+/export",
    r"Free space on that disk",
)
def disk_full_export(env: Env) -> Action:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    env.monkeypatch.setattr("featherweight.io.hf_writer.save_file", full)
    return env.export()


# --- inputs ------------------------------------------------------------------------------------


@case("token id outside the vocabulary", r"token id 49152 is outside the vocabulary \[0, 49152\)")
def token_out_of_range(env: Env) -> Action:
    model = load_model(env.model)
    return lambda: logits(model, [[1, 49152]])


@case(
    "prompt longer than the model reads",
    r"the prompt is 16 tokens but the model reads at most 16 \(max_position_embeddings\)",
    r"shorten the prompt",
)
def prompt_too_long(env: Env) -> Action:
    config = tiny_config(max_position_embeddings=16)
    model = Model(config, init_params(jax.random.PRNGKey(0), config), None, env.tmp / "model")
    return lambda: generate_ids(model, list(range(16)), max_new_tokens=1)


@case(
    "tensor that cannot be NF4-quantized",
    r"cannot NF4-quantize w of shape \(100,\)",
    r"keep this tensor in bf16 or pad the model",
)
def not_quantizable(env: Env) -> Action:
    return lambda: quantize_nf4(np.ones(100, np.float32), name="w")
