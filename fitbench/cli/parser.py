"""The argument parser every command shares: bad flags end as any bad input does, numbers that start
with a minus reach their option's own check, and one option given twice in two spellings is refused."""

from __future__ import annotations

import argparse
import re

from fitbench.util.errors import UserError, excerpt, excerpt_words

# A value that starts with a minus: argparse takes only -5 and -2.5 for values, and calls -inf, -1e3 or
# -80GB an unknown option, so the option's own check (and its message) never sees them. No fitbench
# option is spelled like a number.
_NEGATIVE_VALUE = re.compile(r"-(\.?\d|inf|nan)", re.IGNORECASE)


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {excerpt(text)}") from None


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {excerpt(text)}") from None


class Parser(argparse.ArgumentParser):
    """Bad flags end like any other bad input: one paragraph on stderr, exit code 2, quoting the
    input short (argparse's own messages repeat it whole)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", int, _whole)
        self.register("type", float, _real)

    def error(self, message: str):
        message = excerpt_words(message)
        self.exit(UserError.exit_code, f"{self.prog}: {message}. `{self.prog} --help` lists the options.\n")

    def _parse_optional(self, arg_string: str):
        if _NEGATIVE_VALUE.match(arg_string) and arg_string not in self._option_string_actions:
            return None  # a value, for the option before it
        return super()._parse_optional(arg_string)


# Two spellings of one option: argparse keeps the last one given, so both together say two things.
_SPELLINGS = (("--seq-len", "--context-length"), ("--measure-steps", "--samples"), ("--mode", "--modes"))
# A switch and its negation: argparse keeps the last one given.
_OPPOSITES = (("--cuda-graphs", "--no-cuda-graphs"), ("--compile-decode", "--no-compile-decode"))


def one_spelling(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Refuse ``argv`` (through ``parser.error``) where it gives one option in two spellings, or a switch
    and its negation."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    for first, second in _SPELLINGS:
        if first in given and second in given:
            parser.error(f"{first} and {second} are one option given twice; give only one of them")
    for first, second in _OPPOSITES:
        if first in given and second in given:
            parser.error(f"{first} and {second} contradict; give one of them")
