"""One or several sweeps as one self-contained HTML page: provenance (per directory), warnings, the
written analysis, a sortable table of the rows (with the directory of each where there are
several) and the plots of ``fitbench.report.figures``.

Nothing is fetched when the page is viewed: the styles, the table's sorting script and plotly's
script are inline (plotly once, before the first plot), so the file can be mailed or archived and
opens offline. A comparison of two sweeps (``fitbench.report.compare``) renders on the same page.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from fitbench.report.columns import formats, rows_table
from fitbench.report.compare import Comparison
from fitbench.report.figures import FIGURES
from fitbench.report.output import write_output
from fitbench.report.provenance import provenance
from fitbench.results.directories import Sweeps
from fitbench.results.terminal import NO_STEPS, Steps

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { white-space: normal; min-width: 4em; max-width: 9em; vertical-align: bottom; }
#rows td.text:first-child, #rows td.text:nth-child(2) { white-space: normal; min-width: 14em; max-width: 24em; }
td.text, th.text { text-align: left; }
table.sortable th { cursor: pointer; background: #f4f4f4; position: sticky; top: 0; }
table.sortable th[aria-sort=ascending]::after { content: " \\25B2"; }
table.sortable th[aria-sort=descending]::after { content: " \\25BC"; }
.scroll { overflow-x: auto; max-height: 80vh; }
.warning { color: #8a4b00; } .slower { color: #b00020; } .faster { color: #1b7d2e; }
.analysis { background: #f8f8f8; padding: 0.8em; border-left: 3px solid #888; }
.caption { color: #555; font-size: 0.9em; }
table.facts td.text { white-space: normal; overflow-wrap: anywhere; max-width: 1100px; }
"""

