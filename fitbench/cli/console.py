"""Where the commands write: ``console`` (standard output) and ``errors`` (standard error)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape

# Outside a terminal (CI logs, pipes) rich would wrap tables at 80 columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True, highlight=False)


def warn(message: str) -> None:
    """One warning line on standard error."""
    errors.print(f"fitbench: warning: {escape(message)}", soft_wrap=True)
