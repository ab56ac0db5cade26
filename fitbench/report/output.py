"""Writing a report's file, where an output path that cannot be written is bad input, not a traceback."""

from __future__ import annotations

from pathlib import Path

from fitbench.util.errors import UserError, excerpt


def write_output(path: str | Path, data: str | bytes, option: str) -> Path:
    """``data`` written to ``path`` (its parent directory made); a UserError naming ``option`` when the
    path is empty, a directory, or cannot be written."""
    if not str(path).strip():
        raise UserError(f"{option}: was given an empty path; give the file to write.")
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{option}: {excerpt(str(path), 200)} is a directory; give a file path to write.")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            target.write_bytes(data)
        else:
            target.write_text(data, encoding="utf-8")
    except OSError as error:
        raise UserError(f"{option}: cannot write {excerpt(str(path), 200)}: {error.strerror}. Give a path in a "
                        f"directory you can write to.") from None
    return target
