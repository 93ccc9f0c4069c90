"""SIGINT while an output is written: recorded before it is raised, so one that a garbage-collector
callback swallows is raised again at the next check (and not printed); held back, not raised,
inside `deferred`; nothing changes outside `StopOnSignal`."""

import gc
import os
import signal

import pytest

from featherweight.io.interrupts import StopOnSignal, deferred, raise_if_interrupted


def _sigint_in_a_gc_callback() -> None:
    def callback(phase, _info):
        if phase == "start":
            gc.callbacks.remove(callback)
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # the handler runs here, inside the callback: Python drops its raise

    gc.callbacks.append(callback)
    gc.collect()


def test_a_sigint_a_gc_callback_swallowed_is_raised_at_the_next_check(capsys):
    with StopOnSignal() as stop:
        _sigint_in_a_gc_callback()  # no KeyboardInterrupt gets out of here
        assert stop.signal_number == signal.SIGINT and stop.exit_code == 130
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    assert "Exception ignored" not in capsys.readouterr().err


def test_a_sigint_inside_deferred_is_recorded_not_raised():
    try:
        with StopOnSignal() as stop:
            with deferred():
                os.kill(os.getpid(), signal.SIGINT)
                sum(range(1000))
            assert stop.signal_number == signal.SIGINT
    except KeyboardInterrupt:
        pytest.fail("the signal was raised inside deferred()")


def test_outside_the_guard_nothing_changes():
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignal():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
    raise_if_interrupted()  # no guard: nothing recorded, nothing raised
    with deferred():
        pass
