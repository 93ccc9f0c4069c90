"""Every figure the README quotes from a `featherweight plan` command is that command's output
today: the test runs each command as the README writes it and reads its numbers back."""

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.parallel.backend import cuda_plugin_installed

README = Path(__file__).resolve().parent.parent / "README.md"
GIB = 2**30


def readme_row(label: str) -> str:
    """The result cell of the README's results row that starts with `label`."""
    for line in README.read_text().splitlines():
        if line.startswith(f"| {label}"):
            return line.split(" | ")[1]
    raise AssertionError(f"no README row starts with {label!r}")


def readme_command(prefix: str) -> list[str]:
    """The arguments of the README's command that starts with `featherweight <prefix>`."""
    found = re.search(rf"featherweight ({re.escape(prefix)}[^`\n]*)", README.read_text())
    assert found, f"the README shows no command featherweight {prefix}"
    return shlex.split(found.group(1))


def gib(text: str, what: str) -> float:
    return float(re.search(rf"([\d.]+) GiB {what}", text).group(1))


def plan_json(arguments: list[str]) -> dict:
    arguments = [a for a in arguments if a != "--no-measure"]
    result = CliRunner().invoke(app, [*arguments, "--json", "--no-measure"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_70b_row_is_what_its_command_plans():
    command = readme_command("plan Llama-3.1-70B")
    assert "--no-measure" in command  # as the README shows it: planned, not compiled
    report = plan_json(command)
    row = readme_row("Llama-3.1-70B QLoRA, 4096 tokens, RTX 4090 budget 16 GiB")
    assert gib(row, "device") == round(report["planned_device_bytes"] / GIB, 2)
    assert gib(row, "host") == round(report["planned_host_bytes"] / GIB, 2)


BUDGET_ROW = "Llama-3.1-8B QLoRA b2 x 2048 at `--budget 5.5GiB`'s settings"


def test_the_8b_budget_row_is_what_its_command_plans():
    command = readme_command("plan Llama-3.1-8B --method qlora --batch 2 --seq 2048 --budget")
    report = plan_json(command)
    assert gib(readme_row(BUDGET_ROW), "planned") == round(report["planned_device_bytes"] / GIB, 2)


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_installed(), reason="XLA's GPU compiler is not installed")
def test_the_8b_budget_row_is_what_its_command_compiles():
    command = readme_command("plan Llama-3.1-8B --method qlora --batch 2 --seq 2048 --budget")
    result = CliRunner().invoke(app, [*command, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    compiled = gib(readme_row(BUDGET_ROW), "compiled")
    assert report["measured_target"] == "h100"
    assert compiled == round(report["measured_device_bytes"] / GIB, 2)


def test_the_gpu_pages_host_base_rows_are_what_plan_says():
    """docs/gpus.md's table of the frozen base on the host: each row's planned device and host
    bytes are `plan MODEL --method qlora --batch 1 --seq N --budget B --target rtx4090`'s."""
    text = (README.parent / "docs" / "gpus.md").read_text()
    rows = re.findall(
        r"\| (Llama-3\.1-\w+), (\d+) tokens, budget (\d+) GiB \| ([\d.]+) GiB \| ([\d.]+) GiB", text
    )
    assert len(rows) == 2
    for model, seq, budget, device, host in rows:
        report = plan_json(["plan", model, "--method", "qlora", "--batch", "1", "--seq", seq,
                            "--budget", f"{budget}GiB", "--target", "rtx4090"])  # fmt: skip
        assert float(device) == round(report["planned_device_bytes"] / GIB, 2)
        assert float(host) == round(report["planned_host_bytes"] / GIB, 2)
