"""SIGINT/SIGTERM/SIGHUP during training: finish the current step, save, exit cleanly."""

from __future__ import annotations

import signal
import threading

from featherweight.io.interrupts import EXIT_CODES


class StopRequest:
    """A context manager that records SIGINT/SIGTERM/SIGHUP (`EXIT_CODES`: a closed terminal or
    a dropped SSH session stops a run as Ctrl-C does) instead of dying mid-step.

    `signal_number` is the first signal received (None if none); the loop checks `requested`
    after each step, saves a checkpoint and returns. Previous handlers come back on exit.
    """

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def _handle(self, number, _frame) -> None:
        if self.signal_number is None:
            self.signal_number = number

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in EXIT_CODES:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
