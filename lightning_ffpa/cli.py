"""The `lightning-ffpa` console script: which code answers a command, and its exit code.

Owns `main` and `export_main` (exit 0 on success, 2 with one `error:` line on a bad input, 3 for a diverged fit, 143 after
SIGTERM, 130 after Ctrl-C) and the commands that need no Lightning: `lightning-ffpa --help`, `recipes` and `cp` import
neither Lightning nor torch, so they answer at once. fit/validate/test/predict go to
`lightning_ffpa.lightning_cli` (the LightningCLI), imported only then; its names (`build`, `FFPACLI`, ...)
are reachable from this module too. Does not own parsing the training options (LightningCLI does).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from lightning_ffpa import recipes
from lightning_ffpa.errors import InputError, console_entry, one_line

COMMANDS = recipes.COMMANDS
# LightningCLI's subcommands with the first sentence of its help line for each (tests/cli/test_help.py
# checks these against LightningCLI's own `--help`)
LIGHTNING_COMMANDS = {"fit": "Runs the full optimization routine.",
                      "validate": "Perform one evaluation epoch over the validation set.",
                      "test": "Perform one evaluation epoch over the test set.",
                      "predict": "Run inference on your data."}


def top_level_parser() -> argparse.ArgumentParser:
    """`lightning-ffpa --help` without Lightning: LightningCLI's top-level options and every subcommand."""
    parser = argparse.ArgumentParser(prog="lightning-ffpa", description=recipes.DESCRIPTION)
    parser.add_argument("-c", "--config", help="Path to a configuration file in json or yaml format.")
    parser.add_argument("--print_config", nargs="?", metavar="=flags",
                        help="Print the configuration after applying all other arguments and exit.")
    sub = parser.add_subparsers(title="subcommands", metavar="{" + ",".join([*LIGHTNING_COMMANDS, *COMMANDS]) + "}",
                                description="For more details of each subcommand, add it as an argument "
                                            "followed by --help.")
    for name, text in {**LIGHTNING_COMMANDS, **COMMANDS}.items():
        sub.add_parser(name, help=text)
    return parser


def _help_only(argv: list[str]) -> bool:
    words = [a for a in argv if a != "--debug"]
    return bool(words) and (words[0] in COMMANDS or words in (["--help"], ["-h"]))


def _answer_without_lightning(argv: list[str]) -> int:
    if argv[0] in COMMANDS:
        return recipes.command(argv)
    top_level_parser().parse_args(argv)  # --help: prints and exits 0
    return 0


def _run_lightning(argv: list[str]) -> int:
    words = [a for a in argv if a != "--debug"]
    subcommands = ", ".join([*LIGHTNING_COMMANDS, *COMMANDS])
    if not words:  # jsonargparse's own line lists Lightning's subcommands only
        raise InputError(f"give a subcommand: one of {subcommands} (`lightning-ffpa --help` says what each does)")
    if not words[0].startswith("-") and words[0] not in LIGHTNING_COMMANDS:
        raise InputError(f"`{words[0]}`: not a subcommand; one of {subcommands} (`lightning-ffpa --help` says what "
                         "each does)")
    # a console script's sys.path lacks the folder it runs from (`python -m` has it): a user's reward function or
    # module named by a dotted path (`my_rewards.score`) is found there, after every installed package
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    # imported here, inside `console_entry`'s held stderr: what the imports print (a library's notices) is
    # dropped with a rejected input, as the rest of its output is, and shown once the input is accepted
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_ffpa import lightning_cli

    try:
        return lightning_cli.command(argv)
    except MisconfigurationException as err:  # Lightning's word for a bad option value: the user's mistake
        raise InputError(one_line(err)) from err


def main(argv: list[str] | None = None) -> int:
    """The `lightning-ffpa` console script: exit code 0 on success, 2 with one `error:` line on a bad input."""
    from lightning_ffpa.errors import CheckpointError

    argv = list(sys.argv[1:] if argv is None else argv)
    # a checkpoint that cannot be loaded is the user's: one line, wherever it is found (a load hook included)
    return console_entry(_answer_without_lightning if _help_only(argv) else _run_lightning,
                         user_errors=(CheckpointError,), argv=argv)


def export_main(argv: list[str] | None = None) -> int:
    """The `lightning-ffpa-export` console script. The export's imports run with stderr held: transformers
    imports torchao where it is installed, whose load messages would come before a bad input's one line."""
    from lightning_ffpa.errors import CheckpointError

    def export(args: list[str]) -> Any:
        from lightning_ffpa.export import run

        return run(args)

    return console_entry(export, user_errors=(CheckpointError, FileExistsError), argv=argv)


def __getattr__(name: str) -> Any:
    # `lightning_ffpa.cli.build`, `.FFPACLI`, ...: the LightningCLI module's names, imported on first use (not
    # for dunder probes: `from lightning_ffpa.cli import main` asks for `__path__`)
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lightning_ffpa import lightning_cli

    try:
        return getattr(lightning_cli, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


if __name__ == "__main__":
    sys.exit(main())
