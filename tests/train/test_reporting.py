"""What a run reports: the data summary (printed and in data_summary.json), `epochs` as steps,
plain progress lines off a TTY every `log_every` steps, strict metrics.jsonl with the learning
rate, TensorBoard events read back with tensorboard's own reader, and the loss plot."""

import io
import json
import re

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from featherweight.errors import ConfigError
from featherweight.recipe.optimizer import learning_rate_schedule
from featherweight.recipe.schema import parse_config
from featherweight.train.dataset import steps_from_epochs, summary_lines
from featherweight.train.loggers import check_loggers, scalars
from featherweight.train.loop import train
from featherweight.train.metrics import loss_figure, read_metrics, smoothed, strict
from featherweight.train.progress import PlainProgress
from tests.conftest import run_settings

LINE = re.compile(
    r"^step (\d+)/(\d+) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| [\d,]+ tok/s \| "
    r"ETA (\d+:\d\d:\d\d|-)$"
)


def strict_json(line: str):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def test_plain_progress_prints_one_line_per_update():
    out = io.StringIO()
    console = Console(file=out, width=200)
    assert not console.is_terminal
    progress = PlainProgress(console, total=10, start_step=0)
    record = {"loss": 2.5, "learning_rate": 1e-4, "tokens_per_second": 1234.5, "device_bytes": None}
    progress.update(5, record)
    (line,) = out.getvalue().splitlines()
    assert LINE.match(line) and line.startswith("step 5/10 | loss 2.5000 | lr 1.00e-04 | 1,234")


def test_steps_from_epochs_rounds_up():
    config = parse_config({"epochs": 2.5, "steps": 3})
    assert steps_from_epochs(config, 7).steps == 18
    assert steps_from_epochs(parse_config({"steps": 3}), 7).steps == 3


def test_metrics_are_strict_json_and_scalars_skip_non_finite():
    record = {"step": 3, "loss": 1.0, "grad_norm": float("nan"), "device_bytes": None}
    assert json.dumps(strict(record), allow_nan=False) == (
        '{"step": 3, "loss": 1.0, "grad_norm": null, "device_bytes": null}'
    )
    assert scalars({**record, "eval_loss": 2.0}) == {"train/loss": 1.0, "eval/loss": 2.0}
    assert smoothed([4.0, 2.0])[0] == 4.0  # debiased: the first point is itself


def test_a_logger_that_is_not_installed_is_refused_before_work(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="report_to: wandb needs the wandb package"):
        check_loggers(["wandb"])


@pytest.mark.slow
def test_a_run_reports_its_data_progress_metrics_and_tensorboard_events(
    tiny_model_dir, demo_data, tmp_path
):
    settings = run_settings(
        tiny_model_dir, demo_data, tmp_path / "run", epochs=1.5, log_every=2, report_to=["tensorboard"]
    )  # fmt: skip
    out = io.StringIO()
    result = train(parse_config(settings), console=Console(file=out, width=200))
    run = result.output_dir
    text = out.getvalue()

    summary = json.loads((run / "data_summary.json").read_text())
    assert summary["records"] == 24 and summary["skipped"] == 0
    assert summary["train"]["examples"] + summary["eval"]["examples"] == 24
    assert summary["steps_per_epoch"] == -(-summary["train"]["rows"] // 2)
    assert result.run.config.steps == summary["steps"] == -(-3 * summary["steps_per_epoch"] // 2)
    assert f"data: 24 records read from {demo_data}" in text
    most = summary["train"]["most_per_row"]  # the most examples a packed row holds
    assert most >= 1 and f"up to {most} a row)" in text
    assert f"steps: {summary['steps']} = {summary['epochs']:g} epochs" in text

    steps = summary["steps"]
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    printed = [int(LINE.match(line).group(1)) for line in lines]
    assert printed == sorted({*range(2, steps + 1, 2), steps})  # every log_every steps + the last

    records = [strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, steps + 1))
    assert all(r["learning_rate"] == pytest.approx(1e-2) for r in train_records)  # constant
    schedule = learning_rate_schedule(result.run.config.optimizer, steps)
    assert float(schedule(0)) == pytest.approx(1e-2)

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = [(event.step, event.value) for event in events.Scalars("train/loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"])) for r in train_records]
    assert [e.step for e in events.Scalars("eval/loss")] == [steps]
    assert [e.value for e in events.Scalars("train/learning_rate")] == pytest.approx([1e-2] * steps)
    assert (run / "loss.png").stat().st_size > 0
    assert read_metrics(run / "metrics.jsonl")[-1]["eval_loss"] == pytest.approx(result.eval_loss)


