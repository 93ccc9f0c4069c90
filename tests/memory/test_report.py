"""The plan as a table, a JSON object and a chart; the `featherweight plan` command."""

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import plan_table, plot_plan, report_json
from featherweight.recipe.schema import parse_config
from tests.conftest import tiny_config

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_run():
    """(plan, measurement) of a tiny LoRA step with residuals on host: one compile."""
    config = parse_config(
        {
            "method": "lora",
            "batch_size": 2,
            "model": {"dtype": "float32"},
            "data": {"seq_len": 32},
            "memory": {"residuals": "host"},
        }
    )
    model = tiny_config()
    return plan_for_config(config, model), measure_compiled(config, model)


def test_table_lists_every_component_the_total_and_the_lower_bound(tiny_run):
    plan, measured = tiny_run
    console = Console(width=200, record=True)
    console.print(plan_table(plan, measured))
    text = console.export_text()
    for component in plan.components:
        assert component.name in text
    for label in ("temporaries", "total", "lower bound", "host (offloaded)", "measured", "diff"):
        assert label in text


def test_json_has_what_scripts_rely_on(tiny_run):
    plan, measured = tiny_run
    report = json.loads(json.dumps(report_json(plan, measured, ["batch_size: 4 -> 2"])))
    assert report["planned"] == {c.name: c.bytes for c in plan.components}
    assert report["measured"] == measured.components
    assert report["planned_device_bytes"] == plan.device_bytes
    assert report["planned_host_bytes"] == plan.host_bytes
    assert report["planned_total_bytes"] == plan.device_bytes + plan.host_bytes
    assert report["measured_total_bytes"] == measured.total_bytes
    assert report["measured_platform"] == "cpu" and report["measured_derived"] == []
    assert report["planned_comparable_total_bytes"] == plan.device_bytes + plan.host_bytes
    assert report["settings"]["residuals"] == "host"
    assert report["changes"] == ["batch_size: 4 -> 2"]
    assert any("one memory" in note for note in report["notes"])


def test_plot_writes_a_png(tiny_run, tmp_path):
    plan, measured = tiny_run
    path = plot_plan(plan, measured, tmp_path / "plan.png", budget_bytes=plan.device_bytes)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def config_dir(tmp_path):
    """A model directory with only a config.json (no weights)."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    return tmp_path


def test_cli_plans_a_config_only_directory_as_json(config_dir):
    result = runner.invoke(
        app, ["plan", str(config_dir), "--method", "full", "--batch", "2", "--seq", "64",
              "--no-measure", "--json", "--budget", "1GiB"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["measured"] is None
    assert report["planned_device_bytes"] == sum(
        report["planned"][name] for name, where in report["placement"].items() if where == "device"
    )
    assert report["settings"]["method"] == "full"


def test_cli_measures_and_plots(config_dir, tmp_path):
    plot = tmp_path / "bars.png"
    result = runner.invoke(
        app, ["plan", str(config_dir), "--method", "qlora", "--batch", "1", "--seq", "32",
              "--dtype", "float32", "--offload", "residuals", "--plot", str(plot)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "lower bound" in result.output and "temporaries" in result.output
    assert plot.is_file()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--budget", "eight"], "budget 'eight'"),
        (["--batch", "0"], "batch_size"),
        (["--seq", "0"], "seq_len"),
        (["--seq", "100000"], "max_position_embeddings"),
        (["--offload", "weights"], "--offload"),
        (["--method", "dora"], "method"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(config_dir, arguments, message):
    result = runner.invoke(app, ["plan", str(config_dir), "--no-measure", *arguments])
    assert result.exit_code == 2
    assert message in result.output
    assert result.output.strip().startswith("error:")


def test_cli_unknown_model_lists_the_builtins():
    result = runner.invoke(app, ["plan", "Llama-9B", "--no-measure"])
    assert result.exit_code == 2
    assert "SmolLM2-135M" in result.output and "Llama-3.1-8B" in result.output
