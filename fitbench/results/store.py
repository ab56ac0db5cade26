"""Append-only results: one JSON line per configuration, flushed and fsynced as soon as it exists.

Killing a sweep loses only the run in flight. ``finished_keys`` lets ``--resume`` skip every
configuration that already has a row, whatever its status: an out-of-memory or a crash is a
finished measurement too. Delete a row to run it again. The exceptions are the statuses of
``RERUN_STATUSES`` (``interrupted``; a SLURM job ``cancelled``, ``preempted`` or ``node_failed``): the
sweep, not the configuration, was stopped, so ``--resume`` runs it again, and its later row
replaces it in ``rows``.

Rows come from two kinds of writer, never two on one file: the sweep's own process appends to
``results.jsonl``; a SLURM job writes its configuration's row alone to ``rows/<key>.json``
(``write_job_row``), whole, through a rename. ``rows`` merges both: a job's file comes after the
lines, so it replaces a line of its key that says the job was stopped.

The file outlives the code that wrote it and the people who edit it: a line that is not a row (cut
short by a kill, not JSON, not UTF-8, not an object with a ``key``, a ``status`` and a ``spec``) is
skipped, and a row with damaged fields is read with them blank (``fitbench.results.schema``, then
``fitbench.results.row.typed_row`` for the fields no report reads); either is reported once through
``on_bad_line``, with its line number and the fields, and everything else still reads. Rows of
every schema version read (``fitbench.results.row``): those from before versions as version 0, and
one from a newer fitbench for the fields this one knows, reported the same way. ``rows`` gives each row as the dict it was written as (its damaged fields dropped);
``typed_rows`` gives the same rows as ``Row``, which the renderers read. A write that fails (a full
disk) leaves the file as it was before the write began.

One sweep at a time per directory: ``lock`` takes an exclusive ``flock`` on ``fitbench.lock``,
which holds the holder's PID. The kernel releases it when the holder exits, however it exits, so
a lock left by a killed run is no obstacle.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from fitbench.results.row import RERUN_STATUSES, SCHEMA_VERSION, Row, typed_row, version
from fitbench.results.schema import check_row
from fitbench.util.errors import UserError, excerpt
from fitbench.util.jsonfile import parse_json, read_json

RESULTS_FILE = "results.jsonl"
JOB_ROWS = "rows"
SWEEP_FILE = "sweep.json"
LOCK_FILE = "fitbench.lock"
SWEEP_MAX_BYTES = 10_000_000
# A row is kilobytes (its raw samples included); a line far longer is not one, and is not read whole.
ROW_MAX_BYTES = 16_000_000
# A full disk, a file grown past RLIMIT_FSIZE, a quota, a file system remounted read-only mid-sweep.
DISK_ERRORS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS}
# A file of garbage would print a warning per line; past these, one line counts the rest.
WARNINGS_MAX = 10


# A row as read: the fields written (those a report reads checked) and the same row typed.
Read = tuple[dict[str, Any], Row]


def _row_problem(line: bytes) -> tuple[Read | None, str]:
    """The row on ``line`` (its damaged fields dropped: ``fitbench.results.schema``, then
    ``typed_row``) and what was dropped, or None and why it is not a row."""
    value, problem = parse_json(line)
    if problem:
        return None, problem
    row, problem, dropped = check_row(value)
    if problem:
        return None, problem
    typed, left_out = typed_row(row)
    dropped += left_out
    shown = "; ".join(dropped[:3]) + (f"; and {len(dropped) - 3} more" if len(dropped) > 3 else "")
    problems = [f"has {shown}; shown blank"] if dropped else []
    if version(row) > SCHEMA_VERSION:
        problems.insert(0, f"has schema version {version(row)}, newer than this fitbench's {SCHEMA_VERSION}: read "
                           f"for the fields this version knows (a newer fitbench reads them all)")
    return (row, typed), "; ".join(problems)


def _bounded_lines(handle) -> Iterator[bytes]:
    """The file's lines; b"" for one longer than ``ROW_MAX_BYTES``, which is never held whole."""
    while line := handle.readline(ROW_MAX_BYTES + 1):
        if len(line) > ROW_MAX_BYTES:
            while line and not line.endswith(b"\n"):
                line = handle.readline(ROW_MAX_BYTES)
            yield b""
        else:
            yield line