# Sorts a table by the clicked column: numbers (a cell's data-sort) as numbers, blanks last.
SORT_SCRIPT = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, column) {
    th.addEventListener("click", function () {
      var ascending = th.getAttribute("aria-sort") !== "ascending";
      table.querySelectorAll("th").forEach(function (other) { other.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      function key(row) {
        var cell = row.cells[column];
        var text = cell.hasAttribute("data-sort") ? cell.getAttribute("data-sort") : cell.textContent;
        var number = parseFloat(text);
        return text === "" ? null : (isNaN(number) || !cell.hasAttribute("data-sort") ? text : number);
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === null || y === null) { return x === y ? 0 : (x === null ? 1 : -1); }
        var order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
        return ascending ? order : -order;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""


def _cell(value: Any, digits: str | None = None) -> str:
    """A table cell: numbers shown as ``digits`` says (a format spec), else to four significant figures,
    and sorted by their full value."""
    if value is None:
        return '<td data-sort=""></td>'
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        shown = format(value, digits) if digits else f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"
        return f'<td data-sort="{value!r}">{shown}</td>'
    return f'<td class="text">{html.escape(str(value))}</td>'


def table(header: list[str], rows: list[list[Any]], text_columns: int = 0,
          digits: list[str | None] | None = None) -> str:
    """A sortable table; ``rows`` of plain values (``_cell``), column ``c`` shown as ``digits[c]`` says."""
    head = "".join(f'<th class="text">{html.escape(name)}</th>' if index < text_columns
                   else f"<th>{html.escape(name)}</th>" for index, name in enumerate(header))
    digits = digits or [None] * len(header)
    body = "\n".join("<tr>" + "".join(_cell(value, digits[c]) for c, value in enumerate(row)) + "</tr>"
                     for row in rows)
    return (f'<div class="scroll"><table class="sortable"><thead><tr>{head}</tr></thead>'
            f"<tbody>\n{body}\n</tbody></table></div>")


def _facts(lines: list[tuple[str, str]]) -> str:
    return '<table class="facts">' + "".join(f'<tr><th class="text">{html.escape(name)}</th><td class="text">'
                               f"{html.escape(value)}</td></tr>" for name, value in lines) + "</table>"


def page(title: str, sections: list[str]) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<style>{STYLE}</style></head>\n<body><h1>{html.escape(title)}</h1>\n" + "\n".join(sections)
            + f"\n<script>{SORT_SCRIPT}</script></body></html>\n")


def _warnings(warnings: list[str], several: bool = False) -> str:
    """The warnings of reading the rows; with ``several`` directories, the configurations in more than one too."""
    if not warnings:
        return ""
    items = "".join(f"<li>{html.escape(warning)}</li>" for warning in warnings)
    repeated = (", and configurations found in more than one directory (each row kept, labelled by its "
                "directory)") if several else ""
    return (f'<section id="warnings"><h2>Warnings</h2><p class="warning">Lines of the results that were not '
            f"clean rows (skipped, or read with the fields named left blank){repeated}.</p>"
            f'<ul class="warning">{items}</ul></section>')


def _provenance(sweeps: Sweeps) -> str:
    """One table of provenance; for several directories, one each under its name, folded to a line
    (its devices and rows) so the plots stay near the top of the page."""
    if not sweeps.several:
        return f'<section id="provenance"><h2>Provenance</h2>{_facts(provenance(sweeps.sweeps[0]))}</section>'
    parts = []
    for name, sweep in zip(sweeps.names, sweeps.sweeps):
        facts = provenance(sweep)
        summary = dict(facts)
        parts.append(f"<details><summary>{html.escape(name)}: {html.escape(summary['devices'])}; "
                     f"{len(sweep.rows)} row(s)</summary>{_facts(facts)}</details>")
    return (f'<section id="provenance"><h2>Provenance</h2><p class="caption">{len(sweeps.sweeps)} sweep '
            f"directories, each as it was read; open one for its versions, commands and dates.</p>"
            f"{''.join(parts)}</section>")


def plots(sweeps: Sweeps, steps: Steps = NO_STEPS) -> list[str]:
    """One section per figure that has something to show; plotly's script inline before the first.
    Each figure is a step of ``steps``."""
    sections, script = [], True
    steps.begin("plots", len(FIGURES))
    for plot in FIGURES:
        figure = plot.make(sweeps)
        steps.advance()
        if figure is None:
            continue
        body = figure.to_html(full_html=False, include_plotlyjs=script, div_id=f"plot-{plot.name}",
                              config={"displaylogo": False, "responsive": True})
        script = False
        sections.append(f'<section class="figure" id="figure-{plot.name}"><h2>{html.escape(plot.title)}</h2>'
                        f'<p class="caption">{html.escape(plot.caption)}</p>{body}</section>')
    return sections


def markdown_html(text: str) -> str:
    """The few Markdown forms a model's short analysis uses, as HTML: ``#`` headings, ``-``, ``*`` and
    ``1.`` lists, paragraphs, ``**bold**``, ``*emphasis*`` and ``code``; everything else is text,
    escaped."""
    def inline(line: str) -> str:
        line = html.escape(line)
        line = re.sub(r"`([^`]+)`", r"<code>\1</code>", line)
        line = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", line)
        return re.sub(r"(?<![*\w])\*(?!\s)(.+?)(?<!\s)\*(?![*\w])", r"<em>\1</em>", line)

    parts, paragraph, items, ordered = [], [], [], False

    def flush() -> None:
        nonlocal paragraph, items
        if paragraph:
            parts.append(f"<p>{' '.join(inline(line) for line in paragraph)}</p>")
        if items:
            tag = "ol" if ordered else "ul"
            parts.append(f"<{tag}>" + "".join(f"<li>{inline(item)}</li>" for item in items) + f"</{tag}>")
        paragraph, items = [], []

    for line in text.splitlines():
        stripped = line.strip()
        heading = re.match(r"(#{1,6})\s+(.*)", stripped)
        item = re.match(r"(?:[-*]|(\d+)[.)])\s+(.*)", stripped)
        if not stripped or heading:
            flush()
            if heading:
                level = min(6, len(heading.group(1)) + 2)  # under the page's own h1 and h2
                parts.append(f"<h{level}>{inline(heading.group(2))}</h{level}>")
        elif item:
            if paragraph or (items and ordered != bool(item.group(1))):
                flush()
            ordered = bool(item.group(1))
            items.append(item.group(2))
        elif items:
            items[-1] += " " + stripped  # a list item's continued line
        else:
            paragraph.append(stripped)
    flush()
    return "\n".join(parts)


def write_html(sweeps: Sweeps, path: str | Path, analysis: str | None = None, steps: Steps = NO_STEPS,
               gpu_hour_price: float | None = None, analysis_model: str | None = None) -> Path:
    """The report of ``sweeps`` (one directory's rows, or several read together:
    ``fitbench.results.directories.read_sweeps``) written to ``path``: the rows first, ``analysis``
    (text, Markdown; ``analysis_model`` wrote it) under them, then the provenance, the warnings and the
    plots. Returns the path written; bad input is a ``UserError``."""
    header, values = rows_table(sweeps, sweeps.rows, html=True, gpu_hour_price=gpu_hour_price)
    # The measured rows first, so that the page's first screen holds figures; then where they came from.
    sections = [f'<section id="rows"><h2>Rows</h2><p class="caption">Measurements first, each with its unit; '
                f"click a header to sort. Every field and raw sample is in each directory's results.jsonl.</p>"
                f"{table(header, values, 2 + int(sweeps.several), formats(True, sweeps.several))}</section>"]
    if analysis:
        by = f" by {html.escape(analysis_model)}" if analysis_model else ""
        sections.append(f'<section id="analysis"><h2>Analysis{by}</h2><p class="caption">Written by a language model '
                        f"from the rows above; check its figures against them.</p><div class=\"analysis\">"
                        f"{markdown_html(analysis)}</div></section>")
    sections += [_provenance(sweeps), _warnings(sweeps.warnings, sweeps.several)]
    sections += plots(sweeps, steps)
    title = ", ".join(sweeps.names) if sweeps.several else str(sweeps.sweeps[0].directory)
    return write_output(path, page(f"fitbench report: {title}", sections), "--html")


def write_comparison_html(comparison: Comparison, path: str | Path) -> Path:
    """``comparison`` as a page: the verdict (one line per gate), the table of changes (one row per
    configuration) and each sweep's provenance."""
    header, rows = comparison.table()
    only = "".join(f"<li>only in {html.escape(side)}: {html.escape(label)}</li>"
                   for side, labels in (("A", comparison.only_a), ("B", comparison.only_b)) for label in labels)
    only += "".join(f"<li>not ok on a side: {html.escape(text)}</li>" for text in comparison.not_comparable)
    verdict = "".join(f"<p>{html.escape(line)}</p>" for line in comparison.verdict())
    sections = [f'<section id="verdict"><h2>Verdict</h2><div class="{"slower" if comparison.failed else "faster"}">'
                f"{verdict}</div>{f'<ul>{only}</ul>' if only else ''}</section>",
                f'<section id="changes"><h2>Changes, B against A</h2><p class="caption">{html.escape(comparison.method)}'
                f"</p>{table(header, rows, text_columns=1)}</section>"]
    for side, sweeps in (("A", comparison.a), ("B", comparison.b)):
        for sweep in sweeps:
            where = "" if sweep.place == "." else f", {sweep.place}"
            sections.append(f"<section><h2>Provenance of {side}{html.escape(where)}</h2>{_facts(provenance(sweep))}"
                            f"</section>" + _warnings(sweep.warnings))
    title = f"fitbench compare: {comparison.a[0].tree or comparison.a[0].directory} -> " \
            f"{comparison.b[0].tree or comparison.b[0].directory}"
    return write_output(path, page(title, sections), "--html")
