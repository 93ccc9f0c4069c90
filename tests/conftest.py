"""Shared test setup: CPU with 8 virtual devices (for sharding tests), float32 matmuls, fixtures.

Under pytest-xdist (`scripts/test` runs one worker per core) torch computes on one thread per
worker: its OpenMP pool would otherwise take every core and spin while the other worker needs one.
XLA:CPU's pool is left as it is: jax 0.10.2's thunk runtime ignores --xla_cpu_multi_thread_eigen,
and two workers' 2048^2 matmuls on this 2-core machine ran 4% slower free than pinned one core
each, less than a pinned worker would lose once the other has finished. The settings are
environment variables, so the subprocesses a test starts (the CLI, the GPU check's --tiny mode)
inherit them.
"""

import atexit
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The output is a log's, not a terminal's: pytest-xdist's workers set COLUMNS=80, which the CLI
# (rightly) obeys, wrapping paths and tables that the tests read whole.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags = f"{flags} --xla_force_host_platform_device_count=8".strip()
# LLVM's optimizations off in XLA's backends for the tests. The suite compiles thousands of small
# programs and runs most of them for a step or a few: on this 2-core machine XLA's backend compile
# was 162 of tests/step/test_streamed.py's 187 s, and at level 0 it took 94 (the file 119 s; five
# of the longest files 645 s against 847, run side by side). The level is LLVM's alone: no HLO
# pass changes, so buffer assignment and memory_analysis() are today's compiler's (the
# calibration's held-out check passes under it), and a comparison of two programs compiles both
# alike. The tests that train a real model for minutes run their commands with XLA's defaults
# (`default_compiler_env`): at level 0 the demo's test took 234 s against 135. A whole run's
# minutes vary by day on the same machine (the same tests 15-45% apart on 2026-11-28 and -29), so
# each setting here was measured side by side.
if "xla_backend_optimization_level" not in flags:
    flags = f"{flags} {FAST_COMPILE_FLAG}".strip()
# XLA's GPU compiler (the deviceless compiles for an H100 or an RTX 4090) assembles each kernel in
# its own ptxas process: in tests/memory/test_measure_gpu.py about half of a compile. With a kernel
# cache file, a compile reuses the kernels an earlier one in the same worker assembled: the file
# took 271 s against 342 (run side by side, 2026-11-29). Only the kernels' machine code is cached;
# the HLO passes and buffer assignment run as before, so memory_analysis() is unchanged. One file
# per worker, which the commands a test starts share; the worker removes it when it exits.
if "xla_gpu_kernel_cache_file" not in flags:
    KERNEL_CACHE = Path(tempfile.gettempdir()) / f"featherweight-test-kernels-{os.getpid()}.bin"
    atexit.register(KERNEL_CACHE.unlink, missing_ok=True)
    flags = f"{flags} --xla_gpu_kernel_cache_file={KERNEL_CACHE}"
os.environ["XLA_FLAGS"] = flags
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from tests.emitters import (  # noqa: E402
    FAST_EMITTERS_FLAG,
    pytest_runtest_protocol,  # noqa: F401 (the marked tests' emitters)
    with_fast_emitters,
)

# XLA:CPU's legacy fusion emitters, which compile in half the time; the tests marked
# `default_emitters` compile with XLA's defaults (tests/emitters.py says why and how). Set in the
# environment before the first compile, so the commands the tests start compile alike; the
# pytest-xdist workers inherit it from the process that starts them, which tried it once.
os.environ["XLA_FLAGS"] = with_fast_emitters(os.environ["XLA_FLAGS"])

jax.config.update("jax_default_matmul_precision", "highest")

# The longest test files, longest first (seconds of their longest tests in the fresh-clone run
# of 2026-11-28 on this 2-core machine, `--durations`), collected before the rest. Under
# `--dist loadfile` this order only breaks ties: pytest-xdist hands out files by their number of
# tests, most first, which starts these few-test files last; `--no-loadscope-reorder`
# (pytest-xdist >= 3.8) makes it follow this order instead, but a fresh-clone run with it took
# 2,930 s of pytest against 2,655 without (the two workers ended within a minute of each other
# either way), so `scripts/test` keeps xdist's order.
LONGEST_FILES = (
    "tests/memory/test_measure_gpu.py",  # ~400 in all: deviceless GPU compiles
    "tests/demo/test_run.py",  # 186
    "tests/train/test_preference_walk.py",  # 171
    "tests/test_gpu_check.py",  # 151
    "tests/test_gpu_check_speed.py",  # 141
    "tests/reliability/test_kill.py",  # 139
    "tests/memory/test_calibration.py",  # 139
    "tests/test_gpu_check_attention.py",  # 118
    "tests/reliability/test_fuzz_command_line.py",  # 97
    "tests/train/test_grpo_walk.py",  # 73
    "tests/memory/test_measure.py",  # 50 of setup, then its grid
    "tests/test_walks.py",  # 60
    "tests/test_gpu_check_families.py",  # 51
)


