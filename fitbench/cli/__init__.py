"""The ``fitbench`` command: parse, call the command's plain function, print. One module per command,
each a ``Command`` (``fitbench.cli.command``) listed in ``COMMANDS``; the option groups they share are
in ``fitbench.cli.options``. Bad input ends in one paragraph on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from rich.markup import escape

from fitbench.util.version import __version__
from fitbench.cli import calibrate, compare, env, models, plan, report, run, serve_bench
from fitbench.cli.command import Command
from fitbench.cli.console import errors, warn
from fitbench.cli.parser import Parser, one_spelling
from fitbench.hardware.dependencies import untested_warnings
from fitbench.results.store import DISK_ERRORS
from fitbench.util.errors import UserError

# In the order ``fitbench --help`` lists them; ``fitbench`` alone is ``fitbench run``.
COMMANDS: dict[str, Command] = {command.name: command for command in (
    run.COMMAND, models.COMMAND, plan.COMMAND, calibrate.COMMAND, report.COMMAND, compare.COMMAND,
    env.COMMAND, serve_bench.COMMAND)}
# The commands whose answers rest on the pinned libraries' behaviour: each warns of a version outside
# fitbench's tested range before it plans (``fitbench env`` lists every range).
WARNS_OF_UNTESTED_VERSIONS = ("run", "plan")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``fitbench`` and of each command in ``COMMANDS``."""
    parser = Parser(prog="fitbench", description="Which models fit on these GPUs, how to run them, and how fast they go.")
    parser.add_argument("--version", action="version", version=f"fitbench {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.summary, description=command.function.__doc__,
                                  epilog=command.examples, formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.set_defaults(function=command.function)
        for group in command.options:
            group(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``fitbench`` on ``argv`` (default: this process's arguments) and return its exit status."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run", *argv])
    args.argv = argv
    one_spelling(parser, argv)
    if args.command in WARNS_OF_UNTESTED_VERSIONS:
        for warning in untested_warnings():
            warn(warning)
    try:
        return args.function(args)
    except UserError as error:
        errors.print(f"fitbench: {escape(str(error))}", soft_wrap=True)
        return UserError.exit_code
    except OSError as error:
        if error.errno not in DISK_ERRORS:
            raise
        errors.print(f"fitbench: out: writing {escape(str(error.filename or 'a file'))} failed: {error.strerror}. "
                     f"Rows already written are intact; make room and `fitbench run --resume <its --out directory>` "
                     f"finishes the sweep.", soft_wrap=True)
        return UserError.exit_code
    except KeyboardInterrupt as interruption:
        try:
            errors.print(f"fitbench: {str(interruption) or 'interrupted by SIGINT'}; finished rows are saved, "
                         f"`fitbench run --resume <out>` goes on.")
        except OSError:  # the terminal went with a hangup
            pass
        return 130
