"""Every user-facing training setting, as pydantic models validated with clear errors.

One YAML file (or Python dict) holds a `TrainConfig`; `--set key.sub=value` overrides a field.
Unknown keys get the closest valid key suggested; wrong types name the field and the value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import reprlib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from featherweight.data.records import ALPACA, InstructionTemplate
from featherweight.data.sources import COLUMN_KEYS
from featherweight.errors import ConfigError, check_input_file, read_input_text
from featherweight.parallel.sharding import MeshSettings
from featherweight.peft.lora import LoraConfig
from featherweight.recipe.paths import from_config_folder, reward_files_from
from featherweight.step.grpo import GrpoObjective
from featherweight.step.policy import SAVEABLE, MemoryPolicy

Method = Literal["full", "lora", "qlora"]
MAX_SEED = 2**32 - 1  # seeds are 32-bit: what jax.random.PRNGKey and numpy's generators take


def _is_number(annotation: Any) -> bool:
    """Whether a field's type takes numbers and not yes/no (`int`, `float | None`, ...)."""
    members = typing.get_args(annotation) or (annotation,)
    return bool not in members and any(member in (int, float) for member in members)


AUTO = "auto"
# memory settings chosen from the shapes when "auto" (`memory/defaults.py`: `resolve`)
CHOSEN_FROM_SHAPES = ("mlp_chunk", "loss_chunk", "vocab_chunk")


def refuse_yes_no_number(value: Any, annotation: Any) -> Any:
    """YAML's true/false where a number is meant (`steps: true` would be 1): refused."""
    if isinstance(value, bool) and _is_number(annotation):
        raise ValueError(f"{str(value).lower()} is a yes/no value, not a number; write a number")
    return value


class _Section(BaseModel):
    # a NaN or infinite number is never a valid setting (`learning_rate: .inf`)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_yes_no(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_yes_no_number(value, cls.model_fields[info.field_name].annotation)


class ModelSettings(_Section):
    """The checkpoint to fine-tune and how its weights are held."""

    path: str = Field(
        "demo", description="HF directory, .gguf file, or 'demo' (SmolLM2-135M-Instruct)"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="parameter and compute dtype"
    )
    quantize_head: bool = Field(False, description="QLoRA: NF4 LM head (or tied embedding) too")


class InstructionTemplateSettings(_Section):
    """Prompts for instruction records (format strings over {instruction} and {input})."""

    prompt: str = Field(ALPACA.prompt, description="when the record has an input")
    prompt_no_input: str = Field(ALPACA.prompt_no_input, description="when it has none")

    @model_validator(mode="after")
    def _check(self) -> InstructionTemplateSettings:
        self.template().check()  # only {instruction} (and {input}) may be named
        return self

    def template(self) -> InstructionTemplate:
        """The data layer's form of these prompts."""
        return InstructionTemplate(self.prompt, self.prompt_no_input)


class DataSettings(_Section):
    """The dataset: records of {"text"}, {"instruction","input","output"} or {"messages"}."""

    train: str = Field(
        "demo",
        description=(
            "a JSONL, JSON, CSV, TSV, Parquet, Arrow or .txt file, a save_to_disk directory, a "
            "Hugging Face dataset name in the local cache, or 'demo' (the generated task)"
        ),
    )
    eval: str | None = None
    eval_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="split off train when eval is None"
    )
    seq_len: int = Field(256, gt=0)
    pack: bool = Field(True, description="several examples per row; false: one (padded)")
    max_documents_per_row: int | None = Field(
        None,
        ge=1,
        description=(
            "packed rows hold at most this many examples (a preference pair is two); cuDNN's "
            "packed attention then holds exactly that many a row, its backward workspace "
            "4 x B x M x H x S x (2h + 1) bytes. None: rows hold as many as fit, cuDNN holds "
            "4 a row (lean) and a batch with a row of more runs blockwise attention"
        ),
    )
    overflow: Literal["truncate", "error"] = "truncate"
    skip_bad: bool = False
    shuffle_seed: int = Field(0, ge=0, le=MAX_SEED)
    columns: tuple[tuple[Literal[COLUMN_KEYS], str], ...] = Field(  # type: ignore[valid-type]
        (), description="featherweight field -> the dataset's column, e.g. {output: answer}"
    )
    chat_template: str | None = Field(
        None, description="a Jinja file, or a built-in name (chatml, llama3, zephyr)"
    )
    instruction_template: InstructionTemplateSettings | None = Field(
        None,
        description=(
            "instruction records as plain prompts (default without a chat template: "
            "### Instruction / ### Input / ### Response)"
        ),
    )

    @field_validator("columns", mode="before")
    @classmethod
    def _columns_as_pairs(cls, columns: Any) -> Any:
        """Written as a mapping; held as sorted pairs, so the frozen settings stay hashable."""
        return tuple(sorted(columns.items())) if isinstance(columns, dict) else columns

    @field_serializer("columns")
    def _columns_as_mapping(self, columns: tuple[tuple[str, str], ...]) -> dict[str, str]:
        return dict(columns)


