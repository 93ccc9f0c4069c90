"""The memory plan before compiling: exact persistent bytes, the component formulas, bad input."""

import dataclasses
import json
import time

import pytest

from featherweight.errors import CheckpointNotFoundError, ConfigError, ModelConfigError
from featherweight.io.model_source import model_config_from
from featherweight.memory.budget import fit_budget
from featherweight.memory.defaults import resolve
from featherweight.memory.measure import abstract_step_arguments, measure_compiled, tree_nbytes
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import comparable_total, percent_difference
from featherweight.memory.targets import get_target, usable_bytes
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.registry import BUILTIN_MODELS, builtin_config
from featherweight.models.shapes import layer_shapes, parameter_count
from featherweight.recipe.schema import TrainConfig, parse_config
from tests.conftest import tiny_config

GIB = 2**30
GPU = AttentionTarget("gpu")  # XLA's GPU compiler, no generation named: blockwise attention


def train_config(**values) -> TrainConfig:
    """A TrainConfig from nested values, e.g. train_config(method="lora", memory={...})."""
    values.setdefault("data", {"seq_len": 64})
    return parse_config(values)


PERSISTENT_CASES = [
    ("full", "adamw", "float32", False),
    ("full", "adamw_8bit", "bfloat16", False),
    ("full", "adafactor", "float32", True),
    ("lora", "sgd", "bfloat16", False),
    ("lora", "lion", "float32", True),
    ("qlora", "adamw", "bfloat16", False),
    ("qlora", "adamw_8bit", "float32", True),
]


@pytest.mark.parametrize(("method", "optimizer", "dtype", "tied"), PERSISTENT_CASES)
def test_persistent_bytes_equal_the_pytrees_the_trainer_builds(method, optimizer, dtype, tied):
    model = tiny_config(tie_word_embeddings=tied, hidden_size=128, intermediate_size=256)
    config = train_config(
        method=method,
        optimizer={"name": optimizer},
        model={"dtype": dtype, "quantize_head": method == "qlora" and tied},
    )
    _, (trainable, opt_state, frozen, batch, _) = abstract_step_arguments(config, model)
    plan = plan_for_config(config, model)
    assert plan.bytes_of("frozen_base") == tree_nbytes(frozen)
    assert plan.bytes_of("trainable_weights") == tree_nbytes(trainable)
    assert plan.bytes_of("optimizer_state") == tree_nbytes(opt_state)
    assert plan.bytes_of("batch") == tree_nbytes(batch)


def test_components_sum_to_the_totals_and_offload_moves_the_residual_stream_to_host():
    model = builtin_config("Llama-3.1-8B")
    # the same chunks on both sides (the lean defaults choose smaller ones once the residual
    # stream has left the device): only the placement differs
    chunks = {"loss_chunk": 512, "mlp_chunk": 512}
    on_device = plan_for_config(
        train_config(batch_size=2, data={"seq_len": 2048}, memory=chunks), model
    )
    offloaded = plan_for_config(
        train_config(batch_size=2, data={"seq_len": 2048}, memory={**chunks, "residuals": "host"}),
        model,
    )
    residual = 32 * 2 * 2048 * 4096 * 2  # L x B x S x D x bf16
    assert on_device.bytes_of("residual_stream") == residual
    assert sum(c.bytes for c in on_device.components) == on_device.device_bytes
    assert on_device.host_bytes == 0
    assert offloaded.host_bytes == residual
    assert offloaded.device_bytes == on_device.device_bytes - residual
    assert offloaded.cpu_comparable_bytes == on_device.device_bytes


def test_llama_8b_qlora_plan_is_fast_and_plausible():
    start = time.perf_counter()
    plan = plan_for_config(
        train_config(method="qlora", batch_size=2, data={"seq_len": 2048}),
        model_config_from("Llama-3.1-8B"),
    )
    assert time.perf_counter() - start < 5.0
    # NF4 linear weights (~0.52 B/value) + bf16 embedding and head: about 5.3 GiB
    assert 5.2 * GIB < plan.bytes_of("frozen_base") < 5.4 * GIB
    # rank-8 adapters on all 7 targets of 32 layers: 20.97M float32 values, AdamW 2 moments
    assert plan.bytes_of("trainable_weights") == 20_971_520 * 4
    assert plan.bytes_of("optimizer_state") == 2 * 20_971_520 * 4 + 32 * 14 * 8
    assert plan.lower_bound_bytes < plan.device_bytes
    assert plan.peak_phase in plan.phases
    json.dumps(plan.settings)


