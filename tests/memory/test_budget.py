"""Budgets: parsing, the order in which settings change, and the error when nothing fits."""

import re

import pytest
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.errors import BudgetError, ConfigError
from featherweight.memory import capacity
from featherweight.memory.budget import (
    SEARCHED_FIELDS,
    _plan_if_valid,
    _replace,
    _search,
    _value,
    budget_bytes_of,
    change_costs,
    describe_changes,
    fit_budget,
    parse_budget,
    plan_within_budget,
)
from featherweight.memory.defaults import resolve
from featherweight.memory.plan import plan_for_config
from featherweight.memory.step_cost import (
    ACCELERATOR_RATES,
    CPU_RATES,
    head_matmul_bytes,
    seconds_per_token,
    step_seconds,
)
from featherweight.memory.targets import get_target, usable_bytes
from featherweight.memory.working_set import plan_reserve
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config
from featherweight.step.policy import KEPT_ACTIVATIONS, SAVEABLE

GIB = 2**30
CPU = AttentionTarget("cpu")
GPU = AttentionTarget("gpu")  # XLA's GPU compiler, no generation named: blockwise attention


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GB", 8 * 10**9),
        ("8 GiB", 8 * GIB),
        ("8000MiB", 8000 * 2**20),
        ("7.5gib", int(7.5 * GIB)),
        ("512 B", 512),
    ],
)
def test_budget_strings(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["eight", "8", "8 GiBs", "-1GiB", "0MiB", "", "GiB"])
def test_unparseable_budgets_are_typed_errors(text):
    with pytest.raises(ConfigError, match="budget"):
        parse_budget(text)


def config_of(**values):
    return parse_config(values)


LLAMA_QLORA = {"method": "qlora", "batch_size": 4, "data": {"seq_len": 2048}}
SMOL_FULL = {"method": "full", "batch_size": 4, "data": {"seq_len": 1024}}


@pytest.mark.parametrize(
    ("model", "values"),
    [("Llama-3.1-8B", LLAMA_QLORA), ("SmolLM2-135M", SMOL_FULL), ("Llama-3.2-1B", SMOL_FULL)],
)
def test_a_budget_at_the_total_keeps_the_plan_and_one_byte_less_changes_it(model, values):
    config, model_config = config_of(**values), builtin_config(model)
    plan = plan_for_config(config, model_config)
    kept, kept_plan = fit_budget(config, model_config, plan.device_bytes, reserve=0.0)
    assert kept == resolve(config, model_config) and kept_plan == plan
    try:
        smaller, smaller_plan = fit_budget(config, model_config, plan.device_bytes - 1, reserve=0.0)
    except BudgetError:
        return
    assert smaller != kept
    assert smaller_plan.device_bytes <= plan.device_bytes - 1
    assert smaller_plan == plan_for_config(smaller, model_config)


def test_loss_chunk_is_tried_first_when_the_logits_are_the_peak():
    whole_sequence = {**SMOL_FULL, "memory": {"loss_chunk": None}}  # no automatic chunk
    config, model = config_of(**whole_sequence), builtin_config("SmolLM2-135M")
    plan = plan_for_config(config, model)
    assert plan.peak_phase == "loss"
    fitted, _ = fit_budget(config, model, plan.device_bytes - 1, reserve=0.0)
    changes = describe_changes(resolve(config, model), fitted)
    assert changes[0] == f"memory.loss_chunk: None -> {1024 // 2}"
    # the room the chunk frees below the budget is spent on kept activations, nothing else
    assert all(change.startswith("memory.save: [] -> ") for change in changes[1:])


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_micro_batch_comes_last_and_every_kept_change_is_needed(objective):
    # below what every other setting reaches: SFT splits the batch into micro-batches (the same
    # training); DPO, whose pairs are averaged over one batch, cannot, and halves the batch. On a
    # GPU, where the host placements make room (a CPU's host is its device's memory)
    values = {**LLAMA_QLORA, "objective": objective}
    config, model = config_of(**values), builtin_config("Llama-3.1-8B")
    everything_else = config_of(
        **{**values, "model": {"quantize_head": True}},
        memory={
            "residuals": "host",
            "loss_chunk": 64,
            "vocab_chunk": 2048,
            "mlp_chunk": 256,
            "embed": "host",
            "optimizer_state": "host",
            "base": "host",
        },
        optimizer={"name": "adamw_8bit"},
    )
    floor = plan_for_config(everything_else, model, GPU).device_bytes
    budget = floor - 2**20  # below what the other settings reach
    fitted, plan = fit_budget(config, model, budget, reserve=0.0, target=GPU)
    last = describe_changes(config, fitted)[-1]
    if objective == "sft":
        assert fitted.batch_size == 4 and fitted.memory.accumulation_steps > 1
    else:
        assert last.startswith("batch_size: 4 -> ")
    assert plan.device_bytes <= budget
    start = resolve(config, model, target=GPU)
    changed = [f for f in SEARCHED_FIELDS if _value(start, *f) != _value(fitted, *f)]
    assert len(changed) >= 2
    # undoing any one change no longer fits (or is refused); kept activations only spend room
    for section, field in (f for f in changed if f != ("memory", "save")):
        undone = _replace(fitted, section, **{field: _value(start, section, field)})
        undone_plan = _plan_if_valid(undone, model, GPU)
        assert undone_plan is None or undone_plan.device_bytes > budget


