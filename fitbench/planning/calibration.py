"""Constant overheads outside the tensor formulas, measured once per GPU and software stack.

``fitbench calibrate`` runs ``tiny`` through the real worker on the GPU, training, generating and
in a forward pass, and stores what it finds under the user's cache directory (``calibration.json``
beside the matmul ceilings), keyed by GPU name and torch version; the first ``fitbench run`` on a
GPU with none stored for the running torch measures one the same way (``ensure_calibration``).
The planner uses a stored calibration automatically and names it in every plan and result row:
the one of the running torch version, else the newest stored for that GPU name, which says so
(a laptop planning for a described GPU rarely has the GPU's torch). Without one, the defaults below apply,
measured the same way on one H100 80GB HBM3 with torch 2.11.0+cu130
(``benchmarks/results/2026-11-22-h100-memory``; inference again once decoding ran through CUDA
graphs, ``benchmarks/results/2026-11-22-h100-ladder-infer``):

- **CUDA context**: memory the driver gives the process beyond what the caching allocator
  reserved (NVML's per-process figure minus ``max_memory_reserved``). It holds the CUDA runtime
  and the code of every kernel loaded, so a training step, which loads backward and optimizer
  kernels, has a larger one: 795 MB training; 797 MB generating through the decode graph, whose
  capture loads more kernels; 721 MB for a forward pass or eager decoding.
  NVML's figure is sampled, so one run's difference can read short, never long: a calibration
  also reads it as the step ends (``fitbench.launch.calibrate.overheads``).
- **workspaces**: what the allocator holds beyond the step's tensors: cuBLAS's workspace of
  32 MiB per handle and stream on Hopper, one for the forward stream and one for the autograd
  engine's in training, or for the stream the decode graph is captured on in inference: 64 MiB
  either way (measured allocated peak minus traced tensors); 32 MiB for a forward pass or eager
  decoding, which use one stream.
- **allocator slack**: fitbench's workers run with ``expandable_segments:True``, which maps
  memory in 2 MiB pages as needed instead of caching whole blocks, so when the peak comes with
  the forward pass's tensors the slack is the page rounding. When it comes late in the backward
  pass, gradients are being allocated among freed activations, and the freed holes fragment the
  segment: measured reserved minus allocated there was 0.4 to 3.4 times one layer's saved
  activations, which the planner adds once.
- **NCCL buffers**: per communicator, for multi-GPU strategies: what a rank's process holds
  outside the allocator beyond one GPU's CUDA context (NVML's peak minus the allocator's reserved
  peak, less the context). Measured on 2 x H200 over NVLink (NCCL 2.28.9, torch 2.11): 1.682 GB on
  every rank of DDP and FSDP training (1B, 8B, 20B presets) against 0.795 GB for one GPU's
  training, 887 MB for the one communicator (``benchmarks/results/2026-11-24-h200x2-data-parallel``);
  tensor-parallel decoding held less (0.30 to 0.84 GB), pipeline stages 0.98 to 1.27 GB. NCCL's
  own buffers (4 MiB per channel and peer, ``NCCL_BUFFSIZE``) are part of it; the rest is NCCL's
  device state and its kernels. ``fitbench calibrate`` stores this figure (it does not measure it).
- **bus bandwidth and latency** of all-reduce and all-gather (nccl-tests' definition,
  ``fitbench.planning.collectives``): ``fitbench calibrate`` measures them where several GPUs are visible,
  one process per GPU over NCCL (``fitbench.launch.calibrate.measure_bus_bandwidth``). Without a
  measurement the speed model takes the datasheet's link bandwidth in one direction and the
  interconnect's default latency. Run over several nodes (``fitbench calibrate --nodes N`` in a
  SLURM allocation), it measures the same between nodes (``inter_node_*``,
  ``fitbench.launch.calibrate.measure_across_nodes``); without that, ``fitbench.planning.nodes``'s
  defaults per fabric apply.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from fitbench.hardware.environment import torch_version
from fitbench.precisions import TRAINING_MODES
from fitbench.util.cache import cache_directory

MIB = 1024**2
PAGE = 2 * MIB
NCCL_PER_COMMUNICATOR = 887e6  # the module docstring's measurement
# A tensor-parallel generation's communicator holds less: NVML's peak minus the allocator's reserved
# peak, less the CUDA context, on the rank that held most, over the 22 tensor-parallel generation rows
# of 4 H100s (1B to Llama-2-70B, batch 1 and 16, TP 2 and 4: 0.32 to 0.87 GB, median 0.72; the
# benchmarks/results/2026-11-27-h100x4-* folders): their upper quartile, so that the term falls short
# in one row in four, by at most 0.06 GB. Its all-reduces are of a few rows, with no gradient buckets.
NCCL_TENSOR_PARALLEL_GENERATION = 812e6


@dataclass(frozen=True)
class Calibration:
    cuda_context_training: float
    cuda_context_inference: float  # generating, decode steps replayed from a CUDA graph
    workspace_training: float
    workspace_inference: float
    nccl_per_communicator: float
    source: str  # "default (...)" or "measured on <gpu> ..."
    # A forward pass, or generating with eager decoding; calibrations stored before these existed
    # have none, and the inference figures (an upper bound) apply.
    cuda_context_eager: float | None = None
    workspace_eager: float | None = None
    measured_at: str | None = None  # UTC, ISO 8601; which stored calibration is the newest
    # Bytes/s; None where no several GPUs were measured (and in calibrations stored before these existed).
    all_reduce_bus_bandwidth: float | None = None
    all_gather_bus_bandwidth: float | None = None
    collectives_source: str | None = None  # how they were measured: GPUs, backend, message sizes, torch
    # Seconds per message, fitted beside the bus bandwidths; None in calibrations stored before them.
    all_reduce_latency_s: float | None = None
    all_gather_latency_s: float | None = None
    # The same between nodes, one GPU's peers on the other nodes (``fitbench.planning.nodes``); None where
    # no job over several nodes was measured.
    inter_node_all_reduce_bus_bandwidth: float | None = None
    inter_node_all_gather_bus_bandwidth: float | None = None
    inter_node_all_reduce_latency_s: float | None = None
    inter_node_all_gather_latency_s: float | None = None
    inter_node_source: str | None = None

    def context(self, mode: str, decode_graph: bool = True) -> float:
        return _by_step(mode, decode_graph, self.cuda_context_training, self.cuda_context_inference,
                        self.cuda_context_eager)

    def workspace(self, mode: str, decode_graph: bool = True) -> float:
        return _by_step(mode, decode_graph, self.workspace_training, self.workspace_inference, self.workspace_eager)

    @staticmethod
    def page_rounding(peak_allocated: float) -> float:
        """Expandable segments: the peak rounded up to the next 2 MiB."""
        return -peak_allocated % PAGE


def _by_step(mode: str, decode_graph: bool, training: float, graph: float, eager: float | None) -> float:
    """The figure of the kind of step ``mode`` runs: training, generating through the decode graph, or
    a forward pass / eager decoding (the graph's figure where none was stored)."""
    if mode in TRAINING_MODES:
        return training
    return graph if (mode == "infer" and decode_graph) or eager is None else eager


DEFAULT = Calibration(
    cuda_context_training=795e6,
    cuda_context_inference=797e6,
    workspace_training=2 * 32 * MIB,
    workspace_inference=2 * 32 * MIB,
    nccl_per_communicator=NCCL_PER_COMMUNICATOR,
    source="default (measured on NVIDIA H100 80GB HBM3, torch 2.11.0+cu130)",
    cuda_context_eager=721e6,
    workspace_eager=32 * MIB,
)


# A CPU has no CUDA context, no cuBLAS workspaces and no caching allocator: a prediction there (a
# budget set with FITBENCH_INJECT's mem-limit) is the tensors alone.
TENSORS_ONLY = "none: on a CPU the prediction is the tensors alone (no CUDA context, workspaces or caching allocator)"


def calibration_path() -> Path:
    return cache_directory() / "calibration.json"


def calibration_key(gpu_name: str, torch_version: str) -> str:
    """A calibration's key in calibration.json: the GPU's name and the torch version it was measured with."""
    return f"{gpu_name}|torch {torch_version}"


def _stored(gpu_name: str) -> dict[str, Calibration]:
    """Every readable calibration stored for ``gpu_name``, by torch version."""
    try:
        entries = json.loads(calibration_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict):
        return {}
    found = {}
    for key, fields in entries.items():
        name, _, version = key.partition("|torch ")
        if name != gpu_name:
            continue
        try:
            found[version] = Calibration(**fields)
        except TypeError:
            continue  # written by another fitbench, or damaged: as if absent
    return found


def load_calibration(gpu_name: str | None) -> Calibration:
    """The calibration stored for this GPU and torch version; else the newest stored for this GPU
    (by ``measured_at``; those stored before it existed count as oldest), its source saying which
    torch it was measured with; else the default."""
    if gpu_name is None:
        return DEFAULT
    running = torch_version()
    stored = _stored(gpu_name)
    if running in stored:
        return stored[running]
    if not stored:
        return DEFAULT
    version = max(stored, key=lambda v: stored[v].measured_at or "")
    return replace(stored[version], source=f"{stored[version].source} (stored for torch {version}, the newest for "
                                           f"{gpu_name}; none for torch {running})")


def ensure_calibration(gpu_name: str, measure: Callable[[], Calibration]) -> tuple[Calibration, Path | None]:
    """The calibration of the GPU at hand: the one stored for it and the running torch version, else
    a new one from ``measure`` (``fitbench.launch.calibrate.measure_calibration`` on that GPU),
    stored. Returns it and where it was stored, None when it was already there."""
    stored = _stored(gpu_name).get(torch_version())
    if stored is not None:
        return stored, None
    measured = measure()
    return measured, save_calibration(gpu_name, measured)


def save_calibration(gpu_name: str, calibration: Calibration) -> Path:
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if not isinstance(stored, dict):
        stored = {}
    stored[calibration_key(gpu_name, torch_version())] = asdict(calibration)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stored, indent=2))
    os.replace(tmp, path)
    return path
