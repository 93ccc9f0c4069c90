"""Budgets: parse "8GiB", pick the settings that fit at the least estimated step time, or say
why nothing does.

`fit_budget` plans the configured step (its "auto" chunks chosen from the shapes first,
`memory/defaults.py`: `resolve`) and, while the plan's device bytes exceed the budget, changes
one setting at a time: of each setting's next candidate that lowers the planned bytes, the one whose estimated
time per token rises least (`memory/step_cost.py`: matmul FLOPs, the LM head's bytes and host
transfers counted from the shapes, checked against compiled programs; estimates within
`COST_RESOLUTION` of the step are a tie, which goes to the order below). Settings that keep the
step's result are searched first, then those that change its numerics, then the base on the host,
the micro-batch last. Once a plan fits, every change it does not need is undone (the costliest
first), so a setting that saves nothing is never kept. On a CPU the budget bounds the device
and host bytes together (`needed_bytes`: one memory). The settings, in the order searched, each
with its tier and what it costs, are one table, `SEARCH_ORDER`.

When the last plan still does not fit, `BudgetError` names the largest component, the shortfall in
GiB, and the changes that would fit (shorter sequence, another method, a smaller LoRA rank).
The trainer and `featherweight plan` call one planning function, `plan_within_budget`, with the
target they plan for (`AttentionTarget`: the trainer's own device, or `plan --target`'s GPU);
`describe_changes` gives each change with its estimated step-time cost, as `featherweight plan
--budget` shows it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax

from featherweight.errors import BudgetError, ConfigError
from featherweight.memory import capacity
from featherweight.memory.defaults import resolve
from featherweight.memory.plan import MemoryPlan, plan_for_config
from featherweight.memory.step_cost import DeviceRates, rates_for, seconds_per_token
from featherweight.memory.working_set import plan_reserve
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig
from featherweight.parallel.sharding import planning_mesh
from featherweight.recipe.build import attention_implementation, check_clipping_and_accumulation
from featherweight.recipe.objectives import check_objective, objective_of
from featherweight.recipe.placement import check_placements
from featherweight.recipe.schema import TrainConfig
from featherweight.step.policy import SAVEABLE

GIB = 2**30
MIN_LOSS_CHUNK = 64
MAX_VOCAB_CHUNK, MIN_VOCAB_CHUNK = 16384, 2048  # rows of the LM head at a time
MIN_MLP_CHUNK = 256
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.IGNORECASE)


def parse_budget(text: str) -> int:
    """Bytes of a budget string: a number and a unit, e.g. "8GiB", "8 GiB", "8000MiB", "7.5GB".

    KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB powers of 1000; B is bytes.
    """
    match = _BUDGET.match(str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ConfigError(
            f"budget {text!r} is not a memory size; write a number and a unit, e.g. 8GiB, "
            "8 GiB, 8000MiB or 7.5GB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or device "
            "(all the device's usable memory)"
        )
    value = float(match.group(1)) * unit
    if value <= 0:
        raise ConfigError(f"budget {text!r} must be more than 0 bytes, e.g. 8GiB")
    return int(value)


DEVICE_BUDGET = "device"


def budget_bytes_of(text: str, room: capacity.Capacity | None = None) -> int:
    """Bytes of a budget: a size (`parse_budget`), or "device": all a step may use of the device
    planned for, `room` (default: this process's device, `capacity.of_device`: JAX's pool less
    the library allowance on a GPU, the physical memory on a CPU; a GPU target's usable memory:
    `capacity.of_machine`). With a budget the room the plan leaves is spent on speed (kept
    activations, fewer and larger micro-batches)."""
    if str(text).strip().lower() != DEVICE_BUDGET:
        return parse_budget(text)
    room = capacity.of_device() if room is None else room
    if room is None:
        raise ConfigError(
            "budget 'device': the device planned for reports no memory size to fill; give a "
            "size, e.g. 8GiB"
        )
    return room.limit_bytes


def _replace(config: TrainConfig, section: str | None, **values) -> TrainConfig:
    """A copy of `config` with fields of one section (or top-level fields) changed."""
    if section is None:
        return config.model_copy(update=values)
    current = getattr(config, section)
    updated = (
        dataclasses.replace(current, **values)  # a dataclass section (LoraConfig)
        if dataclasses.is_dataclass(current)
        else current.model_copy(update=values)
    )
    return config.model_copy(update={section: updated})


def _halved_divisors(seq: int, current: int | None, minimum: int) -> Iterator[int]:
    """Halvings of `current` (or of `seq`) down to `minimum` that divide the sequence."""
    chunk = (current or seq) // 2
    while chunk >= minimum:
        if seq % chunk == 0:
            yield chunk
        chunk //= 2


def _loss_chunks(config: TrainConfig) -> Iterator[TrainConfig]:
    for chunk in _halved_divisors(config.data.seq_len, config.memory.loss_chunk, MIN_LOSS_CHUNK):
        yield _replace(config, "memory", loss_chunk=chunk)


def _vocab_chunks(config: TrainConfig, vocab_size: int) -> Iterator[TrainConfig]:
    chunk = min(config.memory.vocab_chunk or vocab_size, MAX_VOCAB_CHUNK)
    if chunk >= vocab_size:
        chunk //= 2
    while chunk >= MIN_VOCAB_CHUNK:
        yield _replace(config, "memory", vocab_chunk=chunk)
        chunk //= 2


def _mlp_chunks(config: TrainConfig) -> Iterator[TrainConfig]:
    for chunk in _halved_divisors(config.data.seq_len, config.memory.mlp_chunk, MIN_MLP_CHUNK):
        yield _replace(config, "memory", mlp_chunk=chunk)


def _embedding_on_host(config: TrainConfig, tied: bool) -> Iterator[TrainConfig]:
    if config.memory.embed == "host":
        return
    changed = _replace(config, "memory", embed="host")
    if tied and changed.memory.vocab_chunk is None:  # the tied head then reads it in chunks
        changed = _replace(changed, "memory", vocab_chunk=MAX_VOCAB_CHUNK)
    yield changed


def _optimizer_state_on_host(config: TrainConfig) -> Iterator[TrainConfig]:
    if config.memory.optimizer_state != "host":
        yield _replace(config, "memory", optimizer_state="host")


def _base_on_host(config: TrainConfig) -> Iterator[TrainConfig]:
    if config.memory.base != "host":
        yield _replace(config, "memory", base="host")


def _blockwise_attention(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> Iterator[TrainConfig]:
    if attention_implementation(config, model_config, target) != "blockwise":
        yield _replace(config, "memory", attention="blockwise")


def _no_saved(config: TrainConfig) -> Iterator[TrainConfig]:
    if config.memory.save:
        yield _replace(config, "memory", save=())


def _offload(config: TrainConfig) -> Iterator[TrainConfig]:
    if config.memory.residuals != "host":
        yield _replace(config, "memory", residuals="host")


def _quantized_head(config: TrainConfig) -> Iterator[TrainConfig]:
    if config.method == "qlora" and not config.model.quantize_head:
        yield _replace(config, "model", quantize_head=True)


def _eight_bit_state(config: TrainConfig) -> Iterator[TrainConfig]:
    if config.optimizer.name == "adamw":
        yield _replace(config, "optimizer", name="adamw_8bit")


def _kept_activations(config: TrainConfig) -> Iterator[TrainConfig]:
    """`config` with each class of block intermediates it does not keep yet added to
    `memory.save` (the backward pass then skips the matmuls that made them)."""
    for name in SAVEABLE:
        if name not in config.memory.save:
            kept = {*config.memory.save, name}
            yield _replace(config, "memory", save=tuple(n for n in SAVEABLE if n in kept))


def _more_accumulation(config: TrainConfig) -> Iterator[TrainConfig]:
    """`config` with twice the micro-batches (`memory.accumulation_steps`), each half as large,
    where the batch splits so: the same batch and update, one smaller micro-batch's
    activations, the weights read once more per micro-batch."""
    steps = 2 * config.memory.accumulation_steps
    if config.batch_size % steps == 0:
        yield _replace(config, "memory", accumulation_steps=steps)


def _fewer_accumulation(config: TrainConfig) -> Iterator[TrainConfig]:
    """`config` with half the micro-batches, each twice as large (the same batch and update):
    what a budget's room buys where the configured accumulation only saved memory."""
    if config.memory.accumulation_steps > 1:
        yield _replace(config, "memory", accumulation_steps=config.memory.accumulation_steps // 2)


def _rollout_chunks(config: TrainConfig) -> Iterator[TrainConfig]:
    """GRPO: fewer completions sampled together (halvings that divide the group), each with its
    KV cache and logits; only the rollout phase shrinks, the step is the same."""
    rollouts = objective_of(config).rollouts(config)
    if rollouts is None:
        return
    generations = rollouts.num_generations
    chunk = (config.memory.rollout_chunk or generations) // 2
    while chunk >= 1:
        if generations % chunk == 0:
            yield _replace(config, "memory", rollout_chunk=chunk)
        chunk //= 2


def _micro_batches(config: TrainConfig) -> Iterator[TrainConfig]:
    # on a mesh only batches whose global rows split over data x fsdp can run
    rows = 1 if config.mesh is None else planning_mesh(config.mesh).size
    batch = config.batch_size // 2
    while batch >= 1:
        if batch * jax.process_count() % rows == 0:
            yield _replace(config, None, batch_size=batch)
        batch //= 2


# estimated step times closer than this fraction of the step are a tie (the estimate counts matmul
# FLOPs and the bytes of the head and the host link, not everything a step does)
COST_RESOLUTION = 0.01


class SearchedSetting(NamedTuple):
    """A setting the budget search may change: how `describe_changes` and the docs name it, the
    config field it changes (`section` None: a top-level field), its tier (0: keeps the step's
    result, taken by estimated time; 1: changes its numerics; 2: the base on the host, the whole
    frozen stack over the host link twice a step; 3: the micro-batch, the effective batch), what
    it costs, and its candidates from the current config, model and target, next first."""

    name: str
    section: str | None
    field: str
    tier: int
    costs: str
    candidates: Callable[[TrainConfig, ModelConfig, AttentionTarget], Iterator[TrainConfig]]


# Every setting the search may change, in the order it prefers them: by tier, then (of the same
# estimated cost) what keeps everything on the device and streams the LM head fewest times.
SEARCH_ORDER = (
    SearchedSetting(
        "rollout chunk", "memory", "rollout_chunk", 0,
        "GRPO: fewer completions sampled together when the rollout phase is the peak -- the same "
        "completions (per-row keys), the step unchanged; the rollouts decode in more, smaller "
        "batches (not in the step-time estimate)",
        lambda c, m, t: _rollout_chunks(c),
    ),
    SearchedSetting(
        "vocabulary chunk", "memory", "vocab_chunk", 0,
        "the LM head 16384 rows at a time, then halved (down to 2048) -- same result; for a "
        "frozen head no extra FLOPs and no more reads of the head (one sweep), for a trained one "
        "one more LM-head forward",
        lambda c, m, t: _vocab_chunks(c, m.vocab_size),
    ),
    SearchedSetting(
        "loss chunk", "memory", "loss_chunk", 0,
        "halve the LM-head/cross-entropy chunk (down to 64 tokens) -- same result, no extra "
        "FLOPs, but the head streams through its matmuls once more per chunk; helps when the "
        "loss phase is the peak (large vocabularies)",
        lambda c, m, t: _loss_chunks(c),
    ),
    SearchedSetting(
        "saved intermediates", "memory", "save", 0,
        "drop them (memory.save = ()) -- the backward pass recomputes them",
        lambda c, m, t: _no_saved(c),
    ),
    SearchedSetting(
        "MLP chunk", "memory", "mlp_chunk", 0,
        "halve the MLP's sequence chunk (down to 256) -- same result; long context",
        lambda c, m, t: _mlp_chunks(c),
    ),
    SearchedSetting(
        "accumulation", "memory", "accumulation_steps", 0,
        "twice the micro-batches, each half as large -- the same batch and update (gradients "
        "summed in float32 before it), the weights read once more per micro-batch; where the "
        "batch splits so",
        lambda c, m, t: _more_accumulation(c),
    ),
    SearchedSetting(
        "residual offload", "memory", "residuals", 0,
        'memory.residuals = "host" -- same result, the residual stream crosses the host link '
        "twice (transfers overlap compute)",
        lambda c, m, t: _offload(c),
    ),
    SearchedSetting(
        "embedding on host", "memory", "embed", 0,
        'memory.embed = "host" -- same result, only a batch\'s rows come over',
        lambda c, m, t: _embedding_on_host(c, m.tie_word_embeddings),
    ),
    SearchedSetting(
        "optimizer state on host", "memory", "optimizer_state", 0,
        'memory.optimizer_state = "host" -- same result, the state crosses the link in and out, '
        "one layer at a time (one device only, like the embedding)",
        lambda c, m, t: _optimizer_state_on_host(c),
    ),
    SearchedSetting(
        "blockwise attention", "memory", "attention", 0,
        'memory.attention = "blockwise" where cuDNN\'s fused kernel would run -- same result '
        "(exact masks both), without cuDNN's backward workspace (Llama-3.1-8B at b2 x 2048 in "
        "the packed layout: 0.5 GiB at the default 4 document slots a row, 4 GiB at 32), at "
        "blockwise's measured extra time on a GPU (`step_cost.DeviceRates"
        ".blockwise_attention_extra`)",
        _blockwise_attention,
    ),
    SearchedSetting(
        "quantized head", "model", "quantize_head", 1,
        "QLoRA: model.quantize_head = true -- the LM head (or tied embedding) in NF4",
        lambda c, m, t: _quantized_head(c),
    ),
    SearchedSetting(
        "8-bit optimizer state", "optimizer", "name", 1,
        "adamw -> adamw_8bit -- 2 bytes of state per parameter instead of 8",
        lambda c, m, t: _eight_bit_state(c),
    ),
    SearchedSetting(
        "base on host", "memory", "base", 2,
        'LoRA/QLoRA: memory.base = "host" -- same result, but the whole frozen layer stack '
        "crosses the host link twice a step (forward, and the backward's recompute), the "
        "costliest transfer of all: tried after every other setting that keeps the batch",
        lambda c, m, t: _base_on_host(c),
    ),
    SearchedSetting(
        "micro-batch", None, "batch_size", 3,
        "halve batch_size (down to 1) -- the streamed step updates per micro-batch, so this "
        "changes the effective batch; last, where the batch cannot split into more "
        "micro-batches (a preference objective, or micro-batches of one row). The plan of a "
        "split batch is within 10% of XLA's GPU compile at the smallest Llama-3.1-8B QLoRA "
        "settings (two micro-batches of one row: +4.3%, deviceless H100), since the plan counts "
        "the layer's dequantized weights at the backward's peak "
        "(`working_set.dequantized_layer_bytes`); before, it fell 19% below and the search did "
        "not split batches. A budget's room merges them again (`_spend_on_speed`)",
        lambda c, m, t: _micro_batches(c),
    ),
)  # fmt: skip
# (section, field) of every setting the search may change, as `describe_changes` names them
SEARCHED_FIELDS = tuple((setting.section, setting.field) for setting in SEARCH_ORDER)
TIERS = tuple(
    tuple(setting for setting in SEARCH_ORDER if setting.tier == tier)
    for tier in sorted({setting.tier for setting in SEARCH_ORDER})
)


def _tier_of(section: str | None, field: str) -> int:
    """The search tier of the setting that changes `section.field`."""
    return next(s.tier for s in SEARCH_ORDER if (s.section, s.field) == (section, field))


def _value(config: TrainConfig, section: str | None, field: str):
    return getattr(config if section is None else getattr(config, section), field)


def describe_changes(
    before: TrainConfig,
    after: TrainConfig,
    model_config: ModelConfig | None = None,
    target: AttentionTarget | None = None,
) -> list[str]:
    """Human-readable `setting: old -> new` lines for the fields a budget search changed; with
    `model_config`, each with its estimated step-time cost on `target` (`change_costs`)."""
    costs = {} if model_config is None else change_costs(before, after, model_config, target)
    lines = []
    for section, field in SEARCHED_FIELDS:
        old, new = _value(before, section, field), _value(after, section, field)
        if old != new:
            name = field if section is None else f"{section}.{field}"
            old, new = (list(v) if isinstance(v, tuple) else v for v in (old, new))
            cost = f" (est. step time {costs[name]:+.1%})" if name in costs else ""
            lines.append(f"{name}: {old} -> {new}{cost}")
    return lines


def needed_bytes(plan: MemoryPlan, target: AttentionTarget) -> int:
    """What of `plan` a budget for `target` bounds: its device bytes and, where the device's
    memory is the host's (a CPU, `AttentionTarget.one_memory`), its host bytes too -- a byte
    moved to the host there is still in the same memory, so a host placement never makes room.
    The device bytes are the peak phase's (GRPO's rollouts may be the larger)."""
    return plan.device_bytes + plan.host_bytes if target.one_memory else plan.device_bytes


def _plan_if_valid(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> MemoryPlan | None:
    """The plan of a candidate, or None when the config validation refuses it (e.g. 8-bit AdamW
    after the embedding moved to the host with full fine-tuning): the search never proposes a
    configuration the trainer would then refuse."""
    try:
        TrainConfig.model_validate(config.model_dump(mode="json"))
        check_placements(config, model_config)  # host placements the trainer would refuse
        check_clipping_and_accumulation(config)  # e.g. two-pass clipping with accumulation
        check_objective(config)  # e.g. pairs averaged over one batch, GRPO's whole groups
        return plan_for_config(config, model_config, target)
    except (ConfigError, ValueError):
        return None


def _cheapest_step(
    config: TrainConfig,
    plan: MemoryPlan,
    model_config: ModelConfig,
    rates: DeviceRates,
    target: AttentionTarget,
) -> tuple[TrainConfig, MemoryPlan] | None:
    """The next change: of each setting's next candidate that lowers the planned bytes, the one
    whose estimated time per token is least, from the first tier that has one; estimates within
    `COST_RESOLUTION` of the step's time of each other are a tie, taken in `SEARCH_ORDER`.
    None when no setting lowers the plan."""
    step = COST_RESOLUTION * seconds_per_token(config, model_config, rates, target)
    for tier in TIERS:
        options = []
        for order, setting in enumerate(tier):
            for candidate in setting.candidates(config, model_config, target):
                candidate_plan = _plan_if_valid(candidate, model_config, target)
                if candidate_plan is not None and needed_bytes(
                    candidate_plan, target
                ) < needed_bytes(plan, target):
                    cost = seconds_per_token(candidate, model_config, rates, target)
                    options.append((cost, order, candidate, candidate_plan))
                    break
        if options:
            least = min(cost for cost, *_ in options)
            ties = [option for option in options if option[0] <= least + step]
            _, _, chosen, chosen_plan = min(ties, key=lambda option: option[1])
            return chosen, chosen_plan
    return None


def _drop_unneeded(
    start: TrainConfig,
    config: TrainConfig,
    model_config: ModelConfig,
    budget: int,
    rates: DeviceRates,
    target: AttentionTarget,
) -> tuple[TrainConfig, MemoryPlan]:
    """`config` with every change from `start` undone that the fit does not need, the costliest
    first (the micro-batch, then what changes the numerics, then by estimated time): a setting
    chosen early can be made useless by a later one, and a setting that saves nothing is never
    kept."""
    changed = [f for f in SEARCHED_FIELDS if _value(start, *f) != _value(config, *f)]

    def cost(field) -> tuple[int, float]:
        undone = _replace(config, field[0], **{field[1]: _value(start, *field)})
        seconds = seconds_per_token(config, model_config, rates, target) - seconds_per_token(
            undone, model_config, rates, target
        )
        return _tier_of(*field), seconds

    for section, field in sorted(changed, key=cost, reverse=True):
        undone = _replace(config, section, **{field: _value(start, section, field)})
        undone_plan = _plan_if_valid(undone, model_config, target)
        if undone_plan is not None and needed_bytes(undone_plan, target) <= budget:
            config = undone
    return config, plan_for_config(config, model_config, target)


def _search(
    config: TrainConfig, model_config: ModelConfig, budget: int, target: AttentionTarget
) -> tuple[TrainConfig, MemoryPlan]:
    """The configuration that fits `budget` on `target` at the least estimated step time (at
    the target platform's rates); else the smallest.

    One change at a time, each the cheapest in estimated time per token (`step_cost`: matmul
    FLOPs and host transfers) of the changes that lower the plan, the same-result settings
    before those that change the numerics and the micro-batch last; once the plan fits, every
    change it does not need is undone.
    """
    rates = rates_for(target.platform)
    start, plan = config, plan_for_config(config, model_config, target)
    while needed_bytes(plan, target) > budget:
        step = _cheapest_step(config, plan, model_config, rates, target)
        if step is None:
            break
        config, plan = step
    if needed_bytes(plan, target) <= budget and config != start:
        config, plan = _drop_unneeded(start, config, model_config, budget, rates, target)
    return config, plan


def _spend_on_speed(
    config: TrainConfig,
    plan: MemoryPlan,
    model_config: ModelConfig,
    budget: int,
    target: AttentionTarget,
) -> tuple[TrainConfig, MemoryPlan]:
    """Memory for speed: while the budget has room, take the change that saves the most
    estimated time per byte it adds (`step_cost`) -- a class of activations kept (the matmuls
    the backward no longer recomputes) or half the micro-batches, each twice as large (the
    weights read fewer times for the same tokens; the same batch and update); a saving within
    `COST_RESOLUTION` of the step is none. A fitted plan's room goes to speed only here, so
    without a budget the step stays as lean as configured."""
    rates = rates_for(target.platform)
    while True:
        now = seconds_per_token(config, model_config, rates, target)
        options = []
        for candidate in (*_kept_activations(config), *_fewer_accumulation(config)):
            candidate_plan = _plan_if_valid(candidate, model_config, target)
            if candidate_plan is None or needed_bytes(candidate_plan, target) > budget:
                continue
            saved = now - seconds_per_token(candidate, model_config, rates, target)
            if saved > COST_RESOLUTION * now:
                added = max(needed_bytes(candidate_plan, target) - needed_bytes(plan, target), 1)
                options.append((saved / added, candidate, candidate_plan))
        if not options:
            return config, plan
        _, config, plan = max(options, key=lambda option: option[0])


def smallest_settings(
    config: TrainConfig,
    model_config: ModelConfig,
    keep_batch: bool = True,
    target: AttentionTarget | None = None,
) -> tuple[TrainConfig, MemoryPlan]:
    """Every change the budget search makes when nothing fits (a budget of 0 bytes) on `target`
    (default: this process's device): the smallest step it can plan, and its plan. With
    `keep_batch`, the micro-batch is set back to the config's (the search's last resort halves
    it), so the row keeps its shapes."""
    target = target or AttentionTarget.of_device()
    smallest, plan = _search(resolve(config, model_config, target=target), model_config, 0, target)
    if keep_batch and smallest.batch_size != config.batch_size:
        smallest = _replace(smallest, None, batch_size=config.batch_size)
        plan = plan_for_config(smallest, model_config, target)
    return smallest, plan


def change_costs(
    before: TrainConfig,
    after: TrainConfig,
    model_config: ModelConfig,
    target: AttentionTarget | None = None,
) -> dict[str, float]:
    """{"memory.vocab_chunk": fraction, ...}: each change's estimated step-time cost per token
    on `target` (default: this process's device; `step_cost`), as a fraction of `before`'s, made
    alone on `before`."""
    target = target or AttentionTarget.of_device()
    rates = rates_for(target.platform)
    base = seconds_per_token(before, model_config, rates, target)
    costs = {}
    for section, field in SEARCHED_FIELDS:
        if _value(before, section, field) != _value(after, section, field):
            alone = _replace(before, section, **{field: _value(after, section, field)})
            name = field if section is None else f"{section}.{field}"
            costs[name] = seconds_per_token(alone, model_config, rates, target) / base - 1.0
    return costs


def _alternatives(
    config: TrainConfig, model_config: ModelConfig, budget: int, target: AttentionTarget
) -> Iterator[tuple[str, int]]:
    """Changes outside the automatic search that fit, each with its planned bytes: the longest
    shorter sequence, the first lighter method, the largest smaller LoRA rank."""
    shorter = []
    # a GRPO row must still hold a prompt token and the longest completion
    rollouts = objective_of(config).rollouts(config)
    shortest = 0 if rollouts is None else rollouts.max_completion_length
    for seq in _halvings(config.data.seq_len, max(MIN_LOSS_CHUNK, shortest)):
        changed = _replace(config, "data", seq_len=seq)
        if config.memory.loss_chunk and seq % config.memory.loss_chunk:
            changed = _replace(changed, "memory", loss_chunk=None)
        shorter.append((f"seq {seq}", changed))
    lighter = {"full": ("lora", "qlora"), "lora": ("qlora",)}.get(config.method, ())
    ranks = () if config.method == "full" else _halvings(config.lora.rank, 1)
    for kind in (
        shorter,
        [(f"method {method}", _replace(config, None, method=method)) for method in lighter],
        [(f"LoRA rank {rank}", _replace(config, "lora", rank=rank)) for rank in ranks],
    ):
        for label, changed in kind:
            _, plan = _search(changed, model_config, budget, target)
            if needed_bytes(plan, target) <= budget:
                yield (
                    f"{label} fits at {needed_bytes(plan, target) / GIB:.2f} GiB",
                    plan.device_bytes,
                )
                break


def _halvings(value: int, minimum: int) -> list[int]:
    """value // 2, value // 4, ... down to `minimum`."""
    halves, value = [], value // 2
    while value >= minimum:
        halves.append(value)
        value //= 2
    return halves


def fit_budget(
    config: TrainConfig,
    model_config: ModelConfig,
    budget_bytes: int,
    reserve: float | None = None,
    target: AttentionTarget | None = None,
) -> tuple[TrainConfig, MemoryPlan]:
    """(config that fits `budget_bytes` of device memory -- on a CPU, of device and host memory
    together: `needed_bytes` -- and its plan), changing settings in the
    order of `SEARCH_ORDER` only as far as needed, then spending the room left on speed (kept
    activations, fewer and larger micro-batches: `_spend_on_speed`). Raises `BudgetError` when
    nothing fits.

    The plan must fit the budget less `reserve` (a fraction; default the calibration's
    `plan_reserve`: how far below its compiled step a plan fell at worst on the held-out grid),
    so that the compiled step, not only its plan, fits the budget. Everything is planned for
    `target` (default: this process's device): its attention, its compiler's calibration, time
    weighed at its platform's rates."""
    if budget_bytes <= 0:
        raise ConfigError(f"budget of {budget_bytes} bytes must be positive, e.g. 8GiB")
    target = target or AttentionTarget.of_device()
    config = resolve(config, model_config, target=target)
    reserve = plan_reserve(config, target) if reserve is None else reserve
    limit = int(budget_bytes * (1 - reserve))
    fitted, plan = _search(config, model_config, limit, target)
    if needed_bytes(plan, target) <= limit:
        return _spend_on_speed(fitted, plan, model_config, limit, target)
    largest, needed = plan.largest_component(), needed_bytes(plan, target)
    options = [text for text, _ in _alternatives(fitted, model_config, limit, target)]
    memory = " (device and host: one memory on a CPU)" if target.one_memory else ""
    raise BudgetError(
        f"nothing fits {limit / GIB:.2f} GiB (the budget less {reserve:.1%} kept for the "
        f"plan's error): the smallest plan "
        f"({', '.join(describe_changes(config, fitted)) or 'as configured'}) needs "
        f"{needed / GIB:.2f} GiB{memory}, {(needed - limit) / GIB:.2f} GiB short; largest "
        f"component: {largest.name} ({largest.bytes / GIB:.2f} GiB). "
        + (
            f"Options that fit: {'; '.join(options)}"
            if options
            else "No shorter sequence, lighter method or smaller rank fits; use a larger device"
        )
    )


def attention_that_fits(
    config: TrainConfig,
    plan: MemoryPlan,
    model_config: ModelConfig,
    room: capacity.Capacity | None = None,
    target: AttentionTarget | None = None,
) -> tuple[TrainConfig, MemoryPlan]:
    """`memory.attention: auto` chose a fused kernel on `target` (default: this process's device)
    whose plan does not fit `room` (default: this process's device, `capacity.of_device`):
    blockwise instead -- the same result, without
    cuDNN's backward workspace (Llama-3.1-8B at b2 x 2048 in the packed layout: 0.5 GiB at 4
    document slots a row, 4 GiB at 32), slower -- so that a step which fits without it is not
    refused; its "auto" chunks chosen again for blockwise (`resolve`: the loss phase may become
    the peak). `config` as requested (settings still "auto"), `plan` its resolved plan; the
    resolved config and plan come back, unchanged where the plan fits, where no room is known,
    or where the attention is named."""
    target = target or AttentionTarget.of_device()
    resolved = resolve(config, model_config, target=target)
    if config.memory.attention != "auto":
        return resolved, plan
    if attention_implementation(resolved, model_config, target) == "blockwise":
        return resolved, plan
    room = capacity.of_device() if room is None else room  # read only when it can matter
    if room is None or room.needed_bytes(plan) <= room.limit_bytes:
        return resolved, plan
    blockwise = resolve(
        _replace(config, "memory", attention="blockwise"), model_config, target=target
    )
    return blockwise, plan_for_config(blockwise, model_config, target)


def plan_within_budget(
    config: TrainConfig,
    model_config: ModelConfig,
    target: AttentionTarget | None = None,
    room: capacity.Capacity | None = None,
) -> tuple[TrainConfig, MemoryPlan]:
    """The one planning step of `train` and `featherweight plan`: (the resolved config, fitted to
    `memory.budget` when set; its plan), for `target` (default: this process's device) whose
    memory is `room` (default: this process's device, `capacity.of_device`; a GPU target's:
    `capacity.of_machine`). Without a budget the config runs as it is, but for "auto" attention,
    which falls back to blockwise where the fused kernel's workspace would not fit `room`
    (`attention_that_fits`); a budget of "device" is all of `room`."""
    target = target or AttentionTarget.of_device()
    if config.memory.budget is None:
        plan = plan_for_config(resolve(config, model_config, target=target), model_config, target)
        return attention_that_fits(config, plan, model_config, room, target)
    budget_bytes = budget_bytes_of(config.memory.budget, room)
    return fit_budget(config, model_config, budget_bytes, target=target)
