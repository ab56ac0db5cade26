"""Traced tensor peak (fake tensors on this machine's device) vs the measured allocator peak, per row.

Usage: python benchmarks/trace_vs_measured.py OUT_DIR

Separates the memory model's two sources of error: the tensors (trace vs analytic, both exact
about what the loop allocates) and what the device adds beyond them (measured allocated vs trace:
workspaces, kernel-specific saved tensors).
"""

from __future__ import annotations

import sys

from fitbench.models.registry import resolve
from fitbench.planning.memory import estimate_memory
from fitbench.results.store import ResultStore
from fitbench.worker.trace import trace_peak


def main(directory: str) -> None:
    print("| configuration | analytic | traced | measured allocated | allocated - traced | reserved - allocated |")
    print("|---|---|---|---|---|---|")
    for row in ResultStore(directory).rows():
        spec, gpus = row["spec"], (row.get("memory") or {}).get("gpus") or []
        if row["status"] != "ok" or not gpus or spec["backend"] != "native":
            continue
        arch = resolve(spec["model"])
        shape = dict(new_tokens=spec["new_tokens"], activation_checkpointing=spec["activation_checkpointing"])
        traced = trace_peak(arch, spec["mode"], spec["precision"], spec["batch_size"], spec["seq_len"], **shape)
        analytic = estimate_memory(arch, spec["mode"], spec["precision"], spec["batch_size"], spec["seq_len"], **shape)
        allocated, reserved = gpus[0]["peak_allocated"], gpus[0]["peak_reserved"]
        print(f"| {row['label']} | {analytic.peak_bytes / 1e6:,.0f} MB | {traced.peak_bytes / 1e6:,.0f} MB "
              f"| {allocated / 1e6:,.0f} MB | {(allocated - traced.peak_bytes) / 1e6:+,.0f} MB "
              f"| {(reserved - allocated) / 1e6:+,.0f} MB |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
