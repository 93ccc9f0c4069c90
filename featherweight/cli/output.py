"""What the command line prints: the consoles, and the boundary that turns errors into one line.

Every command runs inside `friendly_errors`:
- featherweight's typed errors, and the errors a bad input raises from below (a file that cannot
  be read, bytes that are not UTF-8, a value that is not valid) become one plain line on stderr
  and exit code 2 (named `InputFileError` or `ConfigError`, the typed errors they are);
- an option of the wrong type or out of its range (`--steps 0`, `--batch abc`) is refused by
  typer before the command runs; `OneLineErrors` prints that as the same one line, exit code 2;
- anything else is a bug in featherweight: one line that says so and where to report it, exit
  code 1; `featherweight --debug ...` shows the traceback instead.
User text (paths, values) is printed as it is, never read as rich markup: a file named
`data[v2].jsonl` stays `data[v2].jsonl`, and `[/b]` in a path cannot break the printer.
Off a terminal (a log file, a pipe, CI) lines are not wrapped at rich's 80 columns: a path or the
plan's table stays whole, so a log can be read and searched line by line.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from pathlib import Path

import typer
import typer.core
import yaml
from rich.console import Console
from rich.text import Text

from featherweight.errors import FeatherweightError

LOG_WIDTH = 240  # columns of the output off a terminal (COLUMNS, when set, wins)


def _console(stderr: bool = False) -> Console:
    """A console for stdout (or stderr): a terminal's width on a terminal, else wide and
    unwrapped."""
    stream = sys.stderr if stderr else sys.stdout
    wide = not stream.isatty() and "COLUMNS" not in os.environ
    return Console(stderr=stderr, width=LOG_WIDTH if wide else None, soft_wrap=wide)


console = _console()
error_console = _console(stderr=True)
REPORT_URL = "the featherweight issue tracker"
_debug = False


def set_debug(enabled: bool) -> None:
    """Show tracebacks of unexpected errors (the global `--debug` option)."""
    global _debug
    _debug = enabled


def _print_error(kind: str, message: str) -> None:
    line = Text("error: ", style="bold red")
    line.append(f"{kind}: {' '.join(str(message).split())}")
    error_console.print(line, highlight=False, soft_wrap=True)


def _describe_os_error(error: OSError) -> str:
    where = f" {error.filename}" if error.filename else ""
    return f"cannot use{where}: {error.strerror or error}; check that it exists and is readable"


def friendly_errors(command):
    """Run `command` inside the error boundary (see the module docstring)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except FeatherweightError as error:
            _print_error(type(error).__name__, str(error))
            raise typer.Exit(code=2) from None
        except UnicodeDecodeError as error:
            _print_error("InputFileError", f"a file is not UTF-8 text ({error.reason} at byte "
                         f"{error.start}); save it as UTF-8")  # fmt: skip
            raise typer.Exit(code=2) from None
        except OSError as error:
            _print_error("InputFileError", _describe_os_error(error))
            raise typer.Exit(code=2) from None
        except (ValueError, yaml.YAMLError) as error:  # pydantic's, json's and yaml's errors
            _print_error("ConfigError", f"{type(error).__name__}: {error}")
            raise typer.Exit(code=2) from None
        except Exception as error:
            if _debug:
                raise
            _print_error(
                "bug",
                f"{type(error).__name__}: {error} -- this is a bug in featherweight, not your "
                f"input; please report it to {REPORT_URL} with the command you ran (rerun with "
                "featherweight --debug ... for the traceback)",
            )
            raise typer.Exit(code=1) from None

    return wrapper


# --- signals while an output is written ------------------------------------------------------


def stopped(stop, what: str) -> None:
    """One line for a command a signal stopped, then the shell's exit code for that signal."""
    import signal

    by = "an interrupt" if stop.signal_number is None else signal.Signals(stop.signal_number).name
    error_console.print(f"stopped by {by}: {what}", highlight=False)
    raise typer.Exit(code=stop.exit_code)


@contextlib.contextmanager
def stops_on_signal(out: Path, what: str):
    """SIGINT/SIGTERM/SIGHUP while the block writes `out` (an export, a conversion) stop it wherever
    they land (`io/interrupts.py`): one line saying what was kept, exit code 130/143/129."""
    from featherweight.io.interrupts import StopOnSignal

    target = out.expanduser().absolute()
    before = (
        f"the previous {target} is intact"
        if target.exists()
        else f"nothing was written to {target}"
    )
    with StopOnSignal() as stop:
        try:
            yield stop
        except KeyboardInterrupt:
            stopped(stop, f"the {what} stopped before it was complete; {before}")
        if stop.signal_number is not None:  # it came during the final renames, held back
            stopped(stop, f"the {what} had just finished: {target} is complete")


# --- option checks (typer callbacks: they run while the options are parsed, before the command) --


def finite(value: float | None) -> float | None:
    """A number option that must be finite (typer's `min`/`max` let `inf` through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def positive(value: float | None) -> float | None:
    """A finite number option that must be greater than 0."""
    if finite(value) is not None and value <= 0:
        raise typer.BadParameter(f"{value} is not greater than 0")
    return value


def not_utf8(text: str) -> str | None:
    """What is wrong with `text` when it holds bytes that are not UTF-8 (the shell passes them
    through, Python keeps them as lone surrogates and the tokenizer takes only text), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        return (
            f"{what} at character {error.start + 1} is not UTF-8 text; give the text in UTF-8 "
            "(a Latin-1 file converts with iconv -f latin1 -t utf-8)"
        )
    return None


def utf8_text(value: str | None) -> str | None:
    """A text option (a prompt) that must be UTF-8 (`not_utf8`)."""
    problem = None if value is None else not_utf8(value)
    if problem is not None:
        raise typer.BadParameter(problem)
    return value


def path_text(value: str | None) -> str | None:
    """A path option given as text: not empty (an empty path would mean the current directory)."""
    if value is not None and not value.strip():
        raise typer.BadParameter("the path is empty; give a directory, e.g. runs/demo")
    return value


def new_file(value: Path | None) -> Path | None:
    """An output file option: not a directory, in a directory that exists (checked before the
    work whose result it holds)."""
    if value is None:
        return value
    if not str(value).strip():
        raise typer.BadParameter("the path is empty; give a file name, e.g. plan.png")
    if value.is_dir():
        raise typer.BadParameter(f"{value} is a directory; give a file name inside it")
    if not value.expanduser().absolute().parent.is_dir():
        raise typer.BadParameter(f"the directory of {value} does not exist; create it first")
    return value


class OneLineErrors(typer.core.TyperGroup):
    """The app's command group: a usage error (an unknown option, an option value of the wrong
    type or out of range, a missing argument) is one plain line and exit code 2, like every other
    refused input, instead of click's boxed usage text."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            result = super().main(args, prog_name, complete_var, False, **extra)
        except typer.TyperException as error:  # typer's (vendored click's) usage errors
            if type(error).__name__ == "NoArgsIsHelpError":
                error.show()  # no arguments at all: the help is the answer
                sys.exit(2)
            context = getattr(error, "ctx", None)
            command = context.command_path if context is not None else "featherweight"
            _print_error("ConfigError", f"{error.format_message()} (see {command} --help)")
            sys.exit(2)
        except typer.Abort:
            error_console.print("aborted", highlight=False)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)
