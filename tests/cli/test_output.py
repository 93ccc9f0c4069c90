"""What the command line prints off a terminal (a log, a pipe, CI): lines are not wrapped at 80
columns, so a path or the plan's table stays whole."""

import io

from typer.testing import CliRunner

from featherweight.cli import output
from featherweight.cli.main import app


def test_off_a_terminal_long_lines_stay_whole(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    console = output._console()
    line = "metrics: " + "/very/long/path" * 12 + "/metrics.jsonl"
    console.print(line, highlight=False)
    assert console.file.getvalue().splitlines() == [line]


def test_the_plan_table_is_not_wrapped_in_a_log():
    result = CliRunner().invoke(app, ["plan", "SmolLM2-135M", "--no-measure"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(
        line.startswith("settings: method=qlora") and "calibration=" in line for line in lines
    )
    assert any("linear weights NF4 (~0.52 B/value), the rest x 2 B" in line for line in lines)


def test_the_training_logs_memory_table_fits_100_columns_and_verbose_adds_formulas(tmp_path):
    """`train` (here its --dry-run, the same table) prints the plan without its formulas column;
    `--verbose` adds it. Before, the training log's table was 180 columns wide."""
    out = str(tmp_path / "run")
    arguments = ["train", "--dry-run", "--set", f"output_dir={out}"]
    plain = CliRunner().invoke(app, arguments)
    assert plain.exit_code == 0, plain.output
    table = [line for line in plain.output.splitlines() if line[:1] in "┏┃┡│├└"]
    assert len(table) > 5 and max(len(line) for line in table) <= 100
    assert "formula" not in plain.output
    verbose = CliRunner().invoke(app, [*arguments, "--verbose"])
    assert verbose.exit_code == 0, verbose.output
    assert "formula" in verbose.output and "L x B x S x D" in verbose.output
