"""Fit the working set's buffer counts to compiled steps, and check them on configurations held out.

    python -m featherweight.dev.calibrate                  # XLA:CPU float32: measure, fit, write
    python -m featherweight.dev.calibrate --target h100    # XLA:GPU bfloat16 (deviceless H100)
    python -m featherweight.dev.calibrate --refit [--target h100]  # refit the stored measurements

The planner's working set (`working_set.py`) is a sum of terms -- one layer's weights, its
activations, the attention scores, a logits chunk, ... -- each times a count of how many such
buffers the compiler keeps alive at once. The counts are not guessed: this script compiles the
real train step (`measure.measure_compiled`) for every configuration of a FIT grid (random small
models and settings, seeded, plus real shapes), fits the counts by non-negative least squares on
the temporaries' error relative to the step's total, and checks the result on a HELD-OUT grid drawn with another
seed. `calibration.json` stores the counts together with the measurements they were fitted on and
their provenance (compiler, jax version, machine, dtype, date), keyed by compiler and dtype, so a
reader can refit them (`--refit`, deterministic) and a test can check both the fit and the
held-out error.

Per compiler: XLA:CPU float32 (`--target cpu`, toys and real shapes) and XLA:GPU bfloat16
(`--target h100`: the step compiled for an H100 without one, `measure.measure_for_target`; real
model shapes 1B-8B, each compile takes a minute, and in the fit grid small random models at
S 256-1024 as well). Compiles are slow, so each measurement is
appended to a progress file (`--progress`, default next to calibration.json) and an interrupted
run picks up where it stopped. A change to the step's program (attention, chunking) needs a
re-run: `python -m featherweight.dev.calibrate --target h100 --fresh`; a change to how host
placements compile only of the cases that use them: `--again-if-host`.

The fit model: planned temporaries = stored activations + the largest phase (backward, loss, and
in full fine-tuning the untied head's update and the embedding's), each phase a linear function
of its counts (a count may appear in more than one phase: 8-bit AdamW's float32 moments in both
updates); which phase is the peak depends on the counts, so the fit
alternates between assigning each configuration its peak phase and solving the least squares,
until the assignment no longer changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from scipy.optimize import nnls

from featherweight.errors import FeatherweightError
from featherweight.memory import working_set
from featherweight.memory.components import DEQUANTIZED_WEIGHTS, HOST, REBUILT_ON_HOST
from featherweight.memory.defaults import resolve
from featherweight.memory.device_plan import plan_one_device
from featherweight.memory.family_terms import FAMILY_TERMS
from featherweight.memory.measure import measure_for_target
from featherweight.memory.report import percent_difference
from featherweight.memory.targets import Target, get_target
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig, config_from_hf_dict
from featherweight.models.registry import builtin_config
from featherweight.recipe.placement import arguments_on_host
from featherweight.recipe.schema import TrainConfig, parse_config

KEY = "xla-cpu/float32"
GPU_TARGET, GPU_DTYPE = "h100", "bfloat16"
# each count: per phase it appears in, the raw term(s) it multiplies
COUNTS = {
    "layer_weights": {"backward": ("layer_weights",)},
    "optimizer_state": {"backward": ("optimizer_state",)},
    "activations_d": {"backward": ("activations_d",)},
    "activations_f": {"backward": ("activations_f",)},
    "activations_f_saved": {"backward": ("activations_f_saved",)},
    "activations_attention": {"backward": ("activations_attention",)},
    "attention_scores": {"backward": ("attention_scores",)},
    "logits": {"loss": ("logits",)},
    "head_gradient": {"head_update": ("head_gradient",)},
    # 8-bit AdamW's moments in float32: the untied head's update and the embedding's (after
    # the backward loop) are the same update of a V x D tensor
    "head_dequantized_moments": {
        "head_update": ("head_dequantized_moments",),
        "embedding": ("embedding_dequantized_moments",),
    },
}
# counts that refine another for a setting: where a grid never uses the setting (the GPU grids
# save no MLP hidden states), the fit gives them the other's value
REFINES = {"activations_f_saved": "activations_f"}
# terms counted once (no fitted count): they are what they are
FIXED = {
    "backward": (
        "layer_gradient",
        "embedding_gradient",
        "attention_blockwise",
        "dequantized_layer",
        "saved_layer_from_host",
        *(name for name, (phase, _) in FAMILY_TERMS.items() if phase == "backward"),
    ),
    "loss": (
        "embedding_gradient",
        "head_gradient",
        "dequantized_head",
        "head_rows_from_host",
        "head_rows_copy",
        "top_state_on_device",
        *(name for name, (phase, _) in FAMILY_TERMS.items() if phase == "loss"),
    ),
    "head_update": ("embedding_gradient",),
    "embedding": ("embedding_gradient",),
}
FIT_SEED, HELD_OUT_SEED = 1, 2


def _tiny_model(rng: random.Random) -> ModelConfig:
    heads = rng.choice((2, 4, 8))
    kv_heads = rng.choice([k for k in (1, 2, 4) if heads % k == 0])
    head_dim = rng.choice((16, 32))
    hidden = rng.choice((64, 128, 256))
    return config_from_hf_dict(
        {
            "model_type": "llama",
            "vocab_size": rng.choice((256, 1024, 4096)),
            "hidden_size": hidden,
            "intermediate_size": hidden * rng.choice((2, 3, 4)),
            "num_hidden_layers": rng.randint(2, 6),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "tie_word_embeddings": rng.random() < 0.5,
            "max_position_embeddings": 4096,
        },
        source="calibration grid",
    )


def _tiny_settings(rng: random.Random) -> dict[str, Any]:
    method = rng.choice(("full", "lora", "qlora"))
    seq = rng.choice((32, 64, 128))
    memory: dict[str, Any] = {
        "residuals": rng.choice(("device", "host")),
        "loss_chunk": rng.choice((None, seq // 2, seq // 4)),
        "vocab_chunk": rng.choice((None, None, 128)),
        "mlp_chunk": rng.choice((None, None, seq // 2)),
        "save": rng.choice(((), (), ("qkv",), ("mlp_hidden",))),
        "optimizer_state": rng.choice(("device", "device", "host")),
        "attention": "materialized",  # its scores are a fitted count; blockwise is counted once
    }
    return {
        "method": method,
        "model": {"dtype": "float32", "quantize_head": method == "qlora" and rng.random() < 0.3},
        "optimizer": {"name": rng.choice(("adamw", "adamw", "adamw_8bit", "sgd", "lion"))},
        "lora": {"rank": rng.choice((4, 8, 16))},
        "batch_size": rng.choice((1, 2, 4)),
        "data": {"seq_len": seq},
        "memory": memory,
    }


def _real_cases(held_out: bool) -> list[tuple[ModelConfig, dict[str, Any]]]:
    """Real model shapes at small batch and sequence (compile time does not grow with depth), the
    loss over quarter-sequence chunks; and Llama-3.1-8B QLoRA at b2 x 2048 with the whole-sequence
    loss (its logits phase is the peak: 2 GB of them), the planner's reference configuration."""
    if held_out:
        picks = (("SmolLM2-135M", "lora", 2, 256), ("Llama-3.2-1B", "qlora", 1, 512))
    else:
        picks = (
            ("SmolLM2-135M", "full", 1, 256),
            ("SmolLM2-135M", "qlora", 2, 512),
            ("SmolLM2-135M", "lora", 4, 256),
            ("SmolLM2-360M", "qlora", 4, 128),
            ("Llama-3.2-1B", "lora", 1, 1024),
        )
    cases = [
        (
            builtin_config(name),
            {
                "method": method,
                "model": {"dtype": "float32"},
                "batch_size": batch,
                "data": {"seq_len": seq},
                "memory": {"loss_chunk": seq // 4, "attention": "materialized"},
            },
        )
        for name, method, batch, seq in picks
    ]
    if not held_out:
        settings = {"method": "qlora", "model": {"dtype": "float32"}, "batch_size": 2,
                    "data": {"seq_len": 2048}, "memory": {"attention": "materialized"}}  # fmt: skip
        cases.append((builtin_config("Llama-3.1-8B"), settings))
    # long context (batch 1, the position limit lifted for the shapes): the per-token terms of
    # blockwise attention, and the S x S scores of materialized attention, decide the step there
    for name, method, seq, attention in (
        (("SmolLM2-135M", "qlora", 32768, "blockwise"),)
        if held_out
        else (
            ("SmolLM2-135M", "qlora", 16384, "blockwise"),
            ("SmolLM2-360M", "lora", 8192, "blockwise"),
            ("SmolLM2-135M", "qlora", 8192, "materialized"),
        )
    ):
        model = config_from_hf_dict(
            {**builtin_config(name).to_hf_dict(), "max_position_embeddings": seq},
            source="calibration grid",
        )
        settings = {"method": method, "model": {"dtype": "float32"}, "batch_size": 1,
                    "data": {"seq_len": seq},
                    "memory": {"loss_chunk": 1024, "attention": attention}}  # fmt: skip
        cases.append((model, settings))
    return cases


def _planner_test_cases() -> list[tuple[ModelConfig, TrainConfig]]:
    """The shapes tests/memory/test_measure.py checks (two small models x 3 methods x two
    policies): in the fit grid, so the planner's own tests hold with the fitted counts."""
    tiny = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16}  # fmt: skip
    small = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 32}  # fmt: skip
    cases = []
    for shape, seq in ((tiny, 64), (small, 128)):
        model = config_from_hf_dict(
            {"model_type": "llama", "tie_word_embeddings": False,
             "max_position_embeddings": 4096, **shape},
            source="calibration grid",
        )  # fmt: skip
        for method in ("full", "lora", "qlora"):
            for batch, residuals in ((2, "device"), (4, "host")):
                settings = {
                    "method": method,
                    "batch_size": batch,
                    "model": {"dtype": "float32"},
                    "data": {"seq_len": seq},
                    "memory": {
                        "residuals": residuals,
                        "attention": "blockwise",
                    },  # what auto runs on CPU
                }
                cases.append((model, parse_config(settings, source="calibration grid")))
    return cases


