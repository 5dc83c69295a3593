"""The project's user-facing error types, and the console-script wrapper that turns them into one line.

Owns: `ConfigError(option, value, reason)` (a bad option value, raised before expensive work starts),
`InputError` (a user's mistake reported in a library's or a component's own words), the folding of
jsonargparse's nested parse errors into one `option=value: reason` line, and `console_entry`, which runs a
command's body and maps the user's mistakes to `error: <option>=<value>: <why>` on stderr with exit code 2.
While a command is still checking its input, stderr is held back (`hold_stderr`), so a rejected input prints
exactly one line; the command releases it (`release_stderr`) when its input is accepted. Bugs keep their
traceback. `--debug` or `LIGHTNING_FFPA_DEBUG=1` shows the traceback (and all output) for user errors too,
still with exit code 2. The console scripts' exit skips the interpreter's exit-time walks of the heap
(`exit_quickly`). Does not own what is checked: each component validates its own options.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import errno
import gc
import importlib
import os
import re
import signal
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable, Iterator
from typing import Any

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_DIVERGED = 3  # training stopped on non-finite values: an outcome of the run, neither the input nor a bug
EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM (143)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a process ended by Ctrl-C (130)
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a writer whose reader went away (141)
DEBUG_ENV = "LIGHTNING_FFPA_DEBUG"


class ConfigError(ValueError):
    """A bad value for one named option. Subclasses ValueError so callers that catch that keep working."""

    def __init__(self, option: str, value: Any, reason: str) -> None:
        self.option, self.value, self.reason = option, value, reason
        super().__init__(f"`{option}`: {reason}" if value is NOT_GIVEN else f"`{option}={value!r}`: {reason}")


NOT_GIVEN = object()  # a ConfigError whose value the error does not carry (a key of a config file)


class TrainingDiverged(FloatingPointError):
    """A run stopped because its loss, gradients or weights became non-finite (NonFiniteGuard)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing, truncated, corrupt or incompatible)."""


class InputError(ValueError):
    """A user's mistake found by a library (jsonargparse, Lightning) or a component, kept in its own words."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises `InputError` ("prog: message", one line) instead of printing usage and exiting."""

    def error(self, message: str):  # noqa: D102
        raise InputError(f"{self.prog}: {message}")


# OS errors on paths the user named: their messages carry the path.
PATH_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(err: BaseException) -> str:
    """The error's message folded to one line: a multi-line message keeps its first non-empty line, or all of
    its lines joined where the first ends in ":" or an open bracket (it introduces the rest, e.g. peft's
    `Target module Gemma4ClippableLinear(` and the module's repr: cut there, it would say nothing)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    return " ".join(lines) if lines[0].endswith((":", "(", "[", "{")) else lines[0]


def causes(err: BaseException | None) -> Iterator[BaseException]:
    """`err`, then what caused it (`__cause__`, else an unsuppressed `__context__`), outermost first."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)


# jsonargparse's wrappers around the real problem, by the first line of their message.
_KEY = re.compile(r'Parser key "([^"]+)":')
_CLASS = re.compile(r"Problem with given class_path '([^']+)':")


def _is_dataclass_path(path: str) -> bool:
    module, _, name = path.rpartition(".")
    try:
        return dataclasses.is_dataclass(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, ValueError):
        return False
_UNION = "Does not validate against any of the Union subtypes"
_REQUIRED = re.compile(r"^\s*- Problem with given class_path '(?P<path>[^']+)':\s*\n\s*the following arguments are "
                       r"required: (?P<args>.+)$", re.M)
_GOT = re.compile(r"\. Got value: (.*)$", re.S)
_NO_OPTIMIZER_KEY = re.compile(r"Subcommand '[^']+' does not accept option '(optimizer|lr_scheduler)[.']")
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted(?: before subcommand '([^']+)')?")


def _is_wrapper(err: BaseException) -> bool:
    text = str(err).lstrip()
    return bool(_KEY.match(text) or _CLASS.match(text) or text.startswith((_UNION, "- ")))


