"""The one exception type that reaches the user as a message instead of a traceback."""

from __future__ import annotations

import re
import reprlib
from typing import Any


class UserError(Exception):
    """Bad input: the message names the field and says how to fix it. The CLI prints it and exits 2."""

    exit_code = 2


EXCERPT_CHARS = 60

# Nested input (a YAML alias bomb, a huge list) is cut by depth and width before it is turned into text.
_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxtuple, _short.maxset = 2, 4, 4, 4, 4
_short.maxstring, _short.maxother, _short.maxlong = EXCERPT_CHARS, EXCERPT_CHARS, EXCERPT_CHARS


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` of at most ``limit`` characters: messages quote input, never echo it whole."""
    text = _short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def excerpt_words(text: str, word: int = EXCERPT_CHARS, limit: int = 400) -> str:
    """``text`` (a message that repeats input, as argparse's do) with each word, and the whole, cut short."""
    text = re.sub(r"\S{%d,}" % (word + 1), lambda match: match.group(0)[: word - 3] + "...", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
