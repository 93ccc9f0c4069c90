"""From settings to a run's pieces: optimizer schedules, the trainable/frozen split, and the
abstract split the planner compiles matching the real one."""

import jax
import numpy as np
import optax
import pytest

from featherweight.errors import AdapterConfigError, ConfigError
from featherweight.models.init import init_params
from featherweight.quant.nf4 import NF4Tensor
from featherweight.recipe.build import (
    abstract_split,
    check_method_settings,
    router_aux_loss_coef,
    split_params,
)
from featherweight.recipe.optimizer import learning_rate_schedule, make_optimizer
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config
from tests.tiny_families import tiny_family


def test_schedules_warm_up_and_decay():
    settings = parse_config(
        {"optimizer": {"learning_rate": 1.0, "warmup_steps": 10, "schedule": "cosine"}}
    ).optimizer
    schedule = learning_rate_schedule(settings, total_steps=110)
    assert float(schedule(0)) == 0.0
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(60)) == pytest.approx(0.5, abs=1e-6)
    assert float(schedule(110)) == pytest.approx(0.0, abs=1e-6)
    linear = parse_config({"optimizer": {"learning_rate": 1.0, "schedule": "linear"}}).optimizer
    assert float(learning_rate_schedule(linear, 100)(50)) == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion", "adafactor"])
def test_every_named_optimizer_updates(name):
    settings = parse_config({"optimizer": {"name": name, "clip_norm": 1.0}}).optimizer
    optimizer = make_optimizer(settings, 10)
    params = {"w": np.ones((4, 4), np.float32)}
    updates, _ = optimizer.update(
        {"w": np.ones((4, 4), np.float32)}, optimizer.init(params), params
    )
    assert float(np.abs(updates["w"]).sum()) > 0


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_abstract_split_matches_the_real_split(method):
    config = parse_config({"method": method, "model": {"dtype": "float32"}})
    model_config = tiny_config()
    params = init_params(jax.random.PRNGKey(0), model_config)
    real = split_params(params, config, model_config, jax.random.PRNGKey(1))
    abstract = abstract_split(config, model_config)
    shapes = lambda tree: jax.tree.map(lambda leaf: (tuple(leaf.shape), str(leaf.dtype)), tree)
    assert shapes(real) == shapes(abstract)
    if method == "qlora":
        assert isinstance(real[1]["layers"]["gate"], NF4Tensor)
    if method != "full":
        assert set(real[0]) == {"layers"} and set(real[0]["layers"]) == {"lora"}


def test_refusals_before_any_weights():
    model_config = tiny_config()
    with pytest.raises(ConfigError, match="quantize_head"):
        check_method_settings(
            parse_config({"method": "lora", "model": {"quantize_head": True}}), model_config
        )
    check_method_settings(parse_config({"memory": {"accumulation_steps": 4}}), model_config)
    with pytest.raises(ConfigError, match="multiple of 3"):
        check_method_settings(parse_config({"memory": {"accumulation_steps": 3}}), model_config)
    with pytest.raises(AdapterConfigError, match="rank"):
        check_method_settings(parse_config({"lora": {"rank": 4096}}), model_config)
    assert isinstance(make_optimizer(parse_config({}).optimizer, 5), optax.GradientTransformation)
    pairs = {"objective": "dpo", "data": {"max_documents_per_row": 1}}
    with pytest.raises(ConfigError, match="max_documents_per_row=1 cannot hold a preference"):
        check_method_settings(parse_config(pairs), model_config)
    check_method_settings(
        parse_config({**pairs, "data": {"max_documents_per_row": 2}}), model_config
    )


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"method": "full"}, "choose optimizer.clipping: two_pass .* per_tensor .* reference"),
        (
            {"method": "lora", "optimizer": {"clipping": "two_pass"}},
            "use optimizer.clipping: global",
        ),
        ({"memory": {"step": "reference"}, "optimizer": {"clipping": "per_tensor"}}, "global"),
    ],
)
def test_clipping_the_step_cannot_do_exactly_is_refused(settings, expected):
    settings = {**settings, "optimizer": {"clip_norm": 1.0, **settings.get("optimizer", {})}}
    with pytest.raises(ConfigError, match=expected):
        check_method_settings(parse_config(settings), tiny_config())


