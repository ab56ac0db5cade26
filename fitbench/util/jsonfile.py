"""JSON that a person may have edited, cut or replaced: a model's config.json, a saved sweep, a line
of results. One reader, so that every such file fails the same way: a size bound read before
anything is parsed (``read_bounded``, which the sweep's YAML file goes through too), and one sentence
for each way bytes can fail to be JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fitbench.util.errors import UserError


def parse_json(raw: bytes) -> tuple[Any, str | None]:
    """(the value, None), or (None, why ``raw`` is not JSON) as the end of a sentence that begins with
    what it is ("<file> ..."): not UTF-8, empty, not valid JSON and where."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start})"
    if not text.strip():
        return None, "is empty"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as error:
        return None, f"is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})"
    except ValueError:  # Python refuses to read an integer of thousands of digits
        return None, "is not valid JSON (a number with too many digits)"
    except RecursionError:  # arrays nested thousands deep
        return None, "is not valid JSON (nested too deeply)"


def read_bounded(path: str | Path, *, limit: int, field: str, fix: str) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them, or a UserError: ``field`` (the option the file
    came through), the file, why it cannot be read or that it is larger, and ``fix``."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as error:
        raise UserError(f"{field}: cannot read {path}: {error.strerror}. {fix}") from None
    if len(raw) > limit:
        raise UserError(f"{field}: {path} is larger than {limit:,} bytes. {fix}")
    return raw


def read_json(path: str | Path, *, limit: int, field: str, fix: str) -> Any:
    """The JSON value in ``path``, of at most ``limit`` bytes, or a UserError: ``field`` (the option
    the file came through), the file, what is wrong with it, and ``fix``."""
    raw = read_bounded(path, limit=limit, field=field, fix=fix)
    value, problem = parse_json(raw)
    if problem:
        raise UserError(f"{field}: {path} {problem}. {fix}")
    return value
