"""Measured rows against the planner of this checkout: each row's configuration predicted again, beside
the prediction stored with it when it ran (figures of a planner change, before the GPU runs again).

Usage: python benchmarks/repredict.py OUT_DIR [...]   (with the GPU's calibration in fitbench's cache)

Error = (predicted - measured) / measured, measured = the largest NVML peak over the row's GPUs, as
``benchmarks/memory_error.py`` defines it; the GPU's memory is the one the run's prediction used, so
a prediction capped at the GPU's capacity is capped as the run's was.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fitbench.models.registry import resolve
from fitbench.plan.calibration import load_calibration
from fitbench.plan.planner import GpuTarget, predict_spec
from fitbench.precisions import PRECISIONS
from fitbench.spec import RunSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directories", nargs="+")
    args = parser.parse_args()
    errors = []
    print(f"{'configuration':62s} {'measured':>9s} {'stored':>17s} {'now':>17s}")
    for directory in args.directories:
        for path in sorted(Path(directory).rglob("results.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if row["status"] != "ok" or not row.get("prediction"):
                    continue
                spec = RunSpec.model_validate(row["spec"])
                target = GpuTarget(name=row["device_name"], count=spec.layout.world_size,
                                   memory=row["prediction"]["gpu_memory_bytes"], described=False)
                _, prediction = predict_spec(resolve(spec.model), spec, target, load_calibration(row["device_name"]),
                                             choose_precision=False, choose_recompute=False, runnable=PRECISIONS)
                measured = max(gpu["nvml_peak_used"] for gpu in row["memory"]["gpus"])
                stored, now = row["prediction"]["predicted_peak_bytes"], prediction["predicted_peak_bytes"]
                errors.append((now - measured) / measured)
                print(f"{row['label'][:62]:62s} {measured / 1e9:7.1f} GB {stored / 1e9:6.1f} GB "
                      f"({(stored - measured) / measured:+6.1%}) {now / 1e9:6.1f} GB ({errors[-1]:+6.1%})")
    if errors:
        sizes = [abs(error) for error in errors]
        print(f"\nrows: {len(errors)}; now: median |error| {statistics.median(sizes):.2%}, worst {max(sizes):.2%}")


if __name__ == "__main__":
    main()
