"""Predicted vs measured per-GPU peak of every row in a results directory, with the error figures.

Usage: python benchmarks/memory_error.py OUT_DIR [--markdown FILE] [--min-gpus N]

OUT_DIR is one sweep's directory or holds several (the validation scripts give each run its own
numbered directory); every ``results.jsonl`` under it is read.

Error = (predicted - measured) / measured, measured = what the GPU gave the process at its peak
(NVML: allocator reserved plus CUDA context). Targets: median |error| <= 2%, worst <= 5%, no
under-prediction beyond 3%, and no out-of-memory among configurations the planner chose.

For generations it also lists the time to first token of the first measured generation against the
median of all of them (first / median - 1): every measured generation starts from an idle device,
so the first is no different from the others (target: within 10%).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fitbench.results.report import headline
from fitbench.results.store import ResultStore
from fitbench.spec import RunSpec
from fitbench.util.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--markdown", help="also write the table and figures to this file")
    parser.add_argument("--min-gpus", type=int, default=1, metavar="N",
                        help="only rows whose layout spans at least N GPUs (2: the several-GPU rows)")
    args = parser.parse_args()
    lines = ["| configuration | status | predicted | measured | error | peak moment | planner chose |",
             "|---|---|---|---|---|---|---|"]
    errors, picked_oom, ttft = [], [], []
    sweeps = sorted({path.parent for path in Path(args.directory).rglob("results.jsonl")}, key=str)
    rows = [row for sweep in sweeps for row in ResultStore(sweep).typed_rows()
            if RunSpec.model_validate(row.spec).layout.world_size >= args.min_gpus]
    for row in rows:
        samples = ((row.timing or {}).get("samples") or {}).get("time_to_first_token")
        if row.status == "ok" and samples:
            ttft.append((row.label, samples[0] / statistics.median(samples) - 1))
        head, prediction = headline(row), row.prediction or {}
        chosen = ", ".join(prediction.get("chosen_by_planner", [])) or "-"
        error = head["prediction_error"]
        if error is not None and row.status == "ok":
            errors.append(error)
        if chosen != "-" and row.status == "oom":
            picked_oom.append(row.label)
        lines.append(f"| {row.label} | {row.status} | {format_bytes(head['predicted_peak'])} "
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
    if ttft:
        summary.append("time to first token, first measured generation against the median: "
                       + ", ".join(f"{label} {100 * gap:+.1f}%" for label, gap in ttft))
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {line}" for line in summary) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
