"""The current planner's prediction for rows already measured: each row's configuration planned again,
against the GPU memory its NVML sampler recorded. Nothing is run on a GPU: this tells how a change to
the planner moves the error on measurements it did not take, and the result is labelled as such. It
holds only for rows measured with the worker as it runs now: a change to what the worker does (the
chunked loss, the packed quantized build) moves the measurement as well, and such rows must be
measured again.

Error = (predicted - measured) / measured, measured = NVML's per-process peak (the largest over a
row's GPUs where it ran on several), as in memory_error.py; the plan is for the row's GPU count.
The calibration is the one the rows were measured with (a calibration.json of fitbench's cache, given
by --calibration; the GPU's entry is taken from it by the rows' device name and torch version).

Usage: python benchmarks/repredict.py RESULTS_DIR --calibration FILE [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fitbench.models.registry import resolve
from fitbench.plan.calibration import Calibration
from fitbench.plan.planner import GpuTarget, predict_spec
from fitbench.results.store import ResultStore
from fitbench.spec import RunSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    stored = json.loads(args.calibration.read_text())
    lines = ["| configuration | measured | predicted then | predicted now | error then | error now | peak moment now |",
             "|---|---|---|---|---|---|---|"]
    errors = []
    for sweep in sorted({path.parent for path in args.directory.rglob("results.jsonl")}, key=str):
        for row in ResultStore(sweep).rows():
            gpus = (row.get("memory") or {}).get("gpus") or []
            if row["status"] != "ok" or not gpus or not row.get("prediction"):
                continue
            environment = row["environment"]
            gpu = environment["gpus"][0]
            calibration = Calibration(**stored[f"{gpu['name']}|torch {environment['torch']}"])
            spec = RunSpec.model_validate(row["spec"])
            target = GpuTarget(gpu["name"], spec.layout.world_size, gpu["total_memory"], described=False)
            _, prediction = predict_spec(resolve(spec.model), spec, target, calibration, choose_precision=False,
                                         choose_recompute=False, runnable=(spec.precision,))
            measured = max(gpu["nvml_peak_used"] for gpu in gpus)
            then, now = row["prediction"]["predicted_peak_bytes"], prediction["predicted_peak_bytes"]
            errors.append((now - measured) / measured)
            lines.append(f"| {row['label']} | {measured / 1e9:.2f} GB | {then / 1e9:.2f} GB | {now / 1e9:.2f} GB | "
                         f"{(then - measured) / measured:+.1%} | {errors[-1]:+.1%} | {prediction['peak_moment']} |")
    lines += ["", f"- rows: {len(errors)}",
              f"- median |error| now: {statistics.median(abs(e) for e in errors):.2%}",
              f"- worst |error| now: {max(abs(e) for e in errors):.2%}",
              f"- largest under-prediction now: {min(errors):+.2%}"]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
