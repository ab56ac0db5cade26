"""The speed model's forecast against the measured step, for rows already measured: each row's
configuration forecast again with today's model (``fitbench.planning.forecast``), as the run decoded (the
row's ``decode`` field) and on the row's GPU, beside its median step (training, forward) or decode-step
latency (infer). Nothing runs on a GPU: this tells how a change to the model moves its error on
measurements it did not take.

Error = (forecast - measured) / measured, signed as the memory prediction's (``memory_error.py``):
negative where the step took longer than forecast.
Ceilings: the row's measured matmul peak where it recorded one (``measured_peak_flops``), else the
model's table of measured ceilings (``MEASURED_CEILINGS``).

Rows that measure no configuration's speed are listed apart, not counted: pipelined generations
decoded eagerly before stages captured their steps (``PIPELINE_GRAPHS_SINCE``), those measured while the
allocator's history was recorded (``fitbench.worker.snapshot``: the row's warning, or the sweep directory
holding the snapshot's ``allocator-streams-rank*.json``), and steps at the GPU's capacity (the caching
allocator retried inside them, or, in rows older than its counter, the NVML peak within
``AT_CAPACITY`` of the GPU's memory), which the planner keeps configurations off
(``fitbench.planning.planner.RETRY_MARGIN``).

Collectives: the interconnect's defaults (``fitbench.planning.collectives``); with --calibration FILE (a
calibration.json of ``fitbench calibrate --gpus N``), the bus bandwidths it measured for the rows of its
GPU name and torch version on a machine of as many GPUs (``calibration_for``), the in-step latencies
staying the defaults: calibrate times its small messages from back-to-back eager calls, whose host
launch sets their pace, while a decode step's collectives replay inside a CUDA graph.

Usage: python benchmarks/speed_error.py RESULT_DIRS... [--markdown FILE] [--min-gpus N] [--calibration FILE]

Each directory is one sweep's or holds several; every ``results.jsonl`` under it is read. Per directory
and over all of them: the median and the worst |error|, and the median per mode (train, which counts
forward-backward, forward, infer).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from fitbench.models.registry import resolve
from fitbench.planning.calibration import Calibration, calibration_key
from fitbench.planning.collectives import bus_bandwidth
from fitbench.planning.forecast import ceilings, forecast_spec, step_run
from fitbench.results.store import ResultStore
from fitbench.worker.snapshot import RECORDING_WARNING
from fitbench.spec import RunSpec

# The share of a GPU's memory past which a row's steps ran at its capacity.
AT_CAPACITY = 0.99

MODES = {"train": "train", "forward-backward": "train", "forward": "forward", "infer": "infer"}
# The native decoder fused its q/k/v and gate/up projections at this commit (5a8984c); rows measured
# before ran each projection as its own matmul, which the forecast counts as such.
FUSED_SINCE = "2026-11-24T05:50:32+00:00"
# Eager training ran the native decoder's autograd Functions from the sweep that measured them on
# (ebb9493, benchmarks/results/2026-11-24-h200-eager-ops), the fused cross-entropy from its commit on
# (b78e40b); rows started before ran each operator under autograd and the loss out of place, which the
# forecast counts with its figures of that engine.
FUNCTIONS_SINCE = "2026-11-24T09:59:00+00:00"
FUSED_LOSS_SINCE = "2026-11-24T10:09:12+00:00"
# Native pipeline stages decode through CUDA graphs of each stage's step from this commit on (b894232);
# rows started before decoded eagerly, a path a run takes now only when asked (--no-cuda-graphs). They
# are listed apart: what they measured is not what the same configuration does now (Llama-2-70B over
# 2 stages x TP 2 took 67.7 ms a token eagerly and 30.7 ms graphed,
# benchmarks/results/2026-11-27-h100x4-model-parallel/12).
PIPELINE_GRAPHS_SINCE = "2026-11-27T09:56:27+00:00"
# Tensor-parallel generations and forward passes stack their local shards' projections from this commit
# on; rows started before ran q, k, v and gate, up as their own matmuls.
TP_FUSED_SINCE = "2026-11-27T13:03:36+00:00"


def not_a_speed(row: dict, sweep: Path) -> str | None:
    """Why ``row`` (of the sweep directory ``sweep``) measures no configuration's speed, or None."""
    spec = row.get("spec") or {}
    if (spec.get("mode") == "infer" and spec.get("backend") == "native" and (spec.get("layout") or {}).get("pp", 1) > 1
            and not (row.get("decode") or {}).get("cuda_graphs") and spec.get("cuda_graphs", True)
            and row.get("started_at", "") < PIPELINE_GRAPHS_SINCE):
        return "decoded by eager pipeline stages, which CUDA graphs of each stage's step have replaced"
    if RECORDING_WARNING in (row.get("warnings") or []) or any(sweep.glob("allocator-streams-rank*.json")):
        return "measured while the allocator's history was recorded"
    if row.get("allocator_retries") is not None:  # counted: that settles it
        retried = (row["allocator_retries"].get("num_alloc_retries") or 0) > 0
        return "steps at the GPU's capacity: the allocator retried" if retried else None
    gpus = (row.get("memory") or {}).get("gpus") or []
    total = ((row.get("environment") or {}).get("gpus") or [{}])[0].get("total_memory")
    if gpus and total and max(gpu.get("nvml_peak_used") or 0 for gpu in gpus) >= AT_CAPACITY * total:
        return "steps at the GPU's capacity: its whole memory in use"
    return None


