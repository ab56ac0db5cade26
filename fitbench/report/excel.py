"""One or several sweeps as an Excel workbook (openpyxl): one sheet per mode with every column of
``fitbench.report.columns`` (the quantization ones included), a sheet of provenance, one of every
raw sample, and one of warnings when lines of the results were damaged or a configuration is in
more than one directory. Where the report reads several directories, every sheet starts with the
directory each line comes from.

Numbers are stored as numbers in the unit their header names, never as formatted text, so a
spreadsheet computes with them; the header row is frozen and each column is as wide as its longest
value (up to ``WIDTH_MAX`` characters). Samples are ``timing.samples``: per row and figure (step,
token_latency, time_to_first_token, end_to_end, ...), one line per sample, in seconds.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from openpyxl import Workbook
from openpyxl.styles import Font
from openpyxl.utils import get_column_letter
from openpyxl.worksheet.worksheet import Worksheet

from fitbench.report.columns import rows_table
from fitbench.report.output import write_output
from fitbench.report.provenance import provenance
from fitbench.results.directories import Sweeps
from fitbench.results.terminal import NO_STEPS, Steps

WIDTH_MAX = 60
SAMPLE_HEADERS = ["key", "configuration", "figure", "sample", "seconds"]


def _sheet(sheet: Worksheet, header: list[str], rows: list[list[Any]]) -> None:
    sheet.append(header)
    for row in rows:
        sheet.append(row)
    for cell in sheet[1]:
        cell.font = Font(bold=True)
    sheet.freeze_panes = "A2"
    for index, name in enumerate(header, start=1):
        longest = max([len(name)] + [len(f"{row[index - 1]:,.4g}" if isinstance(row[index - 1], float)
                                         else str(row[index - 1] or "")) for row in rows])
        sheet.column_dimensions[get_column_letter(index)].width = min(WIDTH_MAX, longest + 2)


def sample_rows(sweeps: Sweeps) -> list[list[Any]]:
    """Every raw sample of every row: (key, configuration, figure, index from 1, seconds), after the
    row's directory where the report reads several."""
    lines = []
    for row in sweeps.rows:
        where = [sweeps.name(row)] if sweeps.several else []
        for figure, values in ((row.timing or {}).get("samples") or {}).items():
            if isinstance(values, list):
                lines += [where + [row.key, row.label, figure, index, value]
                          for index, value in enumerate(values, start=1)]
    return lines


def _provenance(sweeps: Sweeps) -> tuple[list[str], list[list[str]]]:
    if not sweeps.several:
        return ["what", "value"], [list(line) for line in provenance(sweeps.sweeps[0])]
    return ["directory", "what", "value"], [[name, *line] for name, sweep in zip(sweeps.names, sweeps.sweeps)
                                            for line in provenance(sweep)]


def write_xlsx(sweeps: Sweeps, path: str | Path, steps: Steps = NO_STEPS, gpu_hour_price: float | None = None) -> Path:
    """The workbook of ``sweeps`` (one directory's rows, or several read together:
    ``fitbench.results.directories.read_sweeps``) written to ``path``, each sheet of rows a step of
    ``steps``; bad input is a ``UserError``."""
    book = Workbook()
    _sheet(book.active, *_provenance(sweeps))
    book.active.title = "provenance"
    modes = list(dict.fromkeys(row.spec["mode"] for row in sweeps.rows))
    steps.begin("workbook sheets", len(modes) + 1)
    for mode in modes:
        _sheet(book.create_sheet(mode), *rows_table(sweeps, [row for row in sweeps.rows if row.spec["mode"] == mode],
                                                    gpu_hour_price=gpu_hour_price))
        steps.advance()
    _sheet(book.create_sheet("samples"), (["directory"] if sweeps.several else []) + SAMPLE_HEADERS,
           sample_rows(sweeps))
    steps.advance()
    if sweeps.warnings:
        _sheet(book.create_sheet("warnings"), ["warning"], [[warning] for warning in sweeps.warnings])
    buffer = io.BytesIO()
    book.save(buffer)
    return write_output(path, buffer.getvalue(), "--xlsx")
