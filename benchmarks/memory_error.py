"""Predicted vs measured per-GPU peak of every row in a results directory, with the error figures.

Usage: python benchmarks/memory_error.py OUT_DIR [--markdown FILE]

Error = (predicted - measured) / measured, measured = what the GPU gave the process at its peak
(NVML: allocator reserved plus CUDA context). Targets: median |error| <= 3%, worst <= 8%, no
under-prediction beyond 3%, and no out-of-memory among configurations the planner chose.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fitbench.results.report import headline
from fitbench.results.store import ResultStore
from fitbench.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--markdown", help="also write the table and figures to this file")
    args = parser.parse_args()
    lines = ["| configuration | status | predicted | measured | error | peak moment | planner chose |",
             "|---|---|---|---|---|---|---|"]
    errors, picked_oom = [], []
    for row in ResultStore(args.directory).rows():
        head, prediction = headline(row), row.get("prediction") or {}
        chosen = ", ".join(prediction.get("chosen_by_planner", [])) or "-"
        error = head["prediction_error"]
        if error is not None and row["status"] == "ok":
            errors.append(error)
        if chosen != "-" and row["status"] == "oom":
            picked_oom.append(row["label"])
        lines.append(f"| {row['label']} | {row['status']} | {format_bytes(head['predicted_peak'])} "
                     f"| {format_bytes(head['measured_peak'])} | "
                     f"{'-' if error is None else f'{error:+.1f}%'} | {prediction.get('peak_moment', '-')} | {chosen} |")
    absolute = [abs(e) for e in errors]
    summary = [
        f"rows compared (status ok): {len(errors)}",
        f"median |error|: {statistics.median(absolute):.2f}%" if absolute else "median |error|: -",
        f"worst |error|: {max(absolute):.2f}%" if absolute else "worst |error|: -",
        f"largest under-prediction: {min(errors):+.2f}%" if errors else "largest under-prediction: -",
        f"planner-chosen configurations that ran out of memory: {len(picked_oom)} {picked_oom or ''}",
    ]
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {line}" for line in summary) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