def test_the_search_weighs_time_a_vocabulary_chunk_only_when_needed():
    # SmolLM2-135M b2 x 256 (the shapes). Full fine-tuning trains the head, so a
    # vocabulary chunk costs one more LM-head forward: on this CPU host placements move nothing,
    # so they come first. A frozen head's chunks take one sweep (no extra FLOPs, only the normed
    # rows read once more per block), so LoRA's search may keep one -- only where it lowers the
    # plan. With a GPU's host link the link's cost is weighed.
    model = builtin_config("SmolLM2-135M")
    head_forward = 2 * 2 * 256 * model.vocab_size * model.hidden_size
    for method, extra in (("full", head_forward), ("lora", 0)):
        config = resolve(config_of(method=method, batch_size=2, data={"seq_len": 256}), model)
        chunked = _replace(config, "memory", vocab_chunk=16384)
        costs = change_costs(config, chunked, model, CPU)
        base = step_seconds(config, model, CPU_RATES)
        extra_bytes = head_matmul_bytes(chunked, model) - head_matmul_bytes(config, model)
        expected = (extra / CPU_RATES.flops_per_second) + (
            extra_bytes / CPU_RATES.memory_bytes_per_second
        )
        assert costs["memory.vocab_chunk"] == pytest.approx(expected / base, rel=1e-6)
        assert (costs["memory.vocab_chunk"] > 0.03) == (method == "full")
        plan = plan_for_config(config, model)
        fitted, _ = fit_budget(config, model, plan.device_bytes - 2**20, reserve=0.0)
        if method == "full":
            assert fitted.memory.vocab_chunk is None
        elif resolve(config, model).memory.vocab_chunk is None and (
            fitted.memory.vocab_chunk is not None
        ):  # the search added it (not the lean defaults): undoing it no longer fits
            undone = _replace(fitted, "memory", vocab_chunk=None)
            assert plan_for_config(undone, model).device_bytes > plan.device_bytes - 2**20
    offload = change_costs(config, _replace(config, "memory", residuals="host"), model, GPU)
    assert offload["memory.residuals"] > 0
    assert change_costs(config, _replace(config, "memory", residuals="host"), model, CPU) == {
        "memory.residuals": 0.0
    }


def test_a_frozen_heads_sequence_chunk_costs_the_heads_bytes_and_comes_after_its_vocabulary():
    # a sequence chunk streams the head through its matmuls once more per chunk: the search
    # (and the plan's cost column) see it; a frozen head's vocabulary chunk of the same saving
    # costs almost nothing, so it is taken first
    model = builtin_config("SmolLM2-135M")
    whole = config_of(
        method="lora",
        batch_size=2,
        data={"seq_len": 256},
        memory={"loss_chunk": None, "vocab_chunk": None, "mlp_chunk": None},
    )
    by_sequence = change_costs(whole, _replace(whole, "memory", loss_chunk=64), model, CPU)
    by_vocabulary = change_costs(whole, _replace(whole, "memory", vocab_chunk=4096), model, CPU)
    assert by_sequence["memory.loss_chunk"] > 5 * by_vocabulary["memory.vocab_chunk"] > 0
    plan = plan_for_config(whole, model)
    fitted, _ = fit_budget(whole, model, plan.device_bytes - 2**20, reserve=0.0)
    assert fitted.memory.vocab_chunk is not None and fitted.memory.loss_chunk is None


