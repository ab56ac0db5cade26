"""``fitbench report``: one or several results directories shown again, as tables or Markdown, and
written as documents (an HTML page, a workbook, an analysis) that read them together."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.display import StepsDisplay
from fitbench.cli.documents import write_documents
from fitbench.cli.options import quiet_option, report_documents, results_directory
from fitbench.results.row import Row
from fitbench.util.errors import UserError, excerpt


def _read(directories: list[str]) -> dict[str, list[Row]]:
    """The rows of each directory, in the order given; a UserError for one that is not a sweep's
    directory or is given twice. Damaged lines are warnings (each names its file)."""
    from fitbench.results.store import ResultStore

    sources: dict[str, list[Row]] = {}
    seen: dict[Path, str] = {}
    for directory in directories:
        if not directory.strip():
            raise UserError("report: a directory was given as an empty path; pass the --out directory of a "
                            "`fitbench run`.")
        store = ResultStore(directory, on_bad_line=warn)
        if store.directory.is_file():
            raise UserError(f"report: {excerpt(directory, 200)} is a file; pass the --out directory of a "
                            f"`fitbench run` (it holds {store.path.name}).")
        if not store.path.exists():
            raise UserError(f"report: {directory} has no {store.path.name}. Pass the --out directory "
                            f"of a `fitbench run`.")
        place = store.directory.resolve()
        if place in seen:
            raise UserError(f"report: {excerpt(directory, 200)} is given twice (as {excerpt(seen[place], 200)} "
                            f"too); give each sweep's directory once.")
        seen[place] = directory
        sources[directory] = list(store.typed_rows())
    return sources


def report(args: argparse.Namespace) -> int:
    """Show the results of finished (or interrupted) sweeps again, one table (or Markdown section)
    per directory; with ``--csv``, also write each one's results.csv again from results.jsonl
    (committed results keep only the rows). ``--html``, ``--xlsx`` and ``--ollama-*`` read every
    directory given together."""
    from fitbench.results.report import markdown_report, results_table, write_csv

    sources = _read(args.directories)
    for directory, rows in sources.items():
        if args.markdown:
            print((f"## {directory}\n\n" if len(sources) > 1 else "") + markdown_report(rows), end="")
            if len(sources) > 1:
                print()
        elif not args.quiet:
            console.print(results_table(rows, title=f"fitbench results: {directory}"))
        if args.csv:
            print(f"table: {write_csv(rows, directory)}", file=sys.stderr if args.markdown else sys.stdout)
    with StepsDisplay(args.quiet) as steps:
        write_documents(sources, args.html, args.xlsx, args.ollama_url, args.ollama_model, args.ollama_timeout,
                        steps)
    return 0


REPORT_EXAMPLES = """\
examples:
  fitbench report fitbench-results/20261122-120000 --markdown
  fitbench report fitbench-results/20261122-120000 --html report.html --xlsx report.xlsx
  # one page over several sweeps: the one-GPU rows of one, the several-GPU rows of others
  fitbench report one-gpu ddp-2 ddp-4 --html scaling.html
"""

COMMAND = Command("report", "show results directories again, as tables or Markdown, or one page over several",
                  report,
                  (results_directory, report_documents,
                   quiet_option("no progress and no table (--markdown still prints): only the files written "
                                "and warnings")), REPORT_EXAMPLES)