def pytest_collection_modifyitems(config, items):
    """The longest files first (`LONGEST_FILES`), every other test in its collected order."""
    rank = {path: index for index, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


import yaml  # noqa: E402

from featherweight.data.demo_task import invented_world, write_training_data  # noqa: E402
from featherweight.io.embedded_model import demo_model_path  # noqa: E402
from featherweight.io.gguf_reader import GGUFSource  # noqa: E402
from featherweight.io.hf_writer import iter_hf_tensors, save_hf_checkpoint  # noqa: E402
from featherweight.models.config import ModelConfig  # noqa: E402
from featherweight.models.init import init_params  # noqa: E402
from featherweight.peft.lora import LoraConfig, init_lora, quantize_frozen_base  # noqa: E402


def tiny_config(**overrides) -> ModelConfig:
    """A Llama-shaped config small enough to compile in a second or two."""
    values = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return ModelConfig(**values)


@pytest.fixture(scope="session")
def demo_gguf():
    """The real SmolLM2-135M-Instruct GGUF, fetched by `featherweight setup` (scripts/test runs it)."""
    path = demo_model_path()
    if not path.is_file():
        pytest.fail(
            f"demo model missing at {path}: run `featherweight setup` first (scripts/test does)"
        )
    return path


def default_compiler_env(**extra: str) -> dict[str, str]:
    """This process's environment with XLA's default optimization level and emitters
    (`FAST_COMPILE_FLAG` and `FAST_EMITTERS_FLAG` removed), for a command that runs long rather
    than compiles much, as a user runs it; `extra` added."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = flags.replace(FAST_COMPILE_FLAG, "").replace(FAST_EMITTERS_FLAG, "").split()
    return {**os.environ, "XLA_FLAGS": " ".join(flags), **extra}


# The `featherweight` command line, run by this interpreter in its own process.
CLI = (
    sys.executable,
    "-c",
    "import sys; from featherweight.cli.main import main; sys.exit(main())",
)


def relative_difference(expected, actual) -> float:
    """Largest over the leaves of max |expected - actual| / max |expected|."""
    diffs = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30)),
        expected,
        actual,
    )
    return max(jax.tree.leaves(diffs))


# --- a tiny trainable checkpoint with a real tokenizer, and the demo task as data ---


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_gguf) -> Path:
    """An HF directory: a 2-layer model over SmolLM2's 49152-token vocabulary and tokenizer."""
    source = GGUFSource(demo_gguf)
    tokenizer = source.tokenizer()
    source.close()
    config = tiny_config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)  # fmt: skip
    params = init_params(jax.random.PRNGKey(0), config)
    out = tmp_path_factory.mktemp("tiny") / "model"
    return save_hf_checkpoint(out, config, iter_hf_tensors(params, config), tokenizer)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    return write_training_data(tmp_path_factory.mktemp("data") / "train.jsonl", invented_world())


def run_settings(model_dir: Path, data: Path, output_dir: Path, **overrides) -> dict:
    """A small, fast training config as a dict (YAML-ready)."""
    settings = {
        "method": "lora",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q", "v"]},
        "data": {"train": str(data), "seq_len": 64, "eval_fraction": 0.2},
        "optimizer": {"learning_rate": 1e-2, "schedule": "constant"},
        "batch_size": 2,
        "steps": 4,
        "checkpoint": {"every_steps": 2, "keep": 3},
        "output_dir": str(output_dir),
    }
    for key, value in overrides.items():
        node = settings
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return settings


def write_config(path: Path, settings: dict) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


def training_case(config: ModelConfig, method: str, rank: int = 8):
    """(trainable, frozen, lora spec) of a random float32 model: full, LoRA or QLoRA. The adapters'
    B is non-zero (PEFT starts it at zero), so every adapter gets a gradient from the first step."""
    params = init_params(jax.random.PRNGKey(0), config)
    if method == "full":
        return params, {}, None
    lora = LoraConfig(rank=rank, alpha=2 * rank)
    adapters = init_lora(jax.random.PRNGKey(1), config, lora)
    keys = iter(jax.random.split(jax.random.PRNGKey(2), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape), adapters)
    frozen = params if method == "lora" else quantize_frozen_base(params)
    return adapters, frozen, lora.spec