class OptimizerSettings(_Section):
    """An optax optimizer and learning-rate schedule."""

    name: Literal["adamw", "adamw_8bit", "sgd", "lion", "adafactor"] = "adamw"
    learning_rate: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    clip_norm: float | None = Field(
        None, gt=0, description="clip gradients to this norm (how: optimizer.clipping)"
    )
    clipping: Literal["global", "two_pass", "per_tensor"] = Field(
        "global",
        description=(
            "global: the whole gradient's norm (LoRA/QLoRA streamed: adapters' gradient kept; "
            "reference step; accumulation); two_pass: global for full fine-tuning with the "
            "streamed step, a norm-only backward pass first; per_tensor: each tensor alone"
        ),
    )


class MemorySettings(_Section):
    """Memory policy and budget (see `featherweight plan`)."""

    budget: str | None = Field(
        None,
        description=(
            "e.g. '8GiB', or 'device' (all the device's usable memory); the planner picks "
            "settings that fit, and spends the room left on speed (kept activations)"
        ),
    )
    residuals: Literal["device", "host"] = "device"
    loss_chunk: int | Literal["auto"] | None = Field(
        AUTO,
        description=(
            "sequence chunk of LM head + loss, in tokens; auto: chosen from the shapes; null: "
            "the whole sequence"
        ),
    )
    vocab_chunk: int | Literal["auto"] | None = Field(
        AUTO,
        description=(
            "vocabulary chunk of the LM head (rows of the head at a time); auto: chosen from "
            "the shapes; null: the whole vocabulary"
        ),
    )
    mlp_chunk: int | Literal["auto"] | None = Field(
        AUTO,
        description=(
            "sequence chunk of each block's MLP (long context), in tokens; auto: chosen from "
            "the shapes; null: the whole sequence"
        ),
    )
    optimizer_state: Literal["device", "host"] = Field(
        "device", description="host: each layer's state comes over for its update only"
    )
    embed: Literal["device", "host"] = Field(
        "device",
        description=(
            "host: the embedding table stays in pinned host memory and streams over in row "
            "chunks (frozen: the rows a batch uses are picked from them; full fine-tuning: "
            "updated chunk by chunk)"
        ),
    )
    base: Literal["device", "host"] = Field(
        "device",
        description=(
            "host: the frozen layer stack (LoRA/QLoRA) stays in pinned host memory and each "
            "layer comes to the device one layer ahead, forward and backward: two layers of "
            "the base on the device instead of all of them, the stack moved twice per step"
        ),
    )
    attention: Literal["auto", "blockwise", "cudnn", "pallas", "materialized"] = Field(
        "auto",
        description=(
            "the attention the step calls: blockwise (tiled, no S x S scores, every backend), "
            "cudnn (cuDNN's fused kernel, NVIDIA GPUs; packed rows on Hopper and later), pallas "
            "(jax's Triton flash kernel, NVIDIA GPUs), materialized (XLA: S x S scores); auto: "
            "cudnn where it masks the run's rows exactly on its target, blockwise otherwise"
        ),
    )
    save: tuple[str, ...] = Field(
        (),
        description=(
            "what the forward pass keeps for the backward pass instead of recomputing it: qkv, "
            "attention, mlp_hidden (the block's activations), dequantized (QLoRA: the layer's "
            "NF4 weights kept dense for the backward pass, which then dequantizes nothing; pays "
            "only against many MLP chunks); empty: recompute all"
        ),
    )
    step: Literal["streamed", "reference"] = Field(
        "streamed", description="fused-update or jax.grad step"
    )
    accumulation_steps: int = Field(
        1,
        ge=1,
        description=(
            "split each batch of batch_size rows into this many micro-batches, gradients summed "
            "before one update: same training, one micro-batch's activations"
        ),
    )
    rollout_chunk: int | None = Field(
        None,
        gt=0,
        description=(
            "objective: grpo: completions sampled together (a divisor of grpo.num_generations); "
            "each holds its KV cache and logits in the rollout phase; null: a prompt's whole group"
        ),
    )

    @field_validator(*CHOSEN_FROM_SHAPES, mode="before")
    @classmethod
    def _chunk(cls, value: Any) -> Any:
        """A positive whole number, "auto" or null; one message for any other value."""
        if value is None or value == AUTO:
            return value
        refuse_yes_no_number(value, int)
        whole = isinstance(value, float) and value.is_integer()
        if (whole or (isinstance(value, int) and not isinstance(value, bool))) and value > 0:
            return int(value)
        raise ValueError(
            "must be a positive whole number, auto (chosen from the shapes) or null (whole)"
        )

    @field_validator("attention", mode="before")
    @classmethod
    def _flash_is_gone(cls, value: Any) -> Any:
        if value == "flash":
            raise ValueError(
                "'flash' is gone (it only changed the plan); use blockwise (tiled attention on "
                "every backend), cudnn (NVIDIA GPUs) or auto"
            )
        return value

    @field_validator("save")
    @classmethod
    def _saveable(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Known classes of intermediates only, refused before anything is planned."""
        unknown = [name for name in value if name not in SAVEABLE]
        if unknown:
            raise ValueError(
                f"cannot save intermediate(s) {unknown}: known names are {list(SAVEABLE)}"
            )
        return value

    @property
    def unresolved(self) -> tuple[str, ...]:
        """The settings still "auto" that the shapes choose (`CHOSEN_FROM_SHAPES`)."""
        return tuple(name for name in CHOSEN_FROM_SHAPES if getattr(self, name) == AUTO)

    @property
    def policy(self) -> MemoryPolicy:
        """The streamed step's runtime form of these settings: the fields both share, by name.

        `attention` and `packed_slots` are left at the policy's defaults here: "auto" depends on
        the target and the slots on `data`, so the step builder sets them
        (`recipe.build.attention_implementation`, `recipe.build.packed_slots`)."""
        if self.unresolved:
            raise ConfigError(_unresolved_message("the step's memory policy", self.unresolved))
        shared = {field.name for field in dataclasses.fields(MemoryPolicy)} - {
            "attention",
            "packed_slots",
        }
        return MemoryPolicy(**{name: getattr(self, name) for name in shared})


class DpoSettings(_Section):
    """Direct preference optimization (objective: dpo): TRL's DPOTrainer formulas."""

    beta: float = Field(0.1, gt=0, description="strength of the pull toward the reference model")
    loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid: DPO (Rafailov et al.); ipo: IPO (Azar et al.)"
    )
    reference: Literal["auto", "same_step", "precomputed"] = Field(
        AUTO,
        description=(
            "the reference model's log-probs: same_step (the frozen base with the adapters off, "
            "one more forward pass per step, no memory kept), precomputed (one forward pass over "
            "the data before training, 4 B per token stored with it; the only way for method: "
            "full, which has no frozen copy); auto: same_step for lora/qlora, precomputed for full"
        ),
    )