_IMPORT_PATH = re.compile(r"^(?:Unexpected import path format|Expected a dot import path string): (.*)$")


def _readable(reason: str) -> str:
    """jsonargparse's type words as a user reads them."""
    if (m := _IMPORT_PATH.match(reason.strip())) and ":" in m.group(1):  # a Callable given `module:function`
        return f"`{m.group(1)}` is the old `module:function` form: write a dotted import path `package.module.function`"
    reason = re.sub(r"Expected a typing\.Literal\[(.*)\]$", r"expected one of \1", reason.strip())
    reason = re.sub(r"Expected a <class '(\w+)'>", r"expected \1", reason)
    return re.sub(r"^Expected a ", "expected ", reason)


def _union_reason(text: str) -> tuple[str, str | None]:
    """One reason from a Union error's bullet list (NoneType dropped, Literal choices merged) and its value."""
    bullets = [ln.strip()[2:] for ln in text.splitlines() if re.match(r"^\s{0,4}- ", ln)]
    bullets = [b for b in bullets if b != "Expected a <class 'NoneType'>"]
    literals = [m.group(1) for b in bullets if (m := re.fullmatch(r"Expected a typing\.Literal\[(.*)\]", b))]
    given = re.search(r"^\s*Given value: (.*)$", text, re.M)
    value = given.group(1).strip() if given else None
    if literals and len(literals) == len(bullets):
        return "expected one of " + ", ".join(literals), value
    return "; ".join(_readable(b) for b in bullets if not b.startswith(("Problem with", "Parser key"))), value


_CLASS_BULLET = re.compile(r"^(\s*)- Problem with given class_path '([^']+)':\s*$")


def _class_alternative(text: str, keys: list[str]) -> ConfigError | None:
    """A Union error whose value was nested init args (`--trainer.strategy.init_args.compile maybe`), folded to
    its class alternative's own error. The other alternatives (a plain `str`) are not what the user meant, but
    jsonargparse chains only the first of them as the cause."""
    if not re.search(r"^Given value type: <class 'jsonargparse\._util\.NestedArg'>", text, re.M):
        return None  # this Union's own value (its unindented line), not one nested in an alternative's error
    nested = _nested_arg(text)
    if (plain := re.search(r"^ {0,2}- Expected a dot import path string: (.*)$", text, re.M)) and nested:
        where = ".".join(keys)  # init args given to an option that holds a name (`strategy: auto`), not a class
        return ConfigError(f"{where}.init_args.{nested[0]}", nested[1],
                           f"`{where}` is {plain.group(1).strip()!r}, not a class: set `{where}.class_path` first")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not (m := _CLASS_BULLET.match(line)):
            continue
        depth, path = len(m.group(1)), m.group(2)
        block = []
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= depth:
                break
            block.append(nxt)
        inner = textwrap.dedent("\n".join(block)).strip()
        prefix = [*keys, *([] if _is_dataclass_path(path) else ["init_args"])]
        if rejected := _NOT_ACCEPTED.match(inner):
            return ConfigError(".".join([*prefix, rejected.group(1)]), nested[1] if nested else None,
                               f"is not an argument of {path.rsplit('.', 1)[-1]}")
        if not (key := _KEY.match(inner)):
            return None
        rest = textwrap.dedent(inner[key.end():].strip("\n")).strip()
        if "Problem with given class_path" in rest:
            return None  # a class inside the class: the cause chain reaches that Union on its own
        if rest.startswith(_UNION):
            reason, value = _union_reason(rest)
            if value == "None" and re.search(r"^\s*Given value type: <class 'str'>", rest, re.M):
                # jsonargparse hands a nested field's `null` on to the dataclass as the text 'None'
                parent, field = ".".join(prefix), key.group(1)
                return ConfigError(f"{parent}.{field}", None, f"a null for one field of `{parent}` is read as the "
                                   f"text 'None' on the command line: give it with its parent, `--{parent} "
                                   f"'{{{field}: null}}'` (the other fields keep their values)")
        else:
            got = _GOT.search(rest)
            reason = _readable(rest[: got.start()] if got else rest.splitlines()[0])
            value = got.group(1).strip() if got else NOT_GIVEN  # the reason names it (else `=None`)
        return ConfigError(".".join([*prefix, key.group(1)]), value, reason)
    return None


