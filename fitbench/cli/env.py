"""``fitbench env``: versions, GPUs, their datasheet peaks and the measured ceilings."""

from __future__ import annotations

import argparse
import json

from fitbench.cli.command import Command
from fitbench.cli.console import console, warn
from fitbench.cli.options import device_option, json_output, measure_ceilings


def env(args: argparse.Namespace) -> int:
    """Show versions (each pinned dependency against the range fitbench was tested with), GPUs with their
    datasheet peaks, and the stored measured ceilings."""
    from fitbench.hardware import ceilings
    from fitbench.hardware.datasheet import gpu_spec
    from fitbench.hardware.dependencies import dependencies
    from fitbench.hardware.devices import cpu_device_name
    from fitbench.hardware.environment import environment

    if args.measure:
        from fitbench.sweep import resolve_device

        device = resolve_device(args.device)
        console.print(f"measuring matmul and copy ceilings on {device} ...")
        measured = ceilings.measure_ceilings(device)
        path = ceilings.save_ceilings(measured)
        console.print(f"stored in {path}")
    info = environment()
    device_names = [gpu["name"] for gpu in info["gpus"]] or [cpu_device_name()]
    info["datasheet_peaks"] = {name: (gpu_spec(name).__dict__ if gpu_spec(name) else None)
                               for name in device_names}
    info["measured_ceilings"] = {name: (c.__dict__ if (c := ceilings.load_ceilings(name)) else None)
                                 for name in device_names}
    pinned = dependencies()
    info["dependencies"] = [{"name": d.name, "installed": d.installed, "tested": d.tested, "status": d.status}
                            for d in pinned]
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key in ("fitbench_version", "git_commit", "python", "torch_cuda", "driver", "cpu_model", "cpu_count",
                "hostname"):
        console.print(f"{key:18s} {info[key]}")
    if pinned:
        console.print(f"{'dependency':18s} {'installed':14s} {'tested range':16s} status")
    for dependency in pinned:
        colour = {"tested": "green", "untested": "yellow", "missing": "red"}[dependency.status]
        console.print(f"{dependency.name:18s} {dependency.installed or '-':14s} {dependency.tested:16s} "
                      f"[{colour}]{dependency.status}[/{colour}]")
    if not pinned:
        console.print("dependencies       fitbench's metadata is not installed (pip install -e .): no tested ranges")
    for warning in (d.warning() for d in pinned):
        if warning:
            warn(warning)
    for gpu in info["gpus"]:
        console.print(f"gpu {gpu['index']:<14d} {gpu['name']}, {gpu['total_memory'] / 1e9:.1f} GB, "
                      f"compute capability {gpu['compute_capability'][0]}.{gpu['compute_capability'][1]}")
    for name in device_names:
        peak = info["datasheet_peaks"][name]
        if peak:
            console.print(f"datasheet {name}: bf16 {peak['tflops']['bf16']} TFLOP/s, "
                          f"{peak['bandwidth_gbs']} GB/s ({peak['source']})")
        elif name.startswith("cpu"):
            console.print(f"datasheet {name}: none for CPUs; MFU uses a measured ceiling")
        else:
            console.print(f"datasheet {name}: not in the table; MFU uses a measured ceiling")
        ceiling = info["measured_ceilings"][name]
        if ceiling:
            flops = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in ceiling["matmul_flops"].items())
            console.print(f"measured  {name}: {flops} TFLOP/s; copy {ceiling['bandwidth'] / 1e9:.0f} GB/s "
                          f"({ceiling['measured_at']})")
        else:
            console.print(f"measured  {name}: none yet (fitbench env --measure)")
    return 0


COMMAND = Command("env", "versions against the tested ranges, GPUs, peak FLOP/s; --measure stores this machine's "
                  "ceilings", env,
                  (json_output("machine-readable output"), measure_ceilings,
                   device_option("device to measure (default: first GPU, else cpu)")))
