"""What the login node plans for a sweep's SLURM jobs, and what a job reads of it on its node.

The login node cannot see the nodes' GPUs, so it plans for the GPU the jobs will get (``login_target``):
the one named with ``--gpu``, else the one the partition's GRES names (``sinfo``'s ``%G``, through
``fitbench.launch.slurm.jobs.partition_gpus``), with its datasheet memory; on a CPU, a GPU of the
``FITBENCH_INJECT`` mem-limit's size where one is set, else nothing is planned, as on a workstation.
Each planned configuration is kept, whole, in ``DIR/planned/<key>.json`` (``save``): its spec as the
planner left it, the GPU it was planned for, the prediction or the refusal. The batch script names
the configuration by that key, and the job reads it back (``load``) and runs it as planned, without
planning again: a node that would choose otherwise (another GPU, a memory limit) cannot change the
key the sweep follows. Where the node's GPU is not the one planned for (``difference``), the row keeps
the planned configuration and says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fitbench.hardware.datasheet import gpu_spec
from fitbench.launch.job import Job
from fitbench.launch.slurm.jobs import partition_gpus
from fitbench.planning.calibration import Calibration, load_calibration
from fitbench.planning.planner import GPU_ALIASES, GpuTarget
from fitbench.spec import RunSpec
from fitbench.util.errors import UserError, excerpt
from fitbench.util.inject import injected_memory_limit
from fitbench.util.jsonfile import read_json
from fitbench.util.units import format_bytes

PLANNED = "planned"
INJECTED = "FITBENCH_INJECT mem-limit"


def gres_gpu(gres_type: str) -> str | None:
    """The exact device name of a GRES type (``h100``, ``a100_80gb``, ``H100-80GB``), None where it
    is no GPU fitbench knows: the type upper-cased with ``_`` as ``-``, as ``--gpu`` takes it."""
    name = gres_type.upper().replace("_", "-")
    for candidate in (name, name + "B"):  # a100-80g -> A100-80GB
        if candidate in GPU_ALIASES:
            return GPU_ALIASES[candidate]
    return gres_type if gpu_spec(gres_type) else None


def named_gpu(gpu: str) -> str:
    """The exact device name of ``--gpu`` (an alias or a datasheet's name); a UserError otherwise."""
    name = GPU_ALIASES.get(gpu.upper(), gpu)
    if gpu_spec(name) is None:
        raise UserError(f"gpu: {excerpt(gpu)} is not a known GPU. Known: {', '.join(GPU_ALIASES)} (or an exact "
                        f"device name such as 'NVIDIA H100 80GB HBM3').")
    return name


def cluster_gpu(gpu: str | None, partition: str | None) -> str:
    """The device name of the GPU the jobs get: ``--gpu``, else the one the partition's GRES names.
    A UserError where neither names one fitbench knows."""
    if gpu is not None:
        return named_gpu(gpu)
    where = f"partition {partition!r}" if partition else "the cluster's default partition"
    kinds = partition_gpus(partition)
    names = {kind: gres_gpu(kind) if kind else None for kind, _ in kinds}
    if len(set(names.values())) == 1 and None not in names.values():
        return next(iter(names.values()))
    said = ", ".join(f"gpu:{kind}:{count}" if kind else f"gpu:{count}" for kind, count in kinds) or "no GPU"
    raise UserError(f"gpu: the jobs are planned here for the GPU they will get, and the GRES of {where} "
                    f"({said}, as `sinfo --format=%G` lists it) names {'several' if len(kinds) > 1 else 'none'} "
                    f"that fitbench knows. Name it with --gpu ({', '.join(list(GPU_ALIASES)[:4])}, ...), and pick "
                    f"those nodes with --sbatch-arg=--constraint=... where the partition mixes GPUs.")


def login_target(device: str, ranks: int, gpu: str | None, partition: str | None
                 ) -> tuple[GpuTarget | None, Calibration | None]:
    """What the login node plans the jobs of ``device`` against: (target, calibration). On a GPU, the
    GPU of ``cluster_gpu`` with its datasheet memory (the mem-limit's, where one is injected) and the
    calibration stored here for it, else the default; on a CPU, a GPU of the mem-limit's size, tensors
    only, else (None, None): nothing is planned."""
    limit = injected_memory_limit()
    if device == "cpu":
        return (GpuTarget(None, ranks, limit, described=False, memory_source=INJECTED) if limit else None), None
    name = cluster_gpu(gpu, partition)
    spec = gpu_spec(name)
    memory, source = (limit, INJECTED) if limit else (spec.total_memory, spec.total_memory_source)
    return GpuTarget(name, ranks, memory, described=True, memory_source=source), load_calibration(name)


def planned_file(directory: Path, key: str) -> Path:
    return directory / PLANNED / f"{key}.json"


def save(directory: Path, job: Job) -> None:
    """Keep ``job`` as planned in ``directory`` for its SLURM job (``load``), whole, through a rename."""
    path = planned_file(directory, job.spec.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {"spec": job.spec.model_dump(), "target": asdict(job.target) if job.target else None,
            "calibration": job.calibration.source if job.calibration else None, "prediction": job.prediction,
            "refusal": job.refusal, "chosen_by_planner": list(job.chosen_by_planner)}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(kept, indent=1, default=str))
    os.replace(tmp, path)


def load_spec(directory: Path, key: str) -> dict[str, Any]:
    """What ``save`` kept of configuration ``key``; a UserError where the sweep planned no such key."""
    path = planned_file(directory, key)
    if not path.is_file():
        raise UserError(f"resume: the sweep in {directory} planned no configuration {key} ({path} is missing). "
                        f"Submit the sweep's jobs with `fitbench run --resume {directory}`, which plans them and "
                        f"writes the batch script that names them.")
    kept = read_json(path, limit=10_000_000, field="resume",
                     fix=f"{path} is damaged; `fitbench run --resume {directory}` plans it again")
    if not isinstance(kept, dict) or not isinstance(kept.get("spec"), dict):
        raise UserError(f"resume: {path} holds no planned configuration; `fitbench run --resume {directory}` plans "
                        f"it again.")
    return kept


def target_of(kept: dict[str, Any]) -> GpuTarget | None:
    """The GPU the kept configuration was planned for (None: nothing was planned)."""
    return GpuTarget(**kept["target"]) if kept.get("target") else None


def planned_job(kept: dict[str, Any], unplanned: Job, calibration: Calibration | None) -> Job:
    """The kept configuration as a job: ``unplanned`` (the sweep's fallback policy and timeout for its
    spec) with the planned spec, GPU, prediction or refusal, and ``calibration``."""
    target = target_of(kept)
    return replace(unplanned, spec=RunSpec.model_validate(kept["spec"]), target=target,
                   calibration=calibration if target else None, prediction=kept.get("prediction"),
                   refusal=kept.get("refusal"), chosen_by_planner=tuple(kept.get("chosen_by_planner") or ()))


def describe(target: GpuTarget | None) -> str:
    if target is None:
        return "no GPU (a CPU without a memory limit: nothing planned)"
    return f"{target.name or 'a device'} of {format_bytes(target.memory)} ({target.memory_source})"


def difference(planned: GpuTarget | None, here: GpuTarget | None) -> str | None:
    """What differs between the GPU the login node planned for and this node's, None where nothing does:
    another device name, or, where either memory is a mem-limit or the device is unnamed, another size
    (a datasheet's memory and the one torch reports differ by design, so a named GPU's is not compared)."""
    if planned is None and here is None:
        return None
    if planned is None or here is None or planned.name != here.name or (
            (planned.name is None or INJECTED in (planned.memory_source, here.memory_source))
            and planned.memory != here.memory):
        return (f"planned on the login node for {describe(planned)}; this node has {describe(here)}. The planned "
                f"configuration ran (its key kept); its prediction is for the GPU planned for")
    return None