def describe_parse_error(err: BaseException) -> BaseException:
    """A jsonargparse parse error as a ConfigError naming the option (`model.init_args.loss_impl`) and value.

    jsonargparse nests the real problem under "Parser key", "Problem with given class_path" and Union
    wrappers (each with a Namespace dump); this walks the cause chain and keeps the option path, the value
    and the innermost reason. A ConfigError raised inside is returned as it is.
    """
    for e in causes(err):
        if isinstance(e, ConfigError):
            return e
    keys: list[str] = []
    last_text, owner = None, "this class"
    for e in causes(err):
        text = str(e).strip()
        if text == last_text:
            continue  # jsonargparse re-raises the same message as a different type
        last_text = text
        first = text.splitlines()[0] if text else ""
        if m := _KEY.match(first):
            keys.append(m.group(1))
        elif m := _CLASS.match(first):
            inner, owner = e.__cause__, m.group(1).rsplit(".", 1)[-1]
            if inner is None or (not _is_wrapper(inner) and not _NOT_ACCEPTED.match(str(inner))):
                return ConfigError(".".join([*keys, "class_path"]), m.group(1), one_line(inner or e))
            if not _is_dataclass_path(m.group(1)):  # users spell a dataclass's fields without `init_args`
                keys.append("init_args")
        elif text.startswith(_UNION):
            if folded := _class_alternative(text, keys):
                return folded
            if required := _REQUIRED.search(text):  # one class of a list lacks an argument: its bullet says which
                return ConfigError(".".join(keys) or "config", NOT_GIVEN, f"`{required['args']}` is required by "
                                   f"{required['path'].rsplit('.', 1)[-1]}")
            reason, value = _union_reason(text)
            nested = e.__cause__
            if nested is not None and _CLASS.match(str(nested).strip()):
                continue  # an alternative got as far as its class (a callback in a list): its error is the user's
            if reason or nested is None:
                return ConfigError(".".join(keys) or "config", value, reason or one_line(e))
        elif first.startswith("- "):
            continue  # a list of the alternatives tried; the cause is the first one's error
        elif m := _NOT_ACCEPTED.match(first):
            if m.group(2):  # a top-level config's key that is not a subcommand's: the class is not at fault
                return ConfigError(m.group(1), NOT_GIVEN, f"is not accepted before the subcommand: give it after "
                                   f"`{m.group(2)}` (a config before the subcommand is keyed by it: `{m.group(2)}: "
                                   "{trainer: ...}`)")
            return ConfigError(".".join([*keys, m.group(1)]), _given_value(err), f"is not an argument of {owner}")
        elif m := _NO_OPTIMIZER_KEY.match(first):  # an `optimizer:` / `lr_scheduler:` section of a config file
            return no_optimizer_option(m.group(1))
        elif not _is_wrapper(e):
            got = _GOT.search(text)
            reason = _readable(text[: got.start()] if got else one_line(e))
            if keys:
                return ConfigError(".".join(keys), got.group(1).strip() if got else NOT_GIVEN, reason)
            return InputError(reason)
    return InputError(one_line(err))


def no_optimizer_option(option: str) -> ConfigError:
    """`optimizer` / `lr_scheduler` on the command line or in a config: the CLI has neither (the model builds them)."""
    return ConfigError(option, NOT_GIVEN, "is not an option: the model builds its optimizer and schedule "
                       "(Gemma4LM: AdamW, linear warmup then cosine decay) from `model.init_args.learning_rate`, "
                       "`warmup_steps`, `min_lr_ratio`, `weight_decay` and `betas` (GRPOModule: `learning_rate`); "
                       "set those")


