"""The small-memory settings (vocabulary and MLP chunks, optimizer state and embedding on the
host): each leaves the training result unchanged, lowers the compiled step's measured bytes, and
is planned within 15% of that measurement."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from featherweight.errors import ConfigError
from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.models.batch import batch_from_tokens
from featherweight.optim.adamw8bit import adamw_8bit
from featherweight.parallel.memory_kinds import to_host
from featherweight.quant.nf4 import quantize_nf4
from featherweight.recipe.build import check_method_settings
from featherweight.recipe.schema import parse_config
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.streamed import build_streamed_step
from featherweight.step.top_update import top_row_chunk
from tests.conftest import tiny_config, training_case

UNTIED = tiny_config(vocab_size=512, tie_word_embeddings=False)
TIED = tiny_config(vocab_size=512, tie_word_embeddings=True)
BATCH = batch_from_tokens(jax.random.randint(jax.random.PRNGKey(3), (2, 33), 0, 512))


def _case(config, method):
    return training_case(config, method, rank=4)


def _train(config, method, optimizer, policy=None, state_on="device", embed_on="device",
           quantize_head=False, steps=3, train_embed_on="device"):  # fmt: skip
    policy = policy or MemoryPolicy()
    trainable, frozen, lora = _case(config, method)
    if quantize_head:
        frozen = {**frozen, "lm_head": quantize_nf4(frozen["lm_head"])}
    if embed_on == "host":
        frozen = {**frozen, "embed": to_host(frozen["embed"])}
    state = init_streamed_opt_state(optimizer, trainable, state_on)
    if train_embed_on == "host":
        trainable = {**trainable, "embed": to_host(trainable["embed"])}
    step = build_streamed_step(config, optimizer, trainable, frozen, lora, policy=policy)
    losses = []
    for index in range(steps):
        trainable, state, metrics = step(trainable, state, frozen, BATCH, jax.random.PRNGKey(index))
        losses.append(float(metrics["loss"]))
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)}
    return np.array(losses), jax.tree.map(np.asarray, trainable), kinds


def _assert_same(reference, candidate, tolerance=1e-5):
    """Same losses, and the same parameters norm-wise: AdamW divides each gradient element by
    its own RMS, so a different float32 summation order (chunks) moves an element whose gradient
    nearly cancels by up to lr x its rounding error; the whole tensor agrees to `tolerance`."""
    np.testing.assert_allclose(candidate[0], reference[0], rtol=tolerance)
    for expected, actual in zip(
        jax.tree.leaves(reference[1]), jax.tree.leaves(candidate[1]), strict=True
    ):
        difference = float(np.linalg.norm((expected - actual).ravel()))
        assert difference <= tolerance * max(float(np.linalg.norm(expected.ravel())), 1e-12)


ADAMW = optax.adamw(1e-2, weight_decay=0.1)


@pytest.mark.parametrize("config", [UNTIED, TIED], ids=["untied", "tied"])
def test_vocab_chunk_gives_the_same_training(config):
    """SGD: the update is linear in the gradient, so this compares the gradients themselves (AdamW
    would magnify the float32 reordering of the chunked logsumexp in near-zero gradients)."""
    sgd = optax.sgd(0.5, momentum=0.9)
    reference = _train(config, "full", sgd)
    _assert_same(reference, _train(config, "full", sgd, MemoryPolicy(vocab_chunk=128)))


def test_vocab_chunk_over_an_nf4_head_gives_the_same_training():
    reference = _train(UNTIED, "qlora", ADAMW, quantize_head=True)
    chunked = _train(UNTIED, "qlora", ADAMW, MemoryPolicy(vocab_chunk=128), quantize_head=True)
    _assert_same(reference, chunked)


def test_mlp_chunk_gives_the_same_training():
    reference = _train(UNTIED, "lora", ADAMW)
    _assert_same(reference, _train(UNTIED, "lora", ADAMW, MemoryPolicy(mlp_chunk=8)))


@pytest.mark.default_emitters  # two programs compared bit for bit (tests/emitters.py)
@pytest.mark.parametrize(
    "optimizer",
    [
        ADAMW,
        optax.sgd(0.1, momentum=0.9),
        pytest.param(optax.adafactor(1e-2), marks=pytest.mark.slow),
        pytest.param(adamw_8bit(1e-2), marks=pytest.mark.slow),
    ],
    ids=["adamw", "sgd", "adafactor", "adamw_8bit"],
)
def test_optimizer_state_on_the_host_gives_the_same_training(optimizer):
    """adamw and sgd update the head and embedding in row chunks (vocab_chunk=128: 4 chunks);
    adafactor's factored state and the 8-bit blocks cannot be cut in rows, so those come over
    whole. Any optax transformation works with its state on the host."""
    policy = MemoryPolicy(vocab_chunk=128)
    reference = _train(UNTIED, "full", optimizer, policy)
    losses, params, kinds = _train(UNTIED, "full", optimizer, policy, state_on="host")
    _assert_same(reference, (losses, params), tolerance=0.0)  # the same arithmetic, bit for bit
    assert reference[2] == {"device"} and kinds == {"pinned_host"}


@pytest.mark.parametrize(
    ("config", "method"), [(TIED, "lora"), (UNTIED, "qlora")], ids=["tied-lora", "untied-qlora"]
)
def test_an_embedding_on_the_host_gives_the_same_training(config, method):
    policy = MemoryPolicy(vocab_chunk=128)  # a tied head reads the host table chunk by chunk
    reference = _train(config, method, ADAMW, policy)
    _assert_same(reference, _train(config, method, ADAMW, policy, embed_on="host"))


@pytest.mark.default_emitters  # two programs compared bit for bit (tests/emitters.py)
@pytest.mark.parametrize("state_on", [pytest.param("device", marks=pytest.mark.slow), "host"])
def test_a_trained_embedding_on_the_host_gives_the_same_training(state_on):
    """Full fine-tuning, untied: the table stays on the host, each row chunk's gradient is built
    from the batch's rows in it, and chunk, state and update come over one chunk at a time."""
    policy, sgd = MemoryPolicy(vocab_chunk=128), optax.sgd(0.5, momentum=0.9)
    reference = _train(UNTIED, "full", sgd, policy)
    losses, params, kinds = _train(UNTIED, "full", sgd, policy, state_on, train_embed_on="host")
    _assert_same(reference, (losses, params), tolerance=0.0)
    assert kinds == {"device" if state_on == "device" else "pinned_host"}


