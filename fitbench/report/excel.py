"""One or several sweeps as an Excel workbook (openpyxl): one sheet per mode with every column of
``fitbench.report.columns`` (the quantization ones included), a sheet of provenance, one of every
raw sample, and one of warnings when lines of the results were damaged or a configuration is in
more than one directory. Where the report reads several directories, every sheet starts with the
directory each line comes from.

Numbers are stored as numbers in the unit their header names, never as formatted text, so a
spreadsheet computes with them, each shown with the digits its column names (``NUMBER_FORMATS``:
``fitbench.report.columns``' format specs as Excel's number formats). Every sheet has an autofilter
on its header; the header row is frozen, and in the sheets of rows the configuration column (and the
directory before it) too, so it stays in view beside any figure; a row's status is coloured (green
ok, red otherwise). Each column is as wide as its longest value (up to ``WIDTH_MAX`` characters). Samples are ``timing.samples``: per row and figure (step,
token_latency, time_to_first_token, end_to_end, ...), one line per sample, in seconds.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from openpyxl import Workbook
from openpyxl.styles import Font, PatternFill
from openpyxl.utils import get_column_letter
from openpyxl.worksheet.worksheet import Worksheet

from fitbench.report.columns import formats, rows_table
from fitbench.report.output import write_output
from fitbench.report.provenance import provenance
from fitbench.results.directories import Sweeps
from fitbench.results.terminal import NO_STEPS, Steps

WIDTH_MAX = 60
SAMPLE_HEADERS = ["key", "configuration", "figure", "sample", "seconds"]


# The format specs of fitbench.report.columns as Excel number formats.
NUMBER_FORMATS = {",.0f": "#,##0", ".0f": "0", ".1f": "0.0", "+.1f": "+0.0;-0.0;0.0", ".2f": "0.00",
                  ",.2f": "#,##0.00", ".3g": "#,##0.00"}
STATUS_FILLS = {True: PatternFill("solid", fgColor="C6EFCE"), False: PatternFill("solid", fgColor="FFC7CE")}


def _sheet(sheet: Worksheet, header: list[str], rows: list[list[Any]], digits: list[str | None] | None = None,
           frozen: int = 0) -> None:
    """``rows`` under ``header``, bold, filtered and frozen, the first ``frozen`` columns frozen too;
    column c's numbers shown as ``digits[c]`` says, and a ``status`` column coloured."""
    sheet.append(header)
    for row in rows:
        sheet.append(row)
    for cell in sheet[1]:
        cell.font = Font(bold=True)
    sheet.freeze_panes = f"{get_column_letter(frozen + 1)}2"
    sheet.auto_filter.ref = sheet.dimensions
    for index, name in enumerate(header, start=1):
        longest = max([len(name)] + [len(f"{row[index - 1]:,.4g}" if isinstance(row[index - 1], float)
                                         else str(row[index - 1] or "")) for row in rows])
        sheet.column_dimensions[get_column_letter(index)].width = min(WIDTH_MAX, longest + 2)
        number_format = NUMBER_FORMATS.get((digits or [None] * len(header))[index - 1])
        for (cell,) in sheet.iter_rows(min_row=2, min_col=index, max_col=index):
            if number_format and isinstance(cell.value, (int, float)):
                cell.number_format = number_format
            if name == "status" and cell.value is not None:
                cell.fill = STATUS_FILLS[cell.value == "ok"]


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
                                                    gpu_hour_price=gpu_hour_price),
               formats(directory=sweeps.several), frozen=1 + int(sweeps.several))
        steps.advance()
    _sheet(book.create_sheet("samples"), (["directory"] if sweeps.several else []) + SAMPLE_HEADERS,
           sample_rows(sweeps))
    steps.advance()
    if sweeps.warnings:
        _sheet(book.create_sheet("warnings"), ["warning"], [[warning] for warning in sweeps.warnings])
    buffer = io.BytesIO()
    book.save(buffer)
    return write_output(path, buffer.getvalue(), "--xlsx")