def test_evaluations_get_a_progress_line_of_their_own(tiny_model_dir, demo_data, tmp_path):
    settings = run_settings(tiny_model_dir, demo_data, tmp_path / "run", eval_every=2)
    out = io.StringIO()
    result = train(parse_config(settings), console=Console(file=out, width=200))
    evals = [line for line in out.getvalue().splitlines() if "eval loss" in line]
    records = [r for r in read_metrics(result.output_dir / "metrics.jsonl") if "eval_loss" in r]
    assert evals == [f"step {r['step']}/4 | eval loss {r['eval_loss']:.4f}" for r in records]
    assert len(evals) == 2


def test_the_loss_plot_has_whole_steps_only():
    records = [{"step": step, "loss": 3.0 - step, "learning_rate": 1e-4} for step in (1, 2, 3)]
    figure = loss_figure(records)
    figure.canvas.draw()
    ticks = figure.axes[0].get_xticks()
    assert len(ticks) > 1 and all(float(tick).is_integer() for tick in ticks)


def test_the_data_summary_counts_in_words():
    summary = {"records": 1, "source": "qa.csv", "skipped": 0, "train": None, "eval": None,
               "steps": 1, "epochs": 1.0, "steps_per_epoch": 1, "batch_size": 2, "packed": True}  # fmt: skip
    assert summary_lines(summary) == [
        "data: 1 record read from qa.csv",
        "steps: 1 = 1 epoch of 1 step (batch 2)",
    ]
    summary.update(records=1200, steps=3, epochs=1.5, steps_per_epoch=2)
    assert summary_lines(summary)[1] == "steps: 3 = 1.5 epochs of 2 steps (batch 2)"
    assert summary_lines(summary)[0] == "data: 1,200 records read from qa.csv"


def test_the_smoothed_curve_follows_the_trend_without_lag():
    """A falling loss with noise: the smoothed curve stays on the straight trend (an exponential
    average trails it by ~1/(1 - weight) steps) and is calmer than the raw points."""
    trend = [3.0 - 0.02 * step for step in range(60)]
    noisy = [value + (0.1 if step % 2 else -0.1) for step, value in enumerate(trend)]
    assert smoothed(trend) == pytest.approx(trend)
    inner = zip(smoothed(noisy)[1:-1], trend[1:-1], strict=True)  # the ends are single points
    assert max(abs(s - t) for s, t in inner) < 0.05
    assert smoothed(noisy)[-1] == noisy[-1]  # the last point has nothing after it to centre on


def test_a_constant_learning_rate_is_a_flat_line_on_an_axis_from_zero():
    records = [
        {"step": step, "loss": 3.0 - step / 10, "learning_rate": 2e-3} for step in range(1, 9)
    ]
    rate_axes = loss_figure(records).axes[-1]
    bottom, top = rate_axes.get_ylim()
    assert bottom == 0 and 2e-3 < top <= 2.5e-3


def test_a_grpo_run_plots_its_reward_below_the_loss():
    records = [{"step": step, "loss": 0.1, "reward": step / 10, "reward_std": 0.05,
                "learning_rate": 1e-4} for step in range(1, 6)]  # fmt: skip
    figure = loss_figure(records)
    reward_axes = [a for a in figure.axes if a.get_ylabel() == "reward"]
    assert len(reward_axes) == 1
    lines = {line.get_label(): line for line in reward_axes[0].get_lines()}
    assert list(lines["reward"].get_ydata()) == pytest.approx(
        smoothed([s / 10 for s in range(1, 6)])
    )
    assert figure.axes[0].get_ylabel() == "GRPO loss"