class ResultStore:
    def __init__(self, directory: str | Path, on_bad_line: Callable[[str], None] | None = None):
        self.directory = Path(directory)
        self.path = self.directory / RESULTS_FILE
        self.on_bad_line = on_bad_line
        self._reported: set[int] = set()
        self._reported_files: set[str] = set()
        self._lock = None  # the open lock file while this process holds the directory

    def append(self, row: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        line = json.dumps(row, default=str).encode() + b"\n"
        # Unbuffered: a failed write raises here, where the file is cut back, not later when a buffer flushes.
        with self.path.open("a+b", buffering=0) as handle:
            size = handle.seek(0, os.SEEK_END)
            if size > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":
                    line = b"\n" + line  # a line cut short by a kill must not swallow this row
            try:
                rest = memoryview(line)
                while rest:
                    rest = rest[handle.write(rest):]
                os.fsync(handle.fileno())
            except OSError as error:
                handle.truncate(size)  # no half row: the file stays as every earlier write left it
                raise self._write_error(error, "a row") from None

    def _write_error(self, error: OSError, what: str) -> OSError | UserError:
        if error.errno not in DISK_ERRORS:
            return error
        return UserError(f"out: writing {what} to {self.directory} failed: {error.strerror}. The rows written "
                         f"before are intact; make room and `fitbench run --resume {self.directory}` finishes the "
                         f"sweep.")

    def write_job_row(self, row: dict[str, Any]) -> Path:
        """Write ``row``, a SLURM job's, to ``rows/<key>.json``, whole or not at all; its path."""
        directory = self.directory / JOB_ROWS
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{row['key']}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with tmp.open("wb") as handle:
                handle.write(json.dumps(row, default=str).encode())
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise self._write_error(error, "a row") from None
        os.replace(tmp, path)
        return path

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every complete row, those of ``results.jsonl`` then the jobs' files, but one of
        ``RERUN_STATUSES`` that a later row of its key replaced; any other line is skipped, damaged
        fields are left out (see the module's docstring)."""
        return (fields for fields, _ in self._read())

    def typed_rows(self) -> Iterator[Row]:
        """The rows of ``rows``, typed."""
        return (typed for _, typed in self._read())

    def _read(self) -> Iterator[Read]:
        rows = [*self._lines(), *self._job_rows()]
        later = {}
        for index, (_, row) in enumerate(rows):
            later[row.key] = index
        for index, (fields, row) in enumerate(rows):
            if row.status not in RERUN_STATUSES or later[row.key] == index:
                yield fields, row

    def _job_rows(self) -> Iterator[Read]:
        directory = self.directory / JOB_ROWS
        if not directory.is_dir():
            return
        for path in sorted(directory.glob("*.json")):
            try:
                line = path.read_bytes()
            except OSError:
                continue
            row, problem = _row_problem(line)
            if row is not None:
                yield row
            if problem and str(path) not in self._reported_files:
                self._reported_files.add(str(path))
                if self.on_bad_line:
                    self.on_bad_line(f"{path} {problem}" + ("; skipped" if row is None else ""))

    def _lines(self) -> Iterator[Read]:
        if not self.path.exists():
            return
        try:
            handle = self.path.open("rb")
        except OSError as error:
            raise UserError(f"out: cannot read {self.path}: {error.strerror}. It holds the sweep's rows; make it a "
                            f"readable file, or start a new sweep with --out.") from None
        unreported = []
        with handle:
            for number, line in enumerate(_bounded_lines(handle), start=1):
                if line and not line.strip():
                    continue
                row, problem = _row_problem(line) if line else (None, f"is longer than {ROW_MAX_BYTES:,} bytes")
                if row is not None:
                    yield row
                if problem and number not in self._reported:
                    self._reported.add(number)
                    if len(self._reported) <= WARNINGS_MAX:
                        if self.on_bad_line:
                            self.on_bad_line(f"{self.path}: line {number} {problem}"
                                             + ("; skipped" if row is None else ""))
                    else:
                        unreported.append(number)
        if unreported and self.on_bad_line:
            self.on_bad_line(f"{self.path}: {len(unreported)} more damaged line(s), lines {unreported[0]} to "
                             f"{unreported[-1]}; skipped or shown with fields blank")

    def row_files(self) -> list[Path]:
        """Where this directory's rows are: ``results.jsonl`` and the jobs' ``rows/``, those that exist."""
        return [path for path in (self.path, self.directory / JOB_ROWS) if path.exists()]

    def finished_keys(self) -> set[str]:
        return {row.key for row in self.typed_rows() if row.status not in RERUN_STATUSES}

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
            holder = excerpt(handle.read(32).strip().split("\n")[0], 20).strip("'\"")
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
        try:
            tmp.write_text(json.dumps(sweep, indent=2, default=str))
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise self._write_error(error, SWEEP_FILE) from None
        os.replace(tmp, self.directory / SWEEP_FILE)

    def load_sweep(self) -> Any:
        """The saved sweep as JSON, None when there is none; a file that is not JSON is a UserError (what
        it holds is validated by ``fitbench.config.saved_options``)."""
        path = self.directory / SWEEP_FILE
        if not path.is_file():
            return None
        return read_json(path, limit=SWEEP_MAX_BYTES, field="resume",
                         fix="The saved sweep is damaged (not saved by fitbench, or edited since); start a new "
                             "sweep with --out.")
