"""Append-only results: one JSON line per configuration, flushed and fsynced as soon as it exists.

Killing a sweep loses only the run in flight. ``finished_keys`` lets ``--resume`` skip every
configuration that already has a row, whatever its status: an out-of-memory or a crash is a
finished measurement too. Delete a row to run it again. The one exception is ``interrupted``: the
sweep, not the configuration, was stopped, so ``--resume`` runs it again, and its later row
replaces it in ``rows``.

One sweep at a time per directory: ``lock`` takes an exclusive ``flock`` on ``fitbench.lock``,
which holds the holder's PID. The kernel releases it when the holder exits, however it exits, so
a lock left by a killed run is no obstacle.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any, Iterator

from fitbench.errors import UserError

RESULTS_FILE = "results.jsonl"
SWEEP_FILE = "sweep.json"
LOCK_FILE = "fitbench.lock"
INTERRUPTED = "interrupted"


class ResultStore:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / RESULTS_FILE
        self._lock = None  # the open lock file while this process holds the directory

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
        """Every complete row but an ``interrupted`` one that a later row of its key replaced; a line
        cut short by a kill mid-write is skipped."""
        rows = list(self._lines())
        later = {}
        for index, row in enumerate(rows):
            later[row.get("key")] = index
        for index, row in enumerate(rows):
            if row.get("status") != INTERRUPTED or later[row.get("key")] == index:
                yield row

    def _lines(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as handle:
            for line in handle:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue

    def finished_keys(self) -> set[str]:
        return {row["key"] for row in self.rows() if "key" in row and row.get("status") != INTERRUPTED}

    def lock(self) -> None:
        """Hold the directory's lock until ``unlock`` or this process's exit; a UserError naming the
        holder's PID when another process holds it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle = (self.directory / LOCK_FILE).open("a+")
        except OSError as error:
            raise UserError(f"out: {self.directory} cannot be the results directory ({error.strerror}: "
                            f"{error.filename}); pass an --out directory you can write to.") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read(32).strip()
            handle.close()
            raise UserError(f"out: {self.directory} is in use by another fitbench run (PID {holder or 'unknown'}); "
                            f"one sweep writes to a directory at a time. Wait for it to finish (or stop it), or "
                            f"pass another --out.") from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._lock = handle

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def save_sweep(self, sweep: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / (SWEEP_FILE + ".tmp")
        tmp.write_text(json.dumps(sweep, indent=2, default=str))
        os.replace(tmp, self.directory / SWEEP_FILE)

    def load_sweep(self) -> dict[str, Any] | None:
        path = self.directory / SWEEP_FILE
        return json.loads(path.read_text()) if path.exists() else None