@pytest.mark.parametrize(
    "settings",
    [
        {"method": "full", "optimizer": {"clipping": "two_pass"}},
        {"method": "full", "memory": {"accumulation_steps": 2}},
        {"method": "full", "optimizer": {"clipping": "per_tensor"}},
        {"method": "qlora"},
        {"memory": {"step": "reference", "accumulation_steps": 2}},
    ],
)
def test_clipping_each_step_does_exactly_is_accepted(settings):
    settings = {**settings, "optimizer": {"clip_norm": 1.0, **settings.get("optimizer", {})}}
    check_method_settings(parse_config(settings), tiny_config())


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"method": "full"}, "method: full has none .* lora or qlora, or memory.base: device"),
        ({"memory": {"step": "reference"}}, "needs the streamed step"),
        ({"mesh": {"data": 1, "fsdp": 8}}, "one device only; .* drop the host placement"),
    ],
)
def test_a_base_on_the_host_that_cannot_work_is_refused(settings, expected):
    """memory.base: host needs a frozen base and the streamed step on one device: on a mesh it
    is refused (FSDP divides the base over the devices instead), naming the alternatives."""
    memory = {"base": "host", **settings.get("memory", {})}
    with pytest.raises(ConfigError, match=expected):
        check_method_settings(parse_config({**settings, "memory": memory}), tiny_config())


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_base_on_the_host_is_accepted_for_adapters(method):
    check_method_settings(
        parse_config({"method": method, "memory": {"base": "host"}}), tiny_config()
    )


@pytest.mark.parametrize("step", ["streamed", "reference"])
@pytest.mark.parametrize(("most", "slots"), [(None, 4), (6, 6)])
def test_cudnn_packed_attention_holds_the_packers_limit(monkeypatch, step, most, slots):
    """Every layer's cuDNN packed attention gets `data.max_documents_per_row` slots (4 without
    one), in both steps: traced with the dispatch recorded (cuDNN itself needs a GPU)."""
    from featherweight.memory.measure import abstract_step_arguments
    from featherweight.models import attention as attention_module
    from featherweight.recipe import build

    seen = []

    def recorded(q, k, v, segments, fused, fallback, slots):
        seen.append(slots)
        return fallback(q, k, v, segments)

    monkeypatch.setattr(attention_module, "packed_or_fallback", recorded)
    monkeypatch.setattr(build, "attention_implementation", lambda *args, **kwargs: "cudnn")
    settings = {"model": {"dtype": "float32"}, "memory": {"step": step}}
    config = parse_config({**settings, "data": {"seq_len": 32, "max_documents_per_row": most}})
    jitted, arguments = abstract_step_arguments(config, tiny_config())
    jitted.trace(*arguments)
    assert seen and set(seen) == {slots}


@pytest.mark.parametrize(
    ("setting", "output_router_logits", "expected"),
    [(None, False, 0.0), (None, True, 0.001), (0.0, True, 0.0), (0.3, False, 0.3)],
)
def test_the_router_loss_weight_follows_the_setting_then_the_model(
    setting, output_router_logits, expected
):
    """null: the model's coefficient only when its config.json turns the loss on (transformers'
    `output_router_logits`, off by default); a number: that weight (0: off)."""
    model_config = tiny_family(
        "qwen3_moe", router_aux_loss_coef=0.001, output_router_logits=output_router_logits
    )
    config = parse_config({"moe": {"router_aux_loss_coef": setting}})
    assert router_aux_loss_coef(config, model_config) == expected


def test_the_router_loss_is_refused_for_a_dense_model():
    config = parse_config({"moe": {"router_aux_loss_coef": 0.01}})
    with pytest.raises(ConfigError, match="dense model with no router"):
        check_method_settings(config, tiny_config())
