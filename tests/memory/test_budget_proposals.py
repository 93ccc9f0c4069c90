"""The budget search never proposes a configuration the config validation refuses: over models x
methods x optimizers x budgets, every proposal validates (or nothing fits: `BudgetError`)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featherweight.errors import BudgetError
from featherweight.memory import budget
from featherweight.memory.budget import fit_budget
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.registry import BUILTIN_MODELS, builtin_config
from featherweight.recipe.build import check_method_settings
from featherweight.recipe.schema import TrainConfig, parse_config

MIB = 2**20


def _requested(method: str, optimizer: str, batch: int, seq: int) -> TrainConfig:
    return parse_config(
        {
            "method": method,
            "batch_size": batch,
            "model": {"dtype": "bfloat16"},
            "data": {"seq_len": seq},
            "optimizer": {"name": optimizer},
        }
    )


def _assert_valid(config: TrainConfig, model) -> None:
    check_method_settings(config, model)
    TrainConfig.model_validate(config.model_dump(mode="json"))


@pytest.mark.slow  # 40 budget searches: about a minute
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(BUILTIN_MODELS)),
    method=st.sampled_from(("full", "lora", "qlora")),
    optimizer=st.sampled_from(("adamw", "adamw_8bit", "sgd", "adafactor")),
    batch=st.sampled_from((1, 2, 4)),
    seq=st.sampled_from((512, 2048)),
    budget_mib=st.sampled_from((100, 1024, 4096, 8192, 16384, 24576)),
)
def test_every_proposal_validates(name, method, optimizer, batch, seq, budget_mib):
    model = builtin_config(name)
    try:
        proposed, _ = fit_budget(_requested(method, optimizer, batch, seq), model, budget_mib * MIB)
    except BudgetError:
        return
    _assert_valid(proposed, model)


@pytest.mark.parametrize(
    ("name", "method", "budget_mib"),
    [("Llama-3.1-8B", "full", 8192), ("SmolLM2-135M", "lora", 100)],
)
def test_the_known_refused_proposals_are_gone(name, method, budget_mib):
    # these searches used to pick 8-bit AdamW with embed: host (full), and embed: host with
    # quantize_head on a tied table, and then die on their own choice
    model = builtin_config(name)
    try:
        proposed, _ = fit_budget(_requested(method, "adamw", 2, 2048), model, budget_mib * MIB)
    except BudgetError:
        return
    _assert_valid(proposed, model)


def test_a_refused_candidate_is_skipped_not_planned():
    # negative control: the candidate the old search took is refused by validation
    model = builtin_config("Llama-3.1-8B")
    refused = parse_config(
        {"method": "full", "optimizer": {"name": "adamw_8bit"}, "memory": {"embed": "host"}}
    )
    assert budget._plan_if_valid(refused, model, AttentionTarget("cpu")) is None
    assert (
        budget._plan_if_valid(_requested("full", "adamw", 1, 512), model, AttentionTarget("cpu"))
        is not None
    )
