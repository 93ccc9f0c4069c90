"""What the command line prints: the consoles, and the boundary that turns errors into one line.

Every command runs inside `friendly_errors`:
- featherweight's typed errors, and the errors a bad input raises from below (a file that cannot
  be read, bytes that are not UTF-8, a value that is not valid) become one plain line on stderr
  and exit code 2;
- anything else is a bug in featherweight: one line that says so and where to report it, exit
  code 1; `featherweight --debug ...` shows the traceback instead.
User text (paths, values) is printed as it is, never read as rich markup: a file named
`data[v2].jsonl` stays `data[v2].jsonl`, and `[/b]` in a path cannot break the printer.
"""

from __future__ import annotations

import functools

import typer
import yaml
from rich.console import Console
from rich.text import Text

from featherweight.errors import FeatherweightError

console = Console()
error_console = Console(stderr=True)
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
            _print_error("InputError", f"a file is not UTF-8 text ({error.reason} at byte "
                         f"{error.start}); save it as UTF-8")  # fmt: skip
            raise typer.Exit(code=2) from None
        except OSError as error:
            _print_error("InputError", _describe_os_error(error))
            raise typer.Exit(code=2) from None
        except (ValueError, yaml.YAMLError) as error:  # pydantic's, json's and yaml's errors
            _print_error("InputError", f"{type(error).__name__}: {error}")
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
