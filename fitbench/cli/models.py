"""``fitbench models``: the presets with their exact parameter counts."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from fitbench.cli.command import Command
from fitbench.cli.console import console
from fitbench.cli.options import json_output, preset_sources


def models(args: argparse.Namespace) -> int:
    """List every preset with its exact parameter counts and shape."""
    from fitbench.models.presets import PRESETS
    from fitbench.util.units import format_count

    summaries = [arch.summary() for arch in PRESETS]
    if args.json:
        print(json.dumps(summaries, indent=2))
        return 0
    table = Table(title="fitbench presets (counts computed from the architecture)", title_justify="left")
    columns = ("name", "params", "non-emb", "layers", "hidden", "heads/kv", "ffn", "vocab", "context", "family",
               "follows")
    for column in columns:
        table.add_column(column, justify="left" if column in ("name", "family", "follows") else "right")
    for s in summaries:
        table.add_row(s["name"], f"{s['total_params']:,}", format_count(s["non_embedding_params"]), str(s["layers"]),
                      str(s["hidden"]), f"{s['heads']}/{s['kv_heads']}", str(s["ffn"]), str(s["vocab"]),
                      str(s["max_context"]), s["family"] + (" tied" if s["tied"] else ""), s["follows"])
    console.print(table)
    if args.sources:
        for s in summaries:
            console.print(f"{s['name']}: {s['source']}")
    else:
        console.print("Sources of every number: fitbench models --sources")
    return 0


COMMAND = Command("models", "list the presets with exact parameter counts", models,
                  (json_output("machine-readable output"), preset_sources))
