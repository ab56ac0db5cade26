"""The results directories a report reads: each one's rows, what was wrong with the lines that were
not clean rows, and the command the sweep was started with. ``fitbench report`` and ``fitbench compare``
read each directory here once and pass the rows on to every table and document.

Rows are read through ``fitbench.results.store`` and nothing else: a damaged line is skipped and a
damaged field shown blank there, and each is kept here as a warning, which every report prints
(the HTML page and the workbook each in a section of their own), so no row is dropped unseen.

A report may read several directories (``Sweeps``): a sweep's one-GPU rows in one folder, its
several-GPU rows in others. Each directory keeps its own rows, provenance and NVML timelines; a row
is always looked up in the directory it was read from. A configuration (its ``key``) found in more
than one directory is kept in each, and its rows are labelled by their directory's name (the
shortest trailing part of its path that no other directory of the report ends with), never merged
and never dropped.

A directory given may also be a tree of sweeps (a benchmark's folder of runs): every directory under
it that holds a ``results.jsonl`` is read, in path order, each remembering the tree it was found in
(``SweepRows.tree``) and its place there (``SweepRows.place``), so a table can show them as one with
a folder column and a comparison can pair two trees folder by folder.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from fitbench.results.report import short_names
from fitbench.results.row import Row
from fitbench.results.store import JOB_ROWS, RESULTS_FILE, SWEEP_FILE, SWEEP_MAX_BYTES, ResultStore
from fitbench.util.errors import UserError, excerpt
from fitbench.util.jsonfile import parse_json


@dataclass
class SweepRows:
    """The rows of one sweep directory, the warnings reading them gave, and its saved command."""

    directory: Path
    rows: list[Row]
    warnings: list[str] = field(default_factory=list)
    command: str | None = None
    tree: Path | None = None  # the folder given, where this sweep was found under it
    gpu_hour_price: float | None = None  # the price it was run with (--gpu-hour-price), where given

    @property
    def place(self) -> str:
        """Where this sweep is in the tree it was found in (``weak/ddp-2``); ``.`` for a sweep given itself."""
        return self.directory.relative_to(self.tree).as_posix() if self.tree is not None else "."

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

    def require_rows(self, option: str) -> SweepRows:
        """This sweep, where it holds a row; a UserError naming ``option`` where it holds none (what
        a comparison or a document cannot be made of)."""
        if not self.rows:
            raise UserError(f"{option}: {excerpt(str(self.directory), 200)} holds no readable row"
                            + (f" ({self.warnings[0]})" if self.warnings else "") + "; pass the directory of a "
                            "sweep that finished at least one configuration.")
        return self


def read_sweep(directory: str | Path, option: str = "report",
               on_warning: Callable[[str], None] | None = None) -> SweepRows:
    """The rows of ``directory``, each damaged line a warning, also told to ``on_warning`` as it is read;
    a UserError naming ``option`` when it is no sweep's directory (``_sweep_directory``)."""
    return _read(_sweep_directory(directory, option), on_warning)


def sweep_directories(directory: str | Path, option: str = "report") -> tuple[list[Path], Path | None]:
    """The sweeps ``directory`` names: itself where it holds a sweep's rows (``results.jsonl``, or a SLURM
    sweep's ``rows/``), else every directory under it that does, in path order, with the tree they were found in; a UserError naming ``option``
    when it is empty, a file, or holds no sweep at any depth."""
    path = Path(directory)
    if str(directory).strip() and path.is_dir() and not ResultStore(path).row_files():
        found = sorted({result.parent for result in path.rglob(RESULTS_FILE)}
                       | {rows.parent for rows in path.rglob(JOB_ROWS) if rows.is_dir()})
        if found:
            return found, path
    return [_sweep_directory(directory, option)], None


def _sweep_directory(directory: str | Path, option: str) -> Path:
    """``directory`` as a path, where it holds a sweep's rows (``results.jsonl``, or a SLURM sweep's
    ``rows/``); a UserError naming ``option`` when it is empty, a file, or holds neither."""
    if not str(directory).strip():
        raise UserError(f"{option}: a directory was given as an empty path; pass the --out directory of a "
                        f"`fitbench run`.")
    path = Path(directory)
    if path.is_file():
        raise UserError(f"{option}: {excerpt(str(directory), 200)} is a file; pass the --out directory of a "
                        f"`fitbench run` (it holds {RESULTS_FILE}).")
    if not ResultStore(path).row_files():  # one that cannot be read is the store's to say why
        raise UserError(f"{option}: {directory} has no {RESULTS_FILE} (nor a SLURM sweep's {JOB_ROWS}/), nor a folder "
                        f"under it that has one. Pass the --out directory of a `fitbench run`, or a folder of several.")
    return path


def _read(path: Path, on_warning: Callable[[str], None] | None, tree: Path | None = None) -> SweepRows:
    warnings: list[str] = []

    def warned(warning: str) -> None:
        warnings.append(warning)
        if on_warning is not None:
            on_warning(warning)

    rows = list(ResultStore(path, on_bad_line=warned).typed_rows())
    saved = _saved_sweep(path / SWEEP_FILE)
    command, config = saved.get("command"), saved.get("config")
    price = config.get("gpu_hour_price") if isinstance(config, dict) else None
    return SweepRows(path, rows, warnings, command if isinstance(command, str) else None, tree,
                     float(price) if isinstance(price, (int, float)) and not isinstance(price, bool)
                     and 0 <= price < float("inf") else None)


def _saved_sweep(path: Path) -> dict:
    """What ``sweep.json`` holds (its command, its options), empty when the file is missing or not fitbench's."""
    try:
        if not path.is_file() or path.stat().st_size > SWEEP_MAX_BYTES:
            return {}
        value, problem = parse_json(path.read_bytes())
    except OSError:
        return {}
    return value if isinstance(value, dict) and not problem else {}


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

    def given(self) -> list[list[SweepRows]]:
        """The sweeps as they were given: each sweep given itself alone, those found in one tree together."""
        groups: list[list[SweepRows]] = []
        for sweep in self.sweeps:
            if groups and sweep.tree is not None and groups[-1][0].tree == sweep.tree:
                groups[-1].append(sweep)
            else:
                groups.append([sweep])
        return groups

    @property
    def saved_price(self) -> float | None:
        """The GPU-hour price the sweeps were run with, where those that saved one agree; None otherwise."""
        prices = {sweep.gpu_hour_price for sweep in self.sweeps if sweep.gpu_hour_price is not None}
        return prices.pop() if len(prices) == 1 else None

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


def read_sweeps(directories: str | Path | Iterable[str | Path], option: str = "report",
                on_warning: Callable[[str], None] | None = None) -> Sweeps:
    """The rows of each of ``directories`` (one or several, in the order given; a tree of sweeps is each
    sweep under it, ``sweep_directories``), each read by ``read_sweep``; a UserError naming ``option``
    when none is given or one is given twice."""
    given = [directories] if isinstance(directories, (str, Path)) else list(directories)
    if not given:
        raise UserError(f"{option}: was given no directory; pass the --out directory of a `fitbench run`.")
    sweeps: list[SweepRows] = []
    seen: dict[Path, str | Path] = {}
    for directory in given:
        paths, tree = sweep_directories(directory, option)
        for path in paths:
            place = path.resolve()
            if place in seen:
                raise UserError(f"{option}: {excerpt(str(path), 200)} is given twice (as "
                                f"{excerpt(str(seen[place]), 200)} too); give each sweep's directory once.")
            seen[place] = path if tree is not None else directory
            sweeps.append(_read(path, on_warning, tree))
    return Sweeps(sweeps)