def test_top_row_chunks_divide_the_rows():
    assert top_row_chunk((128256, 4096), 8192) == 8016  # Llama 3: 16 equal chunks
    assert top_row_chunk((49152, 576), 8192) == 8192
    assert top_row_chunk((1000, 8), 8192) is None and top_row_chunk((50000,), 10) is None


# --- memory: measured lower, planned within 15% ---------------------------------------------------

MEMORY_MODEL = dataclasses.replace(
    tiny_config(), vocab_size=8192, intermediate_size=1024, tie_word_embeddings=False
)


def _config(method="full", optimizer="adamw", **memory):
    return parse_config(
        {
            "method": method,
            "optimizer": {"name": optimizer},
            "model": {"path": "unused", "dtype": "float32"},
            "data": {"train": "unused", "seq_len": 128},
            "batch_size": 2,
            "memory": memory,
        }
    )


SETTINGS = {
    # the whole sequence at once (no automatic loss chunk), where the vocabulary chunk is the saving
    "vocab_chunk": ("full", {"loss_chunk": None}, {"loss_chunk": None, "vocab_chunk": 1024}),
    "mlp_chunk": ("full", {"loss_chunk": 32}, {"loss_chunk": 32, "mlp_chunk": 16}),
    "optimizer_state": ("full", {}, {"optimizer_state": "host"}),
    "embed": ("lora", {}, {"embed": "host"}),
    "trained_embed": ("full", {}, {"embed": "host"}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_setting_lowers_the_measured_bytes_as_planned(setting):
    method, before, after = SETTINGS[setting]
    results = []
    for memory in (before, after):
        config = _config(method, **memory)
        plan, measured = (
            plan_for_config(config, MEMORY_MODEL),
            measure_compiled(config, MEMORY_MODEL),
        )
        # the toy's absolute plan (D 64, S 128: the calibration's long-context cases weigh the
        # per-token terms, which this toy's backward over-plans by up to 18.4%) within 20%; what
        # the setting saves is checked to 15% below (it is exact for each setting today)
        assert abs(plan.device_bytes - measured.device_bytes) <= 0.20 * measured.device_bytes
        results.append((plan.device_bytes, measured.device_bytes))
    (planned_before, measured_before), (planned_after, measured_after) = results
    assert measured_after < measured_before and planned_after < planned_before
    measured_drop, planned_drop = measured_before - measured_after, planned_before - planned_after
    assert abs(planned_drop - measured_drop) <= 0.15 * measured_before


def test_host_state_and_embedding_are_host_arguments_of_the_compiled_step():
    config = _config("lora", embed="host", optimizer_state="host")
    measured = measure_compiled(config, MEMORY_MODEL)
    plan = plan_for_config(config, MEMORY_MODEL)
    on_host = plan.bytes_of("optimizer_state") + plan.bytes_of("embedding_table")
    assert measured.host_argument_bytes == on_host  # the program's layouts, byte for byte


# --- refused combinations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "model", "memory", "message"),
    [
        ("full", TIED, {"embed": "host"}, "needs untied embeddings"),
        ("full", UNTIED, {"embed": "host", "optimizer": "adafactor"}, "cannot"),
        ("lora", TIED, {"embed": "host", "vocab_chunk": None}, "set memory.vocab_chunk"),
        ("lora", UNTIED, {"optimizer_state": "host", "step": "reference"}, "streamed step"),
    ],
)
def test_host_placements_that_cannot_work_are_refused(method, model, memory, message):
    with pytest.raises(ConfigError, match=message):
        check_method_settings(_config(method, **memory), model)


def test_host_placement_on_a_mesh_is_refused():
    config = _config("lora", optimizer_state="host").model_copy(
        update={"mesh": parse_config({"mesh": {"data": 1, "fsdp": 8}}).mesh}
    )
    with pytest.raises(ConfigError, match="one device only"):
        check_method_settings(config, UNTIED)
