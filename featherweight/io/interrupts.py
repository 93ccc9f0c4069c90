"""SIGINT, SIGTERM and SIGHUP while an output is written (export, convert): the command stops, and
what existed before is intact.

Python raises KeyboardInterrupt wherever the main thread is when a signal arrives -- also inside a
garbage-collector callback (JAX's `_xla_gc_callback`), where the exception is printed as
"Exception ignored" and lost: the export ran on and replaced the previous one. Inside
`StopOnSignal` the handler records the signal before it raises, a KeyboardInterrupt lost in a
callback is not printed, and `raise_if_interrupted` raises it again at the next point that asks:
each layer read, each tensor written, and the moment before an output is renamed into place
(`io/atomic.py`). The renames themselves run under `deferred`: a signal there is recorded, not
raised, so the previous output and the new one are never both half in place; the command then
says that the new output is complete.

Outside `StopOnSignal` (featherweight used as a library) nothing changes: Python's own handlers
stay, and the checks do nothing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

# the signals that stop a command cleanly, with the shell's 128 + signal as its exit code: SIGHUP
# (a closed terminal, a dropped SSH session) is a stop as SIGINT and SIGTERM are
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
_active: StopOnSignal | None = None


class StopOnSignal:
    """A context manager: SIGINT/SIGTERM/SIGHUP recorded (`signal_number`) and raised as
    KeyboardInterrupt, except inside `deferred`. Previous handlers come back on exit."""

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self.deferring = False
        self._previous: dict[int, object] = {}
        self._previous_hook = sys.unraisablehook

    def _handle(self, number, _frame) -> None:
        if self.signal_number is None:
            self.signal_number = number
        if not self.deferring:
            raise KeyboardInterrupt

    def _unraisable(self, info) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt) and self.signal_number is not None:
            return  # recorded: raised again at the next check, not printed as "ignored"
        self._previous_hook(info)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signal_number, 1)

    def __enter__(self) -> StopOnSignal:
        global _active
        if threading.current_thread() is threading.main_thread():
            for number in EXIT_CODES:
                self._previous[number] = signal.signal(number, self._handle)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        if _active is self:
            sys.unraisablehook, _active = self._previous_hook, None


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt when a signal was recorded (one a callback swallowed included)."""
    if _active is not None and _active.signal_number is not None and not _active.deferring:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A block no signal interrupts (renames that must all happen): a signal is recorded only,
    after a last check that none came before it."""
    raise_if_interrupted()
    if _active is None:
        yield
        return
    _active.deferring = True
    try:
        yield
    finally:
        _active.deferring = False
