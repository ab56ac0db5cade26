"""``fitbench calibrate``: measure this GPU's constant overheads (and its collectives' bus bandwidth, inside
a node and between nodes) for the planner."""

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
    all-gather's bus bandwidth and latency (with ``--nodes``, also between the nodes of a SLURM
    allocation), and store them for the planner."""
    from fitbench.launch.calibrate import (measure_across_nodes, measure_bus_bandwidth, measure_calibration,
                                           with_bus_bandwidth, with_inter_node)
    from fitbench.planning.calibration import save_calibration
    import os

    import torch

    from fitbench.sweep import bus_figures, calibration_figures, resolve_device

    device = resolve_device(args.device)
    nodes = _nodes(args.nodes)
    if device == "cpu" and args.gpus is None and nodes is None:
        raise UserError("device: calibration measures GPU overheads; run it where a GPU is visible (on a CPU, "
                        "--gpus 2 or more measures the bus bandwidth of that many processes over gloo, to try it).")
    # on a CPU, one process per core at most
    low, high, what = (2, max(2, os.cpu_count() or 2), "CPU cores") if device == "cpu" else (
        1, torch.cuda.device_count(), "GPUs visible")
    if nodes is not None:  # a node's ranks may be one, and on a CPU they are one by default
        low = 1
    gpus = (1 if device == "cpu" and nodes else high) if args.gpus is None else args.gpus
    if not low <= gpus <= high:
        raise UserError(f"gpus: {excerpt(gpus)} to measure; give {low} to {high} (the {what}).")
    with tempfile.TemporaryDirectory(prefix="fitbench-calibrate-") as scratch:
        across = None
        if nodes is not None:
            from fitbench.launch.slurm.nodes import first_host, free_port, srun_tasks

            console.print(f"measuring all-reduce and all-gather over {nodes} nodes of {gpus} rank(s), one torchrun "
                          f"agent per node ...")
            across = measure_across_nodes(nodes, gpus, device, Path(scratch), endpoint=f"{first_host()}:{free_port()}",
                                          agents=lambda agent: [[*srun_tasks(nodes), *agent]])
            if device == "cpu":
                inside, between = across
                console.print("\n".join([*([f"inside a node: {bus_figures(inside)}"] if inside else []),
                                         f"between nodes: {bus_figures(between)}",
                                         "nothing stored: the planner plans GPUs"]))
                return 0
        if device == "cpu":
            console.print(f"measuring the bus bandwidth of {gpus} CPU processes over gloo ...")
            bus = measure_bus_bandwidth(gpus, device, Path(scratch))
            console.print(f"{bus_figures(bus)}; nothing stored: the planner plans GPUs")
            return 0
        console.print(f"calibrating {device}: tiny training, generating and in a forward pass, in fresh processes ...")
        calibration = measure_calibration(device, Path(scratch), gpus=gpus)
        if across is not None:
            inside, between = across
            calibration = with_inter_node(with_bus_bandwidth(calibration, inside) if inside else calibration, between)
        elif gpus > 1:
            console.print(f"measuring all-reduce and all-gather over {gpus} GPUs, one process each ...")
            calibration = with_bus_bandwidth(calibration, measure_bus_bandwidth(gpus, device, Path(scratch)))
    path = save_calibration(torch.cuda.get_device_name(torch.device(device)), calibration)
    console.print(f"{calibration_figures(calibration)}; stored in {path}")
    return 0


def _nodes(nodes: int | None) -> int | None:
    """``--nodes``: None for this node alone; several only inside a SLURM allocation, whose nodes srun reaches."""
    import os

    if nodes is None or nodes == 1:
        return None
    if nodes < 1:
        raise UserError(f"nodes: {excerpt(nodes)} nodes to measure; give 2 or more, or leave --nodes out.")
    if "SLURM_JOB_NODELIST" not in os.environ:
        raise UserError(f"nodes: --nodes {nodes} measures between the nodes of a SLURM allocation, through srun, and "
                        f"this shell is in none; run it inside one of {nodes} nodes (salloc --nodes {nodes}, or a "
                        f"batch script's line), or leave --nodes out to measure this node.")
    return nodes


COMMAND = Command("calibrate", "measure this GPU's constant overheads for the planner", calibrate,
                  (device_option("GPU to measure (default: the first)"), bus_gpus))