class OrpoSettings(_Section):
    """Odds ratio preference optimization (objective: orpo, Hong et al.): no reference model."""

    beta: float = Field(0.1, gt=0, description="weight of the odds-ratio term beside the NLL")


class GrpoSettings(_Section):
    """Group relative policy optimization (objective: grpo): TRL's GRPOConfig names and defaults.

    Each step samples `num_generations` completions of `batch_size / num_generations` prompts
    with the adapters being trained, scores them with the reward functions, and trains on the
    group-normalised advantages (`step/grpo.py`)."""

    rewards: tuple[str, ...] = Field(
        (),
        description=(
            "reward functions with TRL's signature f(prompts, completions, **columns): "
            "'file.py:function' (from the config's folder) or 'module:function'"
        ),
    )
    reward_weights: tuple[float, ...] | None = Field(
        None, description="one weight per reward (null: 1 each)"
    )
    num_generations: int = Field(8, ge=2, description="completions sampled per prompt")
    max_completion_length: int = Field(256, ge=1, description="tokens per completion at most")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1: every token)")
    beta: float = Field(0.0, ge=0, description="KL coefficient (0: no reference model)")
    epsilon: float = Field(0.2, ge=0, lt=1, description="lower clip range of the ratio")
    epsilon_high: float | None = Field(
        None, ge=0, description="upper clip range (null: epsilon; DAPO: 0.28)"
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the group's or the batch's std, or not"
    )
    log_completions_every: int = Field(
        10, ge=0, description="steps between sample completions printed and logged (0: never)"
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_booleans(cls, value: Any) -> Any:
        """TRL's older spelling: true is "group", false is "none"."""
        return (
            {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value
        )

    @model_validator(mode="after")
    def _one_weight_per_reward(self) -> GrpoSettings:
        weights = self.reward_weights
        if weights is not None and len(weights) != len(self.rewards):
            raise ValueError(
                f"reward_weights has {len(weights)} weights for {len(self.rewards)} rewards; "
                "give one weight per reward"
            )
        return self

    @property
    def objective(self) -> GrpoObjective:
        """The step's loss settings."""
        return GrpoObjective(
            self.beta, self.epsilon, self.epsilon_high, self.loss_type,
            self.max_completion_length, self.temperature,
        )  # fmt: skip


class MoeSettings(_Section):
    """Mixture-of-experts training (Qwen3-MoE, Mixtral, gpt-oss)."""

    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description=(
            "weight of the router's load-balancing loss beside the task loss (transformers' "
            "aux loss, logged as aux_loss); 0: off; null: the model's router_aux_loss_coef when "
            "its config.json sets output_router_logits: true (transformers' default: off)"
        ),
    )


class CheckpointSettings(_Section):
    """When to save, and how many to keep."""

    every_steps: int = Field(50, gt=0)
    keep: int = Field(2, gt=0)


class TrainConfig(_Section):
    """A whole fine-tuning run."""

    model: ModelSettings = ModelSettings()
    method: Method = "qlora"
    # each objective is one module of recipe/objectives/ (its line in OBJECTIVES)
    objective: Literal["sft", "dpo", "orpo", "grpo"] = Field(
        "sft",
        description=(
            "sft: next-token cross-entropy on the targets; dpo, orpo: preference pairs "
            "({prompt, chosen, rejected} records); grpo: prompts ({prompt, other columns} "
            "records) answered by the model and scored by grpo.rewards"
        ),
    )
    dpo: DpoSettings = DpoSettings()
    orpo: OrpoSettings = OrpoSettings()
    grpo: GrpoSettings = GrpoSettings()
    lora: LoraConfig = LoraConfig()
    data: DataSettings = DataSettings()
    optimizer: OptimizerSettings = OptimizerSettings()
    memory: MemorySettings = MemorySettings()
    moe: MoeSettings = MoeSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()
    mesh: MeshSettings | None = Field(
        None, description="null: one device (several processes: 'auto'); 'auto' or {data, fsdp}"
    )
    batch_size: int = Field(4, gt=0)
    steps: int = Field(100, gt=0)
    epochs: float | None = Field(
        None, gt=0, description="when set, steps = epochs x steps per epoch (rounded up)"
    )
    eval_every: int = Field(0, ge=0, description="0: evaluate only at the end")
    eval_batches: int = Field(4, gt=0)
    log_every: int = Field(1, gt=0, description="steps between host syncs and progress lines")
    report_to: tuple[Literal["tensorboard", "wandb"], ...] = Field(
        (), description="loggers besides metrics.jsonl: tensorboard (event files), wandb"
    )
    seed: int = Field(0, ge=0, le=MAX_SEED)
    output_dir: str = "runs/run"

    @field_validator("mesh", mode="before")
    @classmethod
    def _auto_mesh(cls, mesh: Any) -> Any:
        return {} if mesh == "auto" else mesh

    @model_validator(mode="after")
    def _resolve_reference(self) -> TrainConfig:
        """dpo.reference "auto", resolved once from the method (what the run records): the
        frozen base serves as the reference in the same step, except in full fine-tuning."""
        if self.dpo.reference == AUTO:
            reference = "precomputed" if self.method == "full" else "same_step"
            dpo = self.dpo.model_copy(update={"reference": reference})
            object.__setattr__(self, "dpo", dpo)
        return self

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_numbers_are_not_yes_no(cls, lora: Any) -> Any:
        if isinstance(lora, dict):
            fields = typing.get_type_hints(LoraConfig)  # Annotated[int, Field(...)] -> int
            for name, value in lora.items():
                try:
                    refuse_yes_no_number(value, fields.get(name))
                except ValueError as error:
                    raise ValueError(f"lora.{name}: {error}") from None
        return lora


def _unresolved_message(needs: str, fields: tuple[str, ...]) -> str:
    names = ", ".join(f"memory.{name}" for name in fields)
    return (
        f"{needs} needs a resolved config, but {names} is still auto; resolve it first with "
        "featherweight.resolve(config, model_config) (memory/defaults.py), which chooses it "
        "from the shapes as train and plan do, or set a number (null: whole)"
    )


def require_resolved(config: TrainConfig, needs: str) -> None:
    """Refuse a config with a setting still "auto" (`ConfigError`): what builds or plans a step
    takes the one `resolve` has chosen, never a default of its own."""
    if config.memory.unresolved:
        raise ConfigError(_unresolved_message(needs, config.memory.unresolved))


def take_saved_choices(config: TrainConfig, saved: TrainConfig) -> TrainConfig:
    """`config` with each setting it leaves "auto" taken from `saved`, a run's recorded (resolved)
    config: resuming that run keeps what was chosen for it, whatever `resolve` would choose now."""
    chosen = {name: getattr(saved.memory, name) for name in config.memory.unresolved}
    return config.model_copy(update={"memory": config.memory.model_copy(update=chosen)})


MAX_ERRORS = 5  # problems named in one message
# where a missing config file's message points: commented configs that exist in the repository
CONFIG_HINT = (
    "pass a YAML file; examples/ holds one per common job (examples/lora-csv-qa.yaml runs as it "
    "is), README.md's 'A training config' explains each key"
)
# keys other trainers spell differently: (their name) -> ours, suggested for an unknown key
OTHER_SPELLINGS = {
    "gradient_accumulation_steps": "memory.accumulation_steps",
    "grad_accum": "memory.accumulation_steps",
    "max_grad_norm": "optimizer.clip_norm",
    "clip_grad_norm": "optimizer.clip_norm",
}
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4
_SHORT.maxstring = _SHORT.maxother = 60


def _allowed_keys(model: type[BaseModel], location: tuple) -> list[str]:
    """The field names valid at `location` (a pydantic error location) inside `model`."""
    current: Any = model
    for part in location[:-1]:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        # an optional section (`MeshSettings | None`) names its model among the union's members
        members = (typing.get_args(field.annotation) or (field.annotation,)) if field else ()
        sections = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        if not sections:
            return []
        current = sections[0]
    return list(current.model_fields)


def _key_lines(text: str) -> dict[str, str]:
    """Where every (dotted) key of a YAML mapping is written ("line 4"), for error messages.

    Each node is walked once: an aliased node (`*name`) is not entered again, so a document of
    nested aliases ("billion laughs") costs time linear in its size, not in its expansion. A key
    written twice in one mapping is refused (YAML would keep the last one without a word).
    """
    lines: dict[str, str] = {}
    seen: set[int] = set()

    def walk(node, prefix: str) -> None:
        if id(node) in seen or not isinstance(node, yaml.MappingNode):
            return
        seen.add(id(node))
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":
                if key_node.value in first:
                    raise ConfigError(
                        f"key {prefix + key_node.value!r} is written twice (lines "
                        f"{first[key_node.value]} and {line}); keep one of them"
                    )
                first[key_node.value] = line
            dotted = f"{prefix}{key_node.value}"
            lines.setdefault(dotted, f"line {line}")
            walk(value_node, dotted + ".")

    with contextlib.suppress(yaml.YAMLError):
        walk(yaml.compose(text), "")
    return lines


def _format_errors(error: ValidationError, source: str, key_lines: dict[str, str]) -> str:
    lines = []
    for item in error.errors():
        location = tuple(item["loc"])
        dotted = ".".join(str(part) for part in location)
        where = next(
            (
                f" ({key_lines[key]})"
                for key in (dotted, dotted.rsplit(".", 1)[0])
                if key in key_lines
            ),
            "",
        )
        if item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            allowed = _allowed_keys(TrainConfig, location)
            close = difflib.get_close_matches(str(location[-1]), allowed, n=1)
            if str(location[-1]) in OTHER_SPELLINGS:
                close = [OTHER_SPELLINGS[str(location[-1])]]
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(allowed)}"
            lines.append(f"unknown key {dotted!r}{where} ({hint})")
        else:
            shown = _SHORT.repr(item.get("input"))  # bounded, whatever the input's size
            lines.append(f"{dotted}{where}: {item['msg']} (got {shown})")
    more = f"; and {len(lines) - MAX_ERRORS} more" if len(lines) > MAX_ERRORS else ""
    return f"{source}: invalid config: " + "; ".join(lines[:MAX_ERRORS]) + more


