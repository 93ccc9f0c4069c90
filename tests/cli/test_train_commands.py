"""What `featherweight train` says at the end: the step reached of the steps asked for, losses to
four places (no `None`), or that a finished run had nothing to train."""

from pathlib import Path
from types import SimpleNamespace

from featherweight.cli.train_commands import outcome_line


def _result(step, start_step, loss, eval_loss, steps=4):
    run = SimpleNamespace(start_step=start_step, config=SimpleNamespace(steps=steps))
    return SimpleNamespace(
        step=step, loss=loss, eval_loss=eval_loss, run=run, output_dir=Path("/runs/a")
    )


def test_the_last_line_rounds_losses_and_leaves_out_what_was_not_measured():
    assert (
        outcome_line(_result(4, 0, 10.781560897827148, None)) == "done: step 4 of 4, loss 10.7816"
    )
    assert (
        outcome_line(_result(4, 2, 2.0, 1.234567))
        == "done: step 4 of 4, loss 2.0000, eval loss 1.2346"
    )


def test_a_finished_run_run_again_says_there_was_nothing_to_train():
    line = outcome_line(_result(4, 4, None, None))
    assert line == "nothing to train: /runs/a is already at step 4 of 4; raise steps to train on"