def test_nothing_fits_names_the_largest_component_the_shortfall_and_options():
    config, model = config_of(**LLAMA_QLORA), builtin_config("Llama-3.1-8B")
    _, smallest = _search(resolve(config, model), model, 0, CPU)  # every change that helps
    with pytest.raises(BudgetError) as error:
        fit_budget(
            config, model, smallest.device_bytes - 2**20, reserve=0.0
        )  # just short of it at 2048 tokens
    message = str(error.value)
    assert "largest component: base_layers" not in message  # a host component holds no device
    assert "GiB short" in message
    assert "seq 1024 fits at" in message
    with pytest.raises(BudgetError, match="No shorter sequence"):
        fit_budget(config, model, GIB // 4, reserve=0.0)


def test_the_trainer_entry_point_uses_memory_budget():
    model = builtin_config("Llama-3.1-8B")
    unbounded = config_of(**LLAMA_QLORA)
    same, plan = plan_within_budget(unbounded, model)
    # without a budget the config is planned as given, its unset chunks chosen from the shapes
    assert same == resolve(unbounded, model) != unbounded
    assert plan == plan_for_config(unbounded, model)
    bounded = config_of(**LLAMA_QLORA, memory={"budget": "8GiB"})
    fitted, fitted_plan = plan_within_budget(bounded, model)
    assert fitted_plan.device_bytes <= 8 * GIB < plan.device_bytes
    assert fitted.memory.budget == "8GiB"


def test_the_base_goes_to_the_host_last_and_only_when_nothing_cheaper_fits():
    """Llama-3.1-8B QLoRA b1 x 2048: 4 GiB only fits with the frozen base on the host, which the
    search then picks; a budget that offloading the residual stream meets keeps the base on the
    device, though moving the base would fit too (it is tried after the cheaper settings)."""
    model = builtin_config("Llama-3.1-8B")
    config = parse_config(
        {
            "method": "qlora",
            "batch_size": 1,
            "data": {"seq_len": 2048},
            "model": {"dtype": "bfloat16"},
        }
    )
    fitted, plan = fit_budget(config, model, 4 * GIB, reserve=0.0, target=GPU)
    assert fitted.memory.base == "host" and plan.device_bytes <= 4 * GIB
    assert "memory.base: device -> host" in describe_changes(config, fitted)
    resolved = resolve(config, model, target=GPU)
    residuals = _replace(resolved, "memory", residuals="host")
    budget = plan_for_config(residuals, model, GPU).device_bytes
    base = _replace(resolved, "memory", base="host")
    assert plan_for_config(base, model, GPU).device_bytes <= budget  # the base alone fits too
    fitted, _ = fit_budget(config, model, budget, reserve=0.0, target=GPU)
    assert fitted.memory.base == "device"


def test_plan_fits_llama_70b_qlora_in_16_gib_of_an_rtx_4090_with_the_base_on_the_host():
    """The issue's command: a configuration is found, with the host memory and the PCIe time it
    needs (planned, not compiled)."""
    result = CliRunner().invoke(
        app,
        ["plan", "Llama-3.1-70B", "--method", "qlora", "--budget", "16GiB", "--target",
         "rtx4090", "--batch", "1", "--seq", "4096", "--no-measure"],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "fits:" in text and "memory.base: device -> host" in text
    assert re.search(r"host memory: \d+\.\d+ GiB pinned \(the frozen base 3\d\.\d+ GiB\)", text)
    assert re.search(r"estimate \(RTX 4090, published peaks\).* s at the link's rate", text)


def test_a_budget_keeps_the_plans_error_in_reserve():
    """`memory.budget` and `plan --budget` fit the plan to the budget less the calibration's
    reserve: how far below its compiled step a plan fell at worst on the held-out grid, so the
    compiled step fits too (tests/memory/test_measure_gpu.py compiles the 5.5 GiB answer)."""
    model = builtin_config("Llama-3.1-8B")
    config = config_of(method="qlora", batch_size=2, data={"seq_len": 2048})
    budget = parse_budget("5.5GiB")
    reserve = plan_reserve(resolve(config, model, target=GPU), GPU)
    assert 0.0 < reserve < 0.15
    _, plan = fit_budget(config, model, budget, target=GPU)
    assert plan.device_bytes <= budget * (1 - reserve)
    _, without = fit_budget(config, model, budget, reserve=0.0, target=GPU)
    assert without.device_bytes > budget * (1 - reserve)  # the reserve changed the answer


def test_a_generous_budget_buys_kept_activations_cheapest_time_saving_first():
    # LoRA on SmolLM2-135M at the demo's b2 x 256 (float32): 16 GiB holds every class, and the
    # plan names the change with its estimated saving; no room keeps the step lean
    model = builtin_config("SmolLM2-135M")
    config = resolve(
        config_of(method="lora", batch_size=2, data={"seq_len": 256}, model={"dtype": "float32"}),
        model,
    )
    fitted, plan = fit_budget(config, model, 16 * GIB)
    assert fitted.memory.save == KEPT_ACTIVATIONS and plan.bytes_of("saved_intermediates") > 0
    (line,) = describe_changes(config, fitted, model, CPU)
    saving = re.fullmatch(
        r"memory\.save: \[\] -> \['qkv', 'attention', 'mlp_hidden'\] \(est\. step time -(\d+\.\d)%\)",
        line,
    )
    assert saving and float(saving.group(1)) >= 10.0, line
    lean = plan_for_config(config, model)
    assert fit_budget(config, model, lean.device_bytes, reserve=0.0)[0].memory.save == ()
    # room for q, k, v and the MLP's hidden states: the attention's output saves the least
    # time per byte (one D x D projection for H h + D values a token) and is left out
    both = _replace(config, "memory", save=("qkv", "mlp_hidden"))
    room = plan_for_config(both, model).device_bytes
    assert fit_budget(config, model, room, reserve=0.0)[0].memory.save == ("qkv", "mlp_hidden")


def test_a_device_budget_is_all_the_device_may_use_and_is_spent_on_speed():
    h100 = get_target("h100")
    assert budget_bytes_of("8GiB") == 8 * GIB
    assert budget_bytes_of("device") == capacity.of_device().limit_bytes  # this machine's
    assert budget_bytes_of(" Device ", capacity.of_machine(h100)) == usable_bytes(h100)
    assert budget_bytes_of("device", capacity.of_machine(get_target("cpu"))) == (
        capacity.of_device().limit_bytes
    )
    model = builtin_config("SmolLM2-135M")
    settings = {"method": "lora", "batch_size": 2, "data": {"seq_len": 256}}
    fitted, plan = plan_within_budget(config_of(**settings, memory={"budget": "device"}), model)
    assert fitted.memory.save == KEPT_ACTIVATIONS and plan.device_bytes <= budget_bytes_of("device")
    result = CliRunner().invoke(
        app, ["plan", "SmolLM2-135M", "--method", "lora", "--batch", "2", "--seq", "256",
              "--budget", "device", "--no-measure"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert re.search(r"memory\.save: \[\] -> \[.*\] \(est\. step time -\d", result.output)


def test_the_search_weighs_time_at_the_platforms_rates():
    # Llama-3.2-1B full fine-tuning b2 x 2048: on a GPU 8 GiB needs its AdamW state on the host,
    # and at a GPU's rates that state's trips over the host link dominate the step's estimate,
    # so only the class saving the most time per byte clears the 1% resolution. On a CPU (one
    # memory, no link) the state stays where it is and, with room, every class is kept.
    # `plan --target` passes the target.
    model = builtin_config("Llama-3.2-1B")
    config = resolve(config_of(method="full", batch_size=2, data={"seq_len": 2048}), model)
    on_gpu, _ = fit_budget(config, model, 8 * GIB, target=GPU)
    on_cpu, _ = fit_budget(config, model, 16 * GIB, target=CPU)
    assert on_gpu.memory.optimizer_state == "host" and on_gpu.memory.save == ("mlp_hidden",)
    assert on_cpu.memory.optimizer_state == "device" and on_cpu.memory.save == KEPT_ACTIVATIONS


def _on_hopper_with_cudnn(monkeypatch) -> AttentionTarget:
    """A Hopper GPU to plan for, with cuDNN at hand (auto resolves to cuDNN's packed layout)."""
    from featherweight.models import attention_choice

    monkeypatch.setattr(attention_choice, "cudnn_library_refusal", lambda: None)
    monkeypatch.setattr(attention_choice, "cudnn_packed_refusal", lambda: None)
    return AttentionTarget("gpu", "9.0")


def _qlora_8b_bf16():
    return parse_config(
        {
            "method": "qlora",
            "batch_size": 2,
            "model": {"dtype": "bfloat16"},
            "data": {"seq_len": 2048},
        }
    )


def test_a_gpu_budget_keeps_qloras_dequantized_weights_only_where_that_saves_time():
    """Keeping the NF4 stack dense costs a second dequantization in the forward and a slice
    copy in the backward (`step_cost.dequantization_seconds`); it pays where the backward would
    dequantize the MLP once per chunk of many. Llama-3.1-8B QLoRA b1 x 16384 with the MLP in
    512-token chunks at a GPU's rates: 32 GiB holds the 13.4 GiB of dense weights beside the
    lean 11.1 GiB step and keeps them (the best time per byte); 24 GiB does not hold them. At
    b2 x 2048 (four chunks at most) even 80 GiB leaves them out: keeping would cost time."""
    model = builtin_config("Llama-3.1-8B")
    settings = {"method": "qlora", "batch_size": 1, "model": {"dtype": "bfloat16"}}
    long = parse_config({**settings, "data": {"seq_len": 16384}, "memory": {"mlp_chunk": 512}})
    roomy, plan = fit_budget(long, model, parse_budget("32GiB"), target=GPU)
    tight, _ = fit_budget(long, model, parse_budget("24GiB"), target=GPU)
    short, _ = fit_budget(_qlora_8b_bf16(), model, parse_budget("80GiB"), target=GPU)
    assert roomy.memory.save == ("dequantized",) and "dequantized" not in tight.memory.save
    assert plan.bytes_of("dequantized_weights") == 32 * 218_103_808 * 2  # L x linears x bf16
    (line,) = describe_changes(resolve(long, model, target=GPU), roomy, model, GPU)
    assert re.fullmatch(
        r"memory\.save: \[\] -> \['dequantized'\] \(est\. step time -\d\.\d%\)", line
    )
    assert short.memory.save == KEPT_ACTIVATIONS
    kept = _replace(short, "memory", save=SAVEABLE)
    assert seconds_per_token(kept, model, ACCELERATOR_RATES) > seconds_per_token(
        short, model, ACCELERATOR_RATES
    )


def test_a_tight_budget_on_a_gpu_trades_cudnn_for_blockwise_attention(monkeypatch):
    """cuDNN's backward workspace (packed rows) is one of the things a 5 GiB budget drops for the
    8B at one row of 4096 tokens (a batch that cannot split into micro-batches, the cheaper
    change at two rows); a budget with room keeps cuDNN, the faster kernel."""
    model = builtin_config("Llama-3.1-8B")
    one_row = _qlora_8b_bf16().model_copy(
        update={"batch_size": 1, "data": _qlora_8b_bf16().data.model_copy(update={"seq_len": 4096})}
    )
    hopper = _on_hopper_with_cudnn(monkeypatch)
    tight, plan = fit_budget(one_row, model, parse_budget("5GiB"), target=hopper)
    assert tight.memory.attention == "blockwise"
    assert plan.device_bytes <= parse_budget("5GiB")
    start = resolve(one_row, model, target=hopper)
    lines = describe_changes(start, tight, model, hopper)
    assert any(line.startswith("memory.attention: auto -> blockwise (est.") for line in lines)
    roomy, _ = fit_budget(one_row, model, parse_budget("40GiB"), target=hopper)
    assert roomy.memory.attention == "auto"
    costs = change_costs(start, tight, model, hopper)
    assert costs["memory.attention"] > 0.05  # blockwise is measured slower on a GPU


def _accumulating(steps: int, batch: int = 8, method: str = "qlora"):
    return parse_config(
        {
            "method": method,
            "batch_size": batch,
            "model": {"dtype": "bfloat16"},
            "data": {"seq_len": 2048},
            "memory": {"accumulation_steps": steps},
        }
    )


def test_room_buys_larger_micro_batches_for_the_same_batch():
    """Accumulation the user set to save memory: a budget with room merges the micro-batches
    (the same batch and update, the weights read fewer times), and the plan says so."""
    model = builtin_config("Llama-3.1-8B")
    start = resolve(_accumulating(4), model, target=GPU)
    fitted, plan = fit_budget(_accumulating(4), model, parse_budget("60GiB"), target=GPU)
    assert fitted.batch_size == 8 and fitted.memory.accumulation_steps < 4
    lines = describe_changes(start, fitted, model, GPU)
    line = next(line for line in lines if line.startswith("memory.accumulation_steps: 4 ->"))
    assert re.search(r"est\. step time -\d", line)
    assert plan.device_bytes > plan_for_config(start, model, GPU).device_bytes


def test_a_tight_budget_splits_the_batch_into_micro_batches_before_shrinking_it():
    """Activations too large for the budget: more micro-batches of the same batch (the same
    training), not a smaller batch (another training), come first."""
    model = builtin_config("Llama-3.1-8B")
    start = resolve(_accumulating(1), model, target=GPU)
    whole = plan_for_config(start, model, GPU).device_bytes
    fitted, plan = fit_budget(_accumulating(1), model, int(0.8 * whole), target=GPU)
    assert fitted.batch_size == 8
    assert fitted.memory.accumulation_steps > 1
    assert plan.device_bytes < whole


def test_the_search_never_proposes_accumulation_a_preference_objective_refuses():
    model = builtin_config("Llama-3.1-8B")
    dpo = _accumulating(1).model_copy(update={"objective": "dpo"})
    doubled = _replace(resolve(dpo, model), "memory", accumulation_steps=2)
    assert _plan_if_valid(doubled, model, CPU) is None


def test_auto_attention_falls_back_to_blockwise_where_cudnns_workspace_would_not_fit(monkeypatch):
    """No budget, a 10 GiB GPU: the 8B QLoRA step at b2 x 2048 with 32 documents a row fits
    with blockwise attention but not with cuDNN's workspace for 32 slots, so "auto" runs
    blockwise instead of being refused; on an 80 GB GPU it keeps cuDNN; an attention the user
    named is never changed."""
    from featherweight.memory.budget import attention_that_fits
    from featherweight.memory.capacity import Capacity

    model = builtin_config("Llama-3.1-8B")
    hopper = _on_hopper_with_cudnn(monkeypatch)
    requested = _replace(_qlora_8b_bf16(), "data", max_documents_per_row=32)
    config = resolve(requested, model, target=hopper)
    plan = plan_for_config(config, model, hopper)
    small, large = (Capacity(size * GIB, "on a GPU", "test") for size in (10, 80))
    assert plan.device_bytes > small.limit_bytes  # cuDNN's workspace does not fit
    fitted, fitted_plan = attention_that_fits(requested, plan, model, small, hopper)
    assert fitted.memory.attention == "blockwise"
    assert fitted_plan.device_bytes <= small.limit_bytes < plan.device_bytes
    assert attention_that_fits(requested, plan, model, large, hopper)[0] == config
    named = _replace(requested, "memory", attention="cudnn")
    named_resolved = resolve(named, model, target=hopper)
    named_plan = plan_for_config(named_resolved, model, hopper)
    assert attention_that_fits(named, named_plan, model, small, hopper)[0] == named_resolved


def test_a_budget_on_a_cpu_bounds_device_and_host_together():
    """On a CPU the host is the device's memory: a budget bounds both, a host placement makes no
    room (it is never chosen to fit), and the 8B QLoRA step at 5.5 GiB is answered "nothing
    fits" with the bytes it needs, not fitted by moving 10.5 GiB "to the host"."""
    model = builtin_config("SmolLM2-135M")
    config = resolve(config_of(method="full", batch_size=4, data={"seq_len": 1024}), model)
    whole = plan_for_config(config, model, CPU).cpu_comparable_bytes
    budget = int(0.9 * whole)
    fitted, plan = fit_budget(config, model, budget, reserve=0.0, target=CPU)
    assert plan.device_bytes + plan.host_bytes <= budget
    assert plan.host_bytes == 0
    assert not any(": device -> host" in line for line in describe_changes(config, fitted))
    _, gpu_plan = fit_budget(config, model, budget, reserve=0.0, target=GPU)
    assert gpu_plan.host_bytes > 0  # on a GPU the host does make room
    with pytest.raises(BudgetError, match=r"needs \d+\.\d+ GiB \(device and host: one memory"):
        fit_budget(config_of(**{**LLAMA_QLORA, "batch_size": 2}), builtin_config("Llama-3.1-8B"),
                   parse_budget("5.5GiB"), target=CPU)  # fmt: skip


def test_the_search_order_is_one_table_of_real_settings():
    # SEARCH_ORDER is the one table: every record changes a field the config has, once, in
    # tier order; the fields `describe_changes` names and the search's tiers come from it
    from featherweight.memory.budget import SEARCH_ORDER, TIERS

    config = config_of(**LLAMA_QLORA)
    for setting in SEARCH_ORDER:
        _value(config, setting.section, setting.field)  # an AttributeError for a wrong name
    assert len({s.name for s in SEARCH_ORDER}) == len(SEARCH_ORDER) == len(set(SEARCHED_FIELDS))
    assert [s.tier for s in SEARCH_ORDER] == sorted(s.tier for s in SEARCH_ORDER)
    assert [s for tier in TIERS for s in tier] == list(SEARCH_ORDER)
    assert tuple((s.section, s.field) for s in SEARCH_ORDER) == SEARCHED_FIELDS
