"""``fitbench report``: one or several results directories shown again, as tables or Markdown, and
written as documents (an HTML page, a workbook, an analysis) that read them together."""

from __future__ import annotations

import argparse
import sys

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.display import StepsDisplay
from fitbench.cli.documents import write_documents
from fitbench.cli.options import preregistered_option, quiet_option, report_documents, results_directory


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
    if args.preregistered:
        _show_preregistered(args, [row.model_dump() for sweep in sweeps.sweeps for row in sweep.rows])
    with StepsDisplay(args.quiet) as steps:
        write_documents(sweeps, args.html, args.xlsx, args.ollama_url, args.ollama_model, args.ollama_timeout,
                        steps, price)
    return 0


def _show_preregistered(args: argparse.Namespace, rows: list) -> None:
    """Each registered forecast beside the row that ran its configuration (``fitbench.results.preregistration``),
    as a table, or Markdown with ``--markdown``."""
    from fitbench.results.preregistration import paired, read_registrations

    def percent(value) -> str:
        return "-" if value is None else f"{value:+.1%}"

    def figure(value, scale: float, unit: str) -> str:
        return "-" if value is None else f"{value / scale:,.1f} {unit}"

    lines = []
    for pair in paired(read_registrations(args.preregistered), rows):
        entry, configuration = pair.registration, pair.registration["configuration"]
        layout = ", ".join(f"{key} {value}" for key, value in configuration["layout"].items() if value != 1) or "1 GPU"
        label = (f"{configuration['model']} {configuration['mode']} {configuration['precision']} "
                 f"{configuration['batch_size']}x{configuration['seq_len']} {layout}")
        status = "ran" if pair.row is not None else "not run as registered"
        lines.append((label, entry["registered_at"], figure(entry["predicted_peak_bytes"], 1e9, "GB"),
                      figure(pair.measured_peak_bytes, 1e9, "GB"), percent(pair.peak_error),
                      figure(entry["forecast_tokens_per_s"], 1, "tokens/s"),
                      figure(pair.measured_tokens_per_s, 1, "tokens/s"), percent(pair.speed_error), status))
    header = ("configuration", "registered", "predicted peak", "measured peak", "error", "forecast", "measured",
              "error", "")
    if args.markdown:
        print(f"\n### Registered forecasts ({args.preregistered})\n")
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    from rich.table import Table

    table = Table(title=f"registered forecasts: {args.preregistered}", title_justify="left")
    for column in header:
        table.add_column(column)
    for line in lines:
        table.add_row(*line)
    console.print(table)


REPORT_EXAMPLES = """\
examples:
  fitbench report fitbench-results/20261122-120000 --markdown
  fitbench report fitbench-results/20261122-120000 --html report.html --xlsx report.xlsx
  # one page over several sweeps: the one-GPU rows of one, the several-GPU rows of others
  fitbench report one-gpu ddp-2 ddp-4 --html scaling.html
  # forecasts written before the run (fitbench plan --preregister forecasts.json) beside what ran
  fitbench report fitbench-results/20261122-120000 --preregistered forecasts.json
"""

COMMAND = Command("report", "show results directories again, as tables or Markdown, or one page over several",
                  report,
                  (results_directory, report_documents, preregistered_option,
                   quiet_option("no progress and no table (--markdown still prints): only the files written "
                                "and warnings")), REPORT_EXAMPLES)
