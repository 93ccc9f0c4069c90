"""Loading is lean: the peak host memory a load adds stays below 1.3x the checkpoint size.

Measured in a fresh subprocess: the peak resident set size (`VmHWM`, reset to the current RSS once
the imports are done) minus the RSS at that point. `getrusage`'s `ru_maxrss` would not do: Linux
carries it over from the forking parent across `exec`, so a subprocess of a big pytest process
starts with the parent's peak. The checkpoint (~90 MB float32, written here) is large enough that
holding any part of the model twice -- a memory-mapped file kept resident, a stack copied to the
device -- would show.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import save_file

from featherweight.models.config import ModelConfig
from featherweight.models.shapes import layer_shapes, top_level_shapes

PEAK_RATIO_LIMIT = 1.3

CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=5,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
)

MEASURE = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    from featherweight.io.loader import load_model, params_nbytes

    def status_bytes(field):
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    jnp.zeros(8).block_until_ready()  # start the runtime before the baseline
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak (VmHWM) to the current RSS
    before = status_bytes("VmRSS")
    model = load_model(sys.argv[1], dtype=sys.argv[2])
    jax.block_until_ready(model.params)
    print(json.dumps({"added_peak": status_bytes("VmHWM") - before,
                      "added_after": status_bytes("VmRSS") - before,
                      "params": params_nbytes(model.params)}))
    """
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple:
    """A float32 HF directory of about 90 MB (random weights, exact tensor layout of CONFIG)."""
    from featherweight.io.names import hf_name

    directory = tmp_path_factory.mktemp("lean")
    rng = np.random.default_rng(0)
    tensors = {
        hf_name((name, None), CONFIG): rng.standard_normal(shape, dtype=np.float32)
        for name, shape in top_level_shapes(CONFIG).items()
    }
    for layer in range(CONFIG.num_layers):
        for name, shape in layer_shapes(CONFIG).items():
            tensors[hf_name((name, layer), CONFIG)] = rng.standard_normal(shape, dtype=np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG.to_hf_dict()))
    return directory, (directory / "model.safetensors").stat().st_size


def measure_load(directory, dtype: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(directory), dtype],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_peak_host_memory_of_a_load_is_below_1_3x_the_checkpoint(checkpoint):
    directory, size = checkpoint
    assert 50e6 < size < 100e6
    measured = measure_load(directory, "float32")
    assert measured["params"] == pytest.approx(size, rel=0.01)
    ratio = measured["added_peak"] / size
    print(
        f"load peak RSS: +{measured['added_peak'] / 1e6:.1f} MB for a {size / 1e6:.1f} MB "
        f"checkpoint = {ratio:.2f}x"
    )
    assert measured["added_after"] > 0.9 * size  # the model really is resident
    assert ratio < PEAK_RATIO_LIMIT


def test_casting_load_holds_at_most_one_extra_tensor(checkpoint):
    """float32 -> bfloat16 on load: the result is half the checkpoint, and the peak adds no more
    than the largest float32 tensor in flight (casting the model whole would add all of it)."""
    directory, size = checkpoint
    largest = 4 * max(
        int(np.prod(shape))
        for shape in [*top_level_shapes(CONFIG).values(), *layer_shapes(CONFIG).values()]
    )
    measured = measure_load(directory, "bfloat16")
    assert measured["params"] == pytest.approx(size / 2, rel=0.01)
    assert measured["added_peak"] < size / 2 + largest + 0.05 * size


KQUANT_CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,  # K-quant rows are whole 256-value super-blocks
    num_hidden_layers=5,
    num_attention_heads=8,
    num_key_value_heads=4,
)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """A Q4_K_M-style GGUF (Q4_K, Q6_K for the head and half the v/down projections) of a model
    of about 25M parameters: about 15 MB on disk, 100 MB once dequantized to float32."""
    from tests.io.test_gguf_kquants import q4_k_m
    from tests.tiny_checkpoints import hf_config, random_hf_model, write_gguf

    model = random_hf_model(hf_config("llama2", **KQUANT_CONFIG))
    path = tmp_path_factory.mktemp("kquant") / "model.Q4_K_M.gguf"
    return write_gguf(path, model, type_of=q4_k_m)


@pytest.mark.slow
def test_kquant_load_holds_less_than_one_tensor_beyond_the_result(kquant_gguf):
    """Dequantizing a K-quant file adds, on top of the float32 result, less than its largest
    tensor (the embedding, 16.8 MB): rows are read and dequantized a chunk at a time (measured:
    about 10 MB beyond, 7 of them the GGUF header and tokenizer). The negative control, reading
    each tensor whole through gguf's memory map as the reader did before, measured 30 MB beyond:
    the file's pages stay resident and gguf's dequantizer holds every row group's output before
    concatenating them into a second copy."""
    largest = 4 * KQUANT_CONFIG["vocab_size"] * KQUANT_CONFIG["hidden_size"]
    measured = measure_load(kquant_gguf, "float32")
    beyond = measured["added_peak"] - measured["params"]
    print(
        f"K-quant load: params {measured['params'] / 1e6:.1f} MB, peak RSS +"
        f"{measured['added_peak'] / 1e6:.1f} MB ({beyond / 1e6:.1f} MB beyond the params) from a "
        f"{kquant_gguf.stat().st_size / 1e6:.1f} MB file"
    )
    assert measured["added_after"] > 0.9 * measured["params"]
    assert beyond < largest
