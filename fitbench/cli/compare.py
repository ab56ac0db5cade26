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
    bootstrap confidence interval, tokens/s and peak memory; exit 1 when a --fail-on gate fails, or
    when nothing was compared, for CI."""
    with StepsDisplay(args.quiet) as steps:
        comparison = report_module("compare", "compare").compare_sweeps(
            args.a, args.b, fail_on=args.fail_on, steps=steps, match_across=args.match_across)
    for side, sweeps in (("A", comparison.a), ("B", comparison.b)):
        for sweep in sweeps:
            for warning in sweep.warnings:
                warn(f"{side}: {warning}")
    for line in comparison.verdict() if args.quiet else comparison.lines():
        console.print(escape(line), soft_wrap=True)
    if args.html:
        console.print(f"html: {report_module('html', 'html').write_comparison_html(comparison, args.html)}")
    return 1 if comparison.failed else 0


COMMAND = Command("compare", "compare two results directories; --fail-on gates on a regression", compare,
                  (two_sweeps, quiet_option("no progress and no line per configuration: only the verdict, the "
                                            "file written and warnings")))