def parse_config(
    values: dict[str, Any], source: str = "config", key_lines: dict[str, str] | None = None
) -> TrainConfig:
    """Validate a dict into a `TrainConfig`, or raise `ConfigError` naming every bad field."""
    try:
        return TrainConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(_format_errors(error, source, key_lines or {})) from None


def _set_dotted(values: dict[str, Any], dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(
            f"--set {dotted}={raw}: the key {dotted!r} has an empty part; write key.sub=value, "
            "e.g. --set optimizer.learning_rate=1e-4"
        )
    node = values
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
        node = child
    try:
        node[keys[-1]] = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as error:
        problem = " ".join(str(getattr(error, "problem", None) or error).split())
        raise ConfigError(
            f"--set {dotted}={raw}: the value is not valid YAML ({problem}); quote it "
            f"(--set '{dotted}=\"...\"') or fix the brackets"
        ) from None


def _split_override(override: str) -> tuple[str, str]:
    if "=" not in override:
        raise ConfigError(f"--set {override!r} must look like key.sub=value, e.g. --set steps=200")
    dotted, raw = override.split("=", 1)
    return dotted.strip(), raw.strip()


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides (values parsed as YAML scalars/lists)."""
    for override in overrides:
        _set_dotted(values, *_split_override(override))
    return values


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (None: all defaults), apply overrides, validate.

    Relative paths in the file are read from its folder, those of overrides from the working
    directory (`recipe/paths.py`); an error names the file's line, or the override, it is in."""
    values: dict[str, Any] = {}
    source, key_lines = "config", {}
    overrides = overrides or []
    overridden = {_split_override(override)[0]: override for override in overrides}
    if path is not None:
        path = Path(path)
        source = str(path)
        check_input_file(path, "config file", CONFIG_HINT, ConfigError)
        text = read_input_text(path, "config file")
        try:
            key_lines = _key_lines(text)
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from None
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None
        if loaded is None:  # not a run of every default on the demo data without a word
            raise ConfigError(f"{path} holds no settings (it is empty); {CONFIG_HINT}")
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path} must hold a mapping of settings, found {type(loaded).__name__}"
            )
        line_of = lambda key: f" ({key_lines[key]})" if key in key_lines else ""
        values = from_config_folder(loaded, path, set(overridden), line_of)
        values = reward_files_from(values, path.resolve().parent, set(overridden))
    key_lines.update({key: f"--set {override}" for key, override in overridden.items()})
    values = apply_overrides(values, overrides)
    _refuse_steps_with_epochs(values, source, key_lines)
    return parse_config(values, source, key_lines)


def _refuse_steps_with_epochs(values: dict[str, Any], source: str, key_lines: dict[str, str]):
    """`steps` and `epochs` both written: one would be ignored without a word (epochs decides)."""
    if values.get("steps") is not None and values.get("epochs") is not None:
        where = lambda key: f" ({key_lines[key]})" if key in key_lines else ""
        raise ConfigError(
            f"{source}: steps{where('steps')} and epochs{where('epochs')} are both set, and a run "
            "trains epochs x steps per epoch when epochs is set; keep one of them (--set "
            "epochs=null trains the steps)"
        )


def _flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(values, dict):
        return {prefix: values}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def changed_settings(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The settings that differ between two config dumps, as `key: old -> new` (at most
    MAX_ERRORS of them, then a count): what a refused resume names."""
    before, after = _flatten(old), _flatten(new)
    keys = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    shown = [
        f"{key.rstrip('.')}: {_SHORT.repr(before.get(key))} -> {_SHORT.repr(after.get(key))}"
        for key in keys[:MAX_ERRORS]
    ]
    more = f"; and {len(keys) - MAX_ERRORS} more" if len(keys) > MAX_ERRORS else ""
    return "; ".join(shown) + more
