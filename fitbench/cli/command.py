"""A command of ``fitbench``, as plain data: ``fitbench.cli`` builds the parser from these."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

# Adds some options to a command's parser, in the order its --help lists them.
OptionGroup = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    """``name``: what the user types; ``summary``: its line in ``fitbench --help``; ``function``: runs it
    on the parsed arguments and returns the exit status (its docstring is the description atop the
    command's --help); ``options``: its option groups (``fitbench.cli.options``); ``examples``: the
    text under its --help."""

    name: str
    summary: str
    function: Callable[[argparse.Namespace], int]
    options: tuple[OptionGroup, ...] = ()
    examples: str | None = None
