"""The catalogue's bad inputs given on the command line: unreadable and odd files (no read
permission, not UTF-8, a FIFO, a symbolic link loop), damaged tokenizers, malformed config.json
values, option values typer refuses, and faults while a run writes its last files.

Each builder returns a `Cli` call; tests/reliability/test_catalogue.py runs it through the real
app (typer's CliRunner) and asserts exit code 2, one line `error: TYPE: message` on stderr naming
the catalogued type, the message patterns, and that nothing under the test's directories changed.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.reliability.catalogue_cases import Action, Env, case


@dataclass
class Cli:
    """A command line to run through the app, with environment variables set for it."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def _config(env: Env, **overrides) -> Path:
    output_dir = overrides.pop("output_dir", None)
    settings = env.settings(**overrides)
    if output_dir is not None:
        settings["output_dir"] = output_dir
    path = env.tmp / "train.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def train(env: Env, **overrides) -> Cli:
    return Cli(["train", str(_config(env, **overrides))])


def unreadable(env: Env, path: Path) -> Path:
    """`path` made unreadable (mode 000). Root reads any file anyway, so for root every open of
    it fails the way it would for anyone else (EACCES), as the read_only_dir fixture does."""
    path.chmod(0)
    if os.access(path, os.R_OK):
        real_open = io.open

        def refusing_open(file, *args, **kwargs):
            if isinstance(file, str | Path) and os.path.realpath(file) == str(path.resolve()):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
            return real_open(file, *args, **kwargs)

        env.monkeypatch.setattr(io, "open", refusing_open)
        env.monkeypatch.setattr(builtins, "open", refusing_open)
    return path


def fifo(env: Env, name: str) -> Path:
    path = env.tmp / name
    os.mkfifo(path)
    return path


def link_loop(env: Env, name: str) -> Path:
    """`name` -> `name.other` -> `name`: resolving either never ends."""
    path, other = env.tmp / name, env.tmp / f"{name}.other"
    path.symlink_to(other)
    other.symlink_to(path)
    return path


def model_with(env: Env, **files: bytes | str) -> Path:
    """A copy of the small model with some of its files replaced."""
    model = env.model_copy()
    for name, content in files.items():
        target = model / name.replace("__", ".")
        target.write_bytes(content.encode() if isinstance(content, str) else content)
    return model


# --- files -------------------------------------------------------------------------------------


@case("config file without read permission", r"config file \S+train\.yaml cannot be read",
      r"Permission denied", r"check that it is a file you may read")  # fmt: skip
def unreadable_config(env: Env) -> Action:
    call = train(env)
    unreadable(env, Path(call.args[1]))
    return call


@case("config file that is not UTF-8", r"config file \S+train\.yaml is not UTF-8 text",
      r"at byte 5", r"save it as UTF-8")  # fmt: skip
def latin1_config(env: Env) -> Action:
    path = env.tmp / "train.yaml"
    path.write_bytes(b"# caf\xe9\nsteps: 4\n")
    return Cli(["train", str(path)])


@case("config file that is a FIFO", r"config file \S+train\.yaml is a FIFO \(named pipe\)",
      r"pass a YAML file")  # fmt: skip
def fifo_config(env: Env) -> Action:
    return Cli(["train", str(fifo(env, "train.yaml"))])


@case("config file that is a directory", r"config file \S+ is a directory", r"pass a YAML file")
def directory_config(env: Env) -> Action:
    return Cli(["train", str(env.tmp)])


@case("config file in a symbolic link loop", r"config file \S+loop\.yaml is a symbolic link loop",
      r"pass a YAML file")  # fmt: skip
def looping_config(env: Env) -> Action:
    return Cli(["train", str(link_loop(env, "loop.yaml"))])


@case("dataset without read permission", r"dataset \S+data\.jsonl cannot be read",
      r"Permission denied")  # fmt: skip
def unreadable_dataset(env: Env) -> Action:
    data = Path(shutil.copy(env.data, env.tmp / "data.jsonl"))
    call = train(env, **{"data.train": str(data)})
    unreadable(env, data)
    return call


@case("dataset that is a FIFO", r"dataset \S+data\.jsonl is a FIFO \(named pipe\)",
      r"pass a JSONL file")  # fmt: skip
def fifo_dataset(env: Env) -> Action:
    return train(env, **{"data.train": str(fifo(env, "data.jsonl"))})


@case("model path that is a FIFO", r"model path \S+model\.gguf is a FIFO \(named pipe\)",
      r"give a Hugging Face model directory or a \.gguf file")  # fmt: skip
def fifo_model(env: Env) -> Action:
    return train(env, **{"model.path": str(fifo(env, "model.gguf"))})


@case("model path in a symbolic link loop", r"\S+/model-link cannot be resolved",
      r"symbolic link loop -- remove or fix the link")  # fmt: skip
def looping_model(env: Env) -> Action:
    return train(env, **{"model.path": str(link_loop(env, "model-link"))})


