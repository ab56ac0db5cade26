"""``fitbench report``: one or several results directories shown again, as tables or Markdown, and
written as documents (an HTML page, a workbook, an analysis) that read them together."""

from __future__ import annotations

import argparse
import sys

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.display import StepsDisplay
from fitbench.cli.documents import write_documents
from fitbench.cli.options import quiet_option, report_documents, results_directory


def report(args: argparse.Namespace) -> int:
    """Show the results of finished (or interrupted) sweeps again, one table (or Markdown section)
    per directory, and one for all the sweeps under a folder of several (a folder column first); with
    ``--csv``, also write each sweep's results.csv again from results.jsonl (committed results keep
    only the rows). Each directory is read once; ``--html``, ``--xlsx`` and ``--ollama-*`` take every
    directory given together."""
    from fitbench.results.directories import read_sweeps
    from fitbench.results.report import markdown_report, results_table, write_csv

    sweeps = read_sweeps(args.directories, "report", on_warning=warn)
    price = args.gpu_hour_price if args.gpu_hour_price is not None else sweeps.saved_price
    groups = sweeps.given()
    for group in groups:
        rows = [row for sweep in group for row in sweep.rows]
        tree = group[0].tree
        places = {id(row): sweep.place for sweep in group for row in sweep.rows}
        folder = (lambda row: places[id(row)]) if tree is not None else None
        name = tree if tree is not None else group[0].directory
        if args.markdown:
            print((f"## {name}\n\n" if len(groups) > 1 else "") + markdown_report(rows, folder, price),
                  end="")
            if len(groups) > 1:
                print()
        elif not args.quiet:
            console.print(results_table(rows, title=f"fitbench results: {name}", folder=folder,
                                        gpu_hour_price=price))
        if args.csv:
            for sweep in group:
                print(f"table: {write_csv(sweep.rows, sweep.directory, price)}",
                      file=sys.stderr if args.markdown else sys.stdout)
    with StepsDisplay(args.quiet) as steps:
        write_documents(sweeps, args.html, args.xlsx, args.ollama_url, args.ollama_model, args.ollama_timeout,
                        steps, price)
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
