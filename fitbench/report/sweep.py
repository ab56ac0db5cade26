"""A sweep's directory read for a report: its rows, what was wrong with the lines that were not
clean rows, and where the rows came from.

Rows are read through ``fitbench.results.store`` and nothing else: a damaged line is skipped and a
damaged field shown blank there, and each is kept here as a warning, which every report prints
(the HTML page and the workbook each in a section of their own), so no row is dropped unseen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fitbench.results.row import Row
from fitbench.results.store import RESULTS_FILE, SWEEP_FILE, SWEEP_MAX_BYTES, ResultStore
from fitbench.util.errors import UserError, excerpt
from fitbench.util.jsonfile import parse_json


@dataclass
class SweepRows:
    """The rows of one sweep directory, the warnings reading them gave, and its saved command."""

    directory: Path
    rows: list[Row]
    warnings: list[str] = field(default_factory=list)
    command: str | None = None

    def timeline(self, row: Row) -> Path | None:
        """The NVML timeline the row names (``gpu_monitor.timeline``), found in this directory by its
        place under ``artifacts/<key>/<attempt>/`` (the row holds the path it was written at, which a
        moved or committed folder no longer has), plain or gzipped; None when there is none."""
        written = (row.gpu_monitor or {}).get("timeline")
        parts = Path(written).parts if isinstance(written, str) else ()
        if "artifacts" not in parts:
            return None
        path = self.directory.joinpath(*parts[len(parts) - parts[::-1].index("artifacts") - 1:])
        return path if path.exists() or path.with_name(path.name + ".gz").exists() else None


def read_sweep(directory: str | Path, option: str = "report DIR") -> SweepRows:
    """The rows of ``directory``; a UserError naming ``option`` when it is no sweep's directory (no
    ``results.jsonl``) or holds no row at all."""
    path = Path(directory)
    if not str(directory).strip():
        raise UserError(f"{option}: was given an empty path; pass the --out directory of a `fitbench run`.")
    if path.is_file():
        raise UserError(f"{option}: {excerpt(str(directory), 200)} is a file; pass the --out directory of "
                        f"a `fitbench run` (it holds {RESULTS_FILE}).")
    if not (path / RESULTS_FILE).is_file():
        raise UserError(f"{option}: {excerpt(str(directory), 200)} has no {RESULTS_FILE}, so it is not a "
                        f"sweep's directory; pass the --out directory of a `fitbench run`.")
    warnings: list[str] = []
    rows = list(ResultStore(path, on_bad_line=warnings.append).typed_rows())
    if not rows:
        raise UserError(f"{option}: {excerpt(str(directory), 200)}/{RESULTS_FILE} holds no readable row"
                        + (f" ({warnings[0]})" if warnings else "") + "; pass the directory of a sweep that "
                        "finished at least one configuration.")
    return SweepRows(path, rows, warnings, _saved_command(path / SWEEP_FILE))


def _saved_command(path: Path) -> str | None:
    """The command line saved in ``sweep.json``, None when the file is missing or not fitbench's."""
    try:
        if not path.is_file() or path.stat().st_size > SWEEP_MAX_BYTES:
            return None
        value, problem = parse_json(path.read_bytes())
    except OSError:
        return None
    command = value.get("command") if isinstance(value, dict) and not problem else None
    return command if isinstance(command, str) else None
