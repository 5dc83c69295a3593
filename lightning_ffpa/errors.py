"""The project's one user-facing error type, and the console-script wrapper that turns it into one line.

Owns: `ConfigError(option, value, reason)` (a bad option value, raised before expensive work starts) and
`console_entry`, which runs a command's body and maps the user's mistakes to `error: <option>=<value>:
<why>` on stderr with exit code 2. Bugs keep their traceback. `--debug` or `LIGHTNING_FFPA_DEBUG=1` shows
the traceback for user errors too. Does not own what is checked: each component validates its own options.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

EXIT_OK = 0
EXIT_USAGE = 2
DEBUG_ENV = "LIGHTNING_FFPA_DEBUG"


class ConfigError(ValueError):
    """A bad value for one named option. Subclasses ValueError so callers that catch that keep working."""

    def __init__(self, option: str, value: Any, reason: str) -> None:
        self.option, self.value, self.reason = option, value, reason
        super().__init__(f"`{option}={value!r}`: {reason}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing, truncated, corrupt or incompatible)."""


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(err: BaseException) -> str:
    """The error's message folded to one line (multi-line messages keep their first non-empty line)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def console_entry(body: Callable[[list[str]], Any], user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run `body(argv)` for a console script; return the exit code (0, or 2 for a user's mistake).

    `user_errors` adds exception types (beyond ConfigError and the common OS errors on user paths) that
    are the user's mistake rather than a bug.
    """
    argv = sys.argv[1:]
    debug = _debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    handled = (ConfigError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
               *user_errors)
    try:
        body(argv)
    except handled as err:
        if debug:
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        if err.errno != 28 or debug:  # ENOSPC: no space left on device is the user's disk, not a bug
            raise
        print(f"error: no space left on device: {err.filename or err}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