def test_loss_chunk_shrinks_only_the_loss_phase():
    model = builtin_config("SmolLM2-135M")
    whole_sequence = {"loss_chunk": None, "mlp_chunk": None}  # set: no automatic chunk
    whole = plan_for_config(
        train_config(method="full", data={"seq_len": 1024}, memory=whole_sequence), model
    )
    chunked = plan_for_config(
        train_config(
            method="full", data={"seq_len": 1024}, memory={"loss_chunk": 128, "mlp_chunk": None}
        ),
        model,
    )
    assert whole.peak_phase == "loss"  # 49k vocabulary: the logits dominate
    assert chunked.phases["backward"] == whole.phases["backward"]
    logits_whole, logits_chunked = (
        p.bytes_of("logits_chunk") if p.peak_phase == "loss" else None for p in (whole, chunked)
    )
    assert logits_whole is not None
    assert chunked.phases["loss"] < whole.phases["loss"] - 0.8 * logits_whole
    assert logits_chunked is None or logits_chunked * 8 == pytest.approx(logits_whole, rel=1e-6)


def test_saved_intermediates_are_planned_per_layer():
    model = tiny_config()
    plain = plan_for_config(train_config(), model)
    saving = plan_for_config(train_config(memory={"save": ["qkv", "mlp_hidden"]}), model)
    width = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim + 2 * 128
    assert plain.bytes_of("saved_intermediates") == 0
    assert saving.bytes_of("saved_intermediates") == model.num_layers * 4 * 64 * width * 2


def test_kept_activations_grow_the_plan_as_they_grow_the_compiled_step():
    # every class kept (no projection recomputed): the compiled step grows by what the plan adds
    model = builtin_config("SmolLM2-135M")

    def compiled_and_planned(save):
        config = train_config(
            method="lora", batch_size=2, data={"seq_len": 128}, model={"dtype": "float32"},
            memory={"save": save, "loss_chunk": None, "mlp_chunk": None},
        )  # fmt: skip
        plan = plan_for_config(config, model)
        return measure_compiled(config, model).total_bytes, plan.cpu_comparable_bytes, plan

    compiled_lean, planned_lean, _ = compiled_and_planned([])
    compiled_kept, planned_kept, plan = compiled_and_planned(["qkv", "attention", "mlp_hidden"])
    assert plan.bytes_of("saved_intermediates") > 0
    grown = compiled_kept - compiled_lean
    assert abs((planned_kept - planned_lean) - grown) <= 0.1 * grown
    assert abs(percent_difference(planned_kept, compiled_kept)) <= 10.0


def test_kept_dequantized_weights_grow_the_plan_as_they_grow_the_compiled_step():
    # QLoRA (float32, XLA:CPU): keeping the NF4 weights dense grows the compiled step by L + 1
    # layers' dense weights (the stack, and the next layer's slice fetched ahead in the backward)
    model = tiny_config(hidden_size=256, intermediate_size=768, num_layers=4, vocab_size=512)

    def compiled_and_planned(save):
        config = train_config(
            method="qlora", batch_size=2, model={"dtype": "float32"},
            memory={"save": save, "loss_chunk": None, "mlp_chunk": None, "vocab_chunk": None},
        )  # fmt: skip
        plan = plan_for_config(config, model)
        return measure_compiled(config, model).total_bytes, plan.cpu_comparable_bytes, plan

    layer_dense = (2 * 64 * 256 + 2 * 32 * 256 + 3 * 768 * 256) * 4  # q, o; k, v; the MLP
    activations = ["qkv", "attention", "mlp_hidden"]
    for save, tolerance in (([], 0.01), (activations, 0.05)):
        compiled, planned, _ = compiled_and_planned(save)
        compiled_kept, planned_kept, plan = compiled_and_planned([*save, "dequantized"])
        assert plan.bytes_of("dequantized_weights") == 4 * layer_dense
        grown = compiled_kept - compiled
        assert abs((planned_kept - planned) - grown) <= tolerance * grown, (save, grown)


