"""Append-only results: one JSON line per configuration, flushed and fsynced as soon as it exists.

Killing a sweep loses only the run in flight. ``finished_keys`` lets ``--resume`` skip every
configuration that already has a row, whatever its status: an out-of-memory or a crash is a
finished measurement too. Delete a row to run it again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

RESULTS_FILE = "results.jsonl"
SWEEP_FILE = "sweep.json"


class ResultStore:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / RESULTS_FILE

    def append(self, row: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        line = json.dumps(row, default=str).encode() + b"\n"
        with self.path.open("a+b") as handle:
            if handle.seek(0, os.SEEK_END) > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":
                    line = b"\n" + line  # a line cut short by a kill must not swallow this row
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every complete row; a line cut short by a kill mid-write is skipped."""
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as handle:
            for line in handle:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue

    def finished_keys(self) -> set[str]:
        return {row["key"] for row in self.rows() if "key" in row}

    def save_sweep(self, sweep: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / (SWEEP_FILE + ".tmp")
        tmp.write_text(json.dumps(sweep, indent=2, default=str))
        os.replace(tmp, self.directory / SWEEP_FILE)

    def load_sweep(self) -> dict[str, Any] | None:
        path = self.directory / SWEEP_FILE
        return json.loads(path.read_text()) if path.exists() else None