@case("export of a run path in a symbolic link loop", r"\S+/run-link cannot be resolved",
      r"symbolic link loop")  # fmt: skip
def looping_run(env: Env) -> Action:
    run = link_loop(env, "run-link")
    return Cli(["export", str(run), "--format", "peft", "--out", str(env.tmp / "adapter")])


@case("output_dir inside a file", r"cannot write under \S+/data\.jsonl: it is a file",
      r"choose a output_dir outside that file")  # fmt: skip
def output_inside_dataset(env: Env) -> Action:
    data = Path(shutil.copy(env.data, env.tmp / "data.jsonl"))
    return train(env, **{"data.train": str(data), "output_dir": str(data / "run")})


@case("cache path that is a file", r"FEATHERWEIGHT_CACHE=\S+cache: \S+cache is not a directory",
      r"point FEATHERWEIGHT_CACHE at a directory")  # fmt: skip
def cache_is_a_file(env: Env) -> Action:
    (env.tmp / "cache").write_text("not a directory")
    env.monkeypatch.setenv("FEATHERWEIGHT_CACHE", str(env.tmp / "cache"))
    return Cli(["generate", "--max-new-tokens", "1"])


# --- model config.json and tokenizer -----------------------------------------------------------


@case("config.json that is not UTF-8", r"model config \S+config\.json is not UTF-8 text",
      r"save it as UTF-8")  # fmt: skip
def latin1_config_json(env: Env) -> Action:
    model = model_with(env, config__json=b'{"model_type": "llama", "caf\xe9": 1}')
    return train(env, **{"model.path": str(model)})


@case("config.json without read permission", r"model config \S+config\.json cannot be read",
      r"Permission denied")  # fmt: skip
def unreadable_config_json(env: Env) -> Action:
    model = env.model_copy()
    call = train(env, **{"model.path": str(model)})
    unreadable(env, model / "config.json")
    return call


@case("config.json that is not JSON", r"config\.json is not valid JSON", r"restore the original")
def garbage_config_json(env: Env) -> Action:
    return train(env, **{"model.path": str(model_with(env, config__json='{"model_type": "ll'))})


@case("config.json value of the wrong type", r"hidden_size: Input should be a valid integer",
      r"got '64'", r"restore the model's original config\.json")  # fmt: skip
def string_hidden_size(env: Env) -> Action:
    return train(env, **{"model.path": str(env.edited_config(hidden_size="64"))})


@case("config.json negative size", r"intermediate_size: Input should be greater than 0",
      r"got -128")  # fmt: skip
def negative_size(env: Env) -> Action:
    return train(env, **{"model.path": str(env.edited_config(intermediate_size=-128))})


@case("hidden size not divisible by the heads",
      r"hidden_size=66 is not divisible by num_attention_heads=4 and no head_dim is given")  # fmt: skip
def indivisible_hidden(env: Env) -> Action:
    return train(env, **{"model.path": str(env.edited_config(hidden_size=66, head_dim=None))})


@case("rope scaling that is not a mapping", r"rope_scaling: Input should be a valid dictionary",
      r"got 'llama3'")  # fmt: skip
def rope_scaling_string(env: Env) -> Action:
    return train(env, **{"model.path": str(env.edited_config(rope_scaling="llama3"))})


@case("rope scaling factor that is not a number",
      r"rope_scaling\.factor: Input should be a valid number", r"got 'eight'")  # fmt: skip
