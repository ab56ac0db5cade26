"""``fitbench calibrate``: measure this GPU's constant overheads (and its collectives' bus bandwidth) for
the planner."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from fitbench.cli.command import Command
from fitbench.cli.console import console
from fitbench.cli.options import bus_gpus, device_option
from fitbench.util.errors import UserError, excerpt


def calibrate(args: argparse.Namespace) -> int:
    """Measure this GPU's CUDA context and cuBLAS workspace, and with several GPUs the all-reduce's and
    all-gather's bus bandwidth and latency, and store them for the planner."""
    from fitbench.launch.calibrate import measure_bus_bandwidth, measure_calibration, with_bus_bandwidth
    from fitbench.plan.calibration import save_calibration
    import os

    import torch

    from fitbench.sweep import bus_figures, calibration_figures, resolve_device

    device = resolve_device(args.device)
    if device == "cpu" and args.gpus is None:
        raise UserError("device: calibration measures GPU overheads; run it where a GPU is visible (on a CPU, "
                        "--gpus 2 or more measures the bus bandwidth of that many processes over gloo, to try it).")
    # on a CPU, one process per core at most
    low, high, what = (2, max(2, os.cpu_count() or 2), "CPU cores") if device == "cpu" else (
        1, torch.cuda.device_count(), "GPUs visible")
    gpus = high if args.gpus is None else args.gpus
    if not low <= gpus <= high:
        raise UserError(f"gpus: {excerpt(gpus)} to measure; give {low} to {high} (the {what}).")
    with tempfile.TemporaryDirectory(prefix="fitbench-calibrate-") as scratch:
        if device == "cpu":
            console.print(f"measuring the bus bandwidth of {gpus} CPU processes over gloo ...")
            bus = measure_bus_bandwidth(gpus, device, Path(scratch))
            console.print(f"{bus_figures(bus)}; nothing stored: the planner plans GPUs")
            return 0
        console.print(f"calibrating {device}: tiny training, generating and in a forward pass, in fresh processes ...")
        calibration = measure_calibration(device, Path(scratch))
        if gpus > 1:
            console.print(f"measuring all-reduce and all-gather over {gpus} GPUs, one process each ...")
            calibration = with_bus_bandwidth(calibration, measure_bus_bandwidth(gpus, device, Path(scratch)))
    path = save_calibration(torch.cuda.get_device_name(torch.device(device)), calibration)
    console.print(f"{calibration_figures(calibration)}; stored in {path}")
    return 0


COMMAND = Command("calibrate", "measure this GPU's constant overheads for the planner", calibrate,
                  (device_option("GPU to measure (default: the first)"), bus_gpus))
