"""``fitbench report``: a results directory shown again, as a table or Markdown."""

from __future__ import annotations

import argparse
import sys

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.display import StepsDisplay
from fitbench.cli.documents import write_documents
from fitbench.cli.options import quiet_option, report_documents, results_directory
from fitbench.util.errors import UserError, excerpt


def report(args: argparse.Namespace) -> int:
    """Show the results of a finished (or interrupted) sweep again, as a table or as Markdown; with
    ``--csv``, also write its results.csv again from results.jsonl (committed results keep only the rows)."""
    from fitbench.results.report import markdown_report, results_table, write_csv
    from fitbench.results.store import ResultStore

    if not args.directory.strip():
        raise UserError("report: the directory was given as an empty path; pass the --out directory of a "
                        "`fitbench run`.")
    store = ResultStore(args.directory, on_bad_line=warn)
    if store.directory.is_file():
        raise UserError(f"report: {excerpt(args.directory, 200)} is a file; pass the --out directory of a "
                        f"`fitbench run` (it holds {store.path.name}).")
    if not store.path.exists():
        raise UserError(f"report: {args.directory} has no {store.path.name}. Pass the --out directory of a "
                        f"`fitbench run`.")
    rows = list(store.typed_rows())
    if args.markdown:
        print(markdown_report(rows), end="")
    elif not args.quiet:
        console.print(results_table(rows, title=f"fitbench results: {args.directory}"))
    if args.csv:
        print(f"table: {write_csv(rows, store.directory)}", file=sys.stderr if args.markdown else sys.stdout)
    with StepsDisplay(args.quiet) as steps:
        write_documents(args.directory, rows, args.html, args.xlsx, args.ollama_url, args.ollama_model, steps)
    return 0


COMMAND = Command("report", "show a results directory again, as a table or Markdown", report,
                  (results_directory, report_documents,
                   quiet_option("no progress and no table (--markdown still prints): only the files written "
                                "and warnings")))