def grid(seed: int, size: int, held_out: bool) -> list[tuple[ModelConfig, TrainConfig]]:
    """`size` random valid configurations drawn with `seed` (the fit grid adds the planner
    tests' shapes), then the real-shape cases."""
    rng, cases = random.Random(seed), []
    while len(cases) < size:
        model, settings = _tiny_model(rng), _tiny_settings(rng)
        try:
            config = parse_config(settings, source="calibration grid")
            plan_one_device(config, model)  # refuses what cannot run (e.g. placements)
        except FeatherweightError:
            continue
        cases.append((model, config))
    if not held_out:
        cases.extend(_planner_test_cases())
    for model, settings in _real_cases(held_out):
        cases.append((model, parse_config(settings, source="calibration grid")))
    return cases


GPU_MODELS = ("Llama-3.2-1B", "SmolLM2-1.7B", "Llama-3.2-3B", "Llama-3.1-8B")


def _gpu_settings(rng: random.Random, dtype: str) -> dict[str, Any]:
    """Settings a GPU user runs: LoRA/QLoRA/full, AdamW or 8-bit AdamW, b1-4, S 512-4096, with
    and without each memory setting."""
    method = rng.choice(("lora", "qlora", "full"))
    seq = rng.choice((512, 1024, 2048, 4096))
    memory: dict[str, Any] = {
        "residuals": rng.choice(("device", "host")),
        "loss_chunk": rng.choice((None, seq // 4)),
        "vocab_chunk": rng.choice((None, None, 16384)),
        "mlp_chunk": rng.choice((None, None, 512)),
        "save": rng.choice(((), (), ("qkv",))),
        "optimizer_state": rng.choice(("device", "device", "host")),
        "embed": rng.choice(("device", "device", "host")),
    }
    return {
        "method": method,
        "model": {"dtype": dtype, "quantize_head": method == "qlora" and rng.random() < 0.3},
        "optimizer": {"name": rng.choice(("adamw", "adamw_8bit"))},
        "batch_size": rng.choice((1, 2, 4)),
        "data": {"seq_len": seq},
        "memory": memory,
    }


def gpu_toy_grid(seed: int, size: int, dtype: str) -> list[tuple[ModelConfig, TrainConfig]]:
    """`size` valid configurations of small random models (D 128-512) at S 256-1024 with the GPU
    settings: shapes whose width, heads and sequence vary apart from each other, so each count
    is told apart from the others (real models' shapes grow together), and a small model's plan
    (a test's) is fitted too. Seconds to compile each."""
    rng, cases = random.Random(seed), []
    while len(cases) < size:
        model = _tiny_model(rng)
        hidden = rng.choice((128, 256, 512))
        model = config_from_hf_dict(
            {**model.to_hf_dict(), "hidden_size": hidden, "intermediate_size": hidden * 3},
            source="calibration grid",
        )
        settings = _gpu_settings(rng, dtype)
        seq = rng.choice((256, 512, 1024))
        settings["data"]["seq_len"] = seq
        memory = settings["memory"]
        memory["loss_chunk"] = memory["loss_chunk"] and seq // 4
        memory["vocab_chunk"] = memory["vocab_chunk"] and 128
        memory["mlp_chunk"] = memory["mlp_chunk"] and seq // 2
        try:
            config = parse_config(settings, source="calibration grid")
            plan_one_device(config, model)
        except FeatherweightError:
            continue
        cases.append((model, config))
    return cases


def _gpu_planner_test_cases(dtype: str) -> list[tuple[ModelConfig, TrainConfig]]:
    """The small full fine-tune tests/memory/test_measure_gpu.py compiles for the H100 (residuals
    and optimizer state on the host), and the same settings on SmolLM2-135M: in the fit grid, so
    the planner's own test holds with the fitted counts (as `_planner_test_cases` on CPU)."""
    small = config_from_hf_dict(
        {"model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
         "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 32, "tie_word_embeddings": False,
         "max_position_embeddings": 4096},
        source="calibration grid",
    )  # fmt: skip
    settings = {"method": "full", "batch_size": 2, "model": {"dtype": dtype},
                "data": {"seq_len": 128},
                "memory": {"residuals": "host", "optimizer_state": "host"}}  # fmt: skip
    config = parse_config(settings, source="calibration grid")
    return [(small, config), (builtin_config("SmolLM2-135M"), config)]


def gpu_grid(seed: int, size: int, dtype: str) -> list[tuple[ModelConfig, TrainConfig]]:
    """`size` valid configurations of real models (1B-8B) drawn with `seed`; the fit grid
    (`FIT_SEED`) starts with the planner's reference, Llama-3.1-8B QLoRA b2 x 2048."""
    rng, cases = random.Random(seed), []
    if seed == FIT_SEED:
        reference = {"method": "qlora", "model": {"dtype": dtype}, "batch_size": 2,
                     "data": {"seq_len": 2048}}  # fmt: skip
        cases.append((builtin_config("Llama-3.1-8B"), parse_config(reference, source="grid")))
    while len(cases) < size:
        model = builtin_config(rng.choice(GPU_MODELS))
        try:
            config = parse_config(_gpu_settings(rng, dtype), source="calibration grid")
            plan_one_device(config, model)
        except FeatherweightError:
            continue
        cases.append((model, config))
    return cases


# Long context (batch 1): at 16K-128K tokens the per-token terms (activations, the blockwise
# attention's buffers, host-offloaded residuals) decide the step, which the 512-4096 grids cannot
# tell apart from the weights. (model, method, seq, memory settings); the fit's, then the held-out's.
_SMALLEST = {"residuals": "host", "loss_chunk": 1024, "vocab_chunk": 16384, "mlp_chunk": 256,
             "embed": "host", "optimizer_state": "host"}  # fmt: skip
GPU_LONG_CONTEXT = (
    ("Llama-3.1-8B", "qlora", 65536, _SMALLEST),
    ("Llama-3.2-1B", "lora", 32768, {"residuals": "host", "loss_chunk": 1024, "mlp_chunk": 512}),
    ("Llama-3.2-3B", "qlora", 16384, {"loss_chunk": 2048}),
    ("Llama-3.2-1B", "qlora", 32768, {"residuals": "host", "loss_chunk": 1024}),
    ("SmolLM2-1.7B", "lora", 32768, {"residuals": "host", "loss_chunk": 1024}),  # no GQA
)
GPU_LONG_CONTEXT_HELD_OUT = (
    ("Llama-3.1-8B", "qlora", 131072, _SMALLEST),
    ("SmolLM2-1.7B", "qlora", 65536, {"residuals": "host", "loss_chunk": 1024}),
    ("Llama-3.2-3B", "qlora", 32768, {"residuals": "host", "loss_chunk": 1024}),
)


def gpu_long_context(dtype: str, held_out: bool) -> list[tuple[ModelConfig, TrainConfig]]:
    """The long-context cases (batch 1) of `GPU_LONG_CONTEXT` or its held-out list, the model's
    position limit lifted for the shapes (memory does not depend on rope scaling)."""
    cases = []
    for name, method, seq, memory in GPU_LONG_CONTEXT_HELD_OUT if held_out else GPU_LONG_CONTEXT:
        model = builtin_config(name)
        model = config_from_hf_dict(
            {**model.to_hf_dict(), "max_position_embeddings": max(seq, 4096)},
            source="calibration grid",
        )
        settings = {"method": method, "model": {"dtype": dtype, "quantize_head": method == "qlora"},
                    "optimizer": {"name": "adamw_8bit"}, "batch_size": 1,
                    "data": {"seq_len": seq}, "memory": memory}  # fmt: skip
        cases.append((model, parse_config(settings, source="calibration grid")))
    return cases


REAL_WEIGHT = 3.0  # a real model's shape counts as much as this many random toys


def _case_id(model: ModelConfig, config: TrainConfig) -> str:
    return json.dumps([model.to_hf_dict(), config.model_dump(mode="json")], sort_keys=True)


def _current_case_id(recorded: str) -> str:
    """A recorded case's id as today's schema writes it: a setting added since (at its default)
    leaves the program, and so the measurement, as it was."""
    model, config = json.loads(recorded)
    return _case_id(
        config_from_hf_dict(model, source="calibration record"), TrainConfig.model_validate(config)
    )


def measure(
    cases: list[tuple[ModelConfig, TrainConfig]],
    real_from: int,
    target: str = "cpu",
    progress: Path | None = None,
    reuse: bool = True,
    again_if_host: bool = False,
) -> list[dict[str, Any]]:
    """Compile each case's step for `target` and record what the fit needs (and what reproduces
    the case); cases from index `real_from` on are real model shapes, weighted `REAL_WEIGHT` in
    the fit. With `progress` (a JSON-lines file) each record is appended as it is measured and,
    with `reuse`, cases already recorded there (the latest record of each) are not compiled again
    -- except, with `again_if_host`, cases that place step arguments in host memory (after a
    change to how host placements compile)."""
    done = {}
    if reuse and progress is not None and progress.is_file():
        for line in progress.read_text().splitlines():
            record = json.loads(line)
            done[_current_case_id(record.pop("case"))] = record
    records = []
    for index, (model, config) in enumerate(cases):
        # what the trainer, the plan and the measurement run: "auto" chunks chosen from the
        # shapes (recorded as chosen, so a refit plans exactly the measured program)
        config = resolve(config, model)
        case = _case_id(model, config)
        if case not in done or (again_if_host and arguments_on_host(config)):
            measured = measure_for_target(as_fitted(config, target), model, target)
            done[case] = {
                "model": model.to_hf_dict(),
                "config": config.model_dump(mode="json"),
                # every temporary, wherever placed (the plan's temporaries include host residuals)
                "temp_bytes": measured.temp_bytes + measured.host_temp_bytes,
                "total_bytes": measured.total_bytes,
                "device_bytes": measured.device_bytes,
                "compile_seconds": round(measured.compile_seconds, 1),
                "weight": REAL_WEIGHT if index >= real_from else 1.0,
            }
            if progress is not None:
                with progress.open("a") as file:
                    file.write(json.dumps({"case": case, **done[case]}) + "\n")
        # the weight belongs to the case's place in the grid, not to the measurement
        done[case]["weight"] = REAL_WEIGHT if index >= real_from else 1.0
        records.append(done[case])
        print(f"  {index + 1}/{len(cases)} temp {done[case]['temp_bytes']:,} B", file=sys.stderr)
    return records


def as_fitted(config: TrainConfig, target: str) -> TrainConfig:
    """`config` as the fit measures it: on a GPU target its "auto" attention compiled blockwise,
    the attention a plan for the compiler alone chooses (`compiler_target`: no GPU generation
    named), not the cuDNN kernel the GPU itself would run."""
    if get_target(target).platform != "gpu" or config.memory.attention != "auto":
        return config
    memory = config.memory.model_copy(update={"attention": "blockwise"})
    return config.model_copy(update={"memory": memory})


def case_of(record: dict[str, Any]) -> tuple[ModelConfig, TrainConfig]:
    model = config_from_hf_dict(record["model"], source="calibration record")
    return model, TrainConfig.model_validate(record["config"])


STORED = ("residual_stream", "saved_intermediates", DEQUANTIZED_WEIGHTS)


def _outside_working_set(
    record: dict[str, Any], config: TrainConfig, model: ModelConfig, target: AttentionTarget
) -> int:
    """Bytes of a record's temporaries that no count multiplies: the stored activations
    (planned exactly, wherever placed) and the host arrays a step rebuilds (`REBUILT_ON_HOST`):
    measured where the compiler keeps host temporaries apart (a GPU compile: its host bytes
    beyond the host arguments and the stored activations), planned where it has one memory
    (XLA:CPU counts them in temp)."""
    # the stored activations do not depend on the counts: any counts do (the stored ones may
    # predate a new count)
    plan = plan_one_device(config, model, target, calibration=dict.fromkeys(COUNTS, 1.0))
    stored = [c for c in plan.components if c.name in STORED]
    stored_on_host = sum(c.bytes for c in stored if c.placement == HOST)
    rebuilt = sum(c.bytes for c in plan.components if c.name in REBUILT_ON_HOST)
    host_arguments = plan.host_bytes - stored_on_host - rebuilt
    host_temp = record["total_bytes"] - record["device_bytes"] - host_arguments
    if host_temp > stored_on_host:  # the compiler's own count of what the step rebuilt
        rebuilt = host_temp - stored_on_host
    return sum(c.bytes for c in stored) + rebuilt


def _phase_rows(
    record: dict[str, Any], target: AttentionTarget
) -> dict[str, tuple[np.ndarray, float]]:
    """Per phase: (the term each count multiplies, the fixed bytes), and the target temp, as
    planned for `target` (the compiler the record was compiled by)."""
    model, config = case_of(record)
    terms = working_set.raw_terms(config, model, target)
    rows = {}
    for phase in FIXED:  # a phase without terms (no trained embedding) is 0 and never the peak
        coefficients = np.array(
            [sum(terms[t] for t in per_phase.get(phase, ())) for per_phase in COUNTS.values()],
            dtype=np.float64,
        )
        rows[phase] = (coefficients, float(sum(terms[name] for name in FIXED[phase])))
    return (
        rows,
        float(record["temp_bytes"] - _outside_working_set(record, config, model, target)),
        float(record["total_bytes"]) / record.get("weight", 1.0),  # a weight scales the residual
    )


def compiler_target(compiler: str) -> AttentionTarget:
    """The target a record compiled by `compiler` ("xla-cpu", "xla-gpu") is planned for: the
    compiler's platform, with no GPU generation named (its attention blockwise, as the fit
    grid's steps were built on this machine)."""
    return AttentionTarget(compiler.removeprefix("xla-"))


def fit(
    records: list[dict[str, Any]],
    start: dict[str, float] | None = None,
    compiler: str = "xla-cpu",
) -> dict[str, float]:
    """Counts that minimise the error of planned temporaries, relative to each step's total;
    `compiler`: the one the records were compiled by, whose plans they are compared with."""
    target = compiler_target(compiler)
    prepared = [_phase_rows(record, target) for record in records]
    counts = np.array([(start or {}).get(name, 1.0) for name in COUNTS], dtype=np.float64)
    assignment: list[str] | None = None
    for _ in range(20):
        phases = [
            max(rows, key=lambda p, rows=rows: rows[p][0] @ counts + rows[p][1])
            for rows, _, _ in prepared
        ]
        if phases == assignment:
            break
        assignment = phases
        # relative to the step's total: the error a user sees in the plan of their step
        matrix = np.stack([rows[p][0] / total for (rows, _, total), p in zip(prepared, phases)])
        goal = np.array(
            [(target - rows[p][1]) / total for (rows, target, total), p in zip(prepared, phases)]
        )
        used = matrix.any(axis=0)  # a count no configuration exercises keeps its start value
        solution, _ = nnls(matrix[:, used], goal)
        counts[used] = solution
    names = list(COUNTS)
    for name, base in REFINES.items():  # ... or, refining another count, takes that one's
        if not used[names.index(name)]:
            counts[names.index(name)] = counts[names.index(base)]
    return {name: round(float(value), 2) for name, value in zip(COUNTS, counts)}


def errors_of(
    records: list[dict[str, Any]], counts: dict[str, float], compiler: str = "xla-cpu"
) -> list[dict[str, Any]]:
    """Planned (for `compiler`, the one the records were compiled by) vs measured for each record
    with `counts`, in percent: temp, total (device + host) and, where the record has them (GPU),
    the device bytes alone."""
    rows, target = [], compiler_target(compiler)
    for record in records:
        model, config = case_of(record)
        plan = plan_one_device(config, model, target, calibration=counts)
        planned_temp = plan.measured_groups()["temporaries"]
        row = {
            "method": config.method,
            "temp_error": percent_difference(planned_temp, record["temp_bytes"]),
            "total_error": percent_difference(plan.cpu_comparable_bytes, record["total_bytes"]),
        }
        if "device_bytes" in record and record["device_bytes"] != record["total_bytes"]:
            row["device_error"] = percent_difference(plan.device_bytes, record["device_bytes"])
        else:
            row["device_error"] = row["total_error"]
        rows.append(row)
    return rows


def _worst(rows: list[dict[str, Any]], key: str) -> float:
    return max(abs(row[key]) for row in rows)


def plan_reserve_percent(rows: list[dict[str, Any]], gpu: bool) -> float:
    """The largest amount, in percent, by which a plan fell below its compiled step on `rows`
    (`errors_of`; device bytes for a GPU compiler, device + host for XLA:CPU's one memory)."""
    key = "device_error" if gpu else "total_error"
    return round(max(0.0, *(-row[key] for row in rows)), 2)


def calibration_path() -> Path:
    return Path(working_set.__file__).with_name("calibration.json")


def _grids(args: argparse.Namespace) -> tuple[list, int, list, int]:
    """(fit cases, index of the first real shape, held-out cases, its first real shape)."""
    if args.target != "cpu":
        toys = gpu_toy_grid(FIT_SEED, args.fit_size, args.dtype)
        return (
            toys
            + _gpu_planner_test_cases(args.dtype)
            + gpu_grid(FIT_SEED, args.fit_size, args.dtype)
            + gpu_long_context(args.dtype, held_out=False),
            len(toys),
            gpu_grid(HELD_OUT_SEED, args.held_out_size, args.dtype)
            + gpu_long_context(args.dtype, held_out=True),
            0,
        )
    fit_cases = grid(FIT_SEED, args.fit_size, False)
    held_out = grid(HELD_OUT_SEED, args.held_out_size, True)
    return fit_cases, len(fit_cases) - len(_real_cases(False)), held_out, args.held_out_size


def _provenance(target: Target, dtype: str) -> dict[str, Any]:
    compiler = (
        f"XLA:GPU, deviceless for {target.description} (jax[cuda12-local])"
        if target.platform == "gpu"
        else f"XLA:CPU ({jax.default_backend()})"
    )
    return {
        "compiler": compiler,
        "target": target.name,
        "dtype": dtype,
        "jax_version": jax.__version__,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "date": datetime.date.today().isoformat(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refit", action="store_true", help="refit from stored measurements")
    parser.add_argument("--target", default="cpu", help="cpu (XLA:CPU) or a GPU target, e.g. h100")
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on GPU")
    parser.add_argument(
        "--fit-size", type=int, default=None, help="default: 40 cpu; GPU: 15 real + 15 small"
    )
    parser.add_argument("--held-out-size", type=int, default=None, help="default: 24 cpu, 10 GPU")
    parser.add_argument("--progress", type=Path, default=None, help="JSON lines of measurements")
    parser.add_argument(
        "--fresh", action="store_true", help="compile every case again (new records are appended)"
    )
    parser.add_argument(
        "--again-if-host",
        action="store_true",
        help="compile again the cases with host-resident arguments (new records are appended)",
    )
    args = parser.parse_args(argv)
    target = get_target(args.target)
    gpu = target.platform == "gpu"
    args.dtype = args.dtype or (GPU_DTYPE if gpu else "float32")
    args.fit_size = args.fit_size or (15 if gpu else 40)
    args.held_out_size = args.held_out_size or (10 if gpu else 24)
    key = target.calibration_key(args.dtype)
    path = calibration_path()
    data = json.loads(path.read_text()) if path.is_file() else {"calibrations": {}}
    if args.refit:
        entry = data["calibrations"][key]
        fit_records, held_out = entry["fit_measurements"], entry["held_out_measurements"]
    else:
        progress = args.progress or path.with_name(f"calibration-{key.replace('/', '-')}.jsonl")
        fit_cases, fit_real, held_cases, held_real = _grids(args)
        print(f"measuring the fit grid ({target.name})", file=sys.stderr)
        again = args.again_if_host
        fit_records = measure(fit_cases, fit_real, target.name, progress, not args.fresh, again)
        print("measuring the held-out grid", file=sys.stderr)
        held_out = measure(held_cases, held_real, target.name, progress, not args.fresh, again)
    compiler = key.split("/")[0]
    counts = fit(fit_records, compiler=compiler)
    fitted = errors_of(fit_records, counts, compiler)
    checked = errors_of(held_out, counts, compiler)
    previous = data["calibrations"].get(key, {})
    measured = previous.get("measured", previous.get("date"))
    if not args.refit:
        today = datetime.date.today().isoformat()
        measured = (
            f"cases with host-resident arguments {today}, the others as of {measured}"
            if args.again_if_host and measured
            else today
        )
    data["calibrations"][key] = {
        **_provenance(target, args.dtype),
        "measured": measured,
        "fit": "non-negative least squares on the temporaries' error relative to the total, peak "
        "phase reassigned until stable; counts rounded to 0.01",
        "counts": counts,
        "fit_worst_temp_error_percent": round(_worst(fitted, "temp_error"), 2),
        "fit_worst_total_error_percent": round(_worst(fitted, "total_error"), 2),
        "held_out_worst_temp_error_percent": round(_worst(checked, "temp_error"), 2),
        "held_out_worst_total_error_percent": round(_worst(checked, "total_error"), 2),
        "held_out_worst_device_error_percent": round(_worst(checked, "device_error"), 2),
        # how far below its compile a plan fell at worst on the held-out grid (device bytes on a
        # GPU, device + host on XLA:CPU): the budget search keeps it in reserve
        "plan_reserve_percent": plan_reserve_percent(checked, gpu),
        "fit_measurements": fit_records,
        "held_out_measurements": held_out,
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    entry = data["calibrations"][key]
    print(json.dumps({k: v for k, v in entry.items() if "measurements" not in k}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
