"""The sweep directories a report reads: each one's rows, what was wrong with the lines that were
not clean rows, and where the rows came from.

Rows are read through ``fitbench.results.store`` and nothing else: a damaged line is skipped and a
damaged field shown blank there, and each is kept here as a warning, which every report prints
(the HTML page and the workbook each in a section of their own), so no row is dropped unseen.

A report may read several directories (``Sweeps``): a sweep's one-GPU rows in one folder, its
several-GPU rows in others. Each directory keeps its own rows, provenance and NVML timelines; a row
is always looked up in the directory it was read from. A configuration (its ``key``) found in more
than one directory is kept in each, and its rows are labelled by their directory's name (the
shortest trailing part of its path that no other directory of the report ends with), never merged
and never dropped.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from fitbench.results.report import short_names
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


@dataclass
class Sweeps:
    """The sweep directories of one report, in the order given, each with its own rows; ``names``
    the directories' names, ``repeated`` each configuration key found in several, with their names."""

    sweeps: list[SweepRows]
    names: list[str] = field(init=False)
    repeated: dict[str, list[str]] = field(init=False)
    _sweep_of: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        shown = short_names(str(sweep.directory) for sweep in self.sweeps)
        self.names = [shown[str(sweep.directory)] for sweep in self.sweeps]
        # Rows are not hashable; each is one object, read once, and held here as long as its sweep.
        self._sweep_of = {id(row): index for index, sweep in enumerate(self.sweeps) for row in sweep.rows}
        places: dict[str, list[str]] = defaultdict(list)
        for name, sweep in zip(self.names, self.sweeps):
            for key in dict.fromkeys(row.key for row in sweep.rows):
                places[key].append(name)
        self.repeated = {key: names for key, names in places.items() if len(names) > 1}

    @property
    def rows(self) -> list[Row]:
        return [row for sweep in self.sweeps for row in sweep.rows]

    @property
    def several(self) -> bool:
        return len(self.sweeps) > 1

    def name(self, row: Row) -> str:
        """The name of the directory ``row`` was read from."""
        return self.names[self._sweep_of[id(row)]]

    def timeline(self, row: Row) -> Path | None:
        """The row's NVML timeline, in the directory it was read from (``SweepRows.timeline``)."""
        return self.sweeps[self._sweep_of[id(row)]].timeline(row)

    def label(self, row: Row) -> str:
        """The row's label, and its directory's name where its configuration is in several."""
        return f"{row.label} [{self.name(row)}]" if row.key in self.repeated else row.label

    @property
    def warnings(self) -> list[str]:
        """Every directory's damaged lines (each names its file), then each configuration found in
        more than one directory."""
        labels = {row.key: row.label for row in self.rows}
        repeated = [f"{excerpt(labels[key], 120)} is in {len(names)} directories ({', '.join(names)}); each row is "
                    f"kept, labelled by its directory" for key, names in self.repeated.items()]
        return [warning for sweep in self.sweeps for warning in sweep.warnings] + repeated


def read_sweeps(directories: str | Path | Iterable[str | Path], option: str = "report DIR") -> Sweeps:
    """The rows of each of ``directories`` (one or several), each read by ``read_sweep``; a UserError
    naming ``option`` when none is given or one is given twice."""
    given = [directories] if isinstance(directories, (str, Path)) else list(directories)
    if not given:
        raise UserError(f"{option}: was given no directory; pass the --out directory of a `fitbench run`.")
    sweeps: list[SweepRows] = []
    for directory in given:
        sweep = read_sweep(directory, option)
        twice = next((earlier for earlier in sweeps if earlier.directory.resolve() == sweep.directory.resolve()), None)
        if twice is not None:
            raise UserError(f"{option}: {excerpt(str(directory), 200)} is given twice (as "
                            f"{excerpt(str(twice.directory), 200)} too); give each sweep's directory once.")
        sweeps.append(sweep)
    return Sweeps(sweeps)