# published parameter counts (model cards)
PARAMETER_COUNTS = {
    "Llama-3.1-8B": 8.03e9,
    "Llama-3.1-70B": 70.6e9,
    "Llama-3.2-1B": 1.24e9,
    "Llama-3.2-3B": 3.21e9,
    "Mistral-7B-v0.3": 7.25e9,
    "Qwen2.5-7B": 7.62e9,
    "SmolLM2-135M": 0.135e9,
    # the model cards' sizes (Gemma 3 4B-27B: the text model, the card's size less SigLIP's 0.42B)
    "Qwen3-0.6B": 0.6e9,
    "Qwen3-4B": 4.0e9,
    "Qwen3-8B": 8.2e9,
    "Qwen3-14B": 14.8e9,
    "Qwen3-32B": 32.8e9,
    "Gemma-2-9B": 9.24e9,
    "Gemma-3-1B": 1.0e9,
    "Gemma-3-4B": 3.88e9,
    "Gemma-3-12B": 11.77e9,
    "Gemma-3-27B": 27.0e9,
    "Phi-4": 14.7e9,
    "Phi-3.5-mini": 3.82e9,
    "Mistral-Small-24B": 23.6e9,
    "SmolLM2-360M": 0.362e9,
    "SmolLM2-1.7B": 1.71e9,
}


@pytest.mark.parametrize("name", [name for name in BUILTIN_MODELS if name in PARAMETER_COUNTS])
def test_builtin_models_have_their_published_sizes(name):
    # the mixtures of experts: tests/models/test_registry.py holds them to their cards' totals
    assert parameter_count(builtin_config(name)) == pytest.approx(PARAMETER_COUNTS[name], rel=0.01)


def test_llama_31_8b_builtin_matches_its_config_json():
    config = builtin_config("meta-llama/llama-3.1-8b")
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        128256,
        4096,
        14336,
    )
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (32, 32, 8)
    assert config.rope_theta == 500000.0 and not config.tie_word_embeddings
    assert config.rope_scaling.factor == 8.0 and config.max_position_embeddings == 131072


def test_model_sources_config_dir_gguf_and_errors(tmp_path, demo_gguf):
    (tmp_path / "config.json").write_text(json.dumps(builtin_config("SmolLM2-135M").to_hf_dict()))
    assert model_config_from(tmp_path) == builtin_config("SmolLM2-135M")
    assert model_config_from(demo_gguf).hidden_size == 576
    with pytest.raises(
        CheckpointNotFoundError, match=r"Llama-3\.1-8B, Llama-3\.1-70B, Llama-3\.2-1B"
    ):
        model_config_from("Llama-9B")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(ModelConfigError, match="hidden_size"):
        model_config_from(broken)


def test_bad_shapes_are_refused_with_typed_errors():
    with pytest.raises(ConfigError, match="batch_size"):
        train_config(batch_size=0)
    with pytest.raises(ConfigError, match="seq_len"):
        train_config(data={"seq_len": -1})
    smol = builtin_config("SmolLM2-135M")  # 8192 positions, no rope scaling
    with pytest.raises(ConfigError, match="max_position_embeddings=8192"):
        plan_for_config(train_config(data={"seq_len": 16384}), smol)
    unchecked = TrainConfig.model_construct(batch_size=0)
    with pytest.raises(ConfigError, match="batch=0"):
        plan_for_config(unchecked, smol)


def test_rope_scaling_allows_a_longer_sequence_with_a_warning():
    short_context = dataclasses.replace(
        builtin_config("Llama-3.2-1B"), max_position_embeddings=8192
    )
    plan = plan_for_config(train_config(data={"seq_len": 16384}), short_context)
    assert any("rope scaling" in warning for warning in plan.warnings)
    with pytest.raises(ConfigError, match="rope-scaled context 262144"):
        plan_for_config(train_config(data={"seq_len": 300000}), short_context)


