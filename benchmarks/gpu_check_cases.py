"""One case of the GPU check (`gpu_check.py`), in its own process: the cases, their configs, random
weights made in place, and the step run as the trainer runs it.

A case's record: compile seconds, `peak_bytes_in_use` after setting up, compiling and stepping,
the plan, the compiled step's bytes, and each of `STEPS` steps' time, loss and gradient norm
(`run_case`); `_numerics` names what must be equal for two cases' losses to be comparable.

A case compared with a reference (`Case.reference`) that is not a search case runs with the
chunks its reference resolved (`reference_chunks`: loss_chunk, vocab_chunk, mlp_chunk), so that
only the placement differs. Left to choose its own, a placement that frees device memory resolves
other chunks, another program, and the comparison no longer isolates the placement: on an H200
(2026-11-27) the frozen base on the host resolved loss 512 / MLP 512 against the reference's
256 / 1024 and its first gradient norm, at identical weights, came 13% off; pinned to 256 / 1024 it
equalled the embedding-on-host run's (0.79085, 3.8e-4 from the reference's). Search cases (budget,
smallest) keep the settings their search picks: where those change numerics they are not compared.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.memory import budget
from featherweight.memory.defaults import with_lean_defaults
from featherweight.memory.measure import measurement_of
from featherweight.memory.plan import plan_for_config
from featherweight.memory.working_set import plan_reserve
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.batch import Batch, batch_from_tokens
from featherweight.models.config import ModelConfig
from featherweight.models.registry import builtin_config
from featherweight.parallel.memory_kinds import host_sharding
from featherweight.peft.lora import init_lora
from featherweight.quant.nf4 import DYNAMIC_CODE, NF4_CODE, NF4Tensor
from featherweight.recipe.build import (
    ADAPTER_DTYPE,
    abstract_split,
    build_train_step,
    check_method_settings,
)
from featherweight.recipe.optimizer import make_optimizer
from featherweight.recipe.placement import HOST_SETTINGS, on_host, place, place_abstract
from featherweight.recipe.schema import CHOSEN_FROM_SHAPES, TrainConfig, parse_config

STEPS = 7  # 6 updates, and a 7th step whose loss is the loss after them
TIMED = slice(2, 6)  # steps 3-6: past the first calls, before the last
WEIGHT_SEED, BATCH_SEED = 0, 1
WEIGHT_STD = 0.02  # as `models.init.init_params`
SLAB_BYTES = 64 * 2**20  # rows of a weight drawn on the device at a time
NF4_ABSMAX = WEIGHT_STD / float(NF4_CODE.std())  # uniform NF4 codes x this: std WEIGHT_STD
ZERO_ABSMAX_CODE = int(np.argmin(np.abs(DYNAMIC_CODE)))  # DYNAMIC_CODE[it] == 0


@dataclasses.dataclass(frozen=True)
class Scale:
    """The shapes a run uses: the GPU's (Llama-3.1-8B / 3.2-1B, Qwen3-30B-A3B, bf16) or `--tiny`
    (CPU). Roles: "large", "small" and "moe" (a mixture of experts: the speed rows only)."""

    name: str
    dtype: str
    batch: int
    seq: int
    tolerance: float  # largest relative difference from the all-device run that matches
    timeout_s: dict[str, int]  # per model role
    models: dict[str, Callable[[], ModelConfig]]
    model_names: dict[str, str]
    budget_bytes: Callable[[TrainConfig, ModelConfig], int]


def _tiny_budget(config: TrainConfig, model: ModelConfig) -> int:
    """`--tiny`'s budget: the search's plan must come to 85% of QLoRA's default plan, which
    the same-result settings reach (the budget less the plan's reserve, `budget.fit_budget`)."""
    here = AttentionTarget.of_device()  # the run's own device
    reserve = plan_reserve(with_lean_defaults(config, model), here)
    return int(0.85 * plan_for_config(config, model).device_bytes / (1 - reserve))


def _tiny_model(tied: bool) -> ModelConfig:
    """SmolLM2-135M's layer shapes in 2 layers with a 4096-token vocabulary."""
    smollm = builtin_config("SmolLM2-135M")
    return dataclasses.replace(smollm, num_layers=2, vocab_size=4096, tie_word_embeddings=tied)


def _tiny_moe() -> ModelConfig:
    """Qwen3-30B-A3B's layer (QK-norm, top-8 of 128 experts renormalized) cut to 2 layers of
    D 128, 4 heads of 32, top-2 of 8 experts of 64, a 4096-token vocabulary."""
    qwen = builtin_config("Qwen3-30B-A3B")
    return dataclasses.replace(
        qwen, num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=64, num_experts=8, experts_per_token=2, vocab_size=4096,
    )  # fmt: skip


GPU = Scale(
    "gpu",
    "bfloat16",
    2,
    2048,
    1e-2,
    {"large": 180, "small": 150, "moe": 300},
    {
        "large": lambda: builtin_config("Llama-3.1-8B"),
        "small": lambda: builtin_config("Llama-3.2-1B"),
        "moe": lambda: builtin_config("Qwen3-30B-A3B"),
    },
    {"large": "Llama-3.1-8B", "small": "Llama-3.2-1B", "moe": "Qwen3-30B-A3B"},
    lambda config, model: budget.parse_budget("5.5GiB"),
)
TINY = Scale(
    "tiny",
    "float32",
    2,
    128,
    1e-4,
    {"large": 240, "small": 240, "moe": 240},
    {
        "large": lambda: _tiny_model(tied=False),
        "small": lambda: _tiny_model(tied=True),
        "moe": _tiny_moe,
    },
    {
        "large": "SmolLM2-135M layers x2, V 4096, untied",
        "small": "the same, tied",
        "moe": "qwen3_moe x2, D 128, top-2 of 8 experts, V 4096",
    },
    _tiny_budget,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One run: a train-step configuration and the all-device case it is compared with."""

    name: str
    model: str  # "large" (Llama-3.1-8B's role) or "small" (Llama-3.2-1B's)
    method: str
    what: str
    memory: tuple[tuple[str, str | int], ...] = ()
    search: str | None = None  # "budget", "smallest" or "smallest-on-device"
    reference: str | None = None  # None: this case is an all-device reference


CASES = (
    Case("qlora", "large", "qlora", "QLoRA at defaults: the all-device reference"),
    # open since the H200 run of 2026-11-27: the base on the host at loss / MLP chunks 512 was
    # 13% off the reference's step-1 gradient norm (at 256 / 1024), equal at the reference's
    # chunks; these two say whether the chunks or the base on the host at them move it
    Case("qlora-chunks-512", "large", "qlora",
         "QLoRA at loss and MLP chunks 512, all on the device: the reference of the next",
         (("loss_chunk", 512), ("mlp_chunk", 512))),
    Case("qlora-base-host-chunks-512", "large", "qlora",
         "QLoRA, frozen layer stack on the host, at loss and MLP chunks 512",
         (("base", "host"),), reference="qlora-chunks-512"),
    Case("qlora-budget", "large", "qlora", "QLoRA at the settings fit_budget picks",
         search="budget", reference="qlora"),
    Case("qlora-embed-host", "large", "qlora", "QLoRA, embedding table on the host",
         (("embed", "host"),), reference="qlora"),
    Case("qlora-optimizer-host", "large", "qlora", "QLoRA, optimizer state on the host",
         (("optimizer_state", "host"),), reference="qlora"),
    Case("qlora-base-host", "large", "qlora", "QLoRA, frozen layer stack on the host",
         (("base", "host"),), reference="qlora"),
    Case("full-small", "small", "full", "full fine-tuning at defaults: the all-device reference"),
    Case("full-small-optimizer-host", "small", "full", "full fine-tuning, AdamW state on the host",
         (("optimizer_state", "host"),), reference="full-small"),
    Case("qlora-smallest-device", "large", "qlora",
         "QLoRA at the smallest settings, host placements back on the device: the reference",
         search="smallest-on-device"),
    Case("qlora-smallest", "large", "qlora", "QLoRA at the smallest settings", search="smallest",
         reference="qlora-smallest-device"),
    Case("qlora-residuals-host", "large", "qlora", "QLoRA, residual stream on the host",
         (("residuals", "host"),), reference="qlora"),
    Case("lora", "large", "lora", "LoRA at defaults, all on the device"),
)  # fmt: skip
CASE_NAMES = tuple(case.name for case in CASES)


def reference_chunks(case: Case, scale: Scale) -> dict[str, int | None]:
    """The chunks (`CHOSEN_FROM_SHAPES`) `case_config` resolved for `case`'s reference, which a
    compared case that is not a search case runs with (so that only the placement differs); {}
    for a reference itself and for a search case."""
    if case.reference is None or case.search is not None:
        return {}
    reference = next(other for other in CASES if other.name == case.reference)
    config, _ = case_config(reference, scale, scale.models[reference.model]())
    return {name: getattr(config.memory, name) for name in CHOSEN_FROM_SHAPES}


def case_config(case: Case, scale: Scale, model: ModelConfig) -> tuple[TrainConfig, int | None]:
    """(the case's config as the trainer would run it, unset chunks chosen from the shapes or,
    for a compared case, its reference's (`reference_chunks`); the budget it was fitted to, for
    the budget case)."""
    config = parse_config(
        {
            "method": case.method,
            "batch_size": scale.batch,
            "model": {"dtype": scale.dtype},
            "data": {"seq_len": scale.seq},
            "optimizer": {
                "name": "adamw",
                "learning_rate": 1e-4 if case.method == "full" else 1e-3,
                "schedule": "constant",
            },
            "memory": {**reference_chunks(case, scale), **dict(case.memory)},
        }
    )
    budget_bytes = None
    if case.search == "budget":
        budget_bytes = scale.budget_bytes(config, model)
        config, _ = budget.fit_budget(config, model, budget_bytes)
    elif case.search in ("smallest", "smallest-on-device"):
        config, _ = budget.smallest_settings(config, model)
        if case.search == "smallest-on-device":
            memory = config.memory.model_copy(update=dict.fromkeys(HOST_SETTINGS, "device"))
            config = config.model_copy(update={"memory": memory})
    check_method_settings(config, model)
    return with_lean_defaults(config, model), budget_bytes


def settings_text(config: TrainConfig) -> str:
    """The settings that shape the step's memory and numerics, in a few words."""
    memory = config.memory
    parts = [f"{setting}: host" for setting in on_host(config)]
    parts += [
        f"{name} {getattr(memory, name)}"
        for name in ("loss_chunk", "vocab_chunk", "mlp_chunk")
        if getattr(memory, name)
    ]
    if memory.save:
        parts.append("save " + "+".join(memory.save))
    if config.model.quantize_head:
        parts.append("NF4 head")
    if config.optimizer.name != "adamw":
        parts.append(config.optimizer.name)
    return ", ".join(parts) or "defaults"


# ---------------------------------------------------------------- one case, in its own process


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal_slab(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (WEIGHT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _bits_slab(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jax.random.bits(key, shape, dtype)


def _sharding(leaf: jax.ShapeDtypeStruct) -> jax.sharding.Sharding:
    """Where an abstract argument's array goes, as `place` puts it: pinned host memory where
    the abstract leaf is placed there, else the default device."""
    if getattr(leaf.sharding, "memory_kind", None) == "pinned_host":
        return host_sharding()
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _drawn(leaf: jax.ShapeDtypeStruct, key: jax.Array, draw: Callable) -> jax.Array:
    """`leaf` as a real array in its memory, drawn on the device one slab of leading rows
    (~64 MiB) at a time and gathered on the host, then put in place whole: no float32 copy of a
    whole tensor ever exists on the device, and a host-resident leaf never reaches it."""
    shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
    values = np.empty(shape, dtype)
    rows = values.reshape(shape[0] if shape else 1, -1)
    per_slab = max(1, SLAB_BYTES // max(rows[0].nbytes, 1))
    for start in range(0, rows.shape[0], per_slab):
        count = min(per_slab, rows.shape[0] - start)
        slab = draw(jax.random.fold_in(key, start), (count, rows.shape[1]), dtype)
        rows[start : start + count] = np.asarray(slab)
    return jax.device_put(values, _sharding(leaf))


def _constant(leaf: jax.ShapeDtypeStruct, value: float) -> jax.Array:
    return jax.device_put(np.full(leaf.shape, value, leaf.dtype), _sharding(leaf))


def _random_nf4(tensor: NF4Tensor, key: jax.Array) -> NF4Tensor:
    """Random weights drawn directly in NF4, in place: uniform 4-bit codes (NF4's levels are
    normal quantiles, so the values are near normal) and every block's absmax `NF4_ABSMAX`
    (double quantized: code 0.0 plus that offset), std `WEIGHT_STD`. Quantizing a dense draw
    would hold the dense tensor on the device first, above the step's own peak."""
    codes = _drawn(tensor.codes, key, _bits_slab)
    if not tensor.double_quantized:
        return NF4Tensor(codes, _constant(tensor.absmax, NF4_ABSMAX), None, None, tensor.shape)
    return NF4Tensor(
        codes,
        _constant(tensor.absmax, ZERO_ABSMAX_CODE),
        _constant(tensor.absmax_scale, 1.0),
        _constant(tensor.absmax_offset, NF4_ABSMAX),
        tensor.shape,
    )


def random_weights(abstract: Any, seed: int) -> Any:
    """Real arrays for an abstract parameter tree, each where its leaf says (device or pinned
    host): norms 1, NF4 stacks as `_random_nf4`, other weights normal(0, 0.02); each leaf's
    values depend only on the seed, its name and its shape, so every case of a model that has
    the same tensor gets the same weights."""
    base = jax.random.PRNGKey(seed)

    def make(path, leaf):
        name = jax.tree_util.keystr(path)
        key = jax.random.fold_in(base, zlib.crc32(name.encode()) & 0x7FFFFFFF)
        if isinstance(leaf, NF4Tensor):
            return _random_nf4(leaf, key)
        if name.endswith("norm']"):
            return _constant(leaf, 1.0)
        return _drawn(leaf, key, _normal_slab)

    return jax.tree_util.tree_map_with_path(
        make, abstract, is_leaf=lambda node: isinstance(node, NF4Tensor)
    )


def random_batch(scale: Scale, model: ModelConfig) -> Batch:
    """The one batch every case of a model trains on: random token ids (fixed seed), each
    predicting the next, one segment per row (as packed training rows come)."""
    key = jax.random.PRNGKey(BATCH_SEED)
    tokens = jax.random.randint(key, (scale.batch, scale.seq + 1), 0, model.vocab_size, jnp.int32)
    batch = batch_from_tokens(tokens)
    return batch._replace(segment_ids=jnp.ones(batch.input_ids.shape, jnp.int32))


def _peak() -> tuple[int | None, int | None]:
    """(peak_bytes_in_use, bytes_limit) of the device; (None, None) where it keeps none (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_limit")


def set_up(config: TrainConfig, model: ModelConfig, scale: Scale) -> tuple[Callable, tuple]:
    """(the jitted step, its arguments) as the trainer sets them up (`train.run.prepare_run`:
    split, `build_train_step`, the optimizer-state initialiser in its placement, `place`), on
    random weights made in place (`random_weights`) instead of a checkpoint's."""
    trainable_a, frozen_a = abstract_split(config, model)
    trainable_a, _, frozen_a = place_abstract(config, trainable_a, None, frozen_a)
    frozen = random_weights(frozen_a, WEIGHT_SEED)
    if config.method == "full":
        trainable = random_weights(trainable_a, WEIGHT_SEED)
    else:
        trainable = init_lora(jax.random.PRNGKey(config.seed), model, config.lora, ADAPTER_DTYPE)
    optimizer = make_optimizer(config.optimizer, config.steps)
    step, init_opt_state = build_train_step(config, model, trainable, frozen, optimizer)
    opt_state = init_opt_state(trainable)
    trainable, opt_state, frozen = place(config, trainable, opt_state, frozen)
    arguments = (trainable, opt_state, frozen, random_batch(scale, model))
    jax.block_until_ready(arguments)
    return step, (*arguments, jax.random.PRNGKey(config.seed))


def run_steps(compiled: Callable, arguments: tuple) -> dict[str, list[float]]:
    """`STEPS` steps on the same batch: each step's seconds, loss and gradient norm."""
    trainable, opt_state, frozen, batch, key = arguments
    history: dict[str, list[float]] = {"step_s": [], "losses": [], "grad_norms": []}
    for index in range(STEPS):
        start = time.perf_counter()
        trainable, opt_state, metrics = compiled(
            trainable, opt_state, frozen, batch, jax.random.fold_in(key, index)
        )
        jax.block_until_ready((trainable, opt_state, metrics))
        history["step_s"].append(time.perf_counter() - start)
        history["losses"].append(float(metrics["loss"]))
        history["grad_norms"].append(float(metrics["grad_norm"]))
    return history


def run_case(case: Case, scale: Scale) -> dict[str, Any]:
    """Set up, compile and run one case as the trainer does; its record (see the module doc)."""
    model = scale.models[case.model]()
    config, budget_bytes = case_config(case, scale, model)
    plan = plan_for_config(config, model)
    step, arguments = set_up(config, model, scale)
    peak_after_setup, bytes_limit = _peak()
    start = time.perf_counter()
    compiled = step.lower(*arguments).compile()  # what the trainer's first call does
    compile_s = time.perf_counter() - start
    compiled_bytes = measurement_of(compiled, *arguments[:3], compile_s)
    peak_after_compile, _ = _peak()
    history = run_steps(compiled, arguments)
    peak_after_steps, _ = _peak()
    step_s = statistics.median(history["step_s"][TIMED])
    return {
        "case": case.name,
        "device": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "model": scale.model_names[case.model],
        "settings": settings_text(config),
        "numerics": _numerics(config, case),
        "budget_bytes": budget_bytes,
        "planned_device_bytes": plan.device_bytes,
        "planned_host_bytes": plan.host_bytes,
        "compiled_device_bytes": compiled_bytes.device_bytes,
        "compiled_total_bytes": compiled_bytes.total_bytes,
        "peak_after_setup": peak_after_setup,
        "peak_after_compile": peak_after_compile,
        "peak_after_steps": peak_after_steps,
        "bytes_limit": bytes_limit,
        "compile_s": compile_s,
        **history,
        "median_step_s": step_s,
        "tokens_per_s": scale.batch * scale.seq / step_s,
        "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
    }


def _numerics(config: TrainConfig, case: Case) -> dict[str, Any]:
    """What must be equal for two cases' losses to be comparable (placements and chunks keep
    the step's result; these change it)."""
    return {
        "model": case.model,
        "method": config.method,
        "dtype": config.model.dtype,
        "batch": [config.batch_size, config.data.seq_len],
        "optimizer": config.optimizer.model_dump(mode="json"),
        "quantize_head": config.model.quantize_head,
        "lora": None if config.method == "full" else dataclasses.asdict(config.lora),
    }
