"""What a worker is told beside its configuration (``fitbench.spec.Assignment``): the planner's figures
it acts on, computed here, just before the launch, so that the worker never plans.

- ``offload_layer_memory``: for a run whose layers are offloaded around one device, the bytes its
  decoder layers may take on the device, the planner's ``offload_split`` of the device's memory: a
  GPU's memory (``GpuTarget.memory``: what the device gives a process, or FITBENCH_INJECT's
  mem-limit) less its calibrated overheads, or on a CPU the host memory available now (or the
  mem-limit).
- ``predicted_peak_bytes``: the planner's tensor peak for the configuration as it will be built (with
  the offload split's resident layers; per rank, for a layout of several), against which a
  FITBENCH_INJECT mem-limit raises.
"""

from __future__ import annotations

import psutil

from fitbench.models.registry import resolve
from fitbench.planning.calibration import Calibration
from fitbench.planning.memory import estimate_memory
from fitbench.planning.sharding import Parallelism
from fitbench.planning.planner import GpuTarget, offload_split
from fitbench.spec import Assignment, RunSpec


def assign(spec: RunSpec, target: GpuTarget | None, calibration: Calibration | None) -> Assignment:
    """The assignment of ``spec`` on the GPU of ``target`` (None: a CPU without a mem-limit, whose budget
    is the host memory available now)."""
    arch = resolve(spec.model)
    resident, layer_memory = None, None
    if spec.layer_offload:
        budget = target.memory if target is not None else float(psutil.virtual_memory().available)
        split = offload_split(arch, spec.mode, spec.precision, spec.batch_size, spec.seq_len,
                              new_tokens=spec.new_tokens, budget=budget, calibration=calibration,
                              backend=spec.backend)
        resident, layer_memory = split.resident_layers, split.layer_memory
    layout = spec.layout
    parallelism = Parallelism(layout=layout, offload=spec.fsdp_offload, microbatches=spec.microbatches)
    peak = estimate_memory(arch, spec.mode, spec.precision, spec.batch_size, spec.seq_len, new_tokens=spec.new_tokens,
                           activation_checkpointing=spec.activation_checkpointing,
                           checkpointed_layers=spec.checkpointed_layers, resident_layers=resident,
                           backend=spec.backend, compiled=spec.compile, parallelism=parallelism).peak_bytes
    return Assignment(spec=spec, offload_layer_memory=layer_memory, predicted_peak_bytes=peak)