def test_accumulation_plans_one_micro_batch_and_a_float32_gradient_buffer():
    model = tiny_config()
    whole = plan_for_config(train_config(method="lora", batch_size=1), model)
    split = plan_for_config(
        train_config(method="lora", batch_size=4, memory={"accumulation_steps": 4}), model
    )
    assert split.bytes_of("residual_stream") == whole.bytes_of("residual_stream")  # one micro-batch
    adapters = plan_for_config(train_config(method="lora"), model).bytes_of("trainable_weights")
    assert split.bytes_of("gradient_buffer") == adapters  # the float32 adapters, once
    clipped = plan_for_config(
        train_config(method="full", optimizer={"clip_norm": 1.0, "clipping": "two_pass"}), model
    )
    head = model.vocab_size * model.hidden_size * 2  # untied head, bf16
    assert clipped.bytes_of("head_gradient_kept") == head


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "optimizer", "memory"),
    [
        ("lora", {"clip_norm": 1.0}, {"accumulation_steps": 2}),
        ("qlora", {}, {"accumulation_steps": 2, "base": "host", "optimizer_state": "host"}),
        ("full", {"clip_norm": 1.0, "clipping": "two_pass"}, {}),
        ("full", {}, {"accumulation_steps": 2}),
    ],
    ids=["lora-kept-accumulated", "qlora-accumulated-host", "full-two-pass", "full-accumulated"],
)
def test_clipping_and_accumulation_plans_match_the_compiled_step(method, optimizer, memory):
    config = train_config(
        method=method, batch_size=4, model={"dtype": "float32"}, optimizer=optimizer, memory=memory
    )
    model = tiny_config(vocab_size=1024, hidden_size=128, intermediate_size=384, head_dim=32)
    plan, measured = plan_for_config(config, model), measure_compiled(config, model)
    difference = percent_difference(comparable_total(plan, measured), measured.total_bytes)
    assert abs(difference) <= 10.0, difference


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_base_on_the_host_is_planned_as_the_compiled_step_holds_it(method):
    """memory.base: host -- the frozen stack is planned in host memory, byte for byte what the
    compiled step takes as host-resident arguments; the planned device bytes within the 10% the
    measurement grid holds (tests/memory/test_measure.py). XLA:CPU (one memory) plans one layer
    in flight beyond the slice the device base takes too (the next layer's copy); a GPU
    compiler's plan, two layers."""
    config = train_config(
        method=method, batch_size=2, model={"dtype": "float32"}, memory={"base": "host"}
    )
    model = tiny_config(vocab_size=512, num_layers=8)
    plan, measured = plan_for_config(config, model), measure_compiled(config, model)
    stack = plan.bytes_of("base_layers")
    assert plan.host_bytes == stack == measured.host_argument_bytes
    assert plan.bytes_of("base_layers_in_flight") == stack // model.num_layers
    on_gpu = plan_for_config(config, model, GPU)
    assert on_gpu.bytes_of("base_layers_in_flight") == 2 * stack // model.num_layers
    groups = plan.measured_groups()
    assert groups["frozen_base"] == measured.components["frozen_base"]  # device + host parts
    difference = percent_difference(plan.device_bytes, measured.device_bytes)
    assert abs(difference) <= 10.0, difference
    on_device = plan_for_config(config.model_copy(update={"memory": config.memory.model_copy(
        update={"base": "device"})}), model)  # fmt: skip
    assert on_device.device_bytes - plan.device_bytes == stack - stack // model.num_layers