def row_error(row: dict, calibrations: dict[str, Calibration] | None = None) -> tuple[float, float] | None:
    """(measured, forecast) seconds of one measured row, or None where it has no measured step;
    ``calibrations`` (a calibration.json's entries, ``calibration_for``) give the collectives' constants
    of the rows they hold an entry for."""
    timing = row.get("timing") or {}
    spec = RunSpec.model_validate(row["spec"])
    measured = (timing.get("token_latency" if spec.mode == "infer" else "step") or {}).get("median")
    if row["status"] != "ok" or not measured:
        return None
    gpu = row["environment"]["gpus"][0]["name"]
    ceiling = ceilings(gpu)
    if row.get("measured_peak_flops"):
        ceiling = replace(ceiling, matmul=row["measured_peak_flops"], source="the row's measured peak")
    offload = row.get("offload") or {}
    # rows of generations older than the field decoded eagerly: CUDA graphs came with it
    decoding = row.get("decode") or ({"cuda_graphs": False} if spec.mode == "infer" else None)
    started = row.get("started_at", FUSED_LOSS_SINCE)
    # the row says how its small all-reduces went; rows older than the record went through NCCL
    one_shot = str((row.get("parallel") or {}).get("small_all_reduces", "")).startswith("symmetric memory")
    run = replace(step_run(spec, decoding), fused=started >= FUSED_SINCE, functions=started >= FUNCTIONS_SINCE,
                  fused_loss=started >= FUSED_LOSS_SINCE, tp_fused=started >= TP_FUSED_SINCE, one_shot=one_shot,
                  transformers=row["environment"].get("transformers") or "0")
    calibration = calibration_for(row, calibrations or {})
    links = None
    if calibration is not None:  # its bandwidths; the in-step latencies stay the interconnect's (module docstring)
        default = bus_bandwidth(gpu)
        links = replace(bus_bandwidth(gpu, calibration), all_reduce_latency=default.all_reduce_latency,
                        all_gather_latency=default.all_gather_latency)
    forecast = forecast_spec(resolve(spec.model), spec, gpu, ceiling, run=run,
                             offloaded_bytes=offload.get("offloaded_bytes") or 0.0, links=links)
    return measured, forecast.seconds


def calibration_for(row: dict, calibrations: dict[str, Calibration]) -> Calibration | None:
    """The entry of ``calibrations`` (keyed as fitbench's calibration.json, "GPU name|torch version") of
    the row's GPU and torch, where it measured the collectives over as many GPUs as the row's machine
    has; else None (the forecast's defaults)."""
    environment = row.get("environment") or {}
    gpus = environment.get("gpus") or [{}]
    calibration = calibrations.get(calibration_key(gpus[0].get("name"), environment.get("torch")))
    if calibration is None or not calibration.all_reduce_bus_bandwidth:
        return None
    return calibration if f"on {len(gpus)} x " in (calibration.collectives_source or "") else None


def summary(errors: list[float]) -> str:
    if not errors:
        return "-"
    absolute = [abs(e) for e in errors]
    return f"{statistics.median(absolute):.1%} median |error|, worst {max(errors, key=abs):+.1%} ({len(errors)} rows)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the tables and figures to this file")
    parser.add_argument("--min-gpus", type=int, default=1, metavar="N",
                        help="only rows whose layout spans at least N GPUs (2: the several-GPU rows)")
    parser.add_argument("--calibration", type=Path, metavar="FILE",
                        help="a calibration.json (fitbench calibrate --gpus N): its collectives' bandwidths and "
                             "latencies for the rows of its GPU and torch on a machine of as many GPUs")
    args = parser.parse_args()
    calibrations = ({key: Calibration(**fields) for key, fields in json.loads(args.calibration.read_text()).items()}
                    if args.calibration else {})
    lines = ["| directory | configuration | mode | measured | forecast | error |", "|---|---|---|---|---|---|"]
    by_directory: dict[str, list[float]] = {}
    by_mode: dict[str, list[float]] = {}
    worst: tuple[float, str] = (0.0, "-")
    apart = ["| directory | configuration | left out: why |", "|---|---|---|"]
    for directory in args.directories:
        errors = by_directory.setdefault(str(directory), [])
        for sweep in sorted({path.parent for path in directory.rglob("results.jsonl")}, key=str):
            for row in ResultStore(sweep).rows():
                if RunSpec.model_validate(row["spec"]).layout.world_size < args.min_gpus:
                    continue
                pair = row_error(row, calibrations)
                if pair is None:
                    continue
                reason = not_a_speed(row, sweep)
                if reason:
                    apart.append(f"| {sweep} | {row['label']} | {reason} |")
                    continue
                measured, forecast = pair
                error = (forecast - measured) / measured
                mode = MODES[row["spec"]["mode"]]
                errors.append(error)
                by_mode.setdefault(mode, []).append(error)
                where = sweep.relative_to(directory) if sweep != directory else Path(".")
                worst = max(worst, (abs(error), f"{row['label']} in {directory / where}: {error:+.1%}"))
                lines.append(f"| {directory / where} | {row['label']} | {mode} | {1e3 * measured:.2f} ms | "
                             f"{1e3 * forecast:.2f} ms | {error:+.1%} |")
    every = [e for errors in by_directory.values() for e in errors]
    lines += ["", "| set | error |", "|---|---|"]
    lines += [f"| {directory} | {summary(errors)} |" for directory, errors in by_directory.items()]
    lines += [f"| mode {mode} | {summary(errors)} |" for mode, errors in sorted(by_mode.items())]
    lines += [f"| **all** | {summary(every)} |", "", f"- worst: {worst[1]}"]
    if len(apart) > 2:
        lines += ["", "Rows that measure no configuration's speed:", "", *apart]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