def _nested_arg(text: str) -> tuple[str, str] | None:
    """(key, value) of the first `NestedArg` (an option given inside a class's init args) in an error's text."""
    m = re.search(r"NestedArg\(key='([^']*)', val=(.*)\)\s*$", text, re.M)
    return (m.group(1), m.group(2).strip("'\"")) if m else None


def _given_value(err: BaseException) -> Any:
    nested = _nested_arg(str(err))
    return nested[1] if nested else NOT_GIVEN


def describe_constructor_error(err: BaseException) -> BaseException | None:
    """The user's mistake inside a wrapped constructor error (a ConfigError, ValueError or path OSError).

    Returns None for anything else (a bug), so its traceback is kept.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    class_path = None
    for e in causes(err):
        if isinstance(e, ConfigError):
            return e
        if m := _CLASS.match(str(e).lstrip()):
            class_path = m.group(1)
        if _is_wrapper(e):
            continue
        if isinstance(e, ModuleNotFoundError) and class_path is not None:  # a logger's package not installed
            return ConfigError(_class_option(class_path), class_path, f"needs a package that is not installed: "
                               f"{one_line(e)}")
        if isinstance(e, (ValueError, MisconfigurationException, *PATH_ERRORS)):
            if isinstance(e, ValueError) and (m := _STRATEGY_PRECISION.search(str(e))):
                return ConfigError("trainer.precision", m["precision"], f"is not one the FSDP2 strategy supports "
                                   f"(Lightning's ModelParallelStrategy, which it extends): {m['choices']}")
            return e if isinstance(e, InputError) else InputError(one_line(e))
        return None
    return None


def _class_option(class_path: str) -> str:
    """The Trainer option a class named by `class_path` is given to (`trainer.logger`, ...), else `class_path`."""
    try:
        cls = getattr(importlib.import_module(class_path.rpartition(".")[0]), class_path.rpartition(".")[2])
    except (ImportError, AttributeError, ValueError):
        return "class_path"
    from lightning.pytorch import Callback, LightningDataModule, LightningModule
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import Strategy

    owners = {Logger: "trainer.logger", Callback: "trainer.callbacks", Strategy: "trainer.strategy",
              LightningModule: "model", LightningDataModule: "data"}
    return next((option for base, option in owners.items() if isinstance(cls, type) and issubclass(cls, base)),
                "class_path")


# Lightning's refusal names `Fabric(...)` and its own class, neither of which the user wrote
_STRATEGY_PRECISION = re.compile(r"The `?ModelParallelStrategy`? does not support `?Fabric\(\.\.\., precision='"
                                 r"(?P<precision>[^']+)'\)`?\. Choose a different precision among: (?P<choices>[^.]+)")


class _HeldStderr:
    """File descriptor 2 (and `sys.stderr`) redirected into a temporary file until released, then replayed or
    dropped. Both, because `sys.stderr` need not write to fd 2 (a test's capture), and C code writes to fd 2."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self._sys_stderr = sys.stderr
        self._saved: int | None = os.dup(2)
        self._tmp = tempfile.TemporaryFile()
        os.dup2(self._tmp.fileno(), 2)
        sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")  # noqa: SIM115

    def release(self, replay: bool = True) -> None:
        if self._saved is None:
            return
        sys.stderr.flush()
        sys.stderr = self._sys_stderr
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = None
        if replay:
            self._tmp.seek(0)
            data = self._tmp.read()
            self._sys_stderr.flush()
            while data:
                data = data[os.write(2, data):]
        self._tmp.close()


_held: _HeldStderr | None = None


def hold_stderr() -> None:
    """Hold back everything written to stderr (logging, warnings, C code) until `release_stderr`."""
    global _held
    if _held is None:
        try:
            _held = _HeldStderr()
        except OSError:  # no usable fd 2 (a closed or captured stream): nothing to hold
            _held = None


def release_stderr(replay: bool = True) -> None:
    """Write the held stderr out (or drop it, `replay=False`) and stop holding. No-op when nothing is held."""
    global _held
    if _held is not None:
        held, _held = _held, None
        held.release(replay)


def _exit_quickly() -> None:
    # The interpreter's exit-time collections walk every object torch, Lightning and transformers created
    # (~1.3 s of a CPU fit's exit, for each command and each rank); the process ends right after them, so objects
    # still in reference cycles are freed with the process instead. The other exit handlers (logging, loggers,
    # temporary files) have run by then.
    gc.freeze()
    if _skip_finalizing and _exit_code is not None:
        # A gloo worker thread can still be freeing a collective's tensor (its Python object: it waits for the
        # GIL) when finalization starts; Python then ends it inside a C++ destructor: std::terminate, "terminate
        # called without an active exception", exit 134. Without finalization no thread is ended mid-destructor.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_code)


_exit_registered = False
_skip_finalizing = False  # set by `skip_finalizing`
_exit_code: int | None = None  # what `console_entry` returned


def skip_finalizing() -> None:
    """End this console script right after the exit handlers registered since it started (the loggers', the
    command's), without the interpreter's finalization (`close_process_group` asks for it: gloo's worker threads
    outlive the process group, FSDP2 holding it). stdout and stderr are flushed first."""
    global _skip_finalizing
    _skip_finalizing = True


def exit_quickly() -> None:
    """Make this process's exit skip the interpreter's exit-time walks of the heap: an exit handler, registered
    once and before the command's own (so it runs after them), moves every live object out of the cyclic GC's
    reach (`gc.freeze`). For console scripts (`console_entry` calls it) and benchmark row processes."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(_exit_quickly)
        _exit_registered = True


def console_entry(body: Callable[[list[str]], Any], user_errors: tuple[type[BaseException], ...] = (),
                  argv: list[str] | None = None, hold: bool = True) -> int:
    """Run `body(argv)` for a console script; return the exit code (0, 2 for a user's mistake, 3 for a diverged
    run: `TrainingDiverged`, one line).

    `user_errors` adds exception types (beyond ConfigError, InputError, argparse errors and the common OS
    errors on user paths) that are the user's mistake rather than a bug. With `hold`, stderr is held back
    until the body calls `release_stderr()` (or returns), so a rejected input prints exactly one line.
    An int returned by `body` is the exit code.
    """
    exit_quickly()  # first, so its handler runs after those the command registers
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"  # processes the command starts (e.g. more ranks) show tracebacks too
        argv = [a for a in argv if a != "--debug"]
    handled = (ConfigError, InputError, argparse.ArgumentError, *PATH_ERRORS, *user_errors)
    if hold and not debug:
        hold_stderr()
    try:
        result = body(argv)
    except handled as err:
        line = one_line(describe_parse_error(err) if isinstance(err, argparse.ArgumentError) else err)
        release_stderr(replay=debug)
        if debug:
            traceback.print_exc()
        print(f"error: {line}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingDiverged as err:
        release_stderr()
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt:  # Ctrl-C before the run started (the command's own handler covers a running fit)
        release_stderr()
        if debug:
            traceback.print_exc()
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away (`lightning-ffpa recipes | head -1`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # interpreter exit flushes stdout again
        release_stderr()
        return EXIT_BROKEN_PIPE
    except OSError as err:
        release_stderr()
        if err.errno != errno.ENOSPC or debug:  # no space left on device is the user's disk, not a bug
            raise
        print(f"error: no space left on device: {err.filename or err}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException:
        release_stderr()  # a bug or an exit (--help): keep everything it printed
        raise
    release_stderr()
    global _exit_code
    _exit_code = result if isinstance(result, int) else EXIT_OK
    return _exit_code


def data_option(datamodule: Any, *names: str) -> str:
    """The first of `names` that the data module's class takes, as the CLI spells it (`data.init_args.<name>`)."""
    import inspect

    params = inspect.signature(type(datamodule).__init__).parameters if datamodule is not None else {}
    return "data.init_args." + next((n for n in names if n in params), names[0])