def test_the_gpu_plans_the_backward_at_the_larger_of_attention_and_the_dequantized_layer():
    """XLA:GPU, QLoRA: the backward's peak is the attention's tiles or the layer dequantized for
    the MLP's backward, whichever is larger (`dequantized_layer` is the difference); XLA:CPU's
    count of the layer's weights holds the copy there, and LoRA has nothing to dequantize."""
    model = builtin_config("Llama-3.1-8B")
    memory = {"loss_chunk": 256, "mlp_chunk": 256, "attention": "blockwise"}
    dense = 2 * sum(
        rows * columns for rows, columns in (s for s in layer_shapes(model).values() if len(s) == 2)
    )

    def plan(batch, method="qlora", **extra):
        config = train_config(
            method=method, batch_size=batch, model={"dtype": "bfloat16"},
            data={"seq_len": 2048}, memory={**memory, **extra},
        )  # fmt: skip
        return plan_for_config(config, model, GPU)

    for batch in (1, 2, 4):
        attention = plan(batch).bytes_of("attention_blockwise")
        assert plan(batch).bytes_of("dequantized_layer") == max(0, dense - attention)
    assert plan(4).bytes_of("dequantized_layer") == 0  # the attention's tiles are the larger
    assert plan(1, method="lora").bytes_of("dequantized_layer") == 0
    assert plan(1, save=["dequantized"]).bytes_of("dequantized_layer") == 0
    on_cpu = train_config(method="qlora", batch_size=1, data={"seq_len": 2048}, memory=memory)
    assert plan_for_config(on_cpu, model).bytes_of("dequantized_layer") == 0


def test_a_fused_step_with_its_state_on_the_host_plans_one_base_layer_in_flight_on_a_gpu():
    model = tiny_config(num_layers=4)
    memory = {"base": "host", "optimizer_state": "host"}

    def in_flight(**extra):
        config = train_config(
            method="qlora", batch_size=2, model={"dtype": "bfloat16"}, memory={**memory, **extra}
        )
        plan = plan_for_config(config, model, GPU)
        return plan.bytes_of("base_layers_in_flight") // (plan.bytes_of("base_layers") // 4)

    assert in_flight() == 1  # fused: the next layer comes over after the peak
    assert in_flight(accumulation_steps=2) == 2  # the kept gradient: computing and coming over
    assert in_flight(optimizer_state="device") == 2


def test_kept_activations_in_host_memory_plan_one_layer_on_the_device_on_a_gpu():
    model = tiny_config()
    save = ["qkv", "mlp_hidden"]
    width = (
        model.num_heads + 2 * model.num_kv_heads
    ) * model.head_dim + 2 * model.intermediate_size

    def on_device(residuals, target=GPU):
        config = train_config(
            method="qlora", batch_size=2, model={"dtype": "bfloat16"},
            memory={"save": save, "residuals": residuals},
        )  # fmt: skip
        return plan_for_config(config, model, target).bytes_of("saved_layer_from_host")

    assert on_device("host") == 2 * 64 * width * 2  # B x S x width x bf16, one layer
    assert on_device("device") == 0 and on_device("host", AttentionTarget("cpu")) == 0


# The families' memory goals (issue 41), planned for XLA's GPU compiler; compiled for the target
# without a GPU in tests/memory/test_measure_gpu.py
# (blockwise attention named: the GPU target's cuDNN cannot be compiled here without its library)
QWEN3_14B_GOAL = {"method": "qlora", "batch_size": 2, "model": {"dtype": "bfloat16"},
                  "data": {"seq_len": 2048}, "memory": {"attention": "blockwise"}}  # fmt: skip
QWEN3_14B_BUDGET = 12 * GIB
# Gemma 3 27B on a 24 GB card: the tied 262,208 x 5376 table (2.7 GiB) on the host, read by the
# head in vocabulary chunks
GEMMA3_27B_GOAL = {"method": "qlora", "batch_size": 1, "model": {"dtype": "bfloat16"},
                   "data": {"seq_len": 2048},
                   "memory": {"embed": "host", "attention": "blockwise"}}  # fmt: skip
GEMMA3_27B_ROOM = 1.5 * GIB  # left on the RTX 4090 (17.49 GiB usable at XLA's 0.75)


def qwen3_14b_in_12_gib():
    """(the settings the budget search picks for Qwen3-14B QLoRA b2 x 2048 in 12 GiB, its plan)."""
    return fit_budget(
        parse_config(QWEN3_14B_GOAL), builtin_config("Qwen3-14B"), QWEN3_14B_BUDGET, target=GPU
    )


def gemma3_27b_on_a_4090():
    """(Gemma-3-27B QLoRA b1 x 2048 resolved for the RTX 4090, its plan)."""
    model = builtin_config("Gemma-3-27B")
    config = resolve(parse_config(GEMMA3_27B_GOAL), model, target=GPU)
    return config, plan_for_config(config, model, GPU)