def rope_scaling_factor(env: Env) -> Action:
    scaling = {"rope_type": "llama3", "factor": "eight", "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    return train(env, **{"model.path": str(env.edited_config(rope_scaling=scaling))})


@case("truncated tokenizer.json", r"tokenizer\.json is not a valid tokenizer \(EOF while parsing",
      r"truncated or damaged -- download it again")  # fmt: skip
def truncated_tokenizer(env: Env) -> Action:
    text = (env.model / "tokenizer.json").read_bytes()
    return train(
        env, **{"model.path": str(model_with(env, tokenizer__json=text[: len(text) // 2]))}
    )


@case("tokenizer.json that is not JSON", r"tokenizer\.json is not a valid tokenizer \(key must be a string at line 1",
      r"download it again")  # fmt: skip
def garbage_tokenizer(env: Env) -> Action:
    return train(env, **{"model.path": str(model_with(env, tokenizer__json="{this is not json"))})


@case("tokenizer.json of the wrong schema",
      r"tokenizer\.json is not a valid tokenizer \(invalid type: sequence, expected struct Tokenizer",
      r"download it again")  # fmt: skip
def wrong_schema_tokenizer(env: Env) -> Action:
    return train(env, **{"model.path": str(model_with(env, tokenizer__json='["a", "b"]'))})


@case("tokenizer.json without read permission", r"tokenizer file \S+tokenizer\.json cannot be read",
      r"Permission denied")  # fmt: skip
def unreadable_tokenizer(env: Env) -> Action:
    model = env.model_copy()
    call = train(env, **{"model.path": str(model)})
    unreadable(env, model / "tokenizer.json")
    return call


@case("tokenizer_config.json that is not an object",
      r"tokenizer_config\.json must hold a JSON object, found list", r"download it again")  # fmt: skip
def list_tokenizer_config(env: Env) -> Action:
    model = model_with(env, tokenizer_config__json="[1, 2]")
    return train(env, **{"model.path": str(model)})


# --- options -----------------------------------------------------------------------------------


@case("option below its range", r"Invalid value for '--steps': Input should be greater than or "
      r"equal to 1", r"see \S+ demo --help")  # fmt: skip
def zero_steps(env: Env) -> Action:
    return Cli(["demo", "--steps", "0", "--output-dir", str(env.tmp / "demo")])


@case("option of the wrong type", r"Invalid value for '--batch': Input should be a valid integer")
def text_batch(env: Env) -> Action:
    return Cli(["plan", "SmolLM2-135M", "--batch", "two", "--no-measure"])


@case("unknown option", r"No such option: --stepz", r"see \S+ train --help")
def unknown_option(env: Env) -> Action:
    return Cli(["train", "--stepz", "3"])


@case("option that is not finite", r"Invalid value for '--max-shard-gib': nan is not a finite")
def nan_shard_size(env: Env) -> Action:
    return Cli(["convert", str(env.model), "--out", str(env.tmp / "hf"), "--max-shard-gib", "nan"])


@case("infinite sampling temperature", r"Invalid value for '--temperature': inf is not a finite")
def infinite_temperature(env: Env) -> Action:
    return Cli(["generate", str(env.model), "--temperature", "inf"])


@case("empty output directory option", r"Invalid value for '--output-dir': the path is empty")
def empty_output_dir(env: Env) -> Action:
    return Cli(["demo", "--output-dir", ""])


@case("plot path that is a directory", r"Invalid value for '--plot': \S+ is a directory",
      r"give a file name inside it")  # fmt: skip
def plot_directory(env: Env) -> Action:
    return Cli(["plan", "SmolLM2-135M", "--plot", str(env.tmp), "--no-measure"])


@case("budget option that is not a size", r"budget '8 gigs' is not a memory size", r"e\.g\. 8GiB")
def budget_option(env: Env) -> Action:
    return Cli(["plan", "SmolLM2-135M", "--budget", "8 gigs", "--no-measure"])


@case("mesh option that cannot be read", r"mesh 'data=2,data=4' cannot be read at 'data=4'",
      r"write e\.g\. fsdp=8")  # fmt: skip
def repeated_mesh_axis(env: Env) -> Action:
    return Cli(["plan", "SmolLM2-135M", "--mesh", "data=2,data=4", "--no-measure"])


@case("mesh option naming too many devices", r"--mesh 'fsdp=100000' names 100000 devices",
      r"plan a smaller mesh")  # fmt: skip
def huge_mesh(env: Env) -> Action:
    return Cli(["plan", "SmolLM2-135M", "--mesh", "fsdp=100000", "--no-measure"])


@case("override that is not valid YAML", r"--set steps=\[4: the value is not valid YAML",
      r"quote it")  # fmt: skip
def broken_override(env: Env) -> Action:
    return Cli(["train", str(_config(env)), "--set", "steps=[4"])


@case("override with an empty key part", r"--set data\.\.seq_len=8: the key 'data\.\.seq_len' "
      r"has an empty part")  # fmt: skip
def empty_key_override(env: Env) -> Action:
    return Cli(["train", str(_config(env)), "--set", "data..seq_len=8"])


@case("seed out of range", r"seed \(line \d+\): Input should be less than or equal to 4294967295",
      r"got 18446744073709551616")  # fmt: skip
def huge_seed(env: Env) -> Action:
    return train(env, seed=2**64)


@case("batch larger than the device", r"the memory plan needs [\d.]+ GiB but the device has "
      r"[\d.]+ GiB", r"lower batch_size or data\.seq_len, or set memory\.budget")  # fmt: skip
def batch_beyond_the_device(env: Env) -> Action:
    return train(env, batch_size=10**7)


# --- faults while a run writes its last files ---------------------------------------------------


@case("disk full while writing the loss plot",
      r"no space left on the device while writing the loss plot \S+/run/loss\.png",
      r"checkpoints and metrics\.jsonl are intact, only the plot is missing")  # fmt: skip
def disk_full_plot(env: Env) -> Action:
    """The finished run is run again (it resumes at its last step, so nothing trains); its final
    loss plot meets a full disk. Nothing of the run changes."""
    copy = env.run_copy()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    env.monkeypatch.setattr("matplotlib.figure.Figure.savefig", full)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    path = env.tmp / "again.yaml"
    path.write_text(yaml.safe_dump(config))
    return Cli(["train", str(path)])
