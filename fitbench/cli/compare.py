"""``fitbench compare``: two results directories, configuration by configuration, with a gate for CI."""

from __future__ import annotations

import argparse

from rich.markup import escape

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.display import StepsDisplay
from fitbench.cli.documents import report_module
from fitbench.cli.options import quiet_option, two_sweeps


def compare(args: argparse.Namespace) -> int:
    """Compare sweep B with sweep A configuration by configuration: the change of the mean time with a
    bootstrap confidence interval, tokens/s and peak memory; with --fail-on, exit 1 when a change
    crosses the gate, for CI."""
    with StepsDisplay(args.quiet) as steps:
        comparison = report_module("compare", "compare").compare_sweeps(args.a, args.b, fail_on=args.fail_on,
                                                                        steps=steps)
    for side, sweep in (("A", comparison.a), ("B", comparison.b)):
        for warning in sweep.warnings:
            warn(f"{side}: {warning}")
    for line in comparison.lines()[-1:] if args.quiet else comparison.lines():
        console.print(escape(line), soft_wrap=True)
    if args.html:
        console.print(f"html: {report_module('html', 'html').write_comparison_html(comparison, args.html)}")
    return 1 if comparison.failed else 0


COMMAND = Command("compare", "compare two results directories; --fail-on gates on a regression", compare,
                  (two_sweeps, quiet_option("no progress and no line per configuration: only the verdict, the "
                                            "file written and warnings")))