def test_qwen3_14b_qlora_b2_x_2048_is_planned_within_12_gib():
    config, plan = qwen3_14b_in_12_gib()
    assert (config.batch_size, config.data.seq_len, config.method) == (2, 2048, "qlora")
    assert plan.device_bytes <= QWEN3_14B_BUDGET
    assert plan.bytes_of("qk_norm") == 2 * 2048 * (40 + 8) * 128 * 4  # float32 q and k, once


def test_gemma3_27b_qlora_is_planned_on_a_24_gb_card_with_room_to_spare():
    config, plan = gemma3_27b_on_a_4090()
    assert plan.device_bytes + GEMMA3_27B_ROOM <= usable_bytes(get_target("rtx4090"))
    # the 262,208-row vocabulary: the loss never holds a whole sequence's logits
    assert config.memory.vocab_chunk is not None and config.memory.vocab_chunk < 262208
    whole_logits = 4 * 2048 * 262208
    assert plan.phases["loss"] < whole_logits


# The mixtures of experts' memory goals (issue 42), planned for XLA's GPU compiler; compiled for
# the H100 without a GPU in tests/memory/test_measure_gpu.py. QLoRA b1 x 2048 in bfloat16.
MOE_GOAL = {"method": "qlora", "batch_size": 1, "model": {"dtype": "bfloat16"},
            "data": {"seq_len": 2048}, "memory": {"attention": "blockwise"}}  # fmt: skip
# Qwen3-30B-A3B all on the device: LoRA on attention, the 128 experts of every layer frozen in
# NF4 (at rank 8 their adapters would be 415M parameters: 1.57 GiB and AdamW's 3.14 more)
QWEN3_MOE_ON_DEVICE = {**MOE_GOAL, "lora": {"targets": ["q", "k", "v", "o"]}}
QWEN3_MOE_DEVICE_GOAL = 18 * GIB
QWEN3_MOE_SMALL_BUDGET = 6 * GIB  # every expert trained too; the search moves the base to the host
GPT_OSS_BUDGET = 14 * GIB


def qwen3_moe_on_the_device():
    """(Qwen3-30B-A3B QLoRA b1 x 2048, LoRA on attention, resolved; its plan)."""
    model = builtin_config("Qwen3-30B-A3B")
    config = resolve(parse_config(QWEN3_MOE_ON_DEVICE), model, target=GPU)
    return config, plan_for_config(config, model, GPU)


def moe_in_budget(name: str, budget: int):
    """(the settings the budget search picks for `name` QLoRA b1 x 2048, LoRA on attention and
    every expert, within `budget`; its plan)."""
    return fit_budget(parse_config(MOE_GOAL), builtin_config(name), budget, target=GPU)


def test_qwen3_30b_a3b_qlora_is_planned_within_18_gib_all_on_the_device():
    config, plan = qwen3_moe_on_the_device()
    assert plan.device_bytes <= QWEN3_MOE_DEVICE_GOAL and plan.host_bytes == 0
    memory = config.memory
    assert (memory.base, memory.embed, memory.optimizer_state) == ("device",) * 3


def test_qwen3_30b_a3b_in_6_gib_trains_every_expert_with_the_base_on_the_host():
    config, plan = moe_in_budget("Qwen3-30B-A3B", QWEN3_MOE_SMALL_BUDGET)
    assert config.memory.base == "host" and plan.device_bytes <= QWEN3_MOE_SMALL_BUDGET
    assert {"gate", "up", "down"} <= set(config.lora.targets)
    # an MoE's kept MLP activations are its routed rows' (each token's top 8, padded), not a
    # dense MLP's one row a token: keeping them does not fit
    assert "mlp_hidden" not in config.memory.save


def test_gpt_oss_20b_qlora_is_planned_within_14_gib():
    config, plan = moe_in_budget("gpt-oss-20b", GPT_OSS_BUDGET)
    assert plan.device_bytes <= GPT_OSS_BUDGET and config.memory.base == "device"
