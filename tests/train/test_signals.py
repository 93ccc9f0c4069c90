"""The signals that stop a run cleanly (save the step, exit 128 + n): SIGINT (Ctrl-C), SIGTERM
(kill) and SIGHUP (a closed terminal, a dropped SSH session), which used to kill training without
a checkpoint. The end-to-end save and exit code: tests/train/test_loop.py (SIGTERM)."""

import os
import signal

import pytest

from featherweight.io.interrupts import EXIT_CODES
from featherweight.train.signals import StopRequest


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_is_recorded_for_the_loop_not_fatal(number):
    previous = signal.signal(number, lambda *_: None)  # unhandled by StopRequest: nothing dies
    try:
        with StopRequest() as stop:
            os.kill(os.getpid(), number)
        assert stop.signal_number == number  # the loop saves this step and stops
        assert EXIT_CODES[number] == 128 + number
    finally:
        signal.signal(number, previous)
